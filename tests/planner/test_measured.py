"""Graphs planned at their first call, where the device must run a graph to cost it (one
process, fake process group): a simulated GPU that answers only by measuring stands for a
real one, so the plan can be checked against the model's own. The budget is met, the next
run measures nothing, a profiling budget stops the measuring with a stated fallback, and a
device that cannot set clocks refuses a budget that needs them, saying why."""

import logging
import re

import pytest
from test_step import _train as train_step

import kareus
from kareus.devices import SimulatedGPU
from kareus.planner import measured as measured_module
from kareus.planner.budget import BudgetError
from kareus.profiler import measure
from kareus.runtime.agreement import Verdict


class MeasuredOnly(SimulatedGPU):
    """The simulated H200, costing a graph only by running it (as a real GPU)."""

    costs_graphs = False

    def __init__(self, default_clock_only: bool = False) -> None:
        super().__init__("sim:h200")
        self.default_clock_only = default_clock_only

    def estimate_at(self, gm, clocks, world_size=1):
        return None

    def search_clocks(self):
        clocks = super().search_clocks()
        return clocks[:1] if self.default_clock_only else clocks

    @property
    def clock_limitation(self):
        return "no permission to lock clocks (a test)" if self.default_clock_only else None


def _train(device, options, steps=2):
    """The backend, the clock switches its graphs asked for, and the losses."""
    backend = kareus.KareusBackend(
        {"lowering": "eager", "search_budget": 4, "nanobatches": "auto", **options},
        device=device,
    )
    losses, switches, backend = train_step({}, steps=steps, backend=backend)
    return backend, switches, losses


@pytest.fixture
def measured(monkeypatch):
    calls = []
    original = measure.measure_batch

    def counting(device, workloads, clock_mhz, **kwargs):
        calls.extend(w.name for w in workloads)
        return original(device, workloads, clock_mhz, **kwargs)

    monkeypatch.setattr("kareus.profiler.graph_cost.measure_batch", counting)
    return calls


def test_a_time_budget_is_planned_from_first_call_measurements_and_met(fake_pg, tmp_path,
                                                                      measured):
    options = {"time_budget": "1.4 ms", "cache_dir": str(tmp_path)}
    backend, switches, _ = _train(MeasuredOnly(), options, steps=3)
    plan = backend.planner.plan
    assert plan is not None and plan.predicted.time_s <= 1.4e-3
    assert plan.predicted.energy_j < plan.baseline.energy_j
    clocks = {g.label: g.choice.clock_mhz for g in plan.graphs}
    forward, backward = (g.label for g in plan.graphs)
    assert forward.endswith("forward") and all(clocks.values())
    # the first forward ran at the options' choice (default clocks), every call after it
    # switched to the plan's clock
    assert switches[0] == (forward, 0)
    order = [backward] + [forward, backward] * 2
    assert switches[1:] == [(label, clocks[label]) for label in order]
    assert measured  # whole graphs were measured
    # the plan is the one the model plans when it costs the graphs itself
    model, _, _ = _train(SimulatedGPU("sim:h200"), {**options, "cache_dir": str(tmp_path / "m")},
                         steps=1)
    # (at the same clocks: those a measured graph predicts are within its held-back check)
    assert [g.choice for g in model.planner.plan.graphs] == [g.choice for g in plan.graphs]
    assert model.planner.plan.predicted.time_s == pytest.approx(plan.predicted.time_s, rel=0.02)
    assert model.planner.plan.predicted.energy_j == pytest.approx(plan.predicted.energy_j,
                                                                  rel=0.02)
    reports = {r.label: r for r in backend.reports()}
    for report in reports.values():
        assert report.profile_gpu_s > 0
        # measured with the step's other graph, once both had their first call
        assert any("whole graph measured on its first call's inputs with 1 other graph of "
                   "the step" in n for n in report.notes)
        # the chosen point, measured again in a long window (a model answers alike: what
        # moved is the prediction, where the point lies between measured clocks)
        (moved,) = [re.search(r"checked in one 2 s window: time ([-+][\d.]+)%, energy "
                              r"([-+][\d.]+)%", n) for n in report.notes if "checked" in n]
        assert moved and all(abs(float(x)) <= 2.0 for x in moved.groups())
        assert not any("cannot cost a whole graph" in n for n in report.notes)
    # the next run measures nothing: every whole graph (and partition) is in the store
    measured.clear()
    again, _, _ = _train(MeasuredOnly(), options, steps=2)
    assert measured == [] and again.spend.total_s == 0
    assert again.planner.plan.predicted == plan.predicted


def test_ranks_with_other_graphs_to_measure_measure_each_graph_alone(fake_pg, tmp_path,
                                                                    monkeypatch, caplog):
    """Where the ranks of a team do not agree on the step's graphs (one compiled another),
    each graph is measured as its own team, as at its first call, and the step is still
    planned."""
    asked = []

    def disagree(key, keys, groups, *, timeout_s):
        asked.append(keys)
        return Verdict(False, "rank 1 has other graphs (a test)")

    monkeypatch.setattr(measured_module, "agree", disagree)
    with caplog.at_level(logging.WARNING, logger="kareus"):
        backend, _, _ = _train(MeasuredOnly(), {"time_budget": "1.4 ms",
                                                "cache_dir": str(tmp_path)})
    assert len(asked) == 1 and len(asked[0]) == 2  # the forward's and the backward's keys
    assert any("measured one at a time: the ranks have different graphs to measure (rank 1 "
               "has other graphs (a test))" in r.getMessage() for r in caplog.records)
    assert backend.planner.plan is not None
    for report in backend.reports():
        assert any(n.startswith("whole graph measured on its first call's inputs: ")
                   for n in report.notes)  # alone


def test_a_rank_that_never_comes_to_the_step_s_measuring_leaves_it_unplanned_at_once(
        fake_pg, tmp_path, monkeypatch, measured):
    """Where a rank of the team did not come within the timeout, the step's graphs are not
    planned, and none waits for it again, alone."""
    def missing(key, keys, groups, *, timeout_s):
        return Verdict(False, "rank(s) [1] did not arrive within 60 s", timed_out=True)

    monkeypatch.setattr(measured_module, "agree", missing)
    backend, _, _ = _train(MeasuredOnly(), {"cache_dir": str(tmp_path)})
    assert backend.planner.plan is None and not measured and backend.spend.total_s == 0
    for report in backend.reports():
        assert "not planned: measuring the whole graph failed: ProfilingAborted: the step's " \
               "graphs: rank(s) [1] did not arrive within 60 s" in report.notes


def test_a_spent_profiling_budget_stops_measuring_and_the_graphs_run_unplanned(
        fake_pg_numbers, tmp_path, measured, caplog):
    options = {"cache_dir": str(tmp_path), "profile_budget_s": 2}
    with caplog.at_level(logging.DEBUG, logger="kareus"):
        backend, switches, losses = _train(MeasuredOnly(), options)
    spent = [r for r in caplog.records if "ProfileBudgetSpent" in r.getMessage()]
    assert len(spent) > 1  # every partition and graph after the budget says why...
    assert [r.levelno for r in spent].count(logging.WARNING) == 1  # ...and one warns
    assert backend.planner.plan is None  # nothing planned
    # the round in progress when the budget ran out finishes: here the first, the forward's
    # and the backward's partition searches side by side, 9 GPU-s
    assert 2 <= backend.spend.total_s < 10 and not measured
    assert set(backend.spend.by_graph) == {r.label for r in backend.reports()}
    notes = [n for r in backend.reports() for n in r.notes]
    assert any("not planned: measuring the whole graph failed: ProfileBudgetSpent: the "
               "profiling budget of 2 GPU-s is spent" in n for n in notes)
    assert {mhz for _, mhz in switches} == {0}
    _, _, expected = _train(SimulatedGPU("sim:h200"), {"profile": "off", "nanobatches": 1})
    assert losses == pytest.approx(expected)


def test_a_budget_that_needs_clocks_names_what_keeps_them_fixed(fake_pg, tmp_path):
    with pytest.raises(BudgetError, match=r"no plan meets the energy budget .*; no permission "
                                          r"to lock clocks \(a test\)"):
        _train(MeasuredOnly(default_clock_only=True),
               {"energy_budget": 0.5, "cache_dir": str(tmp_path)}, steps=1)


def test_an_energy_counter_that_never_advances_is_an_error_never_a_zero_energy_plan(
        fake_pg, tmp_path, monkeypatch, fresh_runtime):
    from fake_pynvml import FakeGpu, FakeNvml, FakePowerModel

    from kareus.devices.nvml import energy
    from kareus.devices.nvml.gpu import NvmlGPU

    monkeypatch.setattr(energy, "STALLED_WINDOW_MIN_S", 0.2)  # give up sooner than 5 s
    fake = FakeNvml([FakeGpu(power_model=FakePowerModel.of(), counter_stalled=True)])
    with NvmlGPU(nvml_module=fake, cuda=False, min_window_s=0.01, settle_s=0.0,
                 reset_at_exit=False) as gpu:
        backend, _, _ = _train(gpu, {"nanobatches": 1, "energy_budget": 0.9,
                                     "cache_dir": str(tmp_path)}, steps=1)
    assert backend.planner.plan is None
    notes = [n for r in backend.reports() for n in r.notes]
    assert sum("not planned: measuring the whole graph failed: CounterProbeStalledError"
               in n for n in notes) == 2  # forward and backward (an EnergyCounterStalledError)
    assert fake.gpus[0].locked is None
