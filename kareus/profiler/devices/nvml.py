"""A real GPU measured and controlled through NVML.

Energy comes from the NVML total-energy counter (mJ since driver load). The counter only
updates every ~20-100 ms (REFERENCE.md s4), so a workload is repeated until one window
lasts at least ``min_window_s`` and the window is divided by the repeat count; where the
counter is unsupported, power is polled by a background thread and integrated. Time is the
CUDA-event time of the window (wall clock without CUDA), also divided by the repeats.

``pynvml`` (the ``nvidia-ml-py`` distribution) is imported only when a device is opened,
and any module with its interface can be injected (tests pass a fake driver).
"""

from __future__ import annotations

import logging
import math
import os
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType, TracebackType
from typing import Any

import torch

from kareus.runtime.clock import DEFAULT_CLOCK_MHZ
from kareus.profiler.devices.base import Device, Measurement, Workload
from kareus.profiler.devices.errors import (
    DeviceError,
    EnergyUnavailableError,
    MigClockControlError,
    NvmlUnavailableError,
    UnsupportedMeasurementError,
    nvml_error_code,
)
from kareus.runtime.nvml_clock import (
    EventFactory,
    NvmlClockController,
    no_event,
    record_cuda_event,
)

logger = logging.getLogger("kareus")

DEFAULT_MIN_WINDOW_S = 0.5
"""Shortest measured window: five updates of a ~100 ms energy counter. Either reading may
be up to one update stale, so a 0.5 s window can be off by up to ~20%; raise it for
final numbers (the method's artifact measured 5 s windows)."""

DEFAULT_SETTLE_S = 0.1
"""Wait after a clock switch before measuring: Hopper transitions take about 10-100 ms."""

DEFAULT_POLL_INTERVAL_S = 0.01
"""Power polling period where the energy counter is unsupported."""

SEARCH_STEP_MHZ = 30
SEARCH_COUNT = 18
"""The method's A100 search range is 1410 down to 900 MHz in 30 MHz steps: 18 clocks
(REFERENCE.md s1). Other GPUs get the same shape below their maximum clock."""

STATIC_POWER_W: tuple[tuple[str, float], ...] = (
    (r"\bA100\b", 85.0),
    (r"\bA40\b", 70.0),
)
"""Power while blocked in communication, measured by the method's authors (REFERENCE.md s1)."""

STATIC_POWER_FRACTION_OF_LIMIT = 0.21
"""Assumption for GPUs without a published figure: static power is the same share of the
default power limit as on A100 SXM4 (85 W of 400 W; A40: 70 of 300 W, 23%). On an H100 or
H200 (700 W) this gives 147 W, near the 140-145 W measured idle in P0 with memory
allocated on H100 (CALIBRATION.md, Power)."""


def load_nvml(module: ModuleType | Any = None) -> ModuleType | Any:
    """Import (unless given) and initialize NVML, turning each failure into advice."""
    if module is None:
        try:
            import pynvml as module
        except ImportError as exc:
            raise NvmlUnavailableError(f"the Python bindings are missing ({exc})") from exc
    try:
        module.nvmlInit()
    except module.NVMLError as exc:
        code = nvml_error_code(exc)
        if code == module.NVML_ERROR_LIBRARY_NOT_FOUND:
            reason = "libnvidia-ml.so.1, the NVIDIA driver's NVML library, was not found"
        elif code == module.NVML_ERROR_DRIVER_NOT_LOADED:
            reason = "the NVIDIA kernel driver is not loaded (no GPU or no driver installed)"
        else:
            reason = f"nvmlInit failed ({exc})"
        raise NvmlUnavailableError(reason) from exc
    if module.nvmlDeviceGetCount() == 0:
        module.nvmlShutdown()
        raise NvmlUnavailableError("NVML sees no GPU on this machine")
    return module


def local_cuda_index(
    env: Mapping[str, str], current_device: int | None, visible_count: int
) -> int:
    """The CUDA device this process trains on.

    A script that already picked a device (``torch.cuda.set_device``) is believed; before
    that, ``current_device`` is 0 on every rank and ``LOCAL_RANK`` (torchrun) says which
    GPU this rank will use, unless each process sees only its own GPU(s).
    """
    if current_device:
        return current_device
    local_rank = int(env.get("LOCAL_RANK", "0"))
    return local_rank if 0 <= local_rank < visible_count else 0


def nvml_index_for_cuda_device(
    nvml: ModuleType | Any, cuda_index: int, visible_devices: str | None
) -> int:
    """Map a CUDA device ordinal to the NVML index of the same GPU, without CUDA at hand.

    CUDA numbers devices after ``CUDA_VISIBLE_DEVICES`` (indices or UUIDs, possibly
    abbreviated); NVML numbers all GPUs by PCI bus. A numeric entry is taken as an NVML
    index, which holds with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` and on nodes of identical
    GPUs. With CUDA, the device's UUID from torch is matched instead (``nvml_index_by_uuid``).
    """
    if visible_devices is None:
        return cuda_index
    entries = _entries(visible_devices)
    if cuda_index >= len(entries):
        raise DeviceError(
            f"CUDA device {cuda_index} is not visible (CUDA_VISIBLE_DEVICES={visible_devices!r}); "
            "check LOCAL_RANK and CUDA_VISIBLE_DEVICES of this process"
        )
    entry = entries[cuda_index]
    if entry.startswith("MIG-"):
        raise MigClockControlError(f"the GPU of MIG instance {entry}")
    return int(entry) if entry.isdigit() else nvml_index_by_uuid(nvml, entry)


def nvml_index_by_uuid(nvml: ModuleType | Any, uuid: str) -> int:
    """The NVML index of the one GPU whose UUID starts with ``uuid`` ("GPU-" optional)."""
    prefix = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
    matches = [
        index
        for index in range(nvml.nvmlDeviceGetCount())
        if _text(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(index))).startswith(prefix)
    ]
    if len(matches) != 1:
        raise DeviceError(
            f"{uuid!r} matches {len(matches)} GPUs known to NVML, expected one (a MIG instance "
            "matches none: clocks cannot be controlled per MIG instance)"
        )
    return matches[0]


def _entries(visible_devices: str) -> list[str]:
    return [entry.strip() for entry in visible_devices.split(",") if entry.strip()]


def _text(value: str | bytes) -> str:
    """Old pynvml versions return bytes for names and UUIDs."""
    return value.decode() if isinstance(value, bytes) else value


def default_search_clocks(
    supported: Sequence[int], step_mhz: int = SEARCH_STEP_MHZ, count: int = SEARCH_COUNT
) -> tuple[int, ...]:
    """The supported clock nearest each of max, max - step, ... (``count`` targets, ending
    at the bottom of the supported range), descending."""
    top, bottom = max(supported), min(supported)
    targets = [top - k * step_mhz for k in range(count)]
    picks = {
        min(supported, key=lambda clock: (abs(clock - target), -clock))
        for target in targets
        if target >= bottom - step_mhz / 2
    }
    return tuple(sorted(picks, reverse=True))


def default_static_power_w(gpu_name: str, default_power_limit_w: Callable[[], float]) -> float:
    """Published static power for the GPU, else the documented share of its power limit."""
    for pattern, watts in STATIC_POWER_W:
        if re.search(pattern, gpu_name):
            return watts
    try:
        watts = STATIC_POWER_FRACTION_OF_LIMIT * default_power_limit_w()
    except Exception as exc:
        raise DeviceError(
            f"no static power is known for {gpu_name} and its power limit cannot be read "
            f"({exc}): pass static_power_w=<watts drawn while blocked in communication>"
        ) from exc
    logger.warning(
        "static power of %s assumed to be %.0f W (%.0f%% of its default power limit, as on "
        "A100); pass static_power_w= to use a measured value",
        gpu_name,
        watts,
        100 * STATIC_POWER_FRACTION_OF_LIMIT,
    )
    return watts


class EnergyCounter:
    """Energy of a window from two readings of the NVML counter (mJ since driver load)."""

    method = "nvml-energy-counter"

    def __init__(self, read_mj: Callable[[], int]) -> None:
        self._read_mj = read_mj
        self._start_mj = 0
        self.joules = 0.0

    def __enter__(self) -> EnergyCounter:
        self._start_mj = self._read_mj()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.joules = (self._read_mj() - self._start_mj) / 1000.0


class PowerSampler:
    """Energy of a window by the trapezoid rule over power polled from a background thread.

    Power is also read at both ends of the window, so the integral spans it exactly. Only
    GPUs without the counter (pre-Volta, some vGPU setups) take this path.
    """

    method = "nvml-power-polling"

    def __init__(
        self, read_power_w: Callable[[], float], now: Callable[[], float], interval_s: float
    ) -> None:
        self._read_power_w = read_power_w
        self._now = now
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="kareus-power", daemon=True)
        self.samples: list[tuple[float, float]] = []
        self.joules = 0.0

    def __enter__(self) -> PowerSampler:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        self.joules = sum(
            (t1 - t0) * (p0 + p1) / 2
            for (t0, p0), (t1, p1) in zip(self.samples, self.samples[1:])
        )

    def _poll(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._sample()

    def _sample(self) -> None:
        self.samples.append((self._now(), self._read_power_w()))


@dataclass(frozen=True)
class _Window:
    runs: int
    wall_s: float
    stream_s: float | None
    energy_j: float


class NvmlGPU(Device):
    """The local GPU of this process, measured through NVML and clocked by locked clocks.

    ``dry_run`` measures the same way but never calls an NVML setter: clock switches are
    validated and recorded (``clock_controller().switches``), and every measurement is at
    the default clocks (``details["clock_locked"] == 0``).
    """

    def __init__(
        self,
        *,
        cuda_index: int | None = None,
        dry_run: bool = False,
        static_power_w: float | None = None,
        min_window_s: float = DEFAULT_MIN_WINDOW_S,
        settle_s: float = DEFAULT_SETTLE_S,
        poll_interval_s: float = DEFAULT_POLL_INTERVAL_S,
        nvml_module: ModuleType | Any = None,
        cuda: bool | None = None,
        event_factory: EventFactory | None = None,
        timer: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
        reset_at_exit: bool = True,
    ) -> None:
        self.dry_run = dry_run
        self.min_window_s = min_window_s
        self._settle_s = settle_s
        self._poll_interval_s = poll_interval_s
        self._timer = timer
        self._sleep = sleep
        self._nvml = nvml = load_nvml(nvml_module)
        try:
            self._cuda = cuda_available() if cuda is None else cuda
            self.index = self._select_gpu(cuda_index)
            self._handle = nvml.nvmlDeviceGetHandleByIndex(self.index)
            self.gpu_name = _text(nvml.nvmlDeviceGetName(self._handle))
            prefix = "nvml-dry-run" if dry_run else "nvml"
            self.name = f"{prefix}:{self.index} ({self.gpu_name})"
            memory_mhz = nvml.nvmlDeviceGetClockInfo(self._handle, nvml.NVML_CLOCK_MEM)
            clocks = nvml.nvmlDeviceGetSupportedGraphicsClocks(self._handle, memory_mhz)
            self._supported = tuple(sorted(set(clocks), reverse=True))
            self._static_power_w = (
                static_power_w
                if static_power_w is not None
                else default_static_power_w(self.gpu_name, self._default_power_limit_w)
            )
            self._use_counter = self._energy_counter_supported()
            self._controller = NvmlClockController(
                nvml,
                self._handle,
                gpu=f"GPU {self.index} ({self.gpu_name})",
                index=self.index,
                supported_clocks=self._supported,
                dry_run=dry_run,
                event_factory=event_factory
                or (record_cuda_event if self._cuda else no_event),
                reset_at_exit=reset_at_exit,
            )
        except BaseException:
            nvml.nvmlShutdown()
            raise

    def supported_clocks(self) -> tuple[int, ...]:
        return self._supported

    def search_clocks(self) -> tuple[int, ...]:
        """See ``default_search_clocks``; the first is the maximum, where default clocks boost."""
        return default_search_clocks(self._supported)

    @property
    def static_power_w(self) -> float:
        return self._static_power_w

    @property
    def method(self) -> str:
        return EnergyCounter.method if self._use_counter else PowerSampler.method

    def clock_controller(self) -> NvmlClockController:
        return self._controller

    def measure(
        self, workload: Workload, clock_mhz: int, *, comm_sms: int | None = None
    ) -> Measurement:
        if comm_sms is not None:
            raise UnsupportedMeasurementError(
                "communication resource caps need NCCL sub-communicators, not supported by "
                "this device yet: measure with comm_sms=None"
            )
        if workload.run is None:
            raise ValueError(
                f"workload {workload.name!r} has no run(): the NVML device measures by running it"
            )
        switching = clock_mhz != self._controller.applied_mhz
        self._controller.set_clock(f"measure:{workload.name}", clock_mhz)
        self._controller.flush()
        if switching:
            self._sleep(self._settle_s)
        warmup = self._window(workload.run, 1)
        window = self._window(workload.run, self._runs_to_fill(warmup))
        while window.wall_s < self.min_window_s:  # the warm-up overestimated one run
            window = self._window(workload.run, max(2 * window.runs, self._runs_to_fill(window)))
        time_s = (window.stream_s if window.stream_s is not None else window.wall_s) / window.runs
        details = {
            "runs": float(window.runs),
            "window_s": window.wall_s,
            "wall_time_s": window.wall_s / window.runs,
            "clock_locked": float(not self.dry_run and clock_mhz != DEFAULT_CLOCK_MHZ),
        }
        if window.stream_s is not None:
            details["cuda_time_s"] = window.stream_s / window.runs
        return Measurement(
            time_s=time_s,
            energy_j=window.energy_j / window.runs,
            static_power_w=self._static_power_w,
            clock_mhz=clock_mhz,
            method=self.method,
            details=details,
        )

    def close(self) -> None:
        """Reset clocks, stop the controller thread and release NVML."""
        try:
            self._controller.close()
        finally:
            self._nvml.nvmlShutdown()

    def __enter__(self) -> NvmlGPU:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _select_gpu(self, cuda_index: int | None) -> int:
        if self._cuda:
            if cuda_index is None:
                cuda_index = local_cuda_index(
                    os.environ, torch.cuda.current_device(), torch.cuda.device_count()
                )
            uuid = f"GPU-{torch.cuda.get_device_properties(cuda_index).uuid}"
            return nvml_index_by_uuid(self._nvml, uuid)
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if cuda_index is None:
            count = (
                self._nvml.nvmlDeviceGetCount() if visible is None else len(_entries(visible))
            )
            cuda_index = local_cuda_index(os.environ, None, count)
        return nvml_index_for_cuda_device(self._nvml, cuda_index, visible)

    def power_w(self) -> float:
        """Board power now (NVML's power reading, averaged by the driver over ~1 s)."""
        return self._nvml.nvmlDeviceGetPowerUsage(self._handle) / 1000.0

    def _default_power_limit_w(self) -> float:
        return self._nvml.nvmlDeviceGetPowerManagementDefaultLimit(self._handle) / 1000.0

    def _energy_counter_supported(self) -> bool:
        nvml = self._nvml
        try:
            nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle)
            return True
        except nvml.NVMLError as exc:
            if nvml_error_code(exc) != nvml.NVML_ERROR_NOT_SUPPORTED:
                raise
        try:
            nvml.nvmlDeviceGetPowerUsage(self._handle)
        except nvml.NVMLError as exc:
            raise EnergyUnavailableError(self.gpu_name, exc) from exc
        logger.warning(
            "%s has no NVML energy counter (NOT_SUPPORTED): integrating power polled every "
            "%.0f ms instead, which is less accurate for short kernels",
            self.name,
            1000 * self._poll_interval_s,
        )
        return False

    def _meter(self) -> EnergyCounter | PowerSampler:
        nvml, handle = self._nvml, self._handle
        if self._use_counter:
            return EnergyCounter(lambda: nvml.nvmlDeviceGetTotalEnergyConsumption(handle))
        return PowerSampler(
            self.power_w,
            self._timer,
            self._poll_interval_s,
        )

    def _runs_to_fill(self, window: _Window) -> int:
        """Runs expected to fill ``min_window_s`` with a 10% margin, from a timed window."""
        per_run_s = max(window.wall_s / window.runs, 1e-6)
        return max(1, math.ceil(1.1 * self.min_window_s / per_run_s))

    def _window(self, run: Callable[[], object], runs: int) -> _Window:
        """Run ``runs`` times back to back, energy read around them once the stream is idle."""
        events = _timing_events() if self._cuda else None
        with self._meter() as meter:
            if events is not None:
                events[0].record()
            start = self._timer()
            for _ in range(runs):
                run()
            if events is not None:
                events[1].record()
            self._synchronize()
            wall_s = self._timer() - start
        stream_s = events[0].elapsed_time(events[1]) / 1000.0 if events is not None else None
        return _Window(runs, wall_s, stream_s, meter.joules)

    def _synchronize(self) -> None:
        if self._cuda:
            torch.cuda.synchronize()


def cuda_available() -> bool:
    """Whether torch sees a CUDA GPU; one place for tests to pretend otherwise."""
    return torch.cuda.is_available()


def _timing_events() -> tuple[Any, Any]:
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
