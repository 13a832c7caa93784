"""The NVML energy meter on its own: windows, repeats and the two energy methods."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
from fake_pynvml import FakeClock, FakeGpu, FakeNvml, opened

from kareus.devices.errors import EnergyCounterStalledError, EnergyUnavailableError
from kareus.devices.nvml.energy import NvmlEnergyMeter, PowerSampler


def meter(gpu: FakeGpu | None = None, **kwargs: object) -> tuple[NvmlEnergyMeter, FakeClock]:
    """A meter on a fake GPU drawing 300 W, timed by a clock that moves only when runs do."""
    clock = FakeClock()
    fake, handle = opened(FakeNvml([gpu or FakeGpu()], clock=clock))
    return NvmlEnergyMeter(fake, handle, gpu="GPU 0", timer=clock, **kwargs), clock


def taking(clock: FakeClock, *seconds: float) -> Callable[[], None]:
    """A run that takes ``seconds[0]``, then ``seconds[1]``, ..., the last one from then on."""
    durations = list(seconds)

    def run() -> None:
        clock.advance(durations.pop(0) if len(durations) > 1 else durations[0])

    return run


def test_short_runs_are_repeated_until_the_counter_window_is_long_enough() -> None:
    gauge, clock = meter(min_window_s=0.5)
    window = gauge.measure(taking(clock, 0.002))
    assert gauge.method == "nvml-energy-counter"
    assert window.wall_s >= 0.5 and window.runs == pytest.approx(0.55 / 0.002, abs=1)
    assert window.time_s == pytest.approx(0.002) and window.stream_s is None
    assert window.run_energy_j == pytest.approx(300.0 * 0.002, rel=1e-3)
    assert window.details()["runs"] == window.runs and "cuda_time_s" not in window.details()


def test_the_window_follows_min_window_s() -> None:
    gauge, clock = meter(min_window_s=2.0)
    assert gauge.measure(taking(clock, 0.002)).wall_s >= 2.0


def test_a_slow_warmup_is_followed_by_a_longer_window() -> None:
    gauge, clock = meter()
    window = gauge.measure(taking(clock, 1.0, 0.001))  # compile-like first run, then fast
    assert window.wall_s >= gauge.min_window_s and window.time_s == pytest.approx(0.001)


def test_ranks_measuring_together_run_as_often_as_the_slowest_needs() -> None:
    """Each window's run count is agreed (``Workload.agree``): this rank would take 276
    runs of 2 ms, another rank proposes 400; then whether to extend the window."""
    gauge, clock = meter(min_window_s=0.5)
    proposals: list[int] = []

    def agree(count: int) -> int:
        proposals.append(count)
        return max(count, 400) if count else 0

    window = gauge.measure(taking(clock, 0.002), agree)
    assert window.runs == 400 and proposals == [276, 0]


def test_unsupported_counter_falls_back_to_power_polling(caplog: pytest.LogCaptureFixture) -> None:
    gauge, clock = meter(FakeGpu(energy_counter=False))
    window = gauge.measure(taking(clock, 0.01))
    assert gauge.method == "nvml-power-polling"
    assert window.run_energy_j == pytest.approx(300.0 * 0.01)
    assert any("GPU 0 has no NVML energy counter" in r.getMessage() for r in caplog.records)


def test_no_counter_and_no_power_reading_cannot_measure() -> None:
    with pytest.raises(EnergyUnavailableError, match="GPU 0 reports neither.*sim:h200"):
        meter(FakeGpu(energy_counter=False, power_readable=False))


def test_power_sampler_integrates_the_power_polled_between_the_window_ends() -> None:
    """The ends read 100 W, the polling thread 300 W; each reading takes one second."""
    clock = FakeClock(0.0)
    polled = threading.Event()

    def read_power_w() -> float:
        clock.advance(1.0)
        if threading.current_thread() is threading.main_thread():
            return 100.0
        polled.set()
        return 300.0

    with PowerSampler(read_power_w, clock, interval_s=0.001) as sampler:
        assert polled.wait(5), "the polling thread never read power"
    between = len(sampler.samples) - 2
    # Trapezoids: 100 -> 300 and 300 -> 100 (200 J each), 300 W flat in between.
    assert between >= 1
    assert sampler.joules == pytest.approx(400.0 + 300.0 * (between - 1))


def test_a_counter_slower_than_the_window_gets_a_longer_window(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Updates every 1 s (at 1000.0, 1001.0, ...): the first 0.55 s window sees none."""
    gauge, clock = meter(FakeGpu(counter_period_s=1.0), min_window_s=0.5)
    proposals: list[int] = []

    def agree(count: int) -> int:
        proposals.append(count)
        return count

    window = gauge.measure(taking(clock, 0.002), agree)
    assert proposals == [276, 552, 0]  # doubled once: the window now spans an update
    assert window.energy_j > 0
    assert abs(window.energy_j - 300.0 * window.wall_s) <= 300.0 * 1.0  # one update's worth
    assert window.time_s == pytest.approx(0.002)
    assert any("did not advance in a 0.552 s window" in r.getMessage() for r in caplog.records)


def test_a_stalled_counter_raises_after_a_bounded_window() -> None:
    gauge, clock = meter(FakeGpu(counter_stalled=True), min_window_s=0.5)
    assert gauge.max_window_s == 5.0
    runs: list[int] = []
    proposals: list[int] = []

    def run() -> None:
        runs.append(1)
        clock.advance(0.002)

    def agree(count: int) -> int:
        proposals.append(count)
        return count

    with pytest.raises(EnergyCounterStalledError) as info:
        gauge.measure(run, agree)
    # Doubled up to the 5 s bound (2751 runs fill 5.5 s); the last count agreed is 0, as
    # the other ranks see it, and only then this rank raises.
    assert proposals == [276, 552, 1104, 2208, 2751, 0]
    assert len(runs) == 1 + sum(proposals)
    message = str(info.value)
    for said in ("GPU 0", "5.50 s window (2751 runs", "did not advance", "min_window_s=", "driver"):
        assert said in message
    assert meter(min_window_s=2.0)[0].max_window_s == 20.0
