import logging
import time

import pytest

from kareus.devices import SimulatedGPU
from kareus.devices.base import Device, Measurement, RecordingClockController, Workload
from kareus.devices.nvml.multiplex import DEFAULT_POLICY, first_round
from kareus.devices.nvml.replay import WARMUP_RUNS
from kareus.profiler.measure import Protocol, group_measurement, measure_batch, measure_variant


class Scripted(Device):
    """A GPU whose successive measurements are given (time, energy) pairs."""

    name = "scripted"

    def __init__(self, readings):
        self.readings = list(readings)
        self.calls = 0

    def supported_clocks(self):
        return (1410, 900)

    def search_clocks(self):
        return (1410, 900)

    @property
    def static_power_w(self):
        return 85.0

    def measure(self, workload, clock_mhz, *, resources=None):
        t, e = self.readings[self.calls]
        self.calls += 1
        return Measurement(t, e, 85.0, clock_mhz, "scripted")

    def clock_controller(self):
        return RecordingClockController()


W = Workload("w")


def test_steady_repeats_give_their_medians():
    gpu = Scripted([(1.00, 10.0), (1.02, 10.4), (0.99, 10.1)])
    m = measure_variant(gpu, W, 1410)
    assert gpu.calls == 3
    assert (m.time_s, m.energy_j) == (1.00, 10.1)
    assert m.details["repeats"] == 3 and m.details["spread"] == pytest.approx(0.4 / 10.1)


def test_an_unsteady_variant_is_measured_again_until_steady():
    # the third repeat is an outlier (a missed counter update): the median out-votes it
    gpu = Scripted([(1.00, 10.0), (1.01, 10.0), (1.00, 13.0), (1.00, 10.1), (1.0, 10.0)] * 2)
    m = measure_variant(gpu, W, 1410, protocol=Protocol(repeats=3, max_repeats=5))
    assert gpu.calls == 5  # still 30% apart at 4: the fifth is the last allowed
    assert m.energy_j == 10.0


def test_a_variant_that_stays_unsteady_is_kept_with_a_warning(caplog):
    gpu = Scripted([(1.0, 10.0), (2.0, 10.0)] * 3)
    with caplog.at_level(logging.WARNING, logger="kareus"):
        m = measure_variant(gpu, W, 900, protocol=Protocol(repeats=2, max_repeats=4))
    assert gpu.calls == 4 and m.details["spread"] == pytest.approx(2 / 3)
    assert "still spread by 66.7%" in caplog.text


def test_cooldown_between_repeats_only():
    slept = []
    gpu = Scripted([(1.0, 10.0)] * 3)
    measure_variant(gpu, W, 1410, protocol=Protocol(cooldown_s=5.0), sleep=slept.append)
    assert slept == [5.0, 5.0]


def test_a_model_is_measured_once_and_charged_what_a_real_gpu_would_take(monkeypatch):
    gpu = SimulatedGPU("sim:a100-sxm4-40gb")
    calls, spent = [], []
    m = Measurement(0.2, 50.0, 85.0, 1410, "model")
    monkeypatch.setattr(gpu, "measure", lambda *a, **k: calls.append(a) or m)
    assert measure_variant(gpu, W, 1410, spent=spent.append) is m and len(calls) == 1
    assert spent == [Protocol().seconds_per_batch([0.2])]  # settle, warm-up, blocks


def test_a_real_gpu_is_charged_the_wall_time_of_its_repeats(monkeypatch):
    gpu = Scripted([(1e-3, 0.3)] * 3)
    monkeypatch.setattr(gpu, "measure", lambda *a, _m=gpu.measure, **k: time.sleep(0.01) or _m(
        *a, **k))
    spent = []
    measure_variant(gpu, W, 1410, spent=spent.append)
    assert len(spent) == 1 and spent[0] >= 0.03  # three repeats of 10 ms


@pytest.mark.parametrize(
    "kwargs", [{"repeats": 0}, {"repeats": 4, "max_repeats": 3}, {"max_spread": 0.0},
               {"cooldown_s": -1.0}]
)
def test_bad_protocols_are_refused(kwargs):
    with pytest.raises(ValueError, match="measurement protocol"):
        Protocol(**kwargs)


def test_a_group_takes_the_slowest_time_and_the_summed_energy():
    ranks = [Measurement(1.0, 10.0, 85.0, 1410, "x"), Measurement(1.5, 12.0, 85.0, 1410, "x")]
    m = group_measurement(ranks, 2)
    assert (m.time_s, m.energy_j, m.static_power_w) == (1.5, 22.0, 170.0)
    assert m.details["slowest_rank"] == 1
    assert m.effective_energy_j == pytest.approx(22.0 - 170.0 * 1.5)


def test_one_measurement_stands_for_a_symmetric_group():
    m = group_measurement([Measurement(1.0, 10.0, 85.0, 1410, "x")], 8)
    assert (m.time_s, m.energy_j, m.static_power_w) == (1.0, 80.0, 680.0)
    with pytest.raises(ValueError, match="3 measurements for a group of 8"):
        group_measurement([m] * 3, 8)


def test_the_protocols_gpu_time_per_evaluation():
    # 0.1 s settle + 3 x (the capture's 2 warm-up runs and the meter's, 10 ms each, + a
    # 0.55 s window)
    assert WARMUP_RUNS == 2
    assert Protocol().seconds_per_evaluation(0.01) == pytest.approx(0.1 + 3 * 0.58)
    assert Protocol(cooldown_s=5).seconds_per_evaluation(0.01) == pytest.approx(10.1 + 3 * 0.58)
    assert Protocol.seconds_per_check(0.01) == pytest.approx(0.1 + 0.03 + 2.2)
    # multiplexed: the settle where the clock changed, then 3 warm-up runs and as many
    # 0.15 s blocks (a run, where longer) as the counter's updates need to state errors
    # (fewer where the probe measured the counter's noise and lag, as on an integrating
    # counter)
    (two, two_s), (one, one_s) = (
        first_round(n, 0.1, DEFAULT_POLICY, noise_known=True, lag_known=True) for n in (2, 1))
    assert two * two_s < one * one_s  # a batch shares the readings its error needs
    # (and the waits for the counter: 1.5 updates of 100 ms for its report on average,
    # and half an update for a tick before the first block where no settle held one)
    assert Protocol().seconds_per_batch([0.01, 0.3]) == pytest.approx(
        0.1 + 0.03 + two * two_s + 0.9 + two * 0.3 + 0.15)
    assert Protocol().seconds_per_batch([0.01], switched=False) == pytest.approx(
        0.03 + one * one_s + 0.2)
    assert Protocol().seconds_per_batch([0.01], settle_s=0.05) == pytest.approx(
        0.05 + 0.03 + one * one_s + 0.2)  # a settle shorter than an update may hold none
    unknown, unknown_s = first_round(1, 0.1, DEFAULT_POLICY, lag_known=True)
    assert unknown * unknown_s > one * one_s
    assert Protocol().seconds_per_batch([0.01], switched=False, noise_known=False) == (
        pytest.approx(0.03 + unknown * unknown_s + 0.2))
    # the lag fitted: an update more, where the updates rather than the blocks' least
    # length set the round (six variants here)
    (known, known_s), (fitted, fitted_s) = (
        first_round(6, 0.1, DEFAULT_POLICY, noise_known=True, lag_known=lag)
        for lag in (True, False))
    assert 6 * fitted * fitted_s == pytest.approx(6 * known * known_s + 0.1)
    assert Protocol().seconds_per_batch([0.01] * 6, lag_known=False) == pytest.approx(
        Protocol().seconds_per_batch([0.01] * 6) + 0.1)


def test_a_batch_is_measured_together_where_the_device_states_its_errors(monkeypatch):
    gpu = Scripted([(1.0, 10.0)] * 4)
    batches = []
    monkeypatch.setattr(type(gpu), "estimates_error", property(lambda self: True))
    monkeypatch.setattr(gpu, "measure_batch", lambda ws, clock, agree=None, caps=None: (
        batches.append(([w.name for w in ws], clock))
        or [Measurement(1.0, 2.0, 0.0, clock, "mux")] * len(ws)))
    spent = []
    found = measure_batch(gpu, [W, W], 1410, spent=spent.append)
    assert [m.method for m in found] == ["mux", "mux"] and batches == [([W.name] * 2, 1410)]
    assert measure_variant(gpu, W, 1005).method == "mux"  # once: no repeats
    assert len(batches) == 2 and len(spent) == 1


def test_ranks_measuring_together_repeat_alike():
    """Steady here, but another rank of the group wants five repeats: this one follows."""
    gpu = Scripted([(1.0, 10.0)] * 5)
    asked = []

    def agree(more):
        asked.append(more)
        return 1 if len(asked) <= 5 else 0

    measure_variant(gpu, Workload("w", agree=agree), 1410)
    # first the protocol (1: this rank measures in windows), then each repeat
    assert gpu.calls == 5 and asked == [1, 1, 1, 0, 0, 0]


def test_ranks_measuring_together_use_one_protocol(monkeypatch):
    """This rank's counter integrates, another rank's probe could not tell: the batch is
    measured in windows here too (multiplexed, the ranks would run their variants'
    collectives in other orders and wait on each other)."""
    gpu = Scripted([(1.0, 10.0)] * 6)
    monkeypatch.setattr(type(gpu), "estimates_error", property(lambda self: True))
    batches = []
    monkeypatch.setattr(gpu, "measure_batch", lambda ws, clock, agree=None, caps=None: (
        batches.append(len(ws)) or [Measurement(1.0, 2.0, 0.0, clock, "mux")] * len(ws)))
    asked = []

    def windows_elsewhere(count):  # the other rank proposes 1 to the protocol's question
        asked.append(count)
        return 1 if len(asked) == 1 else count

    found = measure_batch(gpu, [W, W], 1410, agree=windows_elsewhere)
    assert batches == [] and asked[0] == 0  # this rank could multiplex, and did not
    assert [m.method for m in found] != ["mux", "mux"] and gpu.calls == 6
    # where every rank's counter integrates, the batch is multiplexed
    assert [m.method for m in measure_batch(gpu, [W, W], 1410, agree=lambda c: c)] == [
        "mux", "mux"] and batches == [2]
