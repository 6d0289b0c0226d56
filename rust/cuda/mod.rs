//! CUDA: the driver library loaded at run time, the probe that decides
//! whether this process may use it, NVRTC, and kernel launches.
//!
//! - [`driver`]: `libloading` layer over libcuda (open a library, resolve
//!   symbols as `Result`s, thin calls returning named CUDA errors).
//! - [`probe`]: environment rules, the isolated probe child and its protocol,
//!   the per-process cache, and the gate that lets this process initialise
//!   the driver only after a child has survived doing so.
//! - [`nvrtc`]: libnvrtc loaded at run time, compilation to PTX / CUBIN with
//!   the log on error, and the on-disk kernel cache.
//! - [`kernels`]: the sources of `kernels/`, embedded.
//! - [`ops`]: grid shapes and parameter lists of each kernel.
//! - [`launch`]: primary contexts, modules compiled for each device, and
//!   `cuLaunchKernel` on a caller's stream.

pub mod driver;
pub mod kernels;
pub mod launch;
pub mod nvrtc;
pub mod ops;
pub mod probe;

pub use driver::{CudaError, Driver, DriverLibrary};
pub use probe::{DeviceReport, ProbeReport};
