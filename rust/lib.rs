//! fastllm's Rust core: the CUDA probe and driver loading, the paged KV-cache
//! block pool, CPU paged attention, the batched sampler, the decode-time
//! linear kernels and the packed-weight GEMM.
//!
//! Nothing here knows Python except `py.rs`, which is compiled only with the
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
pub mod sampling;
pub mod threads;

#[cfg(feature = "python")]
mod py;

pub use error::{CoreError, CoreResult};
