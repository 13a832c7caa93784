"""The NVML clock controller on its own, against a fake driver (never real NVML setters)."""

from __future__ import annotations

import atexit
import json
import logging
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fake_pynvml import LOCK, RESET, FakeGpu, FakeNvml, controller, locked_child, opened

from kareus.devices.base import ClockController
from kareus.devices.errors import (
    ClockPermissionError,
    ClockResetError,
    MigClockControlError,
    UnsupportedClockError,
)
from kareus.devices.nvml.clock import NvmlClockController, no_event
from kareus.devices.nvml.exit_guard import SIGNALS
from kareus.devices.nvml.gpu import NvmlGPU
from kareus.devices.nvml.ownership import LOCK_DIR_ENV
from kareus.passes.ops import DEFAULT_CLOCK_MHZ
from kareus.runtime import ProcessRuntime, use_controller


@pytest.fixture(autouse=True)
def lock_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Clock ownership files of this test only (its subprocesses inherit the variable)."""
    directory = tmp_path / "clock-locks"
    monkeypatch.setenv(LOCK_DIR_ENV, str(directory))
    return directory


class GatedEvent:
    """A CUDA event stand-in that completes only when the test says the GPU got there."""

    def __init__(self) -> None:
        self.reached = threading.Event()
        self.recorded_on = threading.current_thread().name

    def synchronize(self) -> None:
        assert self.reached.wait(5), "event never completed"


class GatedEvents:
    def __init__(self) -> None:
        self.events: list[GatedEvent] = []

    def __call__(self) -> GatedEvent:
        self.events.append(GatedEvent())
        return self.events[-1]




def test_switches_wait_for_their_event_and_run_off_the_training_thread() -> None:
    fake, handle = opened()
    events = GatedEvents()
    with controller(fake, handle, event_factory=events) as ctl:
        assert isinstance(ctl, ClockController)
        ctl.set_clock("fwd", 1200)
        ctl.set_clock("bwd", 1410)
        assert fake.setter_calls() == []  # returned at once; the GPU has not got there yet
        assert [e.recorded_on for e in events.events] == ["MainThread"] * 2
        events.events[0].reached.set()
        events.events[1].reached.set()
        ctl.flush()
        assert fake.setter_calls() == [(LOCK, 0, 1200, 1200), (LOCK, 0, 1410, 1410)]
        assert {c.thread for c in fake.calls if c.name == LOCK} == {"kareus-clock-0"}
        assert [(s.graph, s.mhz) for s in ctl.switches] == [("fwd", 1200), ("bwd", 1410)]
    assert fake.setter_calls()[-1] == (RESET, 0)
    assert fake.gpus[0].locked is None


def test_unchanged_requests_make_no_call_and_record_no_event() -> None:
    fake, handle = opened()
    events = GatedEvents()
    ctl = controller(fake, handle, event_factory=events)
    for mhz in (1200, 1200, 1200, 1110, 1110, DEFAULT_CLOCK_MHZ, DEFAULT_CLOCK_MHZ):
        ctl.set_clock("g", mhz)
    for event in events.events:
        event.reached.set()
    ctl.flush()
    assert len(events.events) == 3
    assert fake.setter_calls() == [(LOCK, 0, 1200, 1200), (LOCK, 0, 1110, 1110), (RESET, 0)]
    ctl.close()
    assert fake.setter_calls()[-1] == (RESET, 0)  # nothing locked, so close made no call


def test_unsupported_clock_is_refused_before_anything_is_queued() -> None:
    fake, handle = opened()
    with (
        controller(fake, handle) as ctl,
        pytest.raises(UnsupportedClockError, match="nearest: 1230 MHz"),
    ):
        ctl.set_clock("g", 1234)
    assert fake.setter_calls() == []


def test_reset_drops_switches_still_waiting_for_the_gpu() -> None:
    fake, handle = opened()
    events = GatedEvents()
    ctl = controller(fake, handle, event_factory=events)
    ctl.set_clock("g", 1200)
    ctl.reset()
    events.events[0].reached.set()
    ctl.flush()
    assert fake.setter_calls() == [] and fake.gpus[0].locked is None
    ctl.close()


def test_clocks_reset_when_the_block_raises() -> None:
    fake, handle = opened()
    with pytest.raises(RuntimeError, match="boom"), controller(fake, handle) as ctl:
        ctl.set_clock("fwd", 1200)
        ctl.flush()
        assert fake.gpus[0].locked == (1200, 1200)
        raise RuntimeError("boom")
    assert fake.gpus[0].locked is None


def test_use_controller_resets_the_nvml_controller() -> None:
    fake, handle = opened()
    ctl = controller(fake, handle)
    with use_controller(ctl):
        ctl.set_clock("fwd", 1200)
        ctl.flush()
    assert fake.setter_calls() == [(LOCK, 0, 1200, 1200), (RESET, 0)]
    ctl.close()


def test_no_permission_says_what_to_do(caplog: pytest.LogCaptureFixture) -> None:
    fake, handle = opened(FakeNvml(can_set_clocks=False))
    ctl = controller(fake, handle)
    ctl.set_clock("fwd", 1200)
    with pytest.raises(ClockPermissionError) as info:
        ctl.flush()
    for advice in ("root", "CAP_SYS_ADMIN", "zeusd", 'device="nvml-dry-run"'):
        assert advice in str(info.value)
    assert any(r.levelno == logging.ERROR for r in caplog.records)
    ctl.close()


def test_failing_reset_is_logged_critical_and_raised(caplog: pytest.LogCaptureFixture) -> None:
    fake, handle = opened(FakeNvml(reset_fails=True))
    ctl = controller(fake, handle)
    ctl.set_clock("fwd", 1200)
    ctl.flush()
    with pytest.raises(ClockResetError, match=r"nvidia-smi -i 0 -rgc"):
        ctl.close()
    critical = [r for r in caplog.records if r.levelno == logging.CRITICAL]
    assert critical and "FAILED to reset" in critical[0].getMessage()


def test_mig_refuses_clock_control_but_dry_run_is_allowed() -> None:
    fake, handle = opened(FakeNvml([FakeGpu(mig=True)]))
    with pytest.raises(MigClockControlError, match="MIG mode"):
        controller(fake, handle)
    with controller(fake, handle, dry_run=True) as ctl:
        ctl.set_clock("fwd", 1200)
        ctl.flush()
    assert fake.setter_calls() == []


def test_dry_run_records_switches_and_never_calls_a_setter() -> None:
    fake, handle = opened()
    with controller(fake, handle, dry_run=True) as ctl:
        for mhz in (1200, 1200, 990, DEFAULT_CLOCK_MHZ, 1410):
            ctl.set_clock("g", mhz)
        ctl.flush()
        assert [s.mhz for s in ctl.switches] == [1200, 990, DEFAULT_CLOCK_MHZ, 1410]
    assert fake.setter_calls() == []


# -- reset at exit and on signals, in subprocesses ----------------------------------------



def run_child(
    tmp_path: Path,
    then: str = "",
    before: str = "",
    send: int | None = None,
    *,
    runtime: bool = False,
) -> int:
    """Run CHILD until its clock is locked, then let it go on (or signal it); check the reset.

    The child builds its controller directly, or with ``runtime`` opens the runtime's device.
    """
    state = tmp_path / "state.json"
    code = locked_child(state, before, then, runtime=runtime)
    child = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None and child.stderr is not None
    assert child.stdout.readline() == "locked\n", child.stderr.read()
    assert FakeNvml.read_state(state)["locked"] == [[1200, 1200]]
    if send is None:
        child.communicate("go\n", timeout=20)
    else:
        child.send_signal(send)  # arrives while the child blocks reading stdin
        child.wait(timeout=20)
    final = FakeNvml.read_state(state)
    assert final["locked"] == [None], child.stderr.read()
    probe = [[RESET, 0]] if runtime else []  # the device's permission probe at open
    assert final["setter_calls"] == [*probe, [LOCK, 0, 1200, 1200], [RESET, 0]]
    return child.returncode


def test_reset_at_normal_exit(tmp_path: Path) -> None:
    assert run_child(tmp_path) == 0


def test_reset_at_exit_after_an_uncaught_exception(tmp_path: Path) -> None:
    assert run_child(tmp_path, then="raise RuntimeError('crash')") == 1


def test_reset_on_sigterm_then_the_default_action_kills(tmp_path: Path) -> None:
    assert run_child(tmp_path, send=signal.SIGTERM) == -signal.SIGTERM


def test_reset_on_sigterm_then_the_previous_handler_runs(tmp_path: Path) -> None:
    before = "signal.signal(signal.SIGTERM, lambda s, f: sys.exit(7))"
    assert run_child(tmp_path, before=before, send=signal.SIGTERM) == 7


def test_reset_on_sigint_then_keyboard_interrupt(tmp_path: Path) -> None:
    # Python's handler raises KeyboardInterrupt; uncaught, the interpreter exits by SIGINT.
    assert run_child(tmp_path, send=signal.SIGINT) == -signal.SIGINT


def test_reset_on_sighup_and_sigquit_then_the_default_action_kills(
    tmp_path: Path, lock_dir: Path
) -> None:
    no_core = "import resource; resource.setrlimit(resource.RLIMIT_CORE, (0, 0))"
    for signum in (signal.SIGHUP, signal.SIGQUIT):
        assert run_child(tmp_path, before=no_core, send=signum) == -signum
        # The handler kept ownership (a handler may let the process go on) but recorded
        # the reset: the next owner finds the clocks unlocked and resets nothing.
        (lock_file,) = lock_dir.iterdir()
        assert json.loads(lock_file.read_text())["locked_mhz"] is None


def test_normal_exit_releases_clock_ownership(tmp_path: Path, lock_dir: Path) -> None:
    assert run_child(tmp_path) == 0
    (lock_file,) = lock_dir.iterdir()
    assert lock_file.read_text() == ""


def test_reset_on_sigterm_of_the_device_the_runtime_opened(tmp_path: Path) -> None:
    assert run_child(tmp_path, send=signal.SIGTERM, runtime=True) == -signal.SIGTERM


# -- the exit guard's handlers, in this process ---------------------------------------------


class Previous:
    """A handler that was there before kareus's: records the signals passed on to it."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def __call__(self, signum: int, frame: object) -> None:
        self.seen.append(signum)


@pytest.fixture
def previous() -> Iterator[Previous]:
    """``Previous`` as the handler of every guarded signal; what was there is put back."""
    handler = Previous()
    saved = {signum: signal.signal(signum, handler) for signum in SIGNALS}
    yield handler
    for signum, saved_handler in saved.items():
        signal.signal(signum, saved_handler)


@pytest.fixture
def at_exit(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The exit callbacks registered meanwhile and not unregistered (``atexit`` cannot say:
    before Python 3.12 ``atexit._ncallbacks`` counts unregistered ones too)."""
    live: list[object] = []
    register, unregister = atexit.register, atexit.unregister

    def tracked_register(
        func: Callable[..., object], *args: object, **kwargs: object
    ) -> Callable[..., object]:
        live.append(func)
        return register(func, *args, **kwargs)

    def tracked_unregister(func: Callable[..., object]) -> None:
        live[:] = [f for f in live if f != func]
        unregister(func)

    monkeypatch.setattr(atexit, "register", tracked_register)
    monkeypatch.setattr(atexit, "unregister", tracked_unregister)
    return live


def guarded(fake: FakeNvml, gpu: int = 0, **kwargs: object) -> NvmlClockController:
    """A controller that resets at exit and on signals, as one built outside tests does."""
    handle = fake.nvmlDeviceGetHandleByIndex(gpu)
    return NvmlClockController(
        fake, handle, gpu=f"GPU {gpu}", index=gpu, supported_clocks=handle.graphics_clocks[1215],
        event_factory=no_event, **kwargs,
    )


def handlers() -> dict[int, object]:
    return {signum: signal.getsignal(signum) for signum in SIGNALS}


def test_sigterm_resets_a_directly_built_controller_then_passes_the_signal_on(
    previous: Previous,
) -> None:
    fake, _handle = opened()
    with guarded(fake) as ctl:
        ctl.set_clock("fwd", 1200)
        ctl.flush()
        assert fake.gpus[0].locked == (1200, 1200)
        signal.raise_signal(signal.SIGTERM)
        assert fake.gpus[0].locked is None and previous.seen == [signal.SIGTERM]
        assert fake.setter_calls() == [(LOCK, 0, 1200, 1200), (RESET, 0)]
    assert handlers() == dict.fromkeys(SIGNALS, previous)  # put back once closed


def test_directly_built_controllers_leave_no_handler_behind(
    previous: Previous, at_exit: list[object]
) -> None:
    fake, _handle = opened()
    for _ in range(3):
        with guarded(fake):
            assert handlers() != dict.fromkeys(SIGNALS, previous) and len(at_exit) == 1
    assert handlers() == dict.fromkeys(SIGNALS, previous) and at_exit == []
    # Closed out of order: the first guard's handler is under the second's, so it stays
    # (passing signals on) until the second leaves and skips over it.
    first, second = guarded(fake), guarded(fake, dry_run=True)
    first.close()
    signal.raise_signal(signal.SIGINT)
    assert previous.seen == [signal.SIGINT]
    second.close()
    assert handlers() == dict.fromkeys(SIGNALS, previous) and at_exit == []


def test_the_runtime_installs_its_handlers_once_for_every_device(
    previous: Previous, at_exit: list[object], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeNvml([FakeGpu(), FakeGpu(uuid="GPU-second")])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    runtime = ProcessRuntime()
    with runtime.device("nvml") as gpu:
        assert isinstance(gpu, NvmlGPU)
        installed = handlers()
        assert at_exit == [runtime.clock_locks.exit_guard.at_exit]
        guard = runtime.clock_locks.exit_guard
        assert guard.controllers == (gpu.clock_controller(),)
        with guarded(fake, gpu=1, held=runtime.clock_locks) as other:
            assert handlers() == installed and len(at_exit) == 1
            for ctl in (gpu.clock_controller(), other):
                ctl.set_clock("fwd", 1200)
                ctl.flush()
            signal.raise_signal(signal.SIGTERM)
            assert [g.locked for g in fake.gpus] == [None, None]
            assert previous.seen == [signal.SIGTERM]  # passed on once, not per device
        assert handlers() == installed
    assert handlers() == dict.fromkeys(SIGNALS, previous) and at_exit == []


def test_the_first_request_is_sent_even_if_it_looks_unchanged() -> None:
    # NVML cannot say whether the GPU's clocks are locked (by a tool outside kareus, say),
    # so default clocks are not assumed: the first request goes to NVML whatever it is.
    fake, handle = opened()
    with controller(fake, handle) as ctl:
        assert ctl.applied_mhz is None
        ctl.set_clock("g", DEFAULT_CLOCK_MHZ)
        ctl.set_clock("g", DEFAULT_CLOCK_MHZ)
        ctl.flush()
        assert fake.setter_calls() == [(RESET, 0)] and ctl.applied_mhz == DEFAULT_CLOCK_MHZ
    assert fake.setter_calls() == [(RESET, 0)]


def test_a_controller_that_set_nothing_leaves_the_gpu_alone() -> None:
    fake, handle = opened()
    fake.gpus[0].locked = (990, 990)  # someone else's business, as far as we know
    ctl = controller(fake, handle)
    ctl.reset()
    ctl.close()
    assert fake.setter_calls() == [] and fake.gpus[0].locked == (990, 990)


def test_the_permission_probe_resets_once_and_then_default_requests_call_nothing() -> None:
    fake, handle = opened(FakeNvml(can_set_clocks=False))
    ctl = controller(fake, handle)
    assert ctl.owns_clocks
    assert ctl.probe_permission() is False and ctl.applied_mhz == DEFAULT_CLOCK_MHZ
    # it will never change the clocks, so it leaves them to any other job on the GPU
    assert not ctl.owns_clocks
    with controller(fake, handle) as other:
        assert other.owns_clocks
    for _ in range(2):
        ctl.set_clock("g", DEFAULT_CLOCK_MHZ)
        ctl.flush()
    ctl.reset()
    ctl.close()
    assert fake.setter_calls() == [(RESET, 0)]
    fake, handle = opened()
    with controller(fake, handle) as ctl:
        assert ctl.probe_permission() is True
        ctl.set_clock("g", DEFAULT_CLOCK_MHZ)
        ctl.flush()
    assert fake.setter_calls() == [(RESET, 0)] and ctl.switches == []


def test_a_probe_failing_otherwise_leaves_the_clocks_unknown(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake, handle = opened(FakeNvml(reset_fails=True))
    ctl = controller(fake, handle)
    assert ctl.probe_permission() is True and ctl.applied_mhz is None
    ctl.set_clock("g", DEFAULT_CLOCK_MHZ)  # sent to NVML, which fails as without a probe
    with pytest.raises(ClockResetError):
        ctl.flush()
    ctl.close()
    assert fake.setter_calls() == [(RESET, 0), (RESET, 0)]


def test_a_dry_run_probes_nothing() -> None:
    fake, handle = opened(FakeNvml(can_set_clocks=False))
    with controller(fake, handle, dry_run=True) as ctl:
        assert ctl.probe_permission() is True and ctl.applied_mhz is None
    assert fake.setter_calls() == []
