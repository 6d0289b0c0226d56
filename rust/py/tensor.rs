//! Torch tensors seen from Rust: `TensorArg` reads a tensor's metadata
//! through torch's own accessors and checks dtype, device, shape and
//! contiguity before any kernel gets a slice of it.

use pyo3::exceptions::{PyAttributeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;

/// Element types the kernels accept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DType {
    F32,
    BF16,
    F16,
    I32,
    I64,
    U8,
    I8,
}

impl DType {
    pub(crate) fn from_torch(name: &str) -> Option<DType> {
        match name {
            "torch.float32" => Some(DType::F32),
            "torch.bfloat16" => Some(DType::BF16),
            "torch.float16" => Some(DType::F16),
            "torch.int32" => Some(DType::I32),
            "torch.int64" => Some(DType::I64),
            "torch.uint8" => Some(DType::U8),
            "torch.int8" => Some(DType::I8),
            _ => None,
        }
    }

    pub(crate) fn size(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::BF16 | DType::F16 => 2,
            DType::I64 => 8,
            DType::U8 | DType::I8 => 1,
        }
    }
}

/// torch's dtype objects of the kernels' element types, looked up once: a
/// tensor's dtype is then found by identity, without making its name.
static DTYPES: PyOnceLock<Vec<(Py<PyAny>, DType)>> = PyOnceLock::new();

fn known_dtype(dtype: &Bound<'_, PyAny>) -> PyResult<Option<DType>> {
    let py = dtype.py();
    let table = DTYPES.get_or_try_init(py, || -> PyResult<_> {
        let torch = py.import("torch")?;
        let names = [
            ("float32", DType::F32),
            ("bfloat16", DType::BF16),
            ("float16", DType::F16),
            ("int32", DType::I32),
            ("int64", DType::I64),
            ("uint8", DType::U8),
            ("int8", DType::I8),
        ];
        names
            .iter()
            .map(|(n, d)| Ok((torch.getattr(*n)?.unbind(), *d)))
            .collect()
    })?;
    Ok(table
        .iter()
        .find(|(obj, _)| obj.bind(py).is(dtype))
        .map(|(_, d)| *d))
}

/// A torch tensor seen from Rust: pointer, dtype, device, shape, strides.
/// Built only through `TensorArg::extract`, which reads torch's own accessors.
#[allow(dead_code)]
pub(crate) struct TensorArg {
    pub name: &'static str,
    pub ptr: usize,
    pub dtype: DType,
    pub device: String,
    /// The CUDA ordinal of a CUDA tensor (`tensor.device.index`).
    pub device_index: Option<i64>,
    pub shape: Vec<usize>,
    pub strides: Vec<isize>,
}

#[allow(dead_code)]
impl TensorArg {
    /// Reads a torch tensor's metadata; `name` is used in every error message.
    pub fn extract(name: &'static str, obj: &Bound<'_, PyAny>) -> PyResult<TensorArg> {
        // Only "this object has no dtype" means "not a tensor"; any other
        // exception (a KeyboardInterrupt raised by a signal handler during the
        // lookup, a MemoryError) propagates unchanged.
        let dtype_obj = obj
            .getattr("dtype")
            .map_err(|err| not_a_tensor(name, obj.py(), err))?;
        // `extract`, not `Display`: Display would swallow an exception raised
        // while the text is made (printing "<unprintable ...>") instead of
        // returning it.
        let dtype = match known_dtype(&dtype_obj)? {
            Some(d) => d,
            None => {
                let dtype_name: String = dtype_obj.str()?.extract()?;
                DType::from_torch(&dtype_name).ok_or_else(|| {
                    PyValueError::new_err(format!("{name}: unsupported dtype {dtype_name}"))
                })?
            }
        };
        // `is_cpu` first: one attribute for the common case instead of three.
        let (device, device_index) = if obj.getattr("is_cpu")?.extract::<bool>()? {
            ("cpu".to_string(), None)
        } else {
            let device_obj = obj.getattr("device")?;
            let device: String = device_obj.getattr("type")?.extract()?;
            let device_index: Option<i64> = device_obj.getattr("index")?.extract()?;
            (device, device_index)
        };
        let shape: Vec<usize> = obj.getattr("shape")?.extract()?;
        let strides: Vec<isize> = obj.call_method0("stride")?.extract()?;
        let ptr: usize = obj.call_method0("data_ptr")?.extract()?;
        Ok(TensorArg {
            name,
            ptr,
            dtype,
            device,
            device_index,
            shape,
            strides,
        })
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Checks device, dtype, rank and C-contiguity in one call.
    pub fn check(&self, dtypes: &[DType], ndim: usize) -> PyResult<&Self> {
        if self.device != "cpu" {
            return Err(PyValueError::new_err(format!(
                "{}: expected a CPU tensor, got device '{}'",
                self.name, self.device
            )));
        }
        self.expect_layout(dtypes, ndim, 0)
    }

    /// As `check`, but rows (dimension 0) may be any stride apart, as in a
    /// view of a fused projection; the other dimensions are contiguous.
    pub fn check_rows(&self, dtypes: &[DType], ndim: usize) -> PyResult<&Self> {
        if self.device != "cpu" {
            return Err(PyValueError::new_err(format!(
                "{}: expected a CPU tensor, got device '{}'",
                self.name, self.device
            )));
        }
        self.expect_layout(dtypes, ndim, 1)
    }

    /// Elements from the first row's start to the last row's end (a
    /// `check_rows` tensor's span in memory).
    pub fn row_span(&self) -> usize {
        match self.shape.first() {
            None => 1,
            Some(0) => 0,
            Some(&rows) => match self.shape[1..].iter().product::<usize>() {
                0 => 0,
                width => (rows - 1) * self.row_stride().max(0) as usize + width,
            },
        }
    }

    /// The elements of a `check_rows` tensor's span, and its row stride.
    ///
    /// # Safety
    /// As `slice`, with `check_rows` in place of `check`.
    pub unsafe fn rows_slice<T>(&self) -> (&[T], usize) {
        debug_assert_eq!(std::mem::size_of::<T>(), self.dtype.size());
        let span = self.row_span();
        let stride = self.row_stride().max(0) as usize;
        if span == 0 {
            return (&[], stride);
        }
        (
            std::slice::from_raw_parts(self.ptr as *const T, span),
            stride,
        )
    }

    /// As `check`, for a tensor on a CUDA device.
    pub fn expect_cuda(&self, dtypes: &[DType], ndim: usize) -> PyResult<&Self> {
        self.expect_cuda_device()?;
        self.expect_layout(dtypes, ndim, 0)
    }

    /// As `expect_cuda`, but rows (dimension 0) may be any stride apart, as in
    /// a view of a fused projection; the other dimensions are contiguous.
    pub fn expect_cuda_rows(&self, dtypes: &[DType], ndim: usize) -> PyResult<&Self> {
        self.expect_cuda_device()?;
        self.expect_layout(dtypes, ndim, 1)
    }

    fn expect_cuda_device(&self) -> PyResult<()> {
        if self.device != "cuda" || self.device_index.is_none() {
            return Err(PyValueError::new_err(format!(
                "{}: expected a CUDA tensor, got device '{}'",
                self.name, self.device
            )));
        }
        Ok(())
    }

    /// The CUDA ordinal, checked to be the same as `other`'s.
    pub fn same_device(&self, other: &TensorArg) -> PyResult<i32> {
        if self.device != other.device || self.device_index != other.device_index {
            return Err(PyValueError::new_err(format!(
                "{}: on device {}:{:?}, but {} is on {}:{:?}",
                self.name,
                self.device,
                self.device_index,
                other.name,
                other.device,
                other.device_index
            )));
        }
        Ok(self.device_index.unwrap_or(0) as i32)
    }

    /// Stride of dimension 0 in elements (the row pitch of `expect_cuda_rows`).
    pub fn row_stride(&self) -> i64 {
        self.strides.first().copied().unwrap_or(0) as i64
    }

    /// Dtype, rank and contiguity of the dimensions from `free_leading` on.
    fn expect_layout(&self, dtypes: &[DType], ndim: usize, free_leading: usize) -> PyResult<&Self> {
        if !dtypes.contains(&self.dtype) {
            return Err(PyValueError::new_err(format!(
                "{}: expected dtype {:?}, got {:?}",
                self.name, dtypes, self.dtype
            )));
        }
        if self.shape.len() != ndim {
            return Err(PyValueError::new_err(format!(
                "{}: expected {} dimensions, got shape {:?}",
                self.name, ndim, self.shape
            )));
        }
        let mut expected: isize = 1;
        for (dim, (&size, &stride)) in self.shape.iter().zip(&self.strides).enumerate().rev() {
            if dim < free_leading {
                if size > 1 && stride < expected {
                    return Err(PyValueError::new_err(format!(
                        "{}: rows must not overlap (dimension {} has stride {}, rows are {} long)",
                        self.name, dim, stride, expected
                    )));
                }
                continue;
            }
            if size > 1 && stride != expected {
                return Err(PyValueError::new_err(format!(
                    "{}: must be contiguous (dimension {} has stride {}, expected {})",
                    self.name, dim, stride, expected
                )));
            }
            expected *= size as isize;
        }
        if self.numel() > 0 && self.ptr == 0 {
            return Err(PyValueError::new_err(format!(
                "{}: null data pointer",
                self.name
            )));
        }
        Ok(self)
    }

    /// Checks that this tensor has `other`'s shape.
    pub fn expect_shape_of(&self, other: &TensorArg) -> PyResult<()> {
        if self.shape == other.shape {
            return Ok(());
        }
        Err(PyValueError::new_err(format!(
            "{}: shape {:?} must match {} {:?}",
            self.name, self.shape, other.name, other.shape
        )))
    }

    /// Checks the size of one dimension.
    pub fn expect_dim(&self, dim: usize, size: usize, what: &str) -> PyResult<()> {
        if self.shape[dim] != size {
            return Err(PyValueError::new_err(format!(
                "{}: dimension {} must be {} ({}), got {}",
                self.name, dim, size, what, self.shape[dim]
            )));
        }
        Ok(())
    }

    /// A read-only slice over the tensor's elements.
    ///
    /// # Safety
    /// `check` must have checked dtype (matching `T`) and contiguity, and the
    /// tensor must stay alive and unaliased by writers while the slice is used.
    pub unsafe fn slice<T>(&self) -> &[T] {
        debug_assert_eq!(std::mem::size_of::<T>(), self.dtype.size());
        if self.numel() == 0 {
            return &[];
        }
        std::slice::from_raw_parts(self.ptr as *const T, self.numel())
    }

    /// A mutable slice over the tensor's elements.
    ///
    /// # Safety
    /// As `slice`, and no other slice may alias this tensor's memory.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice_mut<T>(&self) -> &mut [T] {
        debug_assert_eq!(std::mem::size_of::<T>(), self.dtype.size());
        if self.numel() == 0 {
            return &mut [];
        }
        std::slice::from_raw_parts_mut(self.ptr as *mut T, self.numel())
    }
}

/// The error for an argument that is not a tensor: an `AttributeError` or
/// `TypeError` from reading its metadata becomes "expected a torch.Tensor";
/// any other exception (KeyboardInterrupt, MemoryError, ...) is returned as
/// it was raised.
pub(crate) fn not_a_tensor(name: &str, py: Python<'_>, err: PyErr) -> PyErr {
    if err.is_instance_of::<PyAttributeError>(py) || err.is_instance_of::<PyTypeError>(py) {
        PyValueError::new_err(format!("{name}: expected a torch.Tensor"))
    } else {
        err
    }
}

/// Borrows a checked bf16 / f32 tensor as a kernel source.
///
/// # Safety
/// As `TensorArg::slice`: `expect` has checked the dtype and contiguity.
pub(crate) unsafe fn kernel_src(t: &TensorArg) -> crate::cpu::Src<'_> {
    match t.dtype {
        DType::BF16 => crate::cpu::Src::Bf16(t.slice::<half::bf16>()),
        _ => crate::cpu::Src::F32(t.slice::<f32>()),
    }
}

/// Borrows a checked bf16 / f32 tensor as a kernel destination.
///
/// # Safety
/// As `TensorArg::slice_mut`: `expect` has checked the dtype and contiguity,
/// and nothing else reads or writes the tensor during the call.
pub(crate) unsafe fn kernel_dst(t: &TensorArg) -> crate::cpu::Dst<'_> {
    match t.dtype {
        DType::BF16 => crate::cpu::Dst::Bf16(t.slice_mut::<half::bf16>()),
        _ => crate::cpu::Dst::F32(t.slice_mut::<f32>()),
    }
}

/// Byte range of a tensor's elements.
fn byte_range(t: &TensorArg) -> (usize, usize) {
    (t.ptr, t.ptr + t.numel() * t.dtype.size())
}

/// Rejects `out` sharing memory with an input (the kernel reads weights and
/// bias while other threads write `out`).
pub(crate) fn check_no_overlap(out: &TensorArg, other: &TensorArg) -> PyResult<()> {
    let (a0, a1) = byte_range(out);
    let (b0, b1) = byte_range(other);
    if a0 < b1 && b0 < a1 {
        return Err(PyValueError::new_err(format!(
            "{}: must not share memory with {}",
            out.name, other.name
        )));
    }
    Ok(())
}
