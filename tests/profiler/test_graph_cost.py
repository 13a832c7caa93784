"""Whole graphs measured per clock (a device that must run a graph to cost it): half the
clocks measured, the rest predicted and checked against a held-back measurement, every
measurement kept in the store, the profiling budget."""

import pytest
import torch
from conftest import analysed, tp_llama

from kareus.codegen.apply import apply
from kareus.devices import SimulatedGPU
from kareus.devices.base import Workload
from kareus.passes.decide import Choice
from kareus.planner.graph import graph_frontier
from kareus.profiler.graph_cost import GraphMeasurer, measured_clocks
from kareus.profiler.measure import GpuTime, ProfileBudgetSpent
from kareus.profiler.profile import Settings
from kareus.profiler.store import ProfileStore


def test_every_other_clock_is_measured_and_the_last():
    assert measured_clocks((5, 4, 3, 2, 1)) == (5, 3, 1)
    assert measured_clocks((6, 5, 4, 3, 2, 1)) == (6, 4, 2, 1)
    assert measured_clocks((7,)) == (7,)


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
        measurer = GraphMeasurer(analysis, workload, gpu, store, Settings(), spend or GpuTime(),
                                 prefix="fw")
        return measurer.run(lambda cost: graph_frontier(
            analysis, (), (1, 2), gpu.search_clocks(), cost))

    return g, analysis, gpu, measure, built


def test_a_held_back_clock_is_predicted_within_a_few_percent(graph, tmp_path):
    g, analysis, gpu, measure, _ = graph
    with ProfileStore(cache_dir=tmp_path) as store:
        measured = measure(store)
    clocks = gpu.search_clocks()
    grid = measured_clocks(clocks)
    assert {c.clock_mhz for c in measured.measurements} == set(grid)  # half the clocks
    errors = []
    for variant in (None, analysis.space.default(2)):
        held_back = [f for f in clocks if f not in grid]
        predicted = measured.cost(variant, held_back)
        truth = gpu.estimate_at(apply(g.gm, analysis, Choice.of(variant), clocked=False),
                                held_back, 2)
        for f in held_back:
            p, m = predicted[f], truth[f]
            assert p.method.startswith("predicted")
            errors.append((abs(p.time_s / m.time_s - 1), abs(p.energy_j / m.energy_j - 1)))
            assert p.time_s == pytest.approx(m.time_s, rel=0.02)
            assert p.energy_j == pytest.approx(m.energy_j, rel=0.02)
        at_grid = measured.cost(variant, grid)
        assert not any(at_grid[f].method.startswith("predicted") for f in grid)
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
    spend = GpuTime(budget_s=5.0, estimated=True)
    with ProfileStore(cache_dir=tmp_path) as store, pytest.raises(ProfileBudgetSpent,
                                                                  match="5 GPU-s is spent"):
        measure(store, spend)
    assert 5.0 <= spend.total_s < 5.0 + 3.0  # stopped at the first measurement past it
