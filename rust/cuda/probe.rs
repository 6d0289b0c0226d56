//! The CUDA probe: may this process use a GPU, and which ones?
//!
//! Order of decisions, cheapest first:
//! 1. environment opt-outs (`FASTLLM_DEVICE=cpu`, `CUDA_VISIBLE_DEVICES` empty
//!    or `-1`): zero devices, no library is ever loaded;
//! 2. platform checks (macOS has no driver; on Linux the kernel driver shows
//!    `/proc/driver/nvidia`, or `/dev/dxg` under WSL), skipped when
//!    `FASTLLM_LIBCUDA` names the library to use;
//! 3. a child process loads the library, calls `cuInit(0)` and queries the
//!    devices, printing a stage marker before each step. A driver that
//!    crashes or hangs takes only the child down; the marker says where.
//!
//! Results are cached per process, keyed by `CUDA_VISIBLE_DEVICES` (and
//! `FASTLLM_LIBCUDA`). [`driver`] initialises the driver in this process only
//! once a child has reported success.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::driver::{candidate_names, Driver, DriverLibrary};
use crate::error::{CoreError, CoreResult};

/// Seconds a probe child may take before it is killed, unless
/// `FASTLLM_PROBE_TIMEOUT` says otherwise. A healthy `cuInit` on a large
/// multi-GPU machine without persistence mode can take several seconds.
pub const DEFAULT_TIMEOUT_SECS: f64 = 15.0;

/// Prefix of every line of the child protocol; other output is ignored.
pub const MARK: &str = "fastllm-probe";

/// One GPU as the driver describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceReport {
    /// Ordinal among the visible devices.
    pub index: i32,
    /// Marketing name, e.g. `NVIDIA H200`.
    pub name: String,
    /// Bytes of device memory.
    pub total_memory: u64,
    /// `(major, minor)`, e.g. `(9, 0)`.
    pub compute_capability: (i32, i32),
}

/// What the probe found: either usable devices, or the reason there are none.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProbeReport {
    /// True when at least one device answered every query.
    pub available: bool,
    /// The devices, in ordinal order.
    pub devices: Vec<DeviceReport>,
    /// `cuDriverGetVersion`, e.g. 12040.
    pub driver_version: Option<i32>,
    /// The driver library that was loaded (a full path where it is known).
    pub library: Option<String>,
    /// Why CUDA is not available, in words a user can act on.
    pub reason: Option<String>,
}

impl ProbeReport {
    /// A report with no devices and the given reason.
    pub fn unavailable(reason: impl Into<String>) -> ProbeReport {
        ProbeReport {
            reason: Some(reason.into()),
            ..ProbeReport::default()
        }
    }

    /// Number of usable devices.
    pub fn device_count(&self) -> usize {
        if self.available {
            self.devices.len()
        } else {
            0
        }
    }
}

/// The environment variables the probe reads, captured once per call.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProbeEnv {
    /// `FASTLLM_DEVICE`.
    pub device: Option<String>,
    /// `CUDA_VISIBLE_DEVICES`.
    pub visible_devices: Option<String>,
    /// `FASTLLM_LIBCUDA`.
    pub libcuda: Option<String>,
    /// `FASTLLM_PROBE_TIMEOUT`.
    pub timeout: Option<String>,
}

impl ProbeEnv {
    /// Reads the variables from this process's environment.
    pub fn from_env() -> ProbeEnv {
        let get = |k: &str| std::env::var_os(k).map(|v| v.to_string_lossy().into_owned());
        ProbeEnv {
            device: get("FASTLLM_DEVICE"),
            visible_devices: get("CUDA_VISIBLE_DEVICES"),
            libcuda: get("FASTLLM_LIBCUDA").filter(|v| !v.trim().is_empty()),
            timeout: get("FASTLLM_PROBE_TIMEOUT"),
        }
    }
}

/// The reason the environment forbids touching the driver, if it does.
pub fn env_opt_out(env: &ProbeEnv) -> Option<String> {
    if let Some(d) = &env.device {
        if d.trim().eq_ignore_ascii_case("cpu") {
            return Some("FASTLLM_DEVICE=cpu is set, so the CUDA driver was not probed".into());
        }
    }
    if let Some(v) = &env.visible_devices {
        if v.trim().is_empty() {
            return Some(
                "CUDA_VISIBLE_DEVICES is set to an empty value, which hides every GPU; \
                 unset it or list the GPUs to use"
                    .into(),
            );
        }
        if v.split(',').next().map(str::trim) == Some("-1") {
            return Some(format!(
                "CUDA_VISIBLE_DEVICES={v} hides every GPU; unset it or list the GPUs to use"
            ));
        }
    }
    None
}

/// The probe child's time limit: a positive number of seconds, else the default.
pub fn parse_timeout(value: Option<&str>) -> Duration {
    let secs = value
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s > 0.0 && *s < 1.0e6)
        .unwrap_or(DEFAULT_TIMEOUT_SECS);
    Duration::from_secs_f64(secs)
}

/// Cheap checks that need no library: which libraries to try, or why not.
/// `os` is `std::env::consts::OS`; `exists` is `Path::exists` outside tests.
pub fn platform_check(
    env: &ProbeEnv,
    os: &str,
    exists: impl Fn(&Path) -> bool,
) -> Result<Vec<String>, String> {
    if let Some(lib) = &env.libcuda {
        let has_dir = lib.contains('/') || lib.contains('\\');
        if has_dir && !exists(Path::new(lib)) {
            return Err(format!(
                "FASTLLM_LIBCUDA={lib} does not exist; point it at a CUDA driver library or unset it"
            ));
        }
        return Ok(vec![lib.clone()]);
    }
    let names = candidate_names(os);
    if names.is_empty() {
        return Err(format!(
            "there is no CUDA driver on {os}; fastllm runs on the CPU here"
        ));
    }
    if os == "linux" && !exists(Path::new("/proc/driver/nvidia")) && !exists(Path::new("/dev/dxg"))
    {
        return Err(
            "no NVIDIA kernel driver is loaded (/proc/driver/nvidia does not exist); \
                    install the NVIDIA driver to use a GPU, or set FASTLLM_LIBCUDA to a \
                    CUDA driver library"
                .into(),
        );
    }
    Ok(names.iter().map(|s| s.to_string()).collect())
}

/// Advice appended to a failed `cuInit`, by error code.
fn init_hint(code: i32) -> &'static str {
    match code {
        100 => "; the driver sees no GPU (check `nvidia-smi` and CUDA_VISIBLE_DEVICES)",
        34 => "; a stub libcuda was loaded instead of the real driver (check LD_LIBRARY_PATH)",
        35 => "; the installed NVIDIA driver is too old for this CUDA runtime; update the driver",
        803 => "; the user-space driver and the kernel module versions differ; reboot or reinstall the driver",
        _ => "; check that `nvidia-smi` works",
    }
}

/// A step of the probe, announced before it runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step<'a> {
    /// The probe is about to do something ("during cuInit").
    Stage(&'a str),
    /// The driver library that was loaded, known before `cuInit` runs.
    Library(&'a str),
}

/// Runs the whole probe in this process, calling `step` before each step
/// with a phrase ("during cuInit", "while loading libcuda.so.1").
///
/// Only the probe child calls this: a broken driver may crash or hang here.
pub fn probe_in_process(candidates: &[String], step: &mut dyn FnMut(Step<'_>)) -> ProbeReport {
    let mut stage = |s: &str| step(Step::Stage(s));
    let mut failures = Vec::new();
    let mut opened = None;
    for name in candidates {
        stage(&format!("while loading {name}"));
        match DriverLibrary::open(name) {
            Ok(lib) => {
                opened = Some(lib);
                break;
            }
            Err(e) => failures.push(e.to_string()),
        }
    }
    let lib = match opened {
        Some(lib) => lib,
        None => {
            return ProbeReport::unavailable(format!(
                "the CUDA driver library could not be loaded ({}); install the NVIDIA driver \
                 or set FASTLLM_LIBCUDA to its libcuda",
                failures.join("; ")
            ))
        }
    };
    stage("while resolving driver symbols");
    let driver = match Driver::new(lib) {
        Ok(d) => d,
        Err(e) => return ProbeReport::unavailable(e.to_string()),
    };
    let mut report = ProbeReport {
        library: Some(driver.library_path()),
        ..ProbeReport::default()
    };
    if let Some(lib) = &report.library {
        step(Step::Library(lib));
    }
    let mut stage = |s: &str| step(Step::Stage(s));
    let fail = |mut report: ProbeReport, reason: String| {
        report.reason = Some(reason);
        report
    };
    stage("during cuInit");
    if let Err(e) = driver.init() {
        let reason = format!("{e}{}", init_hint(e.code));
        return fail(report, reason);
    }
    stage("during cuDriverGetVersion");
    match driver.driver_version() {
        Ok(v) => report.driver_version = Some(v),
        Err(e) => return fail(report, e.to_string()),
    }
    stage("during cuDeviceGetCount");
    let count = match driver.device_count() {
        Ok(n) => n,
        Err(e) => return fail(report, e.to_string()),
    };
    if count <= 0 {
        return fail(
            report,
            "the CUDA driver reports no GPU (cuDeviceGetCount returned 0); check `nvidia-smi` \
             and CUDA_VISIBLE_DEVICES"
                .into(),
        );
    }
    for index in 0..count {
        stage(&format!("while querying device {index}"));
        let info = driver.device(index).and_then(|dev| {
            Ok(DeviceReport {
                index,
                name: driver.device_name(dev)?,
                total_memory: driver.total_memory(dev)?,
                compute_capability: driver.compute_capability(dev)?,
            })
        });
        match info {
            Ok(d) => report.devices.push(d),
            Err(e) => {
                report.devices.clear();
                return fail(report, format!("{e} (device {index})"));
            }
        }
    }
    report.available = true;
    report
}

/// One field per line, prefixed with [`MARK`]; names lose control characters.
pub fn encode_report(report: &ProbeReport) -> String {
    let clean = clean_field;
    let mut out = String::new();
    if let Some(lib) = &report.library {
        out += &format!("{MARK} library {}\n", clean(lib));
    }
    if let Some(v) = report.driver_version {
        out += &format!("{MARK} version {v}\n");
    }
    for d in &report.devices {
        out += &format!(
            "{MARK} device {} {} {} {} {}\n",
            d.index,
            d.total_memory,
            d.compute_capability.0,
            d.compute_capability.1,
            clean(&d.name)
        );
    }
    match &report.reason {
        Some(r) => out += &format!("{MARK} fail {}\n", clean(r)),
        None if report.available => out += &format!("{MARK} ok\n"),
        None => out += &format!("{MARK} fail no reason given\n"),
    }
    out
}

/// A protocol field: control characters (newlines above all) become spaces.
fn clean_field(s: &str) -> String {
    s.replace(|c: char| c.is_control(), " ")
}

/// What the parent read from a child's stdout.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ChildOutput {
    /// The last stage phrase the child announced.
    pub stage: Option<String>,
    /// The driver library the child loaded, if it got that far.
    pub library: Option<String>,
    /// The final report, present only if the child finished (`ok` / `fail`).
    pub report: Option<ProbeReport>,
}

/// Parses the child protocol; lines without [`MARK`] or malformed are ignored.
pub fn decode_output(lines: &[String]) -> ChildOutput {
    let mut out = ChildOutput::default();
    let mut report = ProbeReport::default();
    for line in lines {
        let Some(rest) = line.strip_prefix(MARK).and_then(|r| r.strip_prefix(' ')) else {
            continue;
        };
        let (key, value) = rest.split_once(' ').unwrap_or((rest, ""));
        match key {
            "stage" => out.stage = Some(value.to_string()),
            "library" => {
                report.library = Some(value.to_string());
                out.library = Some(value.to_string());
            }
            "version" => report.driver_version = value.trim().parse().ok(),
            "device" => {
                if let Some(d) = decode_device(value) {
                    report.devices.push(d);
                }
            }
            "ok" => {
                report.available = !report.devices.is_empty();
                if !report.available {
                    report.reason = Some("the probe child reported no device".into());
                }
                out.report = Some(report.clone());
            }
            "fail" => {
                report.available = false;
                report.reason = Some(value.to_string());
                out.report = Some(report.clone());
            }
            _ => {}
        }
    }
    out
}

fn decode_device(value: &str) -> Option<DeviceReport> {
    let mut parts = value.splitn(5, ' ');
    let index = parts.next()?.parse().ok()?;
    let total_memory = parts.next()?.parse().ok()?;
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    let name = parts.next().unwrap_or("").to_string();
    Some(DeviceReport {
        index,
        name,
        total_memory,
        compute_capability: (major, minor),
    })
}

/// The probe child's whole job: read the environment, probe, and write the
/// protocol to `out`, flushing before every step so a crash leaves the stage.
pub fn child_main(out: &mut dyn Write) {
    let env = ProbeEnv::from_env();
    let report = match env_opt_out(&env) {
        Some(reason) => ProbeReport::unavailable(reason),
        None => match platform_check(&env, std::env::consts::OS, |p| p.exists()) {
            Err(reason) => ProbeReport::unavailable(reason),
            Ok(candidates) => probe_in_process(&candidates, &mut |step| {
                let _ = match step {
                    Step::Stage(s) => writeln!(out, "{MARK} stage {s}"),
                    Step::Library(l) => writeln!(out, "{MARK} library {}", clean_field(l)),
                };
                let _ = out.flush();
            }),
        },
    };
    let _ = out.write_all(encode_report(&report).as_bytes());
    let _ = out.flush();
}

/// The name of a signal number (`SIGSEGV`), or `signal N`.
pub fn signal_name(sig: i32) -> String {
    #[cfg(unix)]
    {
        let known = [
            (libc::SIGSEGV, "SIGSEGV"),
            (libc::SIGBUS, "SIGBUS"),
            (libc::SIGABRT, "SIGABRT"),
            (libc::SIGILL, "SIGILL"),
            (libc::SIGFPE, "SIGFPE"),
            (libc::SIGKILL, "SIGKILL"),
            (libc::SIGTERM, "SIGTERM"),
            (libc::SIGTRAP, "SIGTRAP"),
            (libc::SIGSYS, "SIGSYS"),
            (libc::SIGPIPE, "SIGPIPE"),
            (libc::SIGINT, "SIGINT"),
            (libc::SIGQUIT, "SIGQUIT"),
            (libc::SIGHUP, "SIGHUP"),
            (libc::SIGALRM, "SIGALRM"),
            (libc::SIGUSR1, "SIGUSR1"),
            (libc::SIGUSR2, "SIGUSR2"),
        ];
        if let Some((_, name)) = known.iter().find(|(n, _)| *n == sig) {
            return name.to_string();
        }
    }
    format!("signal {sig}")
}

/// How a finished child ended, in words, or `None` for a clean exit.
fn describe_exit(status: ExitStatus) -> Option<String> {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(sig) = status.signal() {
            return Some(format!("crashed with {}", signal_name(sig)));
        }
    }
    match status.code() {
        Some(0) => None,
        #[cfg(windows)]
        Some(code) if (code as u32) >= 0xC000_0000 => {
            Some(format!("crashed with exception 0x{:08X}", code as u32))
        }
        Some(code) => Some(format!("exited with status {code}")),
        None => Some("ended abnormally".into()),
    }
}

/// Phrase for the step a child was in, e.g. " during cuInit", or "".
fn at_stage(stage: &Option<String>) -> String {
    match stage {
        Some(s) => format!(" {s}"),
        None => " before it reached the driver".into(),
    }
}

/// The last non-empty line of the child's stderr, for context.
fn stderr_tail(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    match text.lines().rev().find(|l| !l.trim().is_empty()) {
        Some(l) => format!(": {}", l.trim()),
        None => String::new(),
    }
}

/// Runs the probe child `command` (program and arguments) with a time limit
/// and turns whatever happens to it into a report. Never panics.
pub fn run_child(command: &[String], timeout: Duration) -> ProbeReport {
    let Some((program, args)) = command.split_first() else {
        return ProbeReport::unavailable("no command to run the probe child");
    };
    let spawned = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let mut child = match spawned {
        Ok(c) => c,
        Err(e) => {
            return ProbeReport::unavailable(format!(
                "could not start the CUDA probe child process ({program}): {e}"
            ))
        }
    };
    let (lines, stderr, outcome) = supervise(&mut child, timeout);
    let decoded = decode_output(&lines);
    let stage = at_stage(&decoded.stage);
    let with_library = |reason: String| ProbeReport {
        library: decoded.library.clone(),
        ..ProbeReport::unavailable(reason)
    };
    match outcome {
        Outcome::TimedOut => with_library(format!(
            "driver did not answer within {:.1} s{stage}; the probe child was stopped \
             (set FASTLLM_PROBE_TIMEOUT to allow more seconds if the driver is only slow)",
            timeout.as_secs_f64()
        )),
        Outcome::WaitFailed(e) => {
            ProbeReport::unavailable(format!("could not wait for the CUDA probe child: {e}"))
        }
        Outcome::Exited(status) => match (describe_exit(status), decoded.report) {
            (None, Some(report)) => report,
            (Some(how), _) if how.starts_with("crashed") => {
                with_library(format!("driver {how}{stage}"))
            }
            (Some(how), _) => with_library(format!(
                "the CUDA probe child {how}{stage}{}",
                stderr_tail(&stderr)
            )),
            (None, None) => with_library(format!(
                "the CUDA probe child exited without a report{stage}{}",
                stderr_tail(&stderr)
            )),
        },
    }
}

enum Outcome {
    Exited(ExitStatus),
    TimedOut,
    WaitFailed(String),
}

/// Collects the child's stdout lines and stderr while waiting for it to end
/// or for the deadline; a child past its deadline is killed and reaped.
fn supervise(child: &mut Child, timeout: Duration) -> (Vec<String>, Vec<u8>, Outcome) {
    let deadline = Instant::now() + timeout;
    let (tx, rx) = mpsc::channel::<String>();
    if let Some(stdout) = child.stdout.take() {
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                match line {
                    Ok(l) => {
                        if tx.send(l).is_err() {
                            break;
                        }
                    }
                    Err(_) => break,
                }
            }
        });
    }
    let stderr_buf = Arc::new(Mutex::new(Vec::new()));
    let stderr_reader = child.stderr.take().map(|mut stderr| {
        let buf = Arc::clone(&stderr_buf);
        std::thread::spawn(move || {
            let mut chunk = [0u8; 4096];
            while let Ok(n) = stderr.read(&mut chunk) {
                if n == 0 {
                    break;
                }
                let mut b = buf.lock().unwrap_or_else(|e| e.into_inner());
                b.extend_from_slice(&chunk[..n]);
                let excess = b.len().saturating_sub(8192);
                b.drain(..excess);
            }
        })
    });

    let mut lines = Vec::new();
    let mut stdout_open = true;
    let outcome = loop {
        let now = Instant::now();
        if now >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            break Outcome::TimedOut;
        }
        if stdout_open {
            // Sleeps until the next line, the child closing stdout, or 10 ms.
            match rx.recv_timeout((deadline - now).min(Duration::from_millis(10))) {
                Ok(l) => {
                    lines.push(l);
                    continue;
                }
                Err(RecvTimeoutError::Disconnected) => stdout_open = false,
                Err(RecvTimeoutError::Timeout) => {}
            }
        } else {
            std::thread::sleep(Duration::from_millis(1));
        }
        match child.try_wait() {
            Ok(Some(status)) => break Outcome::Exited(status),
            Ok(None) => {}
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                break Outcome::WaitFailed(e.to_string());
            }
        }
    };
    // Lines still in flight; a grandchild holding the pipe open must not
    // keep the parent waiting, hence the bound.
    let drain_until = Instant::now() + Duration::from_millis(200);
    while let Some(left) = drain_until.checked_duration_since(Instant::now()) {
        match rx.recv_timeout(left) {
            Ok(l) => lines.push(l),
            Err(_) => break,
        }
    }
    if let Some(handle) = stderr_reader {
        while !handle.is_finished() && Instant::now() < drain_until {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    let stderr = stderr_buf.lock().unwrap_or_else(|e| e.into_inner()).clone();
    (lines, stderr, outcome)
}

type CacheKey = (Option<String>, Option<String>);

static CACHE: Mutex<Vec<(CacheKey, ProbeReport)>> = Mutex::new(Vec::new());

/// The probe as the library uses it: environment rules, platform checks,
/// then (once per `CUDA_VISIBLE_DEVICES` value) the isolated child given by
/// `child_command`. Concurrent callers wait for one child.
pub fn probe(child_command: &[String]) -> ProbeReport {
    let env = ProbeEnv::from_env();
    if let Some(reason) = env_opt_out(&env) {
        return ProbeReport::unavailable(reason);
    }
    if let Err(reason) = platform_check(&env, std::env::consts::OS, |p| p.exists()) {
        return ProbeReport::unavailable(reason);
    }
    let key: CacheKey = (env.visible_devices.clone(), env.libcuda.clone());
    let mut cache = CACHE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, report)) = cache.iter().find(|(k, _)| *k == key) {
        return report.clone();
    }
    let report = run_child(child_command, parse_timeout(env.timeout.as_deref()));
    cache.push((key, report.clone()));
    report
}

static PARENT_DRIVER: Mutex<Option<&'static Driver>> = Mutex::new(None);

/// The driver, initialised in this process. Loads and initialises it only
/// after the isolated probe has reported a usable GPU, and only once.
pub fn driver(child_command: &[String]) -> CoreResult<&'static Driver> {
    let mut slot = PARENT_DRIVER.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(d) = *slot {
        return Ok(d);
    }
    let report = probe(child_command);
    if !report.available {
        let reason = report.reason.unwrap_or_else(|| "no GPU".into());
        return Err(CoreError::Cuda(format!("CUDA is not available: {reason}")));
    }
    let path = report
        .library
        .ok_or_else(|| CoreError::Cuda("the probe did not name the driver library".into()))?;
    let driver = Driver::new(DriverLibrary::open(&path)?)?;
    driver.init()?;
    let leaked: &'static Driver = Box::leak(Box::new(driver));
    *slot = Some(leaked);
    Ok(leaked)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(device: Option<&str>, visible: Option<&str>, lib: Option<&str>) -> ProbeEnv {
        ProbeEnv {
            device: device.map(Into::into),
            visible_devices: visible.map(Into::into),
            libcuda: lib.map(Into::into),
            timeout: None,
        }
    }

    #[test]
    fn environment_opt_outs() {
        assert!(env_opt_out(&env(Some("cpu"), None, None))
            .unwrap()
            .contains("FASTLLM_DEVICE=cpu"));
        assert!(env_opt_out(&env(Some(" CPU "), None, None)).is_some());
        assert!(env_opt_out(&env(Some("cuda"), None, None)).is_none());
        assert!(env_opt_out(&env(None, Some(""), None))
            .unwrap()
            .contains("empty"));
        assert!(env_opt_out(&env(None, Some("  "), None)).is_some());
        assert!(env_opt_out(&env(None, Some("-1"), None))
            .unwrap()
            .contains("CUDA_VISIBLE_DEVICES=-1"));
        assert!(env_opt_out(&env(None, Some("-1,0"), None)).is_some());
        assert!(env_opt_out(&env(None, Some("0,1"), None)).is_none());
        assert!(env_opt_out(&env(None, None, None)).is_none());
    }

    #[test]
    fn timeouts_parse_or_default() {
        let default = Duration::from_secs_f64(DEFAULT_TIMEOUT_SECS);
        assert_eq!(parse_timeout(Some("2")), Duration::from_secs(2));
        assert_eq!(parse_timeout(Some(" 0.5 ")), Duration::from_millis(500));
        assert_eq!(parse_timeout(Some("0")), default);
        assert_eq!(parse_timeout(Some("-3")), default);
        assert_eq!(parse_timeout(Some("soon")), default);
        assert_eq!(parse_timeout(Some("inf")), default);
        assert_eq!(parse_timeout(None), default);
    }

    #[test]
    fn platform_checks() {
        let none = |_: &Path| false;
        let all = |_: &Path| true;
        let err = platform_check(&env(None, None, None), "linux", none).unwrap_err();
        assert!(err.contains("/proc/driver/nvidia"), "{err}");
        assert_eq!(
            platform_check(&env(None, None, None), "linux", all).unwrap(),
            ["libcuda.so.1", "libcuda.so"]
        );
        let wsl = |p: &Path| p == Path::new("/dev/dxg");
        assert!(platform_check(&env(None, None, None), "linux", wsl).is_ok());
        assert!(platform_check(&env(None, None, None), "macos", all)
            .unwrap_err()
            .contains("macos"));
        assert_eq!(
            platform_check(&env(None, None, None), "windows", none).unwrap(),
            ["nvcuda.dll"]
        );
        // FASTLLM_LIBCUDA skips the kernel-driver check...
        assert_eq!(
            platform_check(&env(None, None, Some("/x/libfake.so")), "linux", all).unwrap(),
            ["/x/libfake.so"]
        );
        // ...but a path that does not exist is reported without a child.
        let err =
            platform_check(&env(None, None, Some("/x/libfake.so")), "linux", none).unwrap_err();
        assert!(
            err.contains("FASTLLM_LIBCUDA=/x/libfake.so does not exist"),
            "{err}"
        );
        // A bare name is left to the dynamic loader.
        assert_eq!(
            platform_check(&env(None, None, Some("libcuda.so.1")), "linux", none).unwrap(),
            ["libcuda.so.1"]
        );
    }

    fn lines(text: &str) -> Vec<String> {
        text.lines().map(String::from).collect()
    }

    #[test]
    fn protocol_round_trip() {
        let report = ProbeReport {
            available: true,
            devices: vec![
                DeviceReport {
                    index: 0,
                    name: "NVIDIA H200".into(),
                    total_memory: 150_000_000_000,
                    compute_capability: (9, 0),
                },
                DeviceReport {
                    index: 1,
                    name: "Weird\nname\twith controls".into(),
                    total_memory: 1,
                    compute_capability: (8, 6),
                },
            ],
            driver_version: Some(12040),
            library: Some("/usr/lib/libcuda.so.1".into()),
            reason: None,
        };
        let mut text = format!("{MARK} stage during cuInit\nnoise from the driver\n");
        text += &encode_report(&report);
        let out = decode_output(&lines(&text));
        assert_eq!(out.stage.as_deref(), Some("during cuInit"));
        let got = out.report.unwrap();
        assert_eq!(got.devices[1].name, "Weird name with controls");
        assert_eq!(got.devices[0], report.devices[0]);
        assert_eq!(got.driver_version, Some(12040));
        assert_eq!(got.library, report.library);
        assert!(got.available);

        let failed = ProbeReport {
            library: Some("/l.so".into()),
            ..ProbeReport::unavailable("cuInit failed: CUDA_ERROR_NO_DEVICE (100)")
        };
        let got = decode_output(&lines(&encode_report(&failed)))
            .report
            .unwrap();
        assert_eq!(got, failed);
    }

    #[test]
    fn unfinished_output_has_no_report() {
        let out = decode_output(&lines(&format!(
            "{MARK} stage while loading x\n{MARK} stage during cuInit\n"
        )));
        assert_eq!(out.stage.as_deref(), Some("during cuInit"));
        assert!(out.report.is_none());
    }

    #[cfg(unix)]
    #[test]
    fn signals_have_names() {
        assert_eq!(signal_name(libc::SIGSEGV), "SIGSEGV");
        assert_eq!(signal_name(libc::SIGABRT), "SIGABRT");
        assert_eq!(signal_name(1000), "signal 1000");
    }

    #[cfg(unix)]
    fn sh(script: &str) -> Vec<String> {
        vec!["/bin/sh".into(), "-c".into(), script.into()]
    }

    #[cfg(unix)]
    #[test]
    fn child_crash_is_reported_with_signal_and_stage() {
        let script = format!(
            "echo '{MARK} library /x/libcuda.so.1'; echo '{MARK} stage during cuInit'; kill -SEGV $$"
        );
        let r = run_child(&sh(&script), Duration::from_secs(10));
        assert!(!r.available);
        assert_eq!(r.library.as_deref(), Some("/x/libcuda.so.1"));
        assert_eq!(
            r.reason.as_deref(),
            Some("driver crashed with SIGSEGV during cuInit")
        );
    }

    #[cfg(unix)]
    #[test]
    fn child_timeout_is_reported_with_stage() {
        let script = format!("echo '{MARK} stage during cuInit'; exec sleep 30");
        let start = Instant::now();
        let r = run_child(&sh(&script), Duration::from_millis(300));
        assert!(start.elapsed() < Duration::from_secs(5));
        let reason = r.reason.unwrap();
        assert!(
            reason.starts_with("driver did not answer within 0.3 s during cuInit"),
            "{reason}"
        );
    }

    #[cfg(unix)]
    #[test]
    fn child_exit_status_and_stderr_are_reported() {
        let r = run_child(&sh("echo boom >&2; exit 3"), Duration::from_secs(10));
        let reason = r.reason.unwrap();
        assert!(reason.contains("exited with status 3"), "{reason}");
        assert!(reason.contains("boom"), "{reason}");
        let r = run_child(&sh("true"), Duration::from_secs(10));
        assert!(r.reason.unwrap().contains("without a report"));
        let r = run_child(&["/nonexistent/python".into()], Duration::from_secs(10));
        assert!(r.reason.unwrap().contains("could not start"));
        let r = run_child(&[], Duration::from_secs(10));
        assert!(!r.available);
    }

    #[cfg(unix)]
    #[test]
    fn child_report_is_used_on_clean_exit() {
        let script = format!(
            "echo '{MARK} version 12040'; echo '{MARK} device 0 1024 8 9 Fake GPU'; echo '{MARK} ok'"
        );
        let r = run_child(&sh(&script), Duration::from_secs(10));
        assert!(r.available);
        assert_eq!(r.device_count(), 1);
        assert_eq!(r.devices[0].name, "Fake GPU");
        assert_eq!(r.devices[0].compute_capability, (8, 9));
    }
}
