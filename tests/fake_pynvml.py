"""A fake NVML driver with the ``pynvml`` interface, so NVML code runs on CPU-only machines.

An instance stands in for the module (pass it as ``nvml_module``). It models what the
kareus NVML device relies on: an energy counter in mJ that advances with power x elapsed
time on an injectable clock, power readings, supported memory/graphics clocks, MIG mode,
locked-clock state, permission to set clocks, and counters that raise NOT_SUPPORTED. Every
call is logged; with ``state_file`` the locked clocks and the call log are written to a
JSON file after each setter, so a test can inspect a subprocess after it died.
"""

from __future__ import annotations

import json
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
    energy_mj: float = 5.0e7
    last_update: float | None = None


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
        """Change the power draw from now on (energy so far is kept)."""
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
        return gpu.locked[0] if gpu.locked else max(gpu.graphics_clocks[gpu.memory_clock])

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
            return int(gpu.energy_mj)

    def nvmlDeviceGetPowerUsage(self, gpu: FakeGpu) -> int:
        self._log("nvmlDeviceGetPowerUsage", gpu)
        self._check_init()
        if not gpu.power_readable:
            raise self.NVMLError(self.NVML_ERROR_NOT_SUPPORTED)
        return round(gpu.power_w * 1000)

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
        gpu.locked = (min_mhz, max_mhz)
        self._persist()

    def nvmlDeviceResetGpuLockedClocks(self, gpu: FakeGpu) -> None:
        self._log("nvmlDeviceResetGpuLockedClocks", gpu)
        self._check_can_set(gpu)
        if self.reset_fails:
            raise self.NVMLError(self.NVML_ERROR_UNKNOWN)
        gpu.locked = None
        self._persist()

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

    def _advance_energy(self, gpu: FakeGpu) -> None:
        now = self.clock()
        if gpu.last_update is not None:
            gpu.energy_mj += gpu.power_w * (now - gpu.last_update) * 1000.0
        gpu.last_update = now

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
