"""The NVML device: selection, meter and clock controller composed, against a fake driver
(never real NVML setters). Each part is tested on its own in test_nvml_select.py,
test_nvml_energy.py and test_nvml_clock.py."""

from __future__ import annotations

import logging
import sys

import pytest
from fake_pynvml import LOCK, RESET, FakeClock, FakeGpu, FakeNvml

from kareus.devices.base import Workload
from kareus.devices.errors import (
    ClockPermissionError,
    EnergyUnavailableError,
    MigClockControlError,
    NvmlUnavailableError,
)
from kareus.devices.nvml.gpu import NvmlGPU, default_search_clocks
from kareus.devices.resolve import resolve_device
from kareus.passes.ops import DEFAULT_CLOCK_MHZ

H200_CLOCKS = tuple(range(1980, 344, -15))


def device(fake: FakeNvml | None = None, **kwargs: object) -> NvmlGPU:
    kwargs.setdefault("cuda", False)
    kwargs.setdefault("sleep", lambda seconds: None)
    return NvmlGPU(nvml_module=fake or FakeNvml(), reset_at_exit=False, **kwargs)


def timed_workload(clock: FakeClock, seconds: float) -> Workload:
    """A workload whose every run takes ``seconds`` of fake time."""
    return Workload("w", run=lambda: clock.advance(seconds))


def test_measure_locks_the_clock_settles_once_and_meters_the_runs() -> None:
    clock = FakeClock()
    fake = FakeNvml(clock=clock)
    seen: list[object] = []
    slept: list[float] = []

    def run() -> None:
        seen.append(fake.gpus[0].locked)
        clock.advance(0.002)

    with device(fake, timer=clock, sleep=slept.append, min_window_s=0.2) as gpu:
        m = gpu.measure(Workload("w", run=run), 1200)
        assert set(seen) == {(1200, 1200)}  # every run, warm-up included, at the clock
        assert slept == [0.1]  # settled once after the switch
        gpu.measure(timed_workload(clock, 0.002), 1200)
        assert slept == [0.1]  # no switch, no settling
    assert fake.gpus[0].locked is None and fake.init_count == 0
    assert (m.method, m.clock_mhz, m.details["clock_locked"]) == ("nvml-energy-counter", 1200, 1)
    assert m.time_s == pytest.approx(0.002)
    assert m.energy_j == pytest.approx(300.0 * 0.002, rel=1e-3)
    assert m.details["window_s"] >= 0.2 and m.resources == ()


def test_dry_run_device_measures_at_default_clocks() -> None:
    clock = FakeClock()
    fake = FakeNvml(clock=clock)
    with device(fake, timer=clock, dry_run=True) as gpu:
        m = gpu.measure(timed_workload(clock, 0.01), 1200)
        assert gpu.name == "nvml-dry-run:0 (NVIDIA A100-SXM4-40GB)"
        assert [s.mhz for s in gpu.clock_controller().switches] == [1200]
    assert m.details["clock_locked"] == 0.0 and fake.setter_calls() == []


def test_measure_refuses_a_workload_it_cannot_run() -> None:
    with device() as gpu, pytest.raises(ValueError, match="no run"):
        gpu.measure(Workload("w"), 1200)


def test_a_gpu_without_energy_readings_is_released() -> None:
    fake = FakeNvml([FakeGpu(energy_counter=False, power_readable=False)])
    with pytest.raises(EnergyUnavailableError, match="GPU 0 \\(NVIDIA A100-SXM4-40GB\\)"):
        device(fake)
    assert fake.init_count == 0


def test_search_clocks_span_the_methods_range_below_the_maximum() -> None:
    with device() as a100:
        assert a100.search_clocks() == tuple(range(1410, 899, -30))
    h200 = FakeGpu(name="NVIDIA H200", memory_clock=3201, graphics_clocks={3201: H200_CLOCKS})
    with device(FakeNvml([h200])) as gpu:
        assert gpu.supported_clocks() == H200_CLOCKS
        assert gpu.search_clocks() == tuple(range(1980, 1469, -30))


def test_search_clocks_follow_irregular_steps() -> None:
    steps_of_7_or_8 = [1000, 992, 985, 977, 970, 962, 955, 947, 940]
    assert default_search_clocks(steps_of_7_or_8, count=3) == (1000, 970, 940)
    assert default_search_clocks([1000, 985, 970]) == (1000, 970)  # short range: stop at bottom


def test_static_power_is_published_else_a_share_of_the_power_limit(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with device() as a100:
        assert a100.static_power_w == 85.0  # the method's A100 figure
    assert not caplog.records
    h200 = FakeGpu(name="NVIDIA H200", default_power_limit_mw=700_000)
    with device(FakeNvml([h200])) as gpu:
        assert gpu.static_power_w == pytest.approx(0.21 * 700)
    assert any("assumed" in r.getMessage() for r in caplog.records)
    with device(FakeNvml([h200]), static_power_w=120.0) as gpu:
        assert gpu.static_power_w == 120.0


def test_device_mig_and_permission_errors_surface() -> None:
    fake = FakeNvml([FakeGpu(mig=True)])
    with pytest.raises(MigClockControlError):
        device(fake)
    assert fake.init_count == 0
    clock = FakeClock()
    with (
        device(FakeNvml(can_set_clocks=False, clock=clock), timer=clock) as gpu,
        pytest.raises(ClockPermissionError),
    ):
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


def test_each_rank_measures_and_controls_its_own_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    gpus = [FakeGpu(uuid=f"GPU-{i}aaaaaaa-0000", power_w=100.0 * (i + 1)) for i in range(4)]
    clock = FakeClock()
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with device(FakeNvml(gpus, clock=clock), timer=clock) as gpu:
        m = gpu.measure(timed_workload(clock, 0.01), 1200)
        assert gpu.index == 2 and m.average_power_w == pytest.approx(300.0, rel=1e-3)
        assert [g.locked for g in gpus] == [None, None, (1200, 1200), None]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1,0,2")
    with device(FakeNvml(gpus)) as gpu:
        assert gpu.index == 0


NO_PERMISSION_ADVICE = ("root", "CAP_SYS_ADMIN", "zeusd", 'device="nvml-dry-run"')


def test_without_permission_only_the_default_clock_is_planned(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    fake = FakeNvml(can_set_clocks=False, clock=clock)
    with device(fake, timer=clock) as gpu:
        assert gpu.search_clocks() == (1410,) and len(gpu.supported_clocks()) == 81
        assert gpu.identity == "nvml:NVIDIA A100-SXM4-40GB"
        limitation = gpu.clock_limitation
        assert limitation is not None and limitation.startswith(
            "no permission to lock the SM clock of GPU 0 (NVIDIA A100-SXM4-40GB) "
            "(NVML_ERROR_NO_PERMISSION): planned at the default clock only; "
        )
        for advice in NO_PERMISSION_ADVICE:
            assert advice in limitation
        m = gpu.measure(timed_workload(clock, 0.01), DEFAULT_CLOCK_MHZ)
        assert m.energy_j > 0 and m.details["clock_locked"] == 0.0
        assert fake.setter_calls() == [(RESET, 0)]  # the probe at open, nothing since
        with pytest.raises(ClockPermissionError):
            gpu.measure(timed_workload(clock, 0.01), 1200)
        gpu.measure(timed_workload(clock, 0.01), DEFAULT_CLOCK_MHZ)
    assert fake.setter_calls() == [(RESET, 0), (LOCK, 0, 1200, 1200)]  # close made no call
    assert fake.init_count == 0
    warned = [r for r in caplog.records if r.getMessage() == limitation]
    assert [(r.levelno, r.name) for r in warned] == [(logging.WARNING, "kareus")]


def test_with_permission_the_probe_is_the_only_extra_setter_call() -> None:
    clock = FakeClock()
    fake = FakeNvml(clock=clock)
    with device(fake, timer=clock) as gpu:
        assert gpu.clock_limitation is None and len(gpu.search_clocks()) == 18
        gpu.measure(timed_workload(clock, 0.01), DEFAULT_CLOCK_MHZ)  # known default: no call
        assert fake.setter_calls() == [(RESET, 0)]
        gpu.measure(timed_workload(clock, 0.01), 1200)
    assert fake.setter_calls() == [(RESET, 0), (LOCK, 0, 1200, 1200), (RESET, 0)]


def test_a_simulated_device_has_no_clock_limitation() -> None:
    assert resolve_device("sim:h200").clock_limitation is None
