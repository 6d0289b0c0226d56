//! CUDA: the driver library loaded at run time, and the probe that decides
//! whether this process may use it.
//!
//! - [`driver`]: `libloading` layer over libcuda (open a library, resolve
//!   symbols as `Result`s, thin calls returning named CUDA errors).
//! - [`probe`]: environment rules, the isolated probe child and its protocol,
//!   the per-process cache, and the gate that lets this process initialise
//!   the driver only after a child has survived doing so.

pub mod driver;
pub mod probe;

pub use driver::{CudaError, Driver, DriverLibrary};
pub use probe::{DeviceReport, ProbeReport};
