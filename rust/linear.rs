//! One linear-weight type for every CPU GEMM: a weight packed into the
//! kernels' panels, float (`gemm`) or quantized (`quant`), bound to the
//! kernel path that runs it. The Python layers (`py/linear.rs`) and the
//! fused decoder stack (`models/llama.rs`) run any of them through
//! [`LinearKernel`] without knowing which.

use std::fmt;
use std::sync::Arc;

use crate::cpu::{Dst, IntPath, Path, Src};
use crate::error::CoreResult;
use crate::gemm::PackedWeight;
use crate::quant::QuantWeight;

/// What every packed linear weight does.
pub trait LinearKernel: Send + Sync + fmt::Debug {
    /// Input features (columns of the weight).
    fn in_features(&self) -> usize;
    /// Output features (rows of the weight).
    fn out_features(&self) -> usize;
    /// Bytes of packed weights (and scales).
    fn nbytes(&self) -> usize;
    /// The kernel path's name.
    fn path_name(&self) -> &'static str;
    /// `out [m, out_features] = x [m, in_features] W^T + bias`.
    fn forward(&self, out: Dst<'_>, x: Src<'_>, m: usize) -> CoreResult<()>;
}

/// A packed weight and the kernel path that runs it.
#[derive(Debug)]
pub struct OnPath<W, P> {
    pub weight: Arc<W>,
    pub path: P,
}

impl<W, P: Copy> Clone for OnPath<W, P> {
    fn clone(&self) -> Self {
        OnPath {
            weight: self.weight.clone(),
            path: self.path,
        }
    }
}

/// A shared linear weight of either kind.
pub type LinearWeight = Arc<dyn LinearKernel>;

/// `LinearKernel` for a weight type on its path type, run by `gemm`.
macro_rules! on_path {
    ($weight:ty, $path:ty, $gemm:path) => {
        impl LinearKernel for OnPath<$weight, $path> {
            fn in_features(&self) -> usize {
                self.weight.in_features()
            }
            fn out_features(&self) -> usize {
                self.weight.out_features()
            }
            fn nbytes(&self) -> usize {
                self.weight.nbytes()
            }
            fn path_name(&self) -> &'static str {
                self.path.name()
            }
            fn forward(&self, out: Dst<'_>, x: Src<'_>, m: usize) -> CoreResult<()> {
                $gemm(self.path, out, x, &self.weight, m)
            }
        }
    };
}

on_path!(PackedWeight, Path, crate::gemm::gemm_with_path);
on_path!(QuantWeight, IntPath, crate::quant::gemm_with_path);

/// A float weight on `path`, shared.
pub fn float(weight: Arc<PackedWeight>, path: Path) -> LinearWeight {
    Arc::new(OnPath { weight, path })
}

/// A quantized weight on `path`, shared.
pub fn quantized(weight: Arc<QuantWeight>, path: IntPath) -> LinearWeight {
    Arc::new(OnPath { weight, path })
}
