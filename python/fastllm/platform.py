"""Which device fastllm runs on: the CUDA probe report and device resolution.

The probe itself lives in the Rust core (``fastllm._core``): it never loads
the driver in this process until a child process has loaded and initialised
it successfully, so a broken driver cannot crash the caller.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# html, logging and re are imported where used: fastllm.probe() should cost
# little more than the probe itself.

VALID_DEVICES = ("auto", "cpu", "cuda", "cuda:<index>")

_logged_reasons: set[str] = set()


@dataclass(frozen=True)
class DeviceInfo:
    """One CUDA device as the driver describes it."""

    index: int
    name: str
    total_memory: int
    compute_capability: tuple[int, int]

    def __repr__(self) -> str:
        major, minor = self.compute_capability
        return (
            f"DeviceInfo({self.index}: {self.name}, {self.total_memory / 2**30:.1f} GiB, "
            f"sm_{major}{minor})"
        )


@dataclass(frozen=True)
class ProbeReport:
    """What the CUDA probe found: usable devices, or the reason there are none."""

    available: bool
    device_count: int = 0
    devices: tuple[DeviceInfo, ...] = field(default_factory=tuple)
    driver_version: int | None = None
    library: str | None = None
    reason: str | None = None

    @property
    def driver_version_str(self) -> str | None:
        """The driver's CUDA version as ``major.minor`` (12040 -> "12.4")."""
        if self.driver_version is None:
            return None
        return f"{self.driver_version // 1000}.{self.driver_version % 1000 // 10}"

    def __repr__(self) -> str:
        if self.available:
            devices = ", ".join(repr(d) for d in self.devices)
            return (
                f"ProbeReport(available=True, device_count={self.device_count}, "
                f"driver={self.driver_version_str}, library={self.library!r}, "
                f"devices=[{devices}])"
            )
        return f"ProbeReport(available=False, reason={self.reason!r})"

    def _repr_html_(self) -> str:
        from html import escape as esc

        if not self.available:
            return f"<b>CUDA not available</b>: {esc(self.reason or '')}"
        rows = "".join(
            f"<tr><td>{d.index}</td><td>{esc(d.name)}</td>"
            f"<td>{d.total_memory / 2**30:.1f} GiB</td>"
            f"<td>{d.compute_capability[0]}.{d.compute_capability[1]}</td></tr>"
            for d in self.devices
        )
        return (
            f"<b>CUDA available</b>: driver {esc(self.driver_version_str or '?')}, "
            f"<code>{esc(self.library or '')}</code>"
            "<table><tr><th>#</th><th>name</th><th>memory</th><th>capability</th></tr>"
            f"{rows}</table>"
        )


def _from_core(raw: dict) -> ProbeReport:
    devices = tuple(
        DeviceInfo(
            index=int(d["index"]),
            name=str(d["name"]),
            total_memory=int(d["total_memory"]),
            compute_capability=(int(d["compute_capability"][0]), int(d["compute_capability"][1])),
        )
        for d in raw["devices"]
    )
    return ProbeReport(
        available=bool(raw["available"]),
        device_count=int(raw["device_count"]),
        devices=devices,
        driver_version=raw["driver_version"],
        library=raw["library"],
        reason=raw["reason"],
    )


def probe() -> ProbeReport:
    """Probe for CUDA devices (cached per process and CUDA_VISIBLE_DEVICES); never raises."""
    try:
        from fastllm import _core

        return _from_core(_core._probe())
    except Exception as exc:  # the promise is a report, whatever went wrong
        return ProbeReport(available=False, reason=f"the CUDA probe itself failed: {exc!r}")


def device_count() -> int:
    """Number of usable CUDA devices (0 when there is no GPU); never raises."""
    return probe().device_count


def cuda_available() -> bool:
    """Whether at least one CUDA device is usable; never raises."""
    return probe().available


def _log_cpu_fallback(report: ProbeReport) -> None:
    import logging

    reason = report.reason or "no GPU"
    if reason in _logged_reasons:
        return
    _logged_reasons.add(reason)
    # A driver library was found yet failed: the user probably expected a GPU.
    level = logging.WARNING if report.library else logging.INFO
    logging.getLogger("fastllm").log(level, "CUDA is not used, running on the CPU: %s", reason)


def resolve_device(device: str = "auto", tensor_parallel_size: int = 1) -> str:
    """Turn a requested device into "cpu", "cuda" or "cuda:N", or raise ValueError."""
    if not isinstance(device, str):
        raise ValueError(
            f"device must be a string, one of {', '.join(VALID_DEVICES)}; got {device!r}"
        )
    requested = device.strip().lower()
    index: int | None = None
    prefix, colon, number = requested.partition(":")
    if prefix == "cuda" and colon and number.isascii() and number.isdigit():
        index = int(number)
    elif requested not in ("auto", "cpu", "cuda"):
        raise ValueError(f"unknown device {device!r}; valid devices: {', '.join(VALID_DEVICES)}")
    if (
        isinstance(tensor_parallel_size, bool)
        or not isinstance(tensor_parallel_size, int)
        or tensor_parallel_size < 1
    ):
        raise ValueError(
            f"tensor_parallel_size must be a positive integer, got {tensor_parallel_size!r}"
        )
    if requested == "cpu":
        if tensor_parallel_size > 1:
            raise ValueError("tensor_parallel_size must be 1 when device is 'cpu'")
        return "cpu"

    report = probe()
    if requested == "auto":
        if not report.available:
            _log_cpu_fallback(report)
            if tensor_parallel_size > 1:
                raise ValueError(
                    "tensor_parallel_size must be 1 when device is 'cpu' "
                    f"(device='auto' chose the CPU because {report.reason})"
                )
            return "cpu"
    elif not report.available:
        raise ValueError(f"CUDA device requested but no GPU available: {report.reason}")

    if index is not None and index >= report.device_count:
        raise ValueError(
            f"device {device!r} does not exist: {report.device_count} CUDA device(s) visible"
        )
    first = index or 0
    if first + tensor_parallel_size > report.device_count:
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} needs {tensor_parallel_size} CUDA "
            f"devices from index {first}, but only {report.device_count} are visible"
        )
    return requested if index is not None else "cuda"
