"""A fake NVML driver with the ``pynvml`` interface, so NVML code runs on CPU-only machines.

An instance stands in for the module (pass it as ``nvml_module``). It models what the
kareus NVML device relies on: an energy counter in mJ that advances with power x elapsed
time on an injectable clock, power readings, supported memory/graphics clocks, MIG mode,
locked-clock state, permission to set clocks, and counters that raise NOT_SUPPORTED. Every
call is logged; with ``state_file`` the locked clocks and the call log are written to a
JSON file after each setter, so a test can inspect a subprocess after it died.

Power is ``FakeGpu.power_w``, constant, unless the GPU has a ``FakePowerModel``: then it
depends on the SM clock (the locked one, else the maximum) and on how busy this process's
CPU was since the last energy update, so a CPU-only test that runs real work sees energy
that follows the locked clock and whether work ran. ``FakeGpu.counter_period_s`` makes the
counter update only at period boundaries, as real counters do every 20-100 ms, and
``FakeGpu.counter_stalled`` freezes it.
"""

from __future__ import annotations

import json
import math
import os
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
    a ``FakeClock`` can say how busy it was.
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
    energy_mj: float = 5.0e7
    """Energy so far (mJ), continuous; reads return ``counter_mj``."""
    counter_mj: float | None = None
    """What the counter reads: ``energy_mj`` at the last update boundary."""
    last_update: float | None = None
    last_cpu_s: float | None = None
    last_power_w: float | None = None
    """Average power since the previous update (power model only), what power reads give."""

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
    ) -> None:
        self.gpus = gpus if gpus is not None else [FakeGpu()]
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
        """Integrate power since the last update; move the counter to the last boundary.

        Power is constant between two updates, so the energy at a boundary inside the
        interval is interpolated. The first update starts the counter where it is."""
        now = self.clock()
        cpu_s = gpu.power_model.cpu_time() if gpu.power_model is not None else None
        start, start_mj = gpu.last_update, gpu.energy_mj
        if start is not None and now > start:
            watts = self._power_since(gpu, now - start, cpu_s)
            gpu.energy_mj += watts * (now - start) * 1000.0
            gpu.last_power_w = watts if gpu.power_model is not None else None
            if not gpu.counter_stalled:
                boundary = self._boundary(gpu, now)
                if boundary > start:
                    gpu.counter_mj = start_mj + watts * (boundary - start) * 1000.0
        if gpu.counter_mj is None:
            gpu.counter_mj = gpu.energy_mj
        gpu.last_update, gpu.last_cpu_s = now, cpu_s

    @staticmethod
    def _power_since(gpu: FakeGpu, wall_s: float, cpu_s: float | None) -> float:
        if gpu.power_model is None:
            return gpu.power_w
        busy_s = cpu_s - gpu.last_cpu_s if cpu_s is not None and gpu.last_cpu_s is not None else 0
        return gpu.power_model.power_w(gpu.sm_clock_mhz, busy_s / wall_s)

    @staticmethod
    def _boundary(gpu: FakeGpu, now: float) -> float:
        """The last counter update at or before ``now``."""
        period = gpu.counter_period_s
        return math.floor(now / period) * period if period > 0 else now

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
