//! The private rayon pool every CPU kernel runs on.
//!
//! Sized by `FASTLLM_NUM_THREADS`, else by the number of cores available to
//! this process (what torch uses by default), so torch and rayon take turns on
//! the same cores instead of oversubscribing them.

use std::sync::OnceLock;

use rayon::{ThreadPool, ThreadPoolBuilder};

static POOL: OnceLock<Option<ThreadPool>> = OnceLock::new();

/// Parses a thread-count setting: a positive integer, anything else is `None`.
pub fn parse_num_threads(value: Option<&str>) -> Option<usize> {
    value
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
}

static NUM_THREADS: OnceLock<usize> = OnceLock::new();

/// The number of threads the kernels use, decided once per process (finding
/// the available cores reads cgroup files: far too slow for every kernel call).
pub fn num_threads() -> usize {
    *NUM_THREADS.get_or_init(configured_threads)
}

fn configured_threads() -> usize {
    parse_num_threads(std::env::var("FASTLLM_NUM_THREADS").ok().as_deref()).unwrap_or_else(|| {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    })
}

/// Runs `f` inside the private pool (or on the global pool if the private one
/// could not be built, which only happens when the OS refuses new threads).
pub fn install<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    let pool = POOL.get_or_init(|| {
        ThreadPoolBuilder::new()
            .num_threads(num_threads())
            .build()
            .ok()
    });
    match pool {
        Some(p) => p.install(f),
        None => f(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_thread_counts() {
        assert_eq!(parse_num_threads(Some("4")), Some(4));
        assert_eq!(parse_num_threads(Some(" 2 ")), Some(2));
        assert_eq!(parse_num_threads(Some("0")), None);
        assert_eq!(parse_num_threads(Some("-1")), None);
        assert_eq!(parse_num_threads(Some("many")), None);
        assert_eq!(parse_num_threads(None), None);
    }
}
