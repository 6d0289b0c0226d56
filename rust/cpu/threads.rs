//! The threads the CPU kernels run on: a private rayon pool, and a team of
//! helper threads that spin briefly between jobs for the linear layers.
//!
//! Both are sized by `FASTLLM_NUM_THREADS`, else by the number of cores
//! available to this process (what torch uses by default), so torch and the
//! kernels take turns on the same cores instead of oversubscribing them.
//!
//! Why a team beside rayon: a decode step calls about a hundred linear layers
//! of 50-1000 us each, with some Python work between them. Rayon's workers fall
//! asleep within microseconds and waking one costs tens of microseconds on a
//! virtual machine; the team's helpers spin for `TEAM_SPIN` after each job,
//! and the calling thread takes tasks too, so a job starts on every core at
//! once.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use rayon::{ThreadPool, ThreadPoolBuilder};

use crate::error::{CoreError, CoreResult};

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

/// How long a helper spins for the next job before it sleeps.
const TEAM_SPIN: Duration = Duration::from_micros(300);

/// One job: `tasks` calls of `f`, taken in order by whoever is free.
struct Job {
    f: TaskFn,
    tasks: usize,
    next: AtomicUsize,
    done: AtomicUsize,
    panicked: AtomicBool,
}

/// The job's function, lifetime erased; see `team_run` for why it is never
/// called after the job's owner returned.
struct TaskFn(*const (dyn Fn(usize) + Sync));
// SAFETY: the function is `Sync` and only called while `team_run` waits.
unsafe impl Send for TaskFn {}
unsafe impl Sync for TaskFn {}

thread_local! {
    /// Whether this thread is running a team task (a `team_run` inside one
    /// runs its tasks on this thread alone).
    static IN_TASK: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

impl Job {
    /// Takes and runs tasks until none is left.
    fn work(&self) {
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            if i >= self.tasks {
                return;
            }
            // SAFETY: i < tasks, so `done` has not reached `tasks` and the
            // owner is still waiting in `team_run`: `f` is alive.
            let f = unsafe { &*self.f.0 };
            let outer = IN_TASK.with(|t| t.replace(true));
            if catch_unwind(AssertUnwindSafe(|| f(i))).is_err() {
                self.panicked.store(true, Ordering::Relaxed);
            }
            IN_TASK.with(|t| t.set(outer));
            self.done.fetch_add(1, Ordering::Release);
        }
    }
}

struct Team {
    helpers: usize,
    /// Bumped for every new job.
    epoch: AtomicUsize,
    job: Mutex<Option<Arc<Job>>>,
    wake: Condvar,
    /// One job at a time (calls from several threads queue here).
    busy: Mutex<()>,
}

static TEAM: OnceLock<Option<&'static Team>> = OnceLock::new();

fn team() -> Option<&'static Team> {
    *TEAM.get_or_init(|| {
        let helpers = num_threads().saturating_sub(1);
        if helpers == 0 {
            return None;
        }
        let team: &'static Team = Box::leak(Box::new(Team {
            helpers,
            epoch: AtomicUsize::new(0),
            job: Mutex::new(None),
            wake: Condvar::new(),
            busy: Mutex::new(()),
        }));
        for i in 0..helpers {
            let spawned = std::thread::Builder::new()
                .name(format!("fastllm-team-{i}"))
                .spawn(move || helper(team));
            if spawned.is_err() {
                return None; // the OS refuses threads: run jobs on the caller
            }
        }
        Some(team)
    })
}

fn helper(team: &'static Team) {
    let mut seen = 0;
    loop {
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            let e = team.epoch.load(Ordering::Acquire);
            if e != seen {
                seen = e;
                break;
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(256) && start.elapsed() > TEAM_SPIN {
                let mut slot = team.job.lock().unwrap_or_else(|p| p.into_inner());
                while team.epoch.load(Ordering::Acquire) == seen {
                    slot = team.wake.wait(slot).unwrap_or_else(|p| p.into_inner());
                }
                drop(slot);
                continue;
            }
            std::hint::spin_loop();
        }
        let job = team.job.lock().unwrap_or_else(|p| p.into_inner()).clone();
        if let Some(job) = job {
            job.work();
        }
    }
}

/// Runs `f(0) .. f(tasks - 1)` on the team and the calling thread, and
/// returns when all have finished. A task that panics (a bug) becomes an
/// error here, after the other tasks finished, and the team stays usable.
/// Jobs run one at a time: a task that calls `team_run` (a kernel run per
/// expert, itself a GEMM) runs that inner job's tasks on its own thread.
pub fn team_run(tasks: usize, f: &(dyn Fn(usize) + Sync)) -> CoreResult<()> {
    let nested = IN_TASK.with(|t| t.get());
    let Some(team) = team().filter(|_| tasks > 1 && !nested) else {
        return catch_unwind(AssertUnwindSafe(|| (0..tasks).for_each(f)))
            .map_err(|_| task_panicked());
    };
    let _one_job = team.busy.lock().unwrap_or_else(|p| p.into_inner());
    // SAFETY (lifetime erasure): `f` is only called for task indices below
    // `tasks`, and this function returns only after `done == tasks`, i.e.
    // after every such call returned; a helper that picks the job up late
    // finds no task left and never calls it.
    let f: *const (dyn Fn(usize) + Sync + '_) = f;
    let f: *const (dyn Fn(usize) + Sync + 'static) = unsafe { std::mem::transmute(f) };
    let job = Arc::new(Job {
        f: TaskFn(f),
        tasks,
        next: AtomicUsize::new(0),
        done: AtomicUsize::new(0),
        panicked: AtomicBool::new(false),
    });
    {
        let mut slot = team.job.lock().unwrap_or_else(|p| p.into_inner());
        *slot = Some(job.clone());
        team.epoch.fetch_add(1, Ordering::Release);
        team.wake.notify_all();
    }
    job.work();
    while job.done.load(Ordering::Acquire) < tasks {
        std::hint::spin_loop();
    }
    *team.job.lock().unwrap_or_else(|p| p.into_inner()) = None;
    if job.panicked.load(Ordering::Relaxed) {
        return Err(task_panicked());
    }
    Ok(())
}

fn task_panicked() -> CoreError {
    CoreError::Internal("internal error: a CPU kernel task panicked (please report this)".into())
}

/// Helper threads of the team (0 when kernels run on the calling thread only).
pub fn team_helpers() -> usize {
    team().map_or(0, |t| t.helpers)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_inside_a_task_runs_on_the_task_thread() {
        let hits: Vec<AtomicUsize> = (0..12).map(|_| AtomicUsize::new(0)).collect();
        team_run(3, &|outer| {
            let me = std::thread::current().id();
            team_run(4, &|inner| {
                assert_eq!(std::thread::current().id(), me);
                hits[outer * 4 + inner].fetch_add(1, Ordering::Relaxed);
            })
            .unwrap();
        })
        .unwrap();
        assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
        assert!(!IN_TASK.with(|t| t.get()));
    }

    #[test]
    fn team_runs_every_task_once_and_turns_panics_into_errors() {
        for tasks in [0usize, 1, 2, 7, 64] {
            let hits: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
            for _ in 0..50 {
                team_run(tasks, &|i| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                })
                .unwrap();
            }
            assert!(
                hits.iter().all(|h| h.load(Ordering::Relaxed) == 50),
                "{tasks} tasks"
            );
        }
        let err = team_run(4, &|i| assert!(i != 2, "task 2 fails")).unwrap_err();
        assert!(err.to_string().contains("panicked"), "{err}");
        assert!(team_run(1, &|_| panic!("alone")).is_err());
        // The team still works after a panic.
        let sum = AtomicUsize::new(0);
        team_run(10, &|i| {
            sum.fetch_add(i, Ordering::Relaxed);
        })
        .unwrap();
        assert_eq!(sum.load(Ordering::Relaxed), 45);
    }

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
