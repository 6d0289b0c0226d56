//! fastllm's Rust core: the CUDA probe and driver loading, the paged KV-cache
//! block pool, CPU paged attention, the batched sampler, the packed-weight
//! GEMM, the elementwise layers, the mixture-of-experts layers and structured outputs (grammar masks), over the CPU features and threads of
//! `cpu/`.
//!
//! Nothing here knows Python except `py/`, which is compiled only with the
//! `python` feature (maturin turns it on). Kernels take plain slices and
//! return `Result<_, CoreError>`; no panic is meant to cross the FFI boundary.

pub mod attention;
pub mod cpu;
pub mod cuda;
pub mod error;
pub mod gemm;
pub mod kv;
pub mod layers;
pub mod linear;
pub mod models;
pub mod moe;
pub mod quant;
pub mod recurrent;
pub mod sampling;
pub mod structured;

#[cfg(feature = "python")]
mod py;

pub use error::{CoreError, CoreResult};
