"""Whole graphs measured per clock (a device that must run a graph to cost it): about four
clocks measured, the rest predicted and checked against a held-back clock (every other
clock measured where the check fails; the first ask's variants measured there too), one
batch per clock, every measurement kept in the
store, the profiling budget."""

import itertools
import math

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from conftest import analysed, tp_llama

from kareus.codegen.apply import apply
from kareus.devices import SimulatedGPU
from kareus.devices.base import Measurement, Workload
from kareus.passes.decide import Choice
from kareus.planner.graph import graph_frontier
from kareus.profiler import graph_cost
from kareus.profiler.graph_cost import (
    GraphMeasurer,
    MixedTeamsError,
    Subject,
    grid,
    held_back_clock,
    measured_clocks,
    next_check,
)
from kareus.profiler.measure import GpuTime, ProfileBudgetSpent
from kareus.profiler.profile import Settings
from kareus.profiler.store import ProfileStore


def test_four_clocks_are_measured_the_top_two_among_them():
    clocks = tuple(range(1980, 1214, -45))  # H200's 18 search clocks
    assert measured_clocks(clocks) == (1980, 1935, 1575, 1215)
    assert held_back_clock(clocks) == 1395  # midway in the lower of the two widest gaps
    assert measured_clocks((5, 4, 3, 2, 1)) == (5, 4, 3, 1)
    assert held_back_clock((5, 4, 3, 2, 1)) == 2
    assert measured_clocks((7,)) == (7,) and held_back_clock((7,)) is None


def test_a_missed_held_back_clock_joins_the_grid_and_the_next_gap_is_checked():
    clocks = tuple(range(9, 0, -1))  # grid (9, 8, 5, 1), first checked at 3

    def curve(bend_at: set[int]):
        def at(f: int) -> Measurement:  # time a + b/f; power linear, but bent at bend_at
            power = 100 + 10 * f + (30 if f in bend_at else 0)
            return Measurement(1 + 1 / f, power * (1 + 1 / f), 0.0, f, "test")
        return at

    assert grid(clocks, curve(set())) == (9, 8, 5, 1)  # the check at 3 held
    assert next_check(clocks, curve(set())) == 3
    assert grid(clocks, curve({3})) == (9, 8, 5, 3, 1)  # missed at 3; then 7 held
    assert next_check(clocks, curve({3})) == 7
    assert grid(clocks, lambda f: None) == (9, 8, 5, 1)  # nothing measured yet


def subject(analysis, workload, gpu, key="fw"):
    return Subject(analysis, workload, key,
                   lambda cost: graph_frontier(analysis, (), (1, 2), gpu.search_clocks(), cost))


@pytest.fixture
def graph(fake_pg):
    (g, analysis), _ = analysed(tp_llama(1), torch.randint(0, 256, (8, 16)))
    gpu = SimulatedGPU("sim:h200")
    built = []

    def workload(choice):
        built.append(choice)
        return Workload(str(choice), gm=apply(g.gm, analysis, choice, clocked=False),
                        world_size=2)

    def measure(store, spend=None):
        measurer = GraphMeasurer([subject(analysis, workload, gpu)], gpu, store, Settings(),
                                 spend or GpuTime(), prefix="fw")
        (measured,) = measurer.run()
        return measured

    return g, analysis, gpu, measure, built


def test_a_held_back_clock_is_predicted_within_a_few_percent(graph, tmp_path):
    g, analysis, gpu, measure, _ = graph
    with ProfileStore(cache_dir=tmp_path) as store:
        measured = measure(store)
    clocks = gpu.search_clocks()
    sparse = measured.grid
    assert sparse == measured_clocks(clocks)  # the held-back check held
    assert {c.clock_mhz for c in measured.measurements} == {*sparse, held_back_clock(clocks)}
    assert len(sparse) == 4
    errors = []
    for variant in (None, analysis.space.default(2)):
        held_back = [f for f in clocks if f not in sparse]
        predicted = measured.cost(variant, held_back)
        truth = gpu.estimate_at(apply(g.gm, analysis, Choice.of(variant), clocked=False),
                                held_back, 2)
        for f in held_back:
            p, m = predicted[f], truth[f]
            assert p.method.startswith("predicted")
            errors.append((abs(p.time_s / m.time_s - 1), abs(p.energy_j / m.energy_j - 1)))
            assert p.time_s == pytest.approx(m.time_s, rel=0.02)
            assert p.energy_j == pytest.approx(m.energy_j, rel=0.02)
        at_grid = measured.cost(variant, sparse)
        assert not any(at_grid[f].method.startswith("predicted") for f in sparse)
    assert any(t > 0 and e > 0 for t, e in errors)  # a prediction, not the measurement again


def test_the_next_run_reads_every_measurement_back(graph, tmp_path):
    _, _, gpu, measure, built = graph
    with ProfileStore(cache_dir=tmp_path) as store:
        first = measure(store)
    assert first.measured == len(first.measurements) > 0 and first.reused == 0
    assert first.gpu_s > 0
    built.clear()
    with ProfileStore(cache_dir=tmp_path) as store:
        second = measure(store)
    assert (second.measured, second.reused, second.gpu_s) == (0, first.measured, 0.0)
    assert built == []  # nothing compiled or run
    clocks = gpu.search_clocks()
    assert second.cost(None, clocks) == first.cost(None, clocks)


def test_measuring_stops_once_the_profiling_budget_is_spent(graph, tmp_path):
    _, _, _, measure, _ = graph
    spend = GpuTime(budget_s=0.3, estimated=True)
    with ProfileStore(cache_dir=tmp_path) as store, pytest.raises(ProfileBudgetSpent,
                                                                  match="0.3 GPU-s is spent"):
        measure(store, spend)
    assert 0.3 <= spend.total_s < 0.3 + 2.0  # stopped at the first batch past it


class Bent(SimulatedGPU):
    """Energy growing as exp(0.3 x the clock's index): a power curve so bent that every
    held-back clock misses its prediction by more than the tolerance (the chord over two
    steps is 4.5% off), as a GPU whose readings scatter above it would."""

    def measure(self, workload, clock_mhz, *, resources=None):
        m = super().measure(workload, clock_mhz, resources=resources)
        bend = math.exp(0.3 * self.search_clocks().index(clock_mhz))
        return Measurement(m.time_s, m.energy_j * bend, m.static_power_w, m.clock_mhz,
                           m.method)


def test_a_gpu_whose_checks_all_miss_is_measured_at_every_clock_and_settles(fake_pg,
                                                                           tmp_path,
                                                                           monkeypatch):
    (g, analysis), _ = analysed(tp_llama(1), torch.randint(0, 256, (8, 16)))
    gpu = Bent("sim:h200")
    clocks = gpu.search_clocks()
    batches = []
    measure = graph_cost.measure_batch

    def logged(device, workloads, clock_mhz, **kwargs):
        batches.append((clock_mhz, len(workloads)))
        return measure(device, workloads, clock_mhz, **kwargs)

    monkeypatch.setattr(graph_cost, "measure_batch", logged)

    def workload(choice):
        return Workload(str(choice), gm=apply(g.gm, analysis, choice, clocked=False),
                        world_size=2)

    with ProfileStore(cache_dir=tmp_path) as store:
        (measured,) = GraphMeasurer([subject(analysis, workload, gpu)], gpu, store, Settings(),
                                    GpuTime(), prefix="fw").run()
    # one held-back clock joins the grid a round, until every clock is measured, and the
    # exploration settles (its bound allows a round per clock)
    assert measured.grid == tuple(clocks)
    # the first held-back clock had the first ask's variants (unrewritten, k=2's default)
    # measured with the check: joining the grid took no batch of its own there
    first = held_back_clock(clocks)
    assert [b for b in batches if b[0] == first] == [(first, 2)]
    assert len(batches) < 2 * len(clocks)


def test_a_step_s_graphs_measured_together_share_each_clock_s_batch(fake_pg, tmp_path,
                                                                    monkeypatch):
    """The forward and the backward measured together: each round sets each clock once
    for both (one batch holding both graphs' variants), and each graph gets what it gets
    measured alone."""
    graphs = analysed(tp_llama(1), torch.randint(0, 256, (8, 16)))
    gpu = SimulatedGPU("sim:h200")
    batches = []
    measure = graph_cost.measure_batch

    def logged(device, workloads, clock_mhz, **kwargs):
        batches.append((clock_mhz, sorted({w.name.split(" ")[0] for w in workloads})))
        return measure(device, workloads, clock_mhz, **kwargs)

    monkeypatch.setattr(graph_cost, "measure_batch", logged)
    subjects = []
    for g, analysis in graphs:
        def workload(choice, g=g, analysis=analysis):
            return Workload(f"{analysis.label} {choice}",
                            gm=apply(g.gm, analysis, choice, clocked=False), world_size=2)

        subjects.append(subject(analysis, workload, gpu, key=analysis.label))

    alone, counts = [], []
    for i, s in enumerate(subjects):
        batches.clear()
        with ProfileStore(cache_dir=tmp_path / f"alone{i}") as store:
            (m,) = GraphMeasurer([s], gpu, store, Settings(), GpuTime(), prefix=s.key).run()
        alone.append(m)
        counts.append(len(batches))
    batches.clear()
    with ProfileStore(cache_dir=tmp_path / "together") as store:
        together = GraphMeasurer(subjects, gpu, store, Settings(), GpuTime(),
                                 prefix="step").run()
    assert [m.measurements for m in together] == [m.measurements for m in alone]
    assert all(m.measured == len(m.measurements) > 0 for m in together)
    assert max(counts) <= len(batches) < sum(counts)
    assert ["backward", "forward"] in [names for _, names in batches]
    # one batch per clock of a round: never two batches in a row at one clock
    assert all(a[0] != b[0] for a, b in itertools.pairwise(batches))


class Reduce(torch.nn.Module):
    def __init__(self, group):
        super().__init__()
        self.group = group

    def forward(self, x):
        return funcol.all_reduce(2 * x, "sum", self.group)


def test_graphs_whose_collectives_span_other_groups_are_not_measured_together(fake_pg,
                                                                              tmp_path):
    gpu = SimulatedGPU("sim:h200")
    ((_, one),) = analysed(Reduce(dist.new_group([0, 1])), torch.randn(4, 4), backward=False)
    ((_, other),) = analysed(Reduce(dist.new_group([0, 1])), torch.randn(4, 4),
                             backward=False)
    (_, free), _ = analysed(torch.nn.Linear(4, 4), torch.randn(2, 4))
    with ProfileStore(cache_dir=tmp_path) as store:
        for pair in ((one, other), (one, free)):
            with pytest.raises(MixedTeamsError, match="share their"):
                GraphMeasurer([subject(a, None, gpu, key=str(i)) for i, a in enumerate(pair)],
                              gpu, store, Settings(), GpuTime(), prefix="step")
