"""Energy and time of a workload on one GPU, read through NVML.

Energy comes from the NVML total-energy counter (mJ since driver load). The counter only
updates every ~20-100 ms (REFERENCE.md s4), so a workload is repeated until one window
lasts at least ``min_window_s`` and the window is divided by the repeat count; where the
counter is unsupported, power is polled by a background thread and integrated. Time is the
CUDA-event time of the window (wall clock without CUDA), also divided by the repeats.
Several workloads at one clock are measured together where the counter integrates
(``measure_many``: ``nvml.multiplex``), at a tenth of the cost of a window each.

A counter that did not advance within a window (it updates more rarely than the window
lasts, or not at all) would give zero energy: such a window is lengthened by doubling its
runs, up to ``max_window_s`` (the larger of 10 x ``min_window_s`` and 5 s), and a counter
still standing there raises ``EnergyCounterStalledError``. A lengthened window's energy is
right to within one counter update.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from kareus.devices.base import EnergyReading
from kareus.devices.errors import (
    EnergyCounterStalledError,
    EnergyUnavailableError,
    UnsupportedMeasurementError,
    nvml_error_code,
)
from kareus.devices.nvml.multiplex import (
    DEFAULT_POLICY,
    Agree,
    Multiplexed,
    MultiplexPolicy,
    multiplex,
    run_timed,
    runs_to_fill,
)

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11

logger = logging.getLogger("kareus")

DEFAULT_MIN_WINDOW_S = 0.5
"""Shortest measured window: five updates of a ~100 ms energy counter. Either reading may
be up to one update stale, so a 0.5 s window can be off by up to ~20%; raise it for
final numbers (the method's artifact measured 5 s windows)."""

DEFAULT_POLL_INTERVAL_S = 0.01
"""Power polling period where the energy counter is unsupported."""

STALLED_WINDOW_FACTOR = 10
STALLED_WINDOW_MIN_S = 5.0
"""A window whose counter did not advance is lengthened up to the larger of
``STALLED_WINDOW_FACTOR`` x ``min_window_s`` and ``STALLED_WINDOW_MIN_S`` (the method's
artifact measured 5 s windows): a counter that stands still that long is stalled."""


class EnergyCounter:
    """Energy of a window from two readings of the NVML counter (mJ since driver load)."""

    method = "nvml-energy-counter"

    def __init__(self, read_mj: Callable[[], int]) -> None:
        self._read_mj = read_mj
        self._start_mj = 0
        self.joules = 0.0

    def __enter__(self) -> Self:
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

    def __enter__(self) -> Self:
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
class Window:
    """``runs`` back-to-back executions of a workload and what they took together."""

    runs: int
    wall_s: float
    stream_s: float | None  # CUDA-event time; None without CUDA
    energy_j: float

    @property
    def time_s(self) -> float:
        """Time of one run: stream time where there is one, else wall time."""
        return (self.stream_s if self.stream_s is not None else self.wall_s) / self.runs

    @property
    def run_energy_j(self) -> float:
        return self.energy_j / self.runs

    def details(self) -> dict[str, float]:
        details = {
            "runs": float(self.runs),
            "window_s": self.wall_s,
            "wall_time_s": self.wall_s / self.runs,
        }
        if self.stream_s is not None:
            details["cuda_time_s"] = self.stream_s / self.runs
        return details


class NvmlEnergyMeter:
    """Measures a workload on one GPU in windows of at least ``min_window_s``.

    The method (counter or power polling) is chosen once, when the meter is made: a GPU
    without either raises ``EnergyUnavailableError``. ``cuda`` times windows with CUDA
    events and synchronizes before reading energy; without it, wall time is all there is.
    """

    def __init__(
        self,
        nvml: ModuleType | Any,
        handle: object,
        *,
        gpu: str,
        min_window_s: float = DEFAULT_MIN_WINDOW_S,
        poll_interval_s: float = DEFAULT_POLL_INTERVAL_S,
        cuda: bool = False,
        timer: Callable[[], float] = time.perf_counter,
        multiplexing: MultiplexPolicy = DEFAULT_POLICY,
    ) -> None:
        self._nvml = nvml
        self._handle = handle
        self.gpu = gpu
        self.min_window_s = min_window_s
        self._poll_interval_s = poll_interval_s
        self._cuda = cuda
        self._timer = timer
        self.multiplexing = multiplexing
        self._use_counter = self._energy_counter_supported()
        self._warned_stall = False

    @property
    def max_window_s(self) -> float:
        """The longest a window is lengthened to while the energy counter does not advance."""
        return max(STALLED_WINDOW_FACTOR * self.min_window_s, STALLED_WINDOW_MIN_S)

    @property
    def method(self) -> str:
        return EnergyCounter.method if self._use_counter else PowerSampler.method

    def counter_mj(self) -> int:
        """The energy counter now (mJ since driver load); NVMLError where unsupported."""
        return self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle)

    def power_w(self) -> float:
        """Board power now (NVML's power reading, averaged by the driver over ~1 s)."""
        return self._nvml.nvmlDeviceGetPowerUsage(self._handle) / 1000.0

    def measure(
        self, run: Callable[[], object], agree: Callable[[int], int] | None = None
    ) -> Window:
        """A window of repeated ``run()`` calls that lasts at least ``min_window_s``, sized
        from a single warm-up run, and over which the energy counter advanced; ``agree``
        (``Workload.agree``) makes every rank that runs it together take the same, largest,
        count. Every rank makes the same calls of ``agree``, including a rank whose counter
        stalled: it raises ``EnergyCounterStalledError`` only after the last of them."""
        decide = agree or (lambda runs: runs)
        warmup = self._window(run, 1)
        window = self._window(run, decide(_runs_to_fill(warmup, self.min_window_s)))
        while runs := decide(self._more_runs(window)):
            window = self._window(run, runs)
        if self._stalled(window):
            raise EnergyCounterStalledError(self.gpu, window.wall_s, window.runs, self.min_window_s)
        return window

    def lengthened(self, min_window_s: float) -> NvmlEnergyMeter:
        """This meter with windows of at least ``min_window_s`` (never shorter than its own)."""
        meter = copy.copy(self)
        meter.min_window_s = max(self.min_window_s, min_window_s)
        return meter

    def measure_many(
        self,
        runs: Sequence[Callable[[], object]],
        agree: Agree | None = None,
        seed: int = 0,
        *,
        period_s: float | None = None,
        noise_mj: float | None = None,
        lag_s: float | None = None,
        lead_in: Callable[[], object] | None = None,
    ) -> Multiplexed:
        """Each of ``runs`` measured together, interleaved in blocks, its energy recovered
        from the counter's updates (``nvml.multiplex``; the first run is the control). Only
        for a counter that integrates power continuously, updating every ``period_s`` (None:
        told from its updates), with ``noise_mj`` per update and its lag ``lag_s`` where
        known (probed); ``seed`` and ``agree`` must be every rank's; ``lead_in`` runs while
        the counter is watched, before the first block (``multiplex``)."""
        if not self._use_counter:
            raise UnsupportedMeasurementError(
                self.gpu, "multiplexed energy", "it has no NVML energy counter to read"
            )
        return multiplex(
            runs,
            read_mj=self.counter_mj,
            timer=self._timer,
            policy=self.multiplexing,
            seed=seed,
            agree=agree,
            cuda=self._cuda,
            period_s=period_s,
            noise_mj=noise_mj,
            lag_s=lag_s,
            lead_in=lead_in,
        )

    def reading(self) -> EnergyReading | None:
        """The timer and the energy counter now, once the work queued on the GPU ran (with
        ``cuda``: after a synchronize, so that the counter covers it): one end of a window
        of training steps (``runtime.step_meter``). None where the counter is unsupported:
        polled power would need a thread polling through the whole training."""
        if not self._use_counter:
            return None
        if self._cuda:
            torch.cuda.synchronize()
        now = self._timer()
        millijoules = self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle)
        return EnergyReading(now, millijoules / 1000.0, EnergyCounter.method)

    def _more_runs(self, window: Window) -> int:
        """The runs of the next window this rank proposes; 0: this window will do (or the
        counter stalled for good)."""
        stalled = self._stalled(window)
        if stalled and window.wall_s >= self.max_window_s:
            return 0
        if not stalled and window.wall_s >= self.min_window_s:
            return 0
        if stalled:
            self._warn_stalled(window)
        # Short: the warm-up overestimated one run. Stalled: the counter updates more rarely.
        runs = max(2 * window.runs, _runs_to_fill(window, self.min_window_s))
        return min(runs, _runs_to_fill(window, self.max_window_s))

    def _stalled(self, window: Window) -> bool:
        """Time passed but the energy counter did not advance."""
        return self._use_counter and window.energy_j <= 0 and window.wall_s > 0

    def _warn_stalled(self, window: Window) -> None:
        log = logger.debug if self._warned_stall else logger.warning
        self._warned_stall = True
        log(
            "%s: NVML's energy counter did not advance in a %.3f s window; lengthening it "
            "(up to %.1f s). Its energy is then right to within one counter update: a larger "
            "min_window_s= makes that error smaller",
            self.gpu,
            window.wall_s,
            self.max_window_s,
        )

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
            raise EnergyUnavailableError(self.gpu, exc) from exc
        logger.warning(
            "%s has no NVML energy counter (NOT_SUPPORTED): integrating power polled every "
            "%.0f ms instead, which is less accurate for short kernels",
            self.gpu,
            1000 * self._poll_interval_s,
        )
        return False

    def _energy(self) -> EnergyCounter | PowerSampler:
        if self._use_counter:
            return EnergyCounter(self.counter_mj)
        return PowerSampler(self.power_w, self._timer, self._poll_interval_s)

    def _window(self, run: Callable[[], object], runs: int) -> Window:
        """Run ``runs`` times back to back, energy read around them once the stream is idle."""
        with self._energy() as energy:
            start, end, stream_s = run_timed(run, runs, self._timer, self._cuda)
        return Window(runs, end - start, stream_s, energy.joules)


def _runs_to_fill(window: Window, seconds: float) -> int:
    """Runs expected to fill ``seconds`` with a 10% margin, from a timed window."""
    return runs_to_fill(window.wall_s / window.runs, seconds)
