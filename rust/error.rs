//! One error type for the whole core; `py.rs` maps it to Python exceptions.

use thiserror::Error;

/// Every failure of the Rust core, typed so the binding layer can pick the
/// right Python exception and a message a user can act on.
#[derive(Debug, Error)]
pub enum CoreError {
    /// A caller passed a value that is out of range or inconsistent.
    #[error("{0}")]
    InvalidArgument(String),
    /// A resource (KV blocks, memory) ran out.
    #[error("{0}")]
    Exhausted(String),
    /// A CUDA driver / NVRTC call or library load failed.
    #[error("{0}")]
    Cuda(String),
    /// An operating-system level failure (spawning the probe child, I/O).
    #[error("{0}")]
    Os(String),
    /// A bug inside the core (a kernel task panicked), caught before it
    /// could cross into Python.
    #[error("{0}")]
    Internal(String),
}

/// Result alias used by every fallible function of the core.
pub type CoreResult<T> = Result<T, CoreError>;

impl CoreError {
    /// Shorthand for an `InvalidArgument` error.
    pub fn invalid(msg: impl Into<String>) -> Self {
        CoreError::InvalidArgument(msg.into())
    }
}
