//! The panel layout of a packed weight (see the module docs of `gemm`).

use rayon::prelude::*;

use super::NR;
use crate::cpu::elem::expect_matrix;
use crate::cpu::Src;
use crate::error::{CoreError, CoreResult};

/// One 64-byte, 64-byte-aligned line of a panel.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(crate) struct Line(pub(crate) [u8; 64]);

/// `total` lines (None: out of memory), filled on the kernels' threads in
/// chunks of `chunk` lines: each chunk is zeroed and handed to
/// `fill(chunk index, lines)` by the same thread, so the first touch of a
/// large weight and its packing are one pass over memory (the chunk stays
/// in cache between the two). Large buffers are advised into transparent
/// huge pages first, so that first touch takes one page fault per 2 MiB
/// instead of one per 4 KiB.
pub(crate) fn lines_filled(
    total: usize,
    chunk: usize,
    fill: impl Fn(usize, &mut [Line]) + Sync,
) -> Option<Vec<Line>> {
    let mut lines: Vec<Line> = Vec::new();
    lines.try_reserve_exact(total).ok()?;
    advise_huge_pages(
        lines.as_mut_ptr() as *mut u8,
        total * std::mem::size_of::<Line>(),
    );
    if total > 0 {
        crate::cpu::threads::install(|| {
            lines.spare_capacity_mut()[..total]
                .par_chunks_mut(chunk.max(1))
                .enumerate()
                .for_each(|(c, part)| {
                    for line in part.iter_mut() {
                        line.write(Line([0; 64]));
                    }
                    // SAFETY: every line of `part` was written just above.
                    let part = unsafe {
                        std::slice::from_raw_parts_mut(part.as_mut_ptr() as *mut Line, part.len())
                    };
                    fill(c, part);
                });
        });
    }
    // SAFETY: the first `total` lines were all written just above.
    unsafe { lines.set_len(total) };
    Some(lines)
}

/// Asks Linux to back `[ptr, ptr + len)` with huge pages (only the whole
/// 2 MiB pages inside it; smaller buffers are left alone). Advice only: a
/// kernel that declines changes nothing.
fn advise_huge_pages(ptr: *mut u8, len: usize) {
    #[cfg(target_os = "linux")]
    {
        const HUGE: usize = 2 << 20;
        let start = (ptr as usize).div_ceil(HUGE) * HUGE;
        let end = (ptr as usize + len) / HUGE * HUGE;
        if end > start {
            // SAFETY: the range lies inside the caller's own allocation;
            // madvise only changes how its pages are backed.
            unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (ptr, len);
}

/// A weight matrix in panel layout, with its bias.
pub struct PackedWeight {
    pub(super) n: usize,
    pub(super) k: usize,
    pub(super) bf16: bool,
    pub(super) lines: Vec<Line>,
    pub(super) bias: Option<Vec<f32>>,
}

impl std::fmt::Debug for PackedWeight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PackedWeight")
            .field("n", &self.n)
            .field("k", &self.k)
            .field("bf16", &self.bf16)
            .field("bias", &self.bias.is_some())
            .finish()
    }
}

impl PackedWeight {
    /// Packs `weight` (`[n, k]`, row-major, torch `Linear` layout) and `bias`
    /// (`[n]`). bf16 weights stay bf16 (two bytes per weight); f32 weights
    /// stay f32, unless every element is a bf16 value (a bf16 checkpoint run
    /// in float32 on a CPU without native bf16): those are packed as bf16,
    /// the same values in half the bytes (the kernels widen them to the same
    /// f32 and multiply in f32).
    pub fn pack(weight: Src<'_>, bias: Option<Src<'_>>, n: usize, k: usize) -> CoreResult<Self> {
        expect_matrix("weight", weight.len(), n, k)?;
        if let Some(b) = &bias {
            if b.len() != n {
                return Err(CoreError::invalid(format!(
                    "bias: expected {n} elements, got {}",
                    b.len()
                )));
            }
        }
        let bf16 = match weight {
            Src::Bf16(_) => true,
            Src::F32(w) => holds_only_bf16(w),
        };
        let lines_per_k = if bf16 { 1 } else { 2 };
        let panels = n.div_ceil(NR);
        let panel_lines = k * lines_per_k;
        let total = panels
            .checked_mul(panel_lines)
            .ok_or_else(|| CoreError::invalid("weight: packed size overflows"))?;
        let lines = lines_filled(total, panel_lines, |p, panel| {
            pack_panel(weight, p * NR, n, k, bf16, panel)
        })
        .ok_or_else(|| CoreError::Exhausted(format!("weight: cannot allocate {n} x {k}")))?;
        let bias = bias.map(|b| (0..n).map(|j| b.get(j)).collect());
        Ok(PackedWeight {
            n,
            k,
            bf16,
            lines,
            bias,
        })
    }

    /// Output features.
    pub fn out_features(&self) -> usize {
        self.n
    }

    /// Input features.
    pub fn in_features(&self) -> usize {
        self.k
    }

    /// Whether the weights are stored as bf16 (else f32).
    pub fn is_bf16(&self) -> bool {
        self.bf16
    }

    /// Bytes of packed weights (what one batch-1 call streams).
    pub fn nbytes(&self) -> usize {
        self.lines.len() * 64
    }

    pub(super) fn panels(&self) -> usize {
        self.n.div_ceil(NR)
    }

    pub(super) fn panel_bytes(&self) -> usize {
        self.k * if self.bf16 { 64 } else { 128 }
    }
}

/// Whether every element of `w` is a bf16 value (the low 16 bits of its f32
/// bits zero), read on the kernels' threads in chunks (an OR over each, so
/// it vectorises), stopping at the first chunk that is not.
fn holds_only_bf16(w: &[f32]) -> bool {
    !w.is_empty()
        && crate::cpu::threads::install(|| {
            w.par_chunks(1 << 16).all(|c| {
                c.chunks(256)
                    .all(|part| part.iter().fold(0u32, |a, v| a | v.to_bits()) & 0xffff == 0)
            })
        })
}

/// Fills one panel (features `n0..n0 + NR`) from the row-major weight.
fn pack_panel(weight: Src<'_>, n0: usize, n: usize, k: usize, bf16: bool, panel: &mut [Line]) {
    for j in 0..NR.min(n - n0) {
        let row = (n0 + j) * k;
        for kk in 0..k {
            if bf16 {
                let bits = match weight {
                    Src::Bf16(w) => w[row + kk].to_bits(),
                    // A bf16 value's f32 bits are its own and 16 zeros.
                    Src::F32(w) => (w[row + kk].to_bits() >> 16) as u16,
                };
                let off = (j % 16) * 4 + if j < 16 { 0 } else { 2 };
                panel[kk].0[off..off + 2].copy_from_slice(&bits.to_le_bytes());
            } else {
                let v = weight.get(row + kk);
                let off = (j % 16) * 4;
                panel[2 * kk + j / 16].0[off..off + 4].copy_from_slice(&v.to_le_bytes());
            }
        }
    }
}
