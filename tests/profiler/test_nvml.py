"""The NVML device and clock controller, run against a fake driver (never real NVML setters)."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from fake_pynvml import FakeClock, FakeGpu, FakeNvml

from kareus.runtime.clock import DEFAULT_CLOCK_MHZ, ClockController, use_controller
from kareus.profiler.devices.base import Workload
from kareus.profiler.devices.errors import (
    ClockPermissionError,
    ClockResetError,
    DeviceError,
    EnergyUnavailableError,
    MigClockControlError,
    NvmlUnavailableError,
    UnsupportedClockError,
    UnsupportedMeasurementError,
)
from kareus.profiler.devices.nvml import (
    NvmlGPU,
    PowerSampler,
    default_search_clocks,
    local_cuda_index,
    nvml_index_for_cuda_device,
)
from kareus.runtime.nvml_clock import NvmlClockController, no_event

REPO = Path(__file__).resolve().parents[2]
TESTS = Path(__file__).resolve().parents[1]
LOCK, RESET = "nvmlDeviceSetGpuLockedClocks", "nvmlDeviceResetGpuLockedClocks"
H200_CLOCKS = tuple(range(1980, 344, -15))


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


def open_fake(fake: FakeNvml | None = None) -> tuple[FakeNvml, object]:
    fake = fake or FakeNvml()
    fake.nvmlInit()
    return fake, fake.nvmlDeviceGetHandleByIndex(0)


def controller(fake: FakeNvml, handle: object, **kwargs: object) -> NvmlClockController:
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


def device(fake: FakeNvml | None = None, **kwargs: object) -> NvmlGPU:
    kwargs.setdefault("cuda", False)
    kwargs.setdefault("sleep", lambda seconds: None)
    return NvmlGPU(nvml_module=fake or FakeNvml(), reset_at_exit=False, **kwargs)


# -- clock controller ---------------------------------------------------------------------


def test_switches_wait_for_their_event_and_run_off_the_training_thread() -> None:
    fake, handle = open_fake()
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
    fake, handle = open_fake()
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
    fake, handle = open_fake()
    with controller(fake, handle) as ctl:
        with pytest.raises(UnsupportedClockError, match="nearest: 1230 MHz"):
            ctl.set_clock("g", 1234)
    assert fake.setter_calls() == []


def test_reset_drops_switches_still_waiting_for_the_gpu() -> None:
    fake, handle = open_fake()
    events = GatedEvents()
    ctl = controller(fake, handle, event_factory=events)
    ctl.set_clock("g", 1200)
    ctl.reset()
    events.events[0].reached.set()
    ctl.flush()
    assert fake.setter_calls() == [] and fake.gpus[0].locked is None
    ctl.close()


def test_clocks_reset_when_the_block_raises() -> None:
    fake, handle = open_fake()
    with pytest.raises(RuntimeError, match="boom"):
        with controller(fake, handle) as ctl:
            ctl.set_clock("fwd", 1200)
            ctl.flush()
            assert fake.gpus[0].locked == (1200, 1200)
            raise RuntimeError("boom")
    assert fake.gpus[0].locked is None


def test_use_controller_resets_the_nvml_controller() -> None:
    fake, handle = open_fake()
    ctl = controller(fake, handle)
    with use_controller(ctl):
        ctl.set_clock("fwd", 1200)
        ctl.flush()
    assert fake.setter_calls() == [(LOCK, 0, 1200, 1200), (RESET, 0)]
    ctl.close()


def test_no_permission_says_what_to_do(caplog: pytest.LogCaptureFixture) -> None:
    fake, handle = open_fake(FakeNvml(can_set_clocks=False))
    ctl = controller(fake, handle)
    ctl.set_clock("fwd", 1200)
    with pytest.raises(ClockPermissionError) as info:
        ctl.flush()
    for advice in ("root", "CAP_SYS_ADMIN", "zeusd", 'device="nvml-dry-run"'):
        assert advice in str(info.value)
    assert any(r.levelno == logging.ERROR for r in caplog.records)
    ctl.close()


def test_failing_reset_is_logged_critical_and_raised(caplog: pytest.LogCaptureFixture) -> None:
    fake, handle = open_fake(FakeNvml(reset_fails=True))
    ctl = controller(fake, handle)
    ctl.set_clock("fwd", 1200)
    ctl.flush()
    with pytest.raises(ClockResetError, match=r"nvidia-smi -i 0 -rgc"):
        ctl.close()
    critical = [r for r in caplog.records if r.levelno == logging.CRITICAL]
    assert critical and "FAILED to reset" in critical[0].getMessage()


def test_mig_refuses_clock_control_but_dry_run_is_allowed() -> None:
    fake, handle = open_fake(FakeNvml([FakeGpu(mig=True)]))
    with pytest.raises(MigClockControlError, match="MIG mode"):
        controller(fake, handle)
    with controller(fake, handle, dry_run=True) as ctl:
        ctl.set_clock("fwd", 1200)
        ctl.flush()
    assert fake.setter_calls() == []


def test_dry_run_records_switches_and_never_calls_a_setter() -> None:
    fake, handle = open_fake()
    with controller(fake, handle, dry_run=True) as ctl:
        for mhz in (1200, 1200, 990, DEFAULT_CLOCK_MHZ, 1410):
            ctl.set_clock("g", mhz)
        ctl.flush()
        assert [s.mhz for s in ctl.switches] == [1200, 990, DEFAULT_CLOCK_MHZ, 1410]
    assert fake.setter_calls() == []


# -- reset at exit and on signals, in subprocesses ----------------------------------------

CHILD = """
import signal, sys
sys.path[:0] = [{tests!r}, {repo!r}]
from fake_pynvml import FakeNvml
from kareus.runtime.nvml_clock import NvmlClockController, no_event
{before}
fake = FakeNvml(state_file={state!r})
fake.nvmlInit()
gpu = fake.nvmlDeviceGetHandleByIndex(0)
ctl = NvmlClockController(fake, gpu, gpu="GPU 0", index=0,
                          supported_clocks=gpu.graphics_clocks[1215], event_factory=no_event)
ctl.set_clock("fwd", 1200)
ctl.flush()
print("locked", flush=True)
sys.stdin.readline()
{then}
"""


def run_child(tmp_path: Path, then: str = "", before: str = "", send: int | None = None) -> int:
    """Run CHILD until its clock is locked, then let it go on (or signal it); check the reset."""
    state = tmp_path / "state.json"
    code = CHILD.format(
        tests=str(TESTS), repo=str(REPO), state=str(state), before=before, then=then
    )
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
    assert final["setter_calls"] == [[LOCK, 0, 1200, 1200], [RESET, 0]]
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


# -- the device -----------------------------------------------------------------------------


def timed_workload(clock: FakeClock, seconds: float) -> Workload:
    """A workload whose every run takes ``seconds`` of fake time."""
    return Workload("w", run=lambda: clock.advance(seconds))


def test_measure_with_the_energy_counter_repeats_to_fill_the_window() -> None:
    clock = FakeClock()
    fake = FakeNvml(clock=clock)
    seen: list[object] = []
    slept: list[float] = []

    def run() -> None:
        seen.append(fake.gpus[0].locked)
        clock.advance(0.002)

    with device(fake, timer=clock, sleep=slept.append) as gpu:
        m = gpu.measure(Workload("w", run=run), 1200)
        assert m.method == "nvml-energy-counter"
        assert m.time_s == pytest.approx(0.002)
        assert m.energy_j == pytest.approx(300.0 * 0.002, rel=1e-3)
        assert m.static_power_w == 85.0 and m.clock_mhz == 1200
        assert m.details["window_s"] >= gpu.min_window_s and m.details["runs"] >= 250
        assert m.details["clock_locked"] == 1.0
        assert set(seen) == {(1200, 1200)}
        assert slept == [0.1]  # settled once after the switch
        gpu.measure(timed_workload(clock, 0.002), 1200)
        assert slept == [0.1]  # no switch, no settling
    assert fake.gpus[0].locked is None and fake.init_count == 0


def test_a_slow_warmup_is_followed_by_a_longer_window() -> None:
    clock = FakeClock()
    durations = iter([1.0] + [0.001] * 10_000)  # compile-like first run, then fast
    workload = Workload("w", run=lambda: clock.advance(next(durations)))
    with device(FakeNvml(clock=clock), timer=clock) as gpu:
        m = gpu.measure(workload, 1200)
    assert m.details["window_s"] >= 0.5 and m.time_s == pytest.approx(0.001)


def test_unsupported_counter_falls_back_to_power_polling(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    fake = FakeNvml([FakeGpu(energy_counter=False)], clock=clock)
    with device(fake, timer=clock) as gpu:
        m = gpu.measure(timed_workload(clock, 0.01), 1200)
    assert m.method == "nvml-power-polling"
    assert m.energy_j == pytest.approx(300.0 * 0.01)
    assert any("no NVML energy counter" in r.getMessage() for r in caplog.records)


def test_power_sampler_integrates_polled_power_between_the_window_ends() -> None:
    clock = FakeClock(0.0)
    power = iter([100.0, 300.0])
    with PowerSampler(lambda: next(power), clock, interval_s=60.0) as sampler:
        clock.advance(2.0)
    assert sampler.joules == pytest.approx(400.0)  # trapezoid of a linear ramp

    real = PowerSampler(lambda: 50.0, time.monotonic, interval_s=0.001)
    with real:
        threading.Event().wait(0.03)
    assert len(real.samples) > 3  # the background thread polled in between


def test_no_counter_and_no_power_reading_cannot_measure() -> None:
    fake = FakeNvml([FakeGpu(energy_counter=False, power_readable=False)])
    with pytest.raises(EnergyUnavailableError, match="sim:h200"):
        device(fake)
    assert fake.init_count == 0


def test_dry_run_device_measures_at_default_clocks() -> None:
    clock = FakeClock()
    fake = FakeNvml(clock=clock)
    with device(fake, timer=clock, dry_run=True) as gpu:
        m = gpu.measure(timed_workload(clock, 0.01), 1200)
        assert gpu.name == "nvml-dry-run:0 (NVIDIA A100-SXM4-40GB)"
        assert [s.mhz for s in gpu.clock_controller().switches] == [1200]
    assert m.details["clock_locked"] == 0.0 and fake.setter_calls() == []


def test_measure_rejects_comm_sms_and_workloads_it_cannot_run() -> None:
    with device() as gpu:
        with pytest.raises(UnsupportedMeasurementError, match="NCCL sub-communicators"):
            gpu.measure(Workload("w", run=lambda: None), 1200, comm_sms=6)
        with pytest.raises(ValueError, match="no run"):
            gpu.measure(Workload("w"), 1200)


def test_clocks_search_range_and_static_power(caplog: pytest.LogCaptureFixture) -> None:
    with device() as a100:
        assert a100.supported_clocks()[:3] == (1410, 1395, 1380)
        assert a100.search_clocks() == tuple(range(1410, 899, -30))
        assert a100.static_power_w == 85.0
    h200 = FakeGpu(name="NVIDIA H200", memory_clock=3201, graphics_clocks={3201: H200_CLOCKS},
                   default_power_limit_mw=700_000)
    with device(FakeNvml([h200])) as gpu:
        assert gpu.search_clocks()[0] == 1980 and len(gpu.search_clocks()) == 18
        assert gpu.static_power_w == pytest.approx(147.0)
        assert any("assumed" in r.getMessage() for r in caplog.records)
    with device(FakeNvml([h200]), static_power_w=120.0) as gpu:
        assert gpu.static_power_w == 120.0


def test_search_clocks_follow_irregular_steps() -> None:
    steps_of_7_or_8 = [1000, 992, 985, 977, 970, 962, 955, 947, 940]
    assert default_search_clocks(steps_of_7_or_8, count=3) == (1000, 970, 940)
    assert default_search_clocks([1000, 985, 970]) == (1000, 970)  # short range: stop at bottom


def test_device_mig_and_permission_errors_surface() -> None:
    with pytest.raises(MigClockControlError):
        device(FakeNvml([FakeGpu(mig=True)]))
    clock = FakeClock()
    with device(FakeNvml(can_set_clocks=False, clock=clock), timer=clock) as gpu:
        with pytest.raises(ClockPermissionError):
            gpu.measure(timed_workload(clock, 0.01), 1200)


@pytest.mark.parametrize(
    ("code", "reason"),
    [
        (FakeNvml.NVML_ERROR_LIBRARY_NOT_FOUND, "libnvidia-ml.so.1"),
        (FakeNvml.NVML_ERROR_DRIVER_NOT_LOADED, "driver is not loaded"),
    ],
)
def test_missing_nvml_says_what_to_install(code: int, reason: str) -> None:
    with pytest.raises(NvmlUnavailableError) as info:
        device(FakeNvml(init_error=code))
    for advice in (reason, "nvidia-ml-py", "sim:h200"):
        assert advice in str(info.value)


def test_missing_bindings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    with pytest.raises(NvmlUnavailableError, match="Python bindings are missing"):
        NvmlGPU(reset_at_exit=False)


def test_each_rank_controls_its_own_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    gpus = [FakeGpu(uuid=f"GPU-{i}aaaaaaa-0000") for i in range(4)]
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    fake = FakeNvml(gpus)
    with device(fake) as gpu:
        assert gpu.index == 2
        gpu.clock_controller().set_clock("fwd", 1200)
        gpu.clock_controller().flush()
        assert [g.locked for g in gpus] == [None, None, (1200, 1200), None]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1,0,2")
    with device(FakeNvml(gpus)) as gpu:
        assert gpu.index == 0


def test_cuda_index_and_visible_devices_mapping() -> None:
    assert local_cuda_index({"LOCAL_RANK": "3"}, None, 8) == 3
    assert local_cuda_index({"LOCAL_RANK": "3"}, 0, 1) == 0  # one GPU per process
    assert local_cuda_index({"LOCAL_RANK": "3"}, 5, 8) == 5  # the script chose
    assert local_cuda_index({}, None, 8) == 0
    fake, _ = open_fake(FakeNvml([FakeGpu(uuid=f"GPU-{i}bcd-ef") for i in range(3)]))
    assert nvml_index_for_cuda_device(fake, 1, None) == 1
    assert nvml_index_for_cuda_device(fake, 1, "2, 0") == 0
    assert nvml_index_for_cuda_device(fake, 0, "GPU-2bcd-ef,GPU-0bcd-ef") == 2
    assert nvml_index_for_cuda_device(fake, 0, "1bcd") == 1  # abbreviated, no prefix
    with pytest.raises(DeviceError, match="not visible"):
        nvml_index_for_cuda_device(fake, 2, "0,1")
    with pytest.raises(MigClockControlError):
        nvml_index_for_cuda_device(fake, 0, "MIG-1234")
    with pytest.raises(DeviceError, match="matches 0 GPUs"):
        nvml_index_for_cuda_device(fake, 0, "GPU-ffff")
