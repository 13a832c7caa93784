"""A graph's frontier from its profiled partitions and the device's cost of whole graphs."""

import pytest
import torch
from conftest import analysed, tp_llama

from kareus.codegen.apply import apply
from kareus.devices import SimulatedGPU
from kareus.passes.decide import Choice
from kareus.passes.ops import DEFAULT_CLOCK_MHZ
from kareus.planner.compose import clock_of, fronts_by
from kareus.planner.graph import _partition_points, graph_frontier
from kareus.profiler.profile import Settings, profile_graph
from kareus.profiler.store import ProfileStore


@pytest.fixture
def planned(fake_pg, tmp_path):
    (g, analysis), _ = analysed(tp_llama(1), torch.randint(0, 256, (8, 16)))
    gpu = SimulatedGPU("sim:a100-sxm4-40gb")
    clocks = gpu.search_clocks()
    with ProfileStore(cache_dir=tmp_path) as store:
        profiles = profile_graph(analysis, (2,), gpu, store, Settings(budget=10), prefix="fw")
    costed = []

    def cost(variant, at):
        costed.append((variant, tuple(at)))
        return gpu.estimate_at(apply(g.gm, analysis, Choice.of(variant)), at, 2)

    frontier = graph_frontier(analysis, profiles, (1, 2), clocks, cost)
    return g, analysis, gpu, profiles, frontier, costed


def test_every_point_is_what_the_device_says_its_whole_graph_costs(planned):
    g, analysis, gpu, _, frontier, _ = planned
    # a Pareto set at each clock, fastest first
    assert frontier.points == tuple(fronts_by(frontier.points, clock_of))
    default = gpu.search_clocks()[0]
    for o in frontier.points:
        c = o.choice
        assert c.clock_mhz != default  # the default clock has one spelling
        clock = default if c.clock_mhz == DEFAULT_CLOCK_MHZ else c.clock_mhz
        graph = apply(g.gm, analysis, c.at(DEFAULT_CLOCK_MHZ))
        m = gpu.estimate_at(graph, [clock], 2)[clock]
        assert (o.time_s, o.effective_energy_j) == (m.time_s, m.effective_energy_j)
    # nothing unrewritten at some clock beats the frontier
    for single in frontier.frequency_only:
        assert any(o.time_s <= single.time_s and o.effective_energy_j <= single.effective_energy_j
                   for o in frontier.points)
    assert frontier.baseline.choice == Choice(1, DEFAULT_CLOCK_MHZ)


def test_the_graph_is_costed_whole_only_at_the_default_variant_and_the_frontier(planned):
    _, analysis, gpu, _, _, costed = planned
    clocks = tuple(gpu.search_clocks())
    # the unrewritten graph and the default variant at every clock; the rest is composed
    assert costed[:2] == [(None, clocks), (analysis.space.default(2), clocks)]
    # then each other variant of the composed frontier once, at its clocks
    later = [v for v, _ in costed[2:]]
    assert None not in later and analysis.space.default(2) not in later
    assert len(set(later)) == len(later)


def test_a_partition_runs_k_times_and_its_group_shares_the_energy(planned):
    _, analysis, gpu, profiles, _, _ = planned
    parts = analysis.space.partitions(2)
    index = next(i for i, p in enumerate(parts) if p.launch_slots > 1)
    profile = next(p for p in profiles if p.key == parts[index].key)
    options = _partition_points(parts[index], profiles, 2, gpu.search_clocks())
    for point in profile.points:
        sms = next(iter(dict(point.knobs.resources).values()), None)
        (o,) = [o for o in options.get(point.knobs.clock_mhz, ())
                if o.choice == (point.knobs.slot, sms)]
        assert o.time_s == 2 * point.time_s
        assert profile.group_size == 2  # the fake group: energies summed over 2 GPUs
        assert o.effective_energy_j == pytest.approx(2 * point.effective_energy_j / 2)
    # unmeasured clocks of a measured schedule are predicted, never left out alone
    assert len(options) > len({p.knobs.clock_mhz for p in profile.points})


def test_the_default_variant_is_kept_at_every_clock_for_nanobatching_without_search(planned):
    g, analysis, gpu, _, frontier, _ = planned
    default = analysis.space.default(2)
    clocks = gpu.search_clocks()
    assert [o.choice for o in frontier.nanobatched] == [
        Choice.of(default, DEFAULT_CLOCK_MHZ if f == clocks[0] else f) for f in clocks
    ]
    costs = gpu.estimate_at(apply(g.gm, analysis, Choice.of(default)), clocks, 2)
    assert [(o.time_s, o.effective_energy_j) for o in frontier.nanobatched] == [
        (costs[f].time_s, costs[f].effective_energy_j) for f in clocks
    ]
