"""A fake NVML driver with the ``pynvml`` interface, so NVML code runs on CPU-only machines.

An instance stands in for the module (pass it as ``nvml_module``). It models what the
kareus NVML device relies on: an energy counter in mJ that advances with power x elapsed
time on an injectable clock, power readings, supported memory/graphics clocks, MIG mode,
locked-clock state, permission to set clocks, and counters that raise NOT_SUPPORTED. Every
call is logged; with ``state_file`` the locked clocks and the call log are written to a
JSON file after each setter, so a test can inspect a subprocess after it died.

Power is ``FakeGpu.power_w``, constant, unless the GPU has a ``FakePowerModel``: then it
depends on the SM clock (the locked one, else the maximum) and on how busy the GPU was:
as a ``BusyTimeline`` records it, when the model reads one (``BusyTimeline.spin`` is the
tests' workload, so power follows exactly what the test did, whatever else the machine
runs), else as this process's CPU time says since the last energy update (a CPU-only test
that runs real work sees energy that follows the locked clock and whether work ran).

The counter (``FakeGpu.counter_*``) is one of the kinds a real GPU might have: updated
only every ``counter_period_s`` (real ones: every 20-100 ms) and read ``counter_lag_s``
late, each update's increment with seeded gaussian noise; integrating the power
continuously, or sampling it only for ``counter_sample_s`` of each period (as A100/H100
power readings average 25 ms of every 100 ms); or stalled. Without noise or sampling the
counter reads the true energy at its last update exactly: with a ``BusyTimeline`` that is
``idle_w * span + (active_w - idle_w) * busy seconds`` at a constant clock.
"""

from __future__ import annotations

import bisect
import json
import math
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent  # on a subprocess's path to import this module
LOCK, RESET = "nvmlDeviceSetGpuLockedClocks", "nvmlDeviceResetGpuLockedClocks"


_LOCKED_CHILD = """
import signal, sys
# As in a terminal: a background job (or nohup) starts with SIGINT, SIGQUIT (or SIGHUP) ignored.
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.signal(signal.SIGQUIT, signal.SIG_DFL)
signal.signal(signal.SIGHUP, signal.SIG_DFL)
sys.path[:0] = [{tests!r}, {repo!r}]
from fake_pynvml import FakeNvml
from kareus.devices.nvml.clock import NvmlClockController, no_event
{before}
fake = FakeNvml(state_file={state!r})
{open}
ctl.set_clock("fwd", 1200)
ctl.flush()
print("locked", flush=True)
sys.stdin.readline()
{then}
"""

_BUILT_DIRECTLY = """
fake.nvmlInit()
gpu = fake.nvmlDeviceGetHandleByIndex(0)
ctl = NvmlClockController(fake, gpu, gpu="GPU 0", index=0,
                          supported_clocks=gpu.graphics_clocks[1215], event_factory=no_event)
"""

_OPENED_BY_THE_RUNTIME = """
sys.modules["pynvml"] = fake
from kareus.runtime import process_runtime
ctl = process_runtime().device("nvml").clock_controller()
"""


def locked_child(state: Path, before: str = "", then: str = "", *, runtime: bool = False) -> str:
    """Code for ``python -c``: lock GPU 0 of a fake driver whose state goes to ``state``,
    print "locked", wait for a line on stdin, then run ``then`` (``before`` runs first).
    The controller is built directly, or with ``runtime`` is the one of the device the
    process runtime opens (``device="nvml"``)."""
    return _LOCKED_CHILD.format(
        tests=str(TESTS),
        repo=str(REPO),
        state=str(state),
        before=before,
        then=then,
        open=_OPENED_BY_THE_RUNTIME if runtime else _BUILT_DIRECTLY,
    )


class FakeClock:
    """Time that moves only when a test advances it."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class BusyTimeline:
    """When the fake GPU was busy, on the fake driver's clock (pass the same ``clock``).

    ``spin`` is a workload: it busy-waits on the clock (on a ``FakeClock``: advances it)
    and records the interval, so the busy time is what the test asked for, not what the OS
    scheduler gave the process. A spin in progress counts as busy up to now, so reads from
    another thread see it. Plug it into ``FakePowerModel.of(cpu_time=t.busy_until_now)``.
    Overlapping spins (several threads) count once.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._starts: list[float] = []
        self._ends: list[float] = []
        self._before: list[float] = []
        """Busy seconds of the intervals before each one (sorted, disjoint intervals)."""
        self._open: dict[int, float] = {}
        """Start of the spin each thread has in progress."""
        self._lock = threading.Lock()

    def spin(self, seconds: float) -> None:
        """Be busy for ``seconds`` of the clock."""
        start = self.clock()
        advance = getattr(self.clock, "advance", None)
        if advance is not None:
            advance(seconds)
            self.add(start, self.clock())
            return
        me = threading.get_ident()
        with self._lock:
            self._open[me] = start
        try:
            end = start + seconds
            while self.clock() < end:
                pass
        finally:
            with self._lock:
                del self._open[me]
                self._add(start, self.clock())

    def idle(self, seconds: float) -> None:
        """Stay idle for ``seconds`` (sleep, or advance a ``FakeClock``)."""
        advance = getattr(self.clock, "advance", None)
        if advance is not None:
            advance(seconds)
        else:
            time.sleep(seconds)

    def add(self, start: float, end: float) -> None:
        """Record [start, end] as busy."""
        with self._lock:
            self._add(start, end)

    def busy_between(self, start: float, end: float) -> float:
        """Busy seconds within [start, end] (both at or before now)."""
        with self._lock:
            return self._busy_until(end) - self._busy_until(start)

    def busy_until_now(self) -> float:
        """Busy seconds so far: a ``cpu_time`` for ``FakePowerModel``."""
        now = self.clock()
        with self._lock:
            return self._busy_until(now)

    def _busy_until(self, when: float) -> float:
        if self._open and when > (opened := min(self._open.values())):
            return self._closed_until(opened) + when - opened
        return self._closed_until(when)

    def _closed_until(self, when: float) -> float:
        i = bisect.bisect_right(self._starts, when)
        if i == 0:
            return 0.0
        return self._before[i - 1] + min(self._ends[i - 1], when) - self._starts[i - 1]

    def _add(self, start: float, end: float) -> None:
        if end <= start:
            return
        if not self._starts or start > self._ends[-1]:
            total = self._closed_until(math.inf)
            self._starts.append(start)
            self._ends.append(end)
            self._before.append(total)
        elif start >= self._starts[-1]:
            self._ends[-1] = max(self._ends[-1], end)
        else:  # out of order (threads): merge and recount
            merged: list[list[float]] = []
            for a, b in sorted([*zip(self._starts, self._ends), (start, end)]):
                if merged and a <= merged[-1][1]:
                    merged[-1][1] = max(merged[-1][1], b)
                else:
                    merged.append([a, b])
            self._starts = [a for a, _ in merged]
            self._ends = [b for _, b in merged]
            self._before = [0.0]
            for a, b in merged[:-1]:
                self._before.append(self._before[-1] + b - a)


def a100_clocks() -> tuple[int, ...]:
    """A100 SM clocks at memory 1215 MHz: 1410 down to 210 in 15 MHz steps (CALIBRATION.md)."""
    return tuple(range(1410, 209, -15))


@dataclass(frozen=True)
class FakePowerModel:
    """Board power from the SM clock and the activity (0: idle, 1: busy throughout):

        P = idle + (min(P_active(f), tdp) - idle) * activity
        P_active(f) = static + C * f[MHz] * V(f)^2

    the simulated GPU's switching-power model (``devices.sim.presets.GPUSpec``: C is
    ``sm_power_coeff``, V is ``voltage``), held under the power limit without modelling
    the throttling. Activity is this process's CPU time over the fake clock's wall time
    between two energy updates, clamped to [0, 1]; ``cpu_time`` is injectable so a test on
    a ``FakeClock`` can say how busy it was. Where ``cpu_time`` is a ``BusyTimeline``'s
    ``busy_until_now``, activity is known over any interval (``activity_between``), so the
    energy of any span is exact, whenever the counter is read.
    """

    idle_w: float
    static_w: float
    tdp_w: float
    sm_power_coeff: float
    voltage: Callable[[float], float]
    cpu_time: Callable[[], float] = time.process_time

    @classmethod
    def of(cls, spec: object = None, **kwargs: object) -> FakePowerModel:
        """The model of a simulated GPU's spec (default A100 SXM4 40GB, as ``FakeGpu``:
        45 W idle, 85 W static, 400 W limit, 528 W unlimited at 1410 MHz, 244 W at 900)."""
        if spec is None:
            from kareus.devices.sim.presets import A100_SXM4_40GB as spec
        return cls(
            idle_w=spec.idle_power_w,
            static_w=spec.static_power_w,
            tdp_w=spec.tdp_w,
            sm_power_coeff=spec.sm_power_coeff,
            voltage=spec.voltage,
            **kwargs,
        )

    def active_w(self, mhz: float) -> float:
        """Power busy throughout at ``mhz``, under the power limit."""
        return min(self.static_w + self.sm_power_coeff * mhz * self.voltage(mhz) ** 2, self.tdp_w)

    def power_w(self, mhz: float, activity: float) -> float:
        return self.idle_w + (self.active_w(mhz) - self.idle_w) * min(max(activity, 0.0), 1.0)

    @property
    def timeline(self) -> BusyTimeline | None:
        """The ``BusyTimeline`` that ``cpu_time`` reads, if it reads one."""
        timeline = getattr(self.cpu_time, "__self__", None)
        return timeline if isinstance(timeline, BusyTimeline) else None

    def activity_between(self, start: float, end: float) -> float | None:
        """The busy fraction of [start, end] where ``cpu_time`` reads a ``BusyTimeline``;
        None where activity is known only as CPU time between two energy updates."""
        timeline = self.timeline
        return None if timeline is None else timeline.busy_between(start, end) / (end - start)


@dataclass
class EnergyHistory:
    """The true energy since a GPU's first read, at each read (and clock change), with what
    the power was in between, so the energy at any time since is known: a counter read
    late (lag) or over part of a period (sampling) needs it. Oldest first; entries before
    the counter's last update are dropped."""

    times: list[float] = field(default_factory=list)
    energy_mj: list[float] = field(default_factory=list)
    clock_mhz: list[int] = field(default_factory=list)
    """The SM clock during the span that ends at each time."""
    watts: list[float | None] = field(default_factory=list)
    """The constant power over that span; None: the power model's timeline says."""

    def append(self, when: float, energy_mj: float, mhz: int, watts: float | None) -> None:
        self.times.append(when)
        self.energy_mj.append(energy_mj)
        self.clock_mhz.append(mhz)
        self.watts.append(watts)

    def drop_before(self, when: float) -> None:
        """Forget the entries older than the last one at or before ``when``."""
        keep = max(bisect.bisect_right(self.times, when) - 1, 0)
        for column in (self.times, self.energy_mj, self.clock_mhz, self.watts):
            del column[:keep]


@dataclass
class FakeGpu:
    name: str = "NVIDIA A100-SXM4-40GB"
    uuid: str = "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6"
    power_w: float = 300.0
    memory_clock: int = 1215
    graphics_clocks: dict[int, tuple[int, ...]] = field(
        default_factory=lambda: {1215: a100_clocks(), 405: (645, 420)}
    )
    default_power_limit_mw: int = 400_000
    energy_counter: bool = True
    power_readable: bool = True
    mig: bool | None = False
    """MIG enabled; None: the GPU has no MIG (GetMigMode raises NOT_SUPPORTED)."""
    locked: tuple[int, int] | None = None
    power_model: FakePowerModel | None = None
    """None: power is ``power_w`` whatever the clock and load."""
    counter_period_s: float = 0.0
    """The energy counter's update period on the driver's clock: a read returns the energy
    at the last multiple of it, so reads within one period agree. 0: continuous."""
    counter_stalled: bool = False
    """The energy counter never advances (reads keep returning the same value)."""
    counter_lag_s: float = 0.0
    """A read at t returns the counter as of its last update at or before t - lag."""
    counter_noise_mj: float = 0.0
    """Standard deviation of gaussian noise added to each update's increment (with a
    period; keep it well below a period's energy: the counter is not kept monotonic)."""
    counter_seed: int = 0
    """Seed of that noise: the n-th update gets the same noise whenever it is read."""
    counter_sample_s: float = 0.0
    """A sampling counter (with a period): each period's increment is the power averaged
    over only the first ``counter_sample_s`` of the period, times the period. 0: the
    counter integrates the power throughout."""
    energy_mj: float = 5.0e7
    """Energy so far (mJ), continuous; reads return ``counter_mj``."""
    counter_mj: float | None = None
    """What the counter reads: its value as of update ``counter_tick``."""
    counter_tick: float | None = None
    """The time of the update ``counter_mj`` is as of."""
    last_update: float | None = None
    last_cpu_s: float | None = None
    last_power_w: float | None = None
    """Average power since the previous update (power model only), what power reads give."""
    history: EnergyHistory = field(default_factory=EnergyHistory, repr=False)
    """The true energy since the first read, for counters that read it late or sampled."""
    counter_rng: random.Random | None = field(default=None, repr=False)
    """The noise's generator, seeded with ``counter_seed`` at the first noisy update."""

    @property
    def sm_clock_mhz(self) -> int:
        """The locked SM clock, else the maximum (where the default clocks boost)."""
        return self.locked[0] if self.locked else max(self.graphics_clocks[self.memory_clock])


@dataclass(frozen=True)
class Call:
    name: str
    args: tuple[object, ...]
    thread: str


class FakeNvml:
    """One fake driver; its attributes mirror the pynvml functions and constants used."""

    NVML_SUCCESS = 0
    NVML_ERROR_UNINITIALIZED = 1
    NVML_ERROR_INVALID_ARGUMENT = 2
    NVML_ERROR_NOT_SUPPORTED = 3
    NVML_ERROR_NO_PERMISSION = 4
    NVML_ERROR_DRIVER_NOT_LOADED = 9
    NVML_ERROR_LIBRARY_NOT_FOUND = 12
    NVML_ERROR_UNKNOWN = 999
    NVML_CLOCK_GRAPHICS = 0
    NVML_CLOCK_SM = 1
    NVML_CLOCK_MEM = 2
    NVML_DEVICE_MIG_DISABLE = 0
    NVML_DEVICE_MIG_ENABLE = 1
    SETTERS = frozenset({"nvmlDeviceSetGpuLockedClocks", "nvmlDeviceResetGpuLockedClocks"})

    class NVMLError(Exception):
        def __init__(self, value: int) -> None:
            super().__init__(value)
            self.value = value

        def __str__(self) -> str:
            names = {v: k for k, v in vars(FakeNvml).items() if k.startswith("NVML_ERROR_")}
            return names.get(self.value, f"NVML error {self.value}")

    def __init__(
        self,
        gpus: list[FakeGpu] | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        can_set_clocks: bool = True,
        reset_fails: bool = False,
        init_error: int | None = None,
        state_file: str | Path | None = None,
        driver_version: str = "550.54.15",
    ) -> None:
        self.gpus = gpus if gpus is not None else [FakeGpu()]
        self.driver_version = driver_version
        self.clock = clock
        self.can_set_clocks = can_set_clocks
        self.reset_fails = reset_fails
        self.init_error = init_error
        self.state_file = Path(state_file) if state_file is not None else None
        self.init_count = 0
        self.calls: list[Call] = []
        self._lock = threading.RLock()

    # -- test helpers -----------------------------------------------------------------

    def setter_calls(self) -> list[tuple[object, ...]]:
        """(name, gpu index, args...) of every clock setter call, in order."""
        return [(c.name, *c.args) for c in self.calls if c.name in self.SETTERS]

    def set_power(self, gpu: int, watts: float) -> None:
        """Change the constant power draw from now on (energy so far is kept)."""
        with self._lock:
            self._advance_energy(self.gpus[gpu])
            self.gpus[gpu].power_w = watts

    # -- library lifetime -------------------------------------------------------------

    def nvmlInit(self) -> None:
        self._log("nvmlInit")
        if self.init_error is not None:
            raise self.NVMLError(self.init_error)
        self.init_count += 1

    def nvmlShutdown(self) -> None:
        self._log("nvmlShutdown")
        self._check_init()
        self.init_count -= 1

    # -- queries ----------------------------------------------------------------------

    def nvmlSystemGetDriverVersion(self) -> str:
        self._check_init()
        return self.driver_version

    def nvmlDeviceGetCount(self) -> int:
        self._check_init()
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        self._check_init()
        if not 0 <= index < len(self.gpus):
            raise self.NVMLError(self.NVML_ERROR_INVALID_ARGUMENT)
        return self.gpus[index]

    def nvmlDeviceGetName(self, gpu: FakeGpu) -> str:
        self._check_init()
        return gpu.name

    def nvmlDeviceGetUUID(self, gpu: FakeGpu) -> str:
        self._check_init()
        return gpu.uuid

    def nvmlDeviceGetClockInfo(self, gpu: FakeGpu, clock_type: int) -> int:
        self._check_init()
        if clock_type == self.NVML_CLOCK_MEM:
            return gpu.memory_clock
        return gpu.sm_clock_mhz

    def nvmlDeviceGetSupportedMemoryClocks(self, gpu: FakeGpu) -> list[int]:
        self._check_init()
        return sorted(gpu.graphics_clocks, reverse=True)

    def nvmlDeviceGetSupportedGraphicsClocks(self, gpu: FakeGpu, memory_mhz: int) -> list[int]:
        self._check_init()
        if memory_mhz not in gpu.graphics_clocks:
            raise self.NVMLError(self.NVML_ERROR_INVALID_ARGUMENT)
        return list(gpu.graphics_clocks[memory_mhz])

    def nvmlDeviceGetTotalEnergyConsumption(self, gpu: FakeGpu) -> int:
        self._log("nvmlDeviceGetTotalEnergyConsumption", gpu)
        self._check_init()
        if not gpu.energy_counter:
            raise self.NVMLError(self.NVML_ERROR_NOT_SUPPORTED)
        with self._lock:
            self._advance_energy(gpu)
            assert gpu.counter_mj is not None
            return int(gpu.counter_mj)

    def nvmlDeviceGetPowerUsage(self, gpu: FakeGpu) -> int:
        self._log("nvmlDeviceGetPowerUsage", gpu)
        self._check_init()
        if not gpu.power_readable:
            raise self.NVMLError(self.NVML_ERROR_NOT_SUPPORTED)
        if gpu.power_model is None:
            return round(gpu.power_w * 1000)
        with self._lock:
            self._advance_energy(gpu)
            watts = gpu.last_power_w
        return round(1000 * (watts if watts is not None else gpu.power_model.idle_w))

    def nvmlDeviceGetPowerManagementDefaultLimit(self, gpu: FakeGpu) -> int:
        self._check_init()
        return gpu.default_power_limit_mw

    def nvmlDeviceGetMigMode(self, gpu: FakeGpu) -> list[int]:
        self._check_init()
        if gpu.mig is None:
            raise self.NVMLError(self.NVML_ERROR_NOT_SUPPORTED)
        mode = self.NVML_DEVICE_MIG_ENABLE if gpu.mig else self.NVML_DEVICE_MIG_DISABLE
        return [mode, mode]

    # -- setters ----------------------------------------------------------------------

    def nvmlDeviceSetGpuLockedClocks(self, gpu: FakeGpu, min_mhz: int, max_mhz: int) -> None:
        self._log("nvmlDeviceSetGpuLockedClocks", gpu, min_mhz, max_mhz)
        self._check_can_set(gpu)
        supported = gpu.graphics_clocks[gpu.memory_clock]
        if min_mhz not in supported or max_mhz not in supported:
            raise self.NVMLError(self.NVML_ERROR_INVALID_ARGUMENT)
        self._set_locked(gpu, (min_mhz, max_mhz))

    def nvmlDeviceResetGpuLockedClocks(self, gpu: FakeGpu) -> None:
        self._log("nvmlDeviceResetGpuLockedClocks", gpu)
        self._check_can_set(gpu)
        if self.reset_fails:
            raise self.NVMLError(self.NVML_ERROR_UNKNOWN)
        self._set_locked(gpu, None)

    # -- internals --------------------------------------------------------------------

    def _check_init(self) -> None:
        if self.init_count <= 0:
            raise self.NVMLError(self.NVML_ERROR_UNINITIALIZED)

    def _check_can_set(self, gpu: FakeGpu) -> None:
        self._check_init()
        if gpu.mig:
            raise self.NVMLError(self.NVML_ERROR_NOT_SUPPORTED)
        if not self.can_set_clocks:
            raise self.NVMLError(self.NVML_ERROR_NO_PERMISSION)

    def _set_locked(self, gpu: FakeGpu, locked: tuple[int, int] | None) -> None:
        with self._lock:
            if gpu.last_update is not None:  # energy so far at the old clock
                self._advance_energy(gpu)
            gpu.locked = locked
        self._persist()

    def _advance_energy(self, gpu: FakeGpu) -> None:
        """Integrate power since the last update; move the counter to its last update.

        Power is constant between two updates (or, with a ``BusyTimeline``, known at every
        instant), so the energy at an update inside the interval is interpolated. The first
        update starts the counter where it is."""
        now = self.clock()
        model = gpu.power_model
        cpu_s = model.cpu_time() if model is not None else None
        start = gpu.last_update
        if start is None:
            gpu.history.append(now, gpu.energy_mj, gpu.sm_clock_mhz, gpu.power_w)
        elif now > start:
            watts = self._power_since(gpu, start, now, cpu_s)
            gpu.energy_mj = self._energy_after(gpu.energy_mj, watts, now - start)
            gpu.last_power_w = watts if model is not None else None
            exact = model is not None and model.timeline is not None
            gpu.history.append(now, gpu.energy_mj, gpu.sm_clock_mhz, None if exact else watts)
        gpu.last_update, gpu.last_cpu_s = now, cpu_s
        self._update_counter(gpu, now)

    def _update_counter(self, gpu: FakeGpu, now: float) -> None:
        tick = self._last_tick(gpu, now)
        if gpu.counter_mj is None or gpu.counter_tick is None:
            gpu.counter_mj, gpu.counter_tick = gpu.energy_mj, tick
        if gpu.counter_stalled:
            gpu.history.drop_before(now)
            return
        if tick > gpu.counter_tick:
            period = gpu.counter_period_s
            if period > 0 and (gpu.counter_sample_s > 0 or gpu.counter_noise_mj > 0):
                self._count_updates(gpu, round((tick - gpu.counter_tick) / period))
            else:
                gpu.counter_mj = self._energy_at(gpu, tick)
            gpu.counter_tick = tick
        gpu.history.drop_before(gpu.counter_tick)

    def _count_updates(self, gpu: FakeGpu, updates: int) -> None:
        """Add ``updates`` periods' increments, each sampled or integrated, with noise."""
        period, sample_s = gpu.counter_period_s, gpu.counter_sample_s
        if gpu.counter_rng is None:
            gpu.counter_rng = random.Random(gpu.counter_seed)
        first = round(gpu.counter_tick / period)
        for n in range(first, first + updates):
            begin = n * period
            if sample_s > 0:
                sampled = self._energy_at(gpu, begin + sample_s) - self._energy_at(gpu, begin)
                increment = sampled * period / sample_s
            else:
                increment = self._energy_at(gpu, begin + period) - self._energy_at(gpu, begin)
            gpu.counter_mj += increment + gpu.counter_rng.gauss(0.0, gpu.counter_noise_mj)

    def _energy_at(self, gpu: FakeGpu, when: float) -> float:
        """The true energy (mJ) at ``when``, at or before the last update; before the first
        read, the energy the GPU started with."""
        history = gpu.history
        i = bisect.bisect_left(history.times, when)
        if i == 0:
            return history.energy_mj[0]
        if i == len(history.times):
            return history.energy_mj[-1]
        since = history.times[i - 1]
        if when == history.times[i]:
            return history.energy_mj[i]
        watts = history.watts[i]
        if watts is None:
            activity = gpu.power_model.activity_between(since, when)
            watts = gpu.power_model.power_w(history.clock_mhz[i], activity)
        return self._energy_after(history.energy_mj[i - 1], watts, when - since)

    @staticmethod
    def _energy_after(energy_mj: float, watts: float, seconds: float) -> float:
        return energy_mj + watts * seconds * 1000.0

    @staticmethod
    def _power_since(gpu: FakeGpu, start: float, now: float, cpu_s: float | None) -> float:
        if gpu.power_model is None:
            return gpu.power_w
        activity = gpu.power_model.activity_between(start, now)
        if activity is None:
            known = cpu_s is not None and gpu.last_cpu_s is not None
            activity = (cpu_s - gpu.last_cpu_s if known else 0.0) / (now - start)
        return gpu.power_model.power_w(gpu.sm_clock_mhz, activity)

    @staticmethod
    def _last_tick(gpu: FakeGpu, now: float) -> float:
        """The time of the counter's last update that a read at ``now`` sees."""
        period, seen = gpu.counter_period_s, now - gpu.counter_lag_s
        return math.floor(seen / period) * period if period > 0 else seen

    def _log(self, name: str, *args: object) -> None:
        logged = tuple(self._index(a) if isinstance(a, FakeGpu) else a for a in args)
        with self._lock:
            self.calls.append(Call(name, logged, threading.current_thread().name))

    def _index(self, gpu: FakeGpu) -> int:
        return next(i for i, candidate in enumerate(self.gpus) if candidate is gpu)

    def _persist(self) -> None:
        if self.state_file is None:
            return
        state = {
            "locked": [list(g.locked) if g.locked else None for g in self.gpus],
            "setter_calls": [list(c) for c in self.setter_calls()],
        }
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, self.state_file)

    @staticmethod
    def read_state(path: str | Path) -> dict[str, object]:
        return json.loads(Path(path).read_text())


def opened(fake: FakeNvml | None = None) -> tuple[FakeNvml, FakeGpu]:
    """A fake driver after ``nvmlInit`` (as a device opens it) and the handle of GPU 0, for
    testing one part of the NVML device on its own."""
    fake = fake or FakeNvml()
    fake.nvmlInit()
    return fake, fake.nvmlDeviceGetHandleByIndex(0)


def controller(fake: FakeNvml, handle: object, **kwargs: object):
    """An NVML clock controller of GPU 0 of ``fake`` that does not reset at exit (tests
    close it), waiting on no CUDA event unless ``event_factory`` is given."""
    from kareus.devices.nvml.clock import NvmlClockController, no_event

    kwargs.setdefault("event_factory", no_event)
    return NvmlClockController(
        fake,
        handle,
        gpu="GPU 0",
        index=0,
        supported_clocks=fake.gpus[0].graphics_clocks[fake.gpus[0].memory_clock],
        reset_at_exit=False,
        **kwargs,
    )
