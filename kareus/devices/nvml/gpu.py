"""A real GPU measured and controlled through NVML.

``NvmlGPU`` composes three parts, each usable and tested on its own: which GPU this
process trains on (``nvml.select.select_gpu``), the energy meter that measures workloads
on it (``nvml.energy.NvmlEnergyMeter``) and the controller that locks its SM clock
(``nvml.clock.NvmlClockController``). This module adds what NVML does not say: the
clocks to search and the GPU's static power. At open it asks the controller whether the
process may lock clocks (``probe_permission``); where it may not, only the default clock
is searched and ``clock_limitation`` says why.

A batch of workloads at one clock (``measure_batch``) is measured together, interleaved
(``nvml.multiplex``), where the energy counter integrates the power; whether it does is
probed once per GPU model and driver (``nvml.counter``), when first needed. Elsewhere each
workload gets windows long enough for the error a multiplexed estimate would have. With
CUDA, each workload runs as the replay of its CUDA graph where it can be captured
(``nvml.replay``), so that its time is the GPU's, without launch gaps.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import os
import re
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import torch

from kareus.closing import Closing
from kareus.devices.base import Device, EnergyReading, Measurement, Resources, Workload
from kareus.devices.errors import (
    CounterProbeError,
    CounterProbeStalledError,
    DeviceError,
    UnmeasurableWorkloadError,
    UnsupportedMeasurementError,
    no_clock_permission,
)
from kareus.devices.nvml.clock import (
    EventFactory,
    NvmlClockController,
    no_event,
    record_cuda_event,
)
from kareus.devices.nvml.counter import CounterBehaviour, probe_counter
from kareus.devices.nvml.driver import load_nvml, nvml_text
from kareus.devices.nvml.energy import (
    DEFAULT_MIN_WINDOW_S,
    DEFAULT_POLL_INTERVAL_S,
    EnergyCounter,
    NvmlEnergyMeter,
)
from kareus.devices.nvml.multiplex import (
    DEFAULT_POLICY,
    Agree,
    CounterCache,
    MultiplexPolicy,
)
from kareus.devices.nvml.multiplex import details as multiplexed_details
from kareus.devices.nvml.ownership import HeldClockLocks
from kareus.devices.nvml.replay import (
    CudaGraphs,
    Eager,
    EagerKind,
    Replay,
    agreed,
    nccl_version,
    replayable,
)
from kareus.devices.nvml.select import select_gpu
from kareus.passes.ops import DEFAULT_CLOCK_MHZ

logger = logging.getLogger("kareus")

DEFAULT_SETTLE_S = 0.1
"""Wait after a clock switch before measuring: Hopper transitions take about 10-100 ms."""

CHECK_WINDOW_S = 2.0
"""The window of ``check``: twenty updates of a 100 ms counter, whose readings' staleness
(at most one update at each end) then weighs at most 10%, and much less on average."""

POWER_UPDATE_S = 0.1
"""How often NVML's power reading changes (A100/H100: every 100 ms, averaging 25 ms of
it; Yang et al., SC'24): the update period of a GPU measured by polling power."""

GEMM_SIZE = 4096
"""Side of the square bf16 matrices the counter probe multiplies to load the GPU."""

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


class NvmlGPU(Device, Closing):
    """The local GPU of this process, measured through NVML and clocked by locked clocks.

    ``dry_run`` measures the same way but never calls an NVML setter: clock switches are
    validated and recorded (``clock_controller().switches``), and every measurement is at
    the default clocks (``details["clock_locked"] == 0``). Either way the device is this
    process's GPU, so compiled graphs drive its controller (``controls_clocks``).
    ``clock_locks`` is where the process keeps the clock ownerships it holds: the runtime
    passes its own (``ProcessRuntime.clock_locks``); see ``NvmlClockController``.
    Without permission to lock clocks (not a dry run), clocks are locked through zeusd
    at ``zeusd_socket`` (None: ``$ZEUSD_SOCK_PATH``) where it answers; where it does not
    either, only the default clock is searched and ``clock_limitation`` says why (a WARNING
    says it once, at open). ``load`` keeps the GPU busy for about the seconds given while
    its energy counter is probed (None: a GEMM loop with CUDA, a CPU spin without).
    With CUDA each workload is measured replaying its CUDA graph (``nvml.replay``) where
    it can be captured; ``replay=False`` measures every one eagerly, and ``graphs`` stands
    in for ``torch.cuda``'s graph API (tests). ``details["replayed"]`` says which ran.
    """

    controls_clocks = True

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
        clock_locks: HeldClockLocks | None = None,
        zeusd_socket: str | os.PathLike[str] | None = None,
        counter: CounterBehaviour | None = None,
        multiplexing: MultiplexPolicy = DEFAULT_POLICY,
        load: Callable[[float], None] | None = None,
        replay: bool = True,
        graphs: CudaGraphs | None = None,
    ) -> None:
        self.dry_run = dry_run
        self._load = load
        self._settle_s = settle_s
        self._sleep = sleep
        self._timer = timer
        self._counter = counter
        self._nvml = nvml = load_nvml(nvml_module)
        self._clock_limitation: str | None = None
        controller: NvmlClockController | None = None
        try:
            cuda = cuda_available() if cuda is None else cuda
            self.index = select_gpu(nvml, cuda_index, cuda=torch.cuda if cuda else None)
            handle = nvml.nvmlDeviceGetHandleByIndex(self.index)
            self.gpu_name = nvml_text(nvml.nvmlDeviceGetName(handle))
            prefix = "nvml-dry-run" if dry_run else "nvml"
            self.name = f"{prefix}:{self.index} ({self.gpu_name})"
            gpu = f"GPU {self.index} ({self.gpu_name})"
            memory_mhz = nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_MEM)
            clocks = nvml.nvmlDeviceGetSupportedGraphicsClocks(handle, memory_mhz)
            self._supported = tuple(sorted(set(clocks), reverse=True))
            self._static_power_w = (
                static_power_w
                if static_power_w is not None
                else default_static_power_w(
                    self.gpu_name,
                    lambda: nvml.nvmlDeviceGetPowerManagementDefaultLimit(handle) / 1000.0,
                )
            )
            self.meter = NvmlEnergyMeter(
                nvml,
                handle,
                gpu=gpu,
                min_window_s=min_window_s,
                poll_interval_s=poll_interval_s,
                cuda=cuda,
                timer=timer,
                multiplexing=multiplexing,
            )
            self._cuda = cuda
            self._graphs = (graphs if graphs is not None else torch.cuda if cuda else None
                            ) if replay else None
            self._nccl = nccl_version() if self._graphs is not None else None
            self._eager_said: set[EagerKind] = set()
            self._controller = controller = NvmlClockController(
                nvml,
                handle,
                gpu=gpu,
                index=self.index,
                supported_clocks=self._supported,
                dry_run=dry_run,
                event_factory=event_factory or (record_cuda_event if cuda else no_event),
                reset_at_exit=reset_at_exit,
                held=clock_locks,
                zeusd_socket=zeusd_socket,
            )
            if not controller.probe_permission():
                self._clock_limitation = no_clock_permission(gpu)
                logger.warning("%s", self._clock_limitation)
        except BaseException:
            try:
                if controller is not None:
                    controller.close()
            finally:
                nvml.nvmlShutdown()
            raise

    @property
    def identity(self) -> str:
        """The GPU model, and whether clocks really change (a dry run measures every clock
        at the default ones): a profile measured on one H200 holds for another."""
        return f"{'nvml-dry-run' if self.dry_run else 'nvml'}:{self.gpu_name}"

    def supported_clocks(self) -> tuple[int, ...]:
        return self._supported

    def search_clocks(self) -> tuple[int, ...]:
        """See ``default_search_clocks``; the first is the maximum, where default clocks boost.
        Only that one where the clocks cannot be locked (``clock_limitation``)."""
        clocks = default_search_clocks(self._supported)
        return clocks[:1] if self._clock_limitation is not None else clocks

    @property
    def clock_limitation(self) -> str | None:
        return self._clock_limitation

    @property
    def static_power_w(self) -> float:
        return self._static_power_w

    @property
    def min_window_s(self) -> float:
        return self.meter.min_window_s

    @property
    def method(self) -> str:
        return self.meter.method

    def power_w(self) -> float:
        return self.meter.power_w()

    def read_energy(self) -> EnergyReading | None:
        return self.meter.reading()

    def clock_controller(self) -> NvmlClockController:
        return self._controller

    def counter_behaviour(self, cache: CounterCache | None = None) -> CounterBehaviour:
        """How this GPU's energy counter behaves: given at open, else found in ``cache``
        (by GPU model and driver), else probed (a few seconds: a GEMM loop with CUDA, a CPU
        spin without) and put there; kept on the device either way."""
        if self._counter is None:
            driver = nvml_text(self._nvml.nvmlSystemGetDriverVersion())
            stored = cache.counter(self.gpu_name, driver) if cache is not None else None
            if stored is not None:
                self._counter = CounterBehaviour.from_json(stored)
            else:
                try:
                    self._counter = self._probe_counter(driver)
                except CounterProbeStalledError:
                    raise
                except CounterProbeError as exc:
                    # Not known to integrate: windows, as long as the device's own; not
                    # kept, so that the next run probes again.
                    logger.warning("%s; measuring in windows of at least %.2f s instead of "
                                   "multiplexing", str(exc).rstrip("."), self.meter.min_window_s)
                    self._counter = CounterBehaviour(self.gpu_name, driver, 0.0, False,
                                                     math.nan, 0.0)
                    return self._counter
                if cache is not None:
                    cache.record_counter(self.gpu_name, driver, self._counter.to_json())
        return self._counter

    def probe_counter(self, cache: CounterCache | None = None) -> None:
        self.counter_behaviour(cache)

    @property
    def estimates_error(self) -> bool:
        """True where ``measure_batch`` multiplexes: the counter integrates the power."""
        return self.meter.method == EnergyCounter.method and self.counter_behaviour().integrates

    def measure(
        self, workload: Workload, clock_mhz: int, *, resources: Resources | None = None
    ) -> Measurement:
        self._refuse_caps(resources)
        # Once the counter is known not to integrate (probed before profiling measures),
        # a window must be long enough for the stated error, as in measure_batch.
        known = self._counter is not None and not self._counter.integrates
        meter = self.meter.lengthened(self.fallback_window_s) if known else self.meter
        (replay,) = self._replays([workload], workload.agree)
        return self._windowed(workload, replay, clock_mhz, meter, workload.agree)

    def measure_batch(
        self, workloads: Sequence[Workload], clock_mhz: int, agree: Agree | None = None,
        resources: Sequence[Resources | None] | None = None,
    ) -> list[Measurement]:
        """``workloads`` at ``clock_mhz``, the clock set once: multiplexed where the counter
        integrates (``method`` "nvml-multiplexed", ``details["error"]`` each estimate's
        relative error), else each in windows of ``fallback_window_s`` (its
        ``details["min_window_s"]``). The block order's seed comes from the workloads'
        names, so ranks measuring the same batch draw the same order. SM caps are refused,
        as by ``measure``."""
        for caps in resources or ():
            self._refuse_caps(caps)
        replays = self._replays(workloads, agree)
        if not self.estimates_error:
            meter = self.meter.lengthened(self.fallback_window_s)
            return [
                self._windowed(w, r, clock_mhz, meter, agree if agree is not None else w.agree)
                for w, r in zip(workloads, replays, strict=True)
            ]
        behaviour = self.counter_behaviour()
        switching = self._switching(clock_mhz)
        locked = self._at_clock("measure:batch", clock_mhz, settle=False)
        result = self.meter.measure_many(
            [replay.run for replay in replays],
            agree,
            batch_seed([workload.name for workload in workloads]),
            period_s=behaviour.update_period_s,
            noise_mj=behaviour.update_noise_mj,
            lag_s=behaviour.lag_s,
            lead_in=functools.partial(self._sleep, self._settle_s) if switching else None,
        )
        return [
            Measurement(
                time_s=estimate.time_s,
                energy_j=estimate.energy_j,
                static_power_w=self._static_power_w,
                clock_mhz=clock_mhz,
                method="nvml-multiplexed",
                details={**multiplexed_details(estimate, result, v), "clock_locked": locked,
                         "replayed": float(replays[v].replayed)},
            )
            for v, estimate in enumerate(result.estimates)
        ]

    def _refuse_caps(self, resources: Resources | None) -> None:
        capped = sorted(name for name, sms in (resources or {}).items() if sms is not None)
        if capped:
            raise UnsupportedMeasurementError(
                self.name,
                f"SM caps on {', '.join(capped)}",
                "caps are realised by NCCL sub-communicators the runtime creates "
                "(runtime.communicators), not by the meter; measure the rewritten graph "
                "with resources=None",
            )

    @property
    def fallback_window_s(self) -> float:
        """The shortest window where ``measure_batch`` cannot multiplex: long enough that
        the counter's (or the power reading's) update period is at most ``max_error`` of
        it. A counter that samples part of each period, or a reading that is stale by up
        to one update at each end of a window, errs by up to about one period's energy; a
        window of ``period / max_error`` bounds that below the error a multiplexed
        estimate is held to (6.7 s at 100 ms and 1.5%: the fix of Yang et al., SC'24, for
        A100/H100 power readings that average 25 of every 100 ms is likewise windows of
        several seconds, >= 5 s). Never shorter than ``min_window_s``."""
        period = (
            self.counter_behaviour().update_period_s
            if self.meter.method == EnergyCounter.method
            else POWER_UPDATE_S
        )
        return max(self.min_window_s, period / self.meter.multiplexing.max_error)

    def check(self, workload: Workload, clock_mhz: int) -> Measurement:
        """One window of at least ``CHECK_WINDOW_S``, measured apart from any batch."""
        (replay,) = self._replays([workload], workload.agree)
        return self._windowed(
            workload, replay, clock_mhz, self.meter.lengthened(CHECK_WINDOW_S), workload.agree
        )

    def _run_of(self, workload: Workload) -> Callable[[], object]:
        if workload.run is None:
            raise UnmeasurableWorkloadError(
                workload.name, "run()", "the NVML device measures by running it"
            )
        return workload.run

    def _replays(self, workloads: Sequence[Workload], agree: Agree | None) -> list[Replay]:
        """What each of ``workloads`` runs while measured (``nvml.replay``): its CUDA graph's
        replay where the device replays and every rank running it together captured it,
        the batch's graphs in one memory pool; else the workload's run, said once per
        reason."""
        runs = [self._run_of(workload) for workload in workloads]
        if self._graphs is None:
            off = Eager(EagerKind.OFF, "the device does not replay")
            return [Replay(run, off) for run in runs]
        pool = self._graphs.graph_pool_handle()
        replays = []
        for workload, run in zip(workloads, runs, strict=True):
            replay = agreed(
                replayable(run, self._graphs, pool=pool, collectives=workload.world_size > 1,
                           nccl=self._nccl),
                run, agree if agree is not None else workload.agree,
            )
            if replay.eager is not None:
                self._say_eager(workload, replay.eager)
            replays.append(replay)
        return replays

    def _say_eager(self, workload: Workload, eager: Eager) -> None:
        """Say why ``workload`` is measured eagerly: a warning the first time for a reason."""
        log = logger.debug if eager.kind in self._eager_said else logger.warning
        self._eager_said.add(eager.kind)
        log("%s: %s is measured without CUDA-graph replay (its time holds the gaps between "
            "its kernel launches): %s", self.name, workload.name, eager)

    def _requested(self, clock_mhz: int) -> int:
        """What the controller is asked for at ``clock_mhz``: the default clocks where the
        one search clock stands for them."""
        if self._clock_limitation is not None and clock_mhz == self.search_clocks()[0]:
            return DEFAULT_CLOCK_MHZ
        return clock_mhz

    def _switching(self, clock_mhz: int) -> bool:
        """Whether measuring at ``clock_mhz`` changes the clock (and must settle)."""
        return self._requested(clock_mhz) != self._controller.applied_mhz

    def _at_clock(self, graph: str, clock_mhz: int, *, settle: bool = True) -> float:
        """Set ``clock_mhz`` (settling after a switch, unless the caller settles where it
        watches the counter): 1.0 where it is really locked, 0.0 where the GPU runs its
        default clocks (a dry run, or no permission)."""
        requested = self._requested(clock_mhz)
        switching = self._switching(clock_mhz)
        self._controller.set_clock(graph, requested)
        self._controller.flush()
        if switching and settle:
            self._sleep(self._settle_s)
        return float(not self.dry_run and requested != DEFAULT_CLOCK_MHZ)

    def _windowed(
        self,
        workload: Workload,
        replay: Replay,
        clock_mhz: int,
        meter: NvmlEnergyMeter,
        agree: Agree | None,
    ) -> Measurement:
        """One window of ``workload`` (run as ``replay``) at ``clock_mhz`` by ``meter``."""
        locked = self._at_clock(f"measure:{workload.name}", clock_mhz)
        window = meter.measure(replay.run, agree)
        return Measurement(
            time_s=window.time_s,
            energy_j=window.run_energy_j,
            static_power_w=self._static_power_w,
            clock_mhz=clock_mhz,
            method=self.method,
            details={
                **window.details(),
                "min_window_s": meter.min_window_s,
                "clock_locked": locked,
                "replayed": float(replay.replayed),
            },
        )

    def _probe_counter(self, driver: str) -> CounterBehaviour:
        return probe_counter(
            self.meter.counter_mj,
            busy=self._load or (gemm_busy(self._timer) if self._cuda else cpu_busy(self._timer)),
            idle=self._sleep,
            timer=self._timer,
            gpu=self.gpu_name,
            driver=driver,
        )

    def close(self) -> None:
        """Reset clocks, stop the controller thread and release NVML."""
        try:
            self._controller.close()
        finally:
            self._nvml.nvmlShutdown()


def batch_seed(names: Sequence[str]) -> int:
    """A seed from ``names`` that every process computes alike (unlike ``hash()``)."""
    digest = hashlib.blake2b("\0".join(names).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def cpu_busy(timer: Callable[[], float]) -> Callable[[float], None]:
    """Busy-waits on ``timer``: the load of a GPU measured without CUDA (the tests)."""

    def busy(seconds: float) -> None:
        end = timer() + seconds
        while timer() < end:
            pass

    return busy


def gemm_busy(timer: Callable[[], float]) -> Callable[[float], None]:
    """Multiplies bf16 matrices on the current CUDA device until ``seconds`` pass: a load
    near the GPU's full power, synchronized so that it stops when the call returns."""
    a = torch.randn(GEMM_SIZE, GEMM_SIZE, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(a)

    def busy(seconds: float) -> None:
        end = timer() + seconds
        while timer() < end:
            torch.matmul(a, a, out=out)
            torch.cuda.synchronize()

    return busy


def cuda_available() -> bool:
    """Whether torch sees a CUDA GPU; one place for tests to pretend otherwise."""
    return torch.cuda.is_available()
