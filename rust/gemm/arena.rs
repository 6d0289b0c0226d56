//! The memory packed weights live in: 2 MiB-aligned chunks, advised into
//! transparent huge pages, from which the weights of a model are carved one
//! after another.
//!
//! A model's matrices are many and mostly small next to a huge page (a 0.5B
//! model's q/k/v and output projections are 0.5-1 MB each). Allocated one by
//! one, only whole 2 MiB pages inside each allocation can be huge, so about
//! two thirds of such a model sat in 4 KiB pages: its first touch at load took
//! one page fault per 4 KiB (on a virtual machine, 60 ms per 144 MB against
//! 8 ms in huge pages), and each batch-1 decode step walked the page tables
//! of every 4 KiB it streamed. Carved out of shared chunks, every weight
//! lies in huge pages where the kernel grants them.
//!
//! A chunk is freed when the last weight carved from it is dropped; the chunk
//! being filled is kept for the next weight and restarts from its beginning
//! once nothing else uses it.

use std::alloc::{alloc, dealloc, Layout};
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use rayon::prelude::*;

use super::pack::Line;

const HUGE: usize = 2 << 20;
/// Size of a shared chunk; a larger weight gets a chunk of its own size.
const CHUNK: usize = 64 << 20;

struct Chunk {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: a chunk is plain memory; who writes which part of it is decided
// by the `Lines` carved from it, which never overlap.
unsafe impl Send for Chunk {}
unsafe impl Sync for Chunk {}

impl Chunk {
    fn new(size: usize) -> Option<Chunk> {
        let layout = Layout::from_size_align(size.div_ceil(HUGE) * HUGE, HUGE).ok()?;
        // SAFETY: the layout has a nonzero size.
        let ptr = NonNull::new(unsafe { alloc(layout) })?;
        advise_huge_pages(ptr.as_ptr(), layout.size());
        Some(Chunk { ptr, layout })
    }
}

impl Drop for Chunk {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// The chunk being filled and how many of its bytes are handed out.
static CURRENT: Mutex<Option<(Arc<Chunk>, usize)>> = Mutex::new(None);

/// Zeroed, 64-byte-aligned lines carved from a chunk.
pub(crate) struct Lines {
    ptr: NonNull<Line>,
    len: usize,
    _chunk: Option<Arc<Chunk>>,
}

// SAFETY: `Lines` owns its part of the chunk exclusively, like a `Vec`.
unsafe impl Send for Lines {}
unsafe impl Sync for Lines {}

impl Deref for Lines {
    type Target = [Line];
    fn deref(&self) -> &[Line] {
        // SAFETY: `len` initialised lines at `ptr`, kept alive by `_chunk`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for Lines {
    fn deref_mut(&mut self) -> &mut [Line] {
        // SAFETY: as `deref`; `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

/// Takes `bytes` (a multiple of 64) from the current chunk, or from a new
/// one: a chunk of its own for a weight larger than `CHUNK`.
fn carve(bytes: usize) -> Option<(NonNull<u8>, Arc<Chunk>)> {
    let mut current = CURRENT.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((chunk, used)) = current.as_mut() {
        if Arc::strong_count(chunk) == 1 {
            *used = 0; // every weight carved from it is gone
        }
        if chunk.layout.size() - *used >= bytes {
            // SAFETY: `used + bytes` is within the chunk.
            let ptr = unsafe { chunk.ptr.add(*used) };
            *used += bytes;
            return Some((ptr, chunk.clone()));
        }
    }
    let chunk = Arc::new(Chunk::new(bytes.max(CHUNK))?);
    let left = chunk.layout.size() - bytes;
    let keep_old = current
        .as_ref()
        .is_some_and(|(c, used)| c.layout.size() - used >= left);
    if !keep_old {
        *current = Some((chunk.clone(), bytes));
    }
    Some((chunk.ptr, chunk))
}

/// `total` zeroed lines (None: out of memory), zeroed on the kernels'
/// threads, so that their first touch is spread over the cores.
pub(crate) fn zeroed_lines(total: usize) -> Option<Lines> {
    if total == 0 {
        return Some(Lines {
            ptr: NonNull::dangling(),
            len: 0,
            _chunk: None,
        });
    }
    let bytes = total.checked_mul(std::mem::size_of::<Line>())?;
    let (ptr, chunk) = carve(bytes)?;
    let ptr = ptr.cast::<Line>();
    // SAFETY: the `total` lines at `ptr` belong to this allocation alone
    // (carved above), and a Line is plain bytes: writing zeros initialises it.
    let raw = unsafe {
        std::slice::from_raw_parts_mut(ptr.as_ptr() as *mut std::mem::MaybeUninit<Line>, total)
    };
    crate::cpu::threads::install(|| {
        raw.par_chunks_mut(1 << 12).for_each(|chunk| {
            for line in chunk {
                line.write(Line([0; 64]));
            }
        });
    });
    Some(Lines {
        ptr,
        len: total,
        _chunk: Some(chunk),
    })
}

/// Asks Linux to back `[ptr, ptr + len)` with huge pages (only the whole
/// 2 MiB pages inside it). Advice only: a kernel that declines changes nothing.
fn advise_huge_pages(ptr: *mut u8, len: usize) {
    #[cfg(target_os = "linux")]
    {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_are_zeroed_disjoint_and_freed_with_their_chunk() {
        let sizes = [1usize, 7, 4096, 300_000, (CHUNK / 64) + 5, 3];
        let mut all: Vec<Lines> = sizes.iter().map(|&n| zeroed_lines(n).unwrap()).collect();
        for (lines, &n) in all.iter().zip(&sizes) {
            assert_eq!(lines.len(), n);
            assert!(lines.iter().all(|l| l.0.iter().all(|&b| b == 0)));
            assert_eq!(lines.as_ptr() as usize % 64, 0);
        }
        // Each writes its own bytes: no two overlap.
        for (i, lines) in all.iter_mut().enumerate() {
            for l in lines.iter_mut() {
                l.0 = [i as u8 + 1; 64];
            }
        }
        for (i, lines) in all.iter().enumerate() {
            assert!(
                lines.iter().all(|l| l.0 == [i as u8 + 1; 64]),
                "weight {i} was overwritten"
            );
        }
        drop(all);
        // Once every weight is gone the current chunk starts over, zeroed again.
        let again = zeroed_lines(10).unwrap();
        assert!(again.iter().all(|l| l.0 == [0; 64]));
        assert!(zeroed_lines(0).unwrap().is_empty());
    }
}
