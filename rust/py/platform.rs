//! The platform: the CUDA probe (isolated in a child process), CPU features,
//! the kernels' thread count and memory bandwidth.

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::error::CoreError;

/// Number of threads the Rust kernels use (`FASTLLM_NUM_THREADS` or the cores).
#[pyfunction]
fn num_threads() -> usize {
    crate::cpu::threads::num_threads()
}
/// The command that runs the isolated probe child: this Python interpreter,
/// isolated (`-I -S`), loading this very extension file by path and calling
/// `_probe_child`. A fresh process (spawn, not fork) is safe whatever threads
/// the parent runs.
pub(super) fn probe_child_command(py: Python<'_>) -> PyResult<Vec<String>> {
    let exe: String = py.import("sys")?.getattr("executable")?.extract()?;
    if exe.is_empty() {
        return Err(PyRuntimeError::new_err(
            "sys.executable is empty, so the CUDA probe child cannot be started",
        ));
    }
    let file: String = py.import("fastllm._core")?.getattr("__file__")?.extract()?;
    let code = "import sys, importlib.util as u\n\
                s = u.spec_from_file_location('fastllm._core', sys.argv[1])\n\
                m = u.module_from_spec(s)\n\
                s.loader.exec_module(m)\n\
                m._probe_child()\n";
    Ok(vec![
        exe,
        "-I".into(),
        "-S".into(),
        "-c".into(),
        code.into(),
        file,
    ])
}

/// Runs the probe (cached), with the GIL released while a child runs.
fn run_probe(py: Python<'_>) -> crate::cuda::ProbeReport {
    match probe_child_command(py) {
        Ok(cmd) => py.detach(|| crate::cuda::probe::probe(&cmd)),
        Err(e) => crate::cuda::ProbeReport::unavailable(format!(
            "could not prepare the CUDA probe child: {e}"
        )),
    }
}

/// The probe report as a dict (the fields of `fastllm.ProbeReport`).
#[pyfunction]
fn _probe(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let report = run_probe(py);
    let out = PyDict::new(py);
    out.set_item("available", report.available)?;
    out.set_item("device_count", report.device_count())?;
    let devices = PyList::empty(py);
    for d in &report.devices {
        let dev = PyDict::new(py);
        dev.set_item("index", d.index)?;
        dev.set_item("name", &d.name)?;
        dev.set_item("total_memory", d.total_memory)?;
        dev.set_item("compute_capability", d.compute_capability)?;
        devices.append(dev)?;
    }
    out.set_item("devices", devices)?;
    out.set_item("driver_version", report.driver_version)?;
    out.set_item("library", report.library)?;
    out.set_item("reason", report.reason)?;
    Ok(out)
}

/// Number of usable CUDA devices; 0 without a GPU. Goes through the isolated probe.
#[pyfunction]
fn get_device_count(py: Python<'_>) -> usize {
    run_probe(py).device_count()
}

/// Entry point of the probe child process: probes, prints the report, exits.
#[pyfunction]
fn _probe_child() {
    #[cfg(unix)]
    {
        // A crashing driver should not spend seconds writing a core file.
        let no_core = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: setrlimit only reads the struct.
        unsafe { libc::setrlimit(libc::RLIMIT_CORE, &no_core) };
    }
    let mut out = std::io::stdout().lock();
    crate::cuda::probe::child_main(&mut out);
    drop(out);
    // The report is out: skip interpreter and driver teardown, whose
    // destructors this probe has no reason to trust.
    #[cfg(unix)]
    // SAFETY: _exit ends the process immediately; stdout was flushed.
    unsafe {
        libc::_exit(0)
    };
    #[cfg(not(unix))]
    std::process::exit(0);
}

/// Initialises the driver in this process, only after the isolated probe
/// succeeded; returns the device count this process sees.
#[pyfunction]
fn _init_driver(py: Python<'_>) -> PyResult<i32> {
    let cmd = probe_child_command(py)?;
    let count = py.detach(|| -> Result<i32, CoreError> {
        let driver = crate::cuda::probe::driver(&cmd)?;
        Ok(driver.device_count()?)
    })?;
    Ok(count)
}

/// The CPU features the kernels choose from, detected at run time.
#[pyfunction]
fn cpu_features(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let out = PyDict::new(py);
    for (name, value) in crate::cpu::features().as_pairs() {
        out.set_item(name, value)?;
    }
    Ok(out)
}

/// STREAM-triad memory bandwidth in GB/s over f32 arrays of `bytes` each.
#[pyfunction]
#[pyo3(signature = (bytes=200_000_000, repeats=5))]
fn stream_triad_gbs(py: Python<'_>, bytes: usize, repeats: usize) -> PyResult<f64> {
    Ok(py.detach(|| crate::cpu::bandwidth::stream_triad_gbs(bytes, repeats))?)
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(num_threads, m)?)?;
    m.add_function(wrap_pyfunction!(_probe, m)?)?;
    m.add_function(wrap_pyfunction!(get_device_count, m)?)?;
    m.add_function(wrap_pyfunction!(_probe_child, m)?)?;
    m.add_function(wrap_pyfunction!(_init_driver, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_features, m)?)?;
    m.add_function(wrap_pyfunction!(stream_triad_gbs, m)?)?;
    Ok(())
}
