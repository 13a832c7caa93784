"""The partition search: frontiers against brute force, budget, early stop, determinism."""

from __future__ import annotations

import random
import statistics

import pytest

from kareus.devices.base import Measurement
from kareus.profiler.search import (
    MAX_EXHAUSTIVE,
    MAX_SEARCH_CLOCKS,
    WIDTH,
    ClockSearch,
    Config,
    GridSearch,
    Point,
    SearchSpaceError,
    Space,
    _start,
    exhaustive,
    hypervolume,
    lockstep,
    pareto,
    reference_point,
    search,
    sweep,
)

A100_CLOCKS = tuple(range(1410, 899, -30))
SPACE = Space(slots=(0, 1, 2, 3), resources=(6, 12, 18, 24), clocks=A100_CLOCKS)


def synthetic(config: Config) -> Measurement:
    """A partition's shape in miniature: compute scales with 1/f, the collective is faster
    with more SMs and hides behind the compute issued after its slot, SMs taken slow the
    compute, dynamic power grows with f^3, static power is paid for the whole time."""
    sms, f = config.sms, config.clock_mhz
    compute = 1e-3 * (1410 / f) * (1 + 0.15 * sms / 24)
    comm = 0.5e-3 * 24 / sms
    hidden = compute * (1 - config.slot / 4)
    t = compute + max(0.0, comm - hidden)
    dynamic = 250 * (f / 1410) ** 3 * compute + 2.0 * sms * comm
    return Measurement(t, 85 * t + dynamic, 85.0, f, "synthetic")


def brute_force_front(points: list[Point]) -> set[Config]:
    def dominated(p: Point) -> bool:
        return any(
            q.time_s <= p.time_s and q.energy_j <= p.energy_j
            and (q.time_s < p.time_s or q.energy_j < p.energy_j)
            for q in points
        )

    return {p.config for p in points if not dominated(p)}


def test_pareto_matches_brute_force_on_random_points():
    rng = random.Random(0)
    for _ in range(20):
        points = [
            Point(Config(0, None, i), rng.random(), rng.random(), rng.random())
            for i in range(40)
        ]
        front = pareto(points)
        assert {p.config for p in front} == brute_force_front(points)
        assert [p.time_s for p in front] == sorted(p.time_s for p in front)


def test_hypervolume_of_a_known_front():
    a = Point(Config(0, None, 1), 1.0, 3.0, 0.0)
    b = Point(Config(0, None, 2), 2.0, 1.0, 0.0)
    worse = Point(Config(0, None, 3), 2.5, 3.5, 0.0)
    # [1, 2) x [3, 4) plus [2, 4) x [1, 4)
    assert hypervolume([a, b, worse], (4.0, 4.0)) == pytest.approx(1 * 1 + 2 * 3)
    assert hypervolume([worse], (2.0, 2.0)) == 0.0


def test_a_budget_as_large_as_the_grid_finds_the_exhaustive_frontier():
    small = Space(slots=(0, 2), resources=(6, 24), clocks=(1410, 1200, 900))
    result = search(small, synthetic, budget=100, patience=100)
    assert result.stopped == "exhausted" and len(result.points) == small.size
    truth = exhaustive(small, synthetic)
    # Configurations that tie on (time, energy) count once.
    values = {(p.time_s, p.energy_j) for p in truth if p.config in brute_force_front(truth)}
    assert {(p.time_s, p.energy_j) for p in result.frontier} == values


def test_the_budget_is_kept_and_nothing_is_measured_twice():
    calls: list[Config] = []

    def counted(config: Config) -> Measurement:
        calls.append(config)
        return synthetic(config)

    result = search(SPACE, counted, budget=20, patience=100)
    assert len(calls) == 20 == len(set(calls)) and result.stopped == "budget"
    # the seeded start: the default schedule and four drawn ones at the top clock, then
    # the default schedule at the lowest
    assert calls[0] == Config(0, 6, 1410) and calls[5] == Config(0, 6, 900)
    assert {c.clock_mhz for c in calls[:5]} == {1410} and len({c for c in calls[:5]}) == 5


def test_a_flat_problem_stops_early():
    def flat(config: Config) -> Measurement:
        return Measurement(1.0, 100.0, 85.0, config.clock_mhz, "flat")

    result = search(SPACE, flat, budget=50, patience=5)
    assert result.stopped == "converged" and len(result.points) < 50


def test_the_same_seed_proposes_the_same_points():
    first, second = (search(SPACE, synthetic, budget=16, seed=3) for _ in range(2))
    assert [p.config for p in first.points] == [p.config for p in second.points]
    other = search(SPACE, synthetic, budget=16, seed=4)
    assert [p.config for p in other.points] != [p.config for p in first.points]


def test_the_search_beats_random_sampling_on_the_synthetic_partition():
    truth = exhaustive(SPACE, synthetic)
    reference = reference_point(truth)
    full = hypervolume(truth, reference)
    searched, sampled = [], []
    for seed in range(3):
        result = search(SPACE, synthetic, budget=32, seed=seed, patience=100)
        searched.append(hypervolume(result.points, reference) / full)
        rng = random.Random(seed)
        picks = rng.sample(truth, 32)
        sampled.append(hypervolume(picks, reference) / full)
    assert statistics.median(searched) > statistics.median(sampled)
    assert statistics.median(searched) >= 0.95


def test_the_default_sms_sit_where_their_count_puts_them():
    space = Space(slots=(0,), resources=(None, 3, 30), clocks=(1410,), default_sms=24)
    assert space.ordered_resources == (3, None, 30)
    assert Space(slots=(0,), resources=(3, None), clocks=(1410,)).ordered_resources == (None, 3)


def clocked(config: Config) -> Measurement:
    """Time a + b/f, a set by the schedule (the default one, slot 0 with 6 SMs, the best);
    power static plus f^3, so energy is convex in the clock with its least near 1170 MHz:
    the frontier is that schedule at every clock from there up."""
    f = config.clock_mhz / 1410
    t = 0.25e-3 * (1 + 0.5 * config.slot + (config.sms - 6) / 12) + 1e-3 / f
    return Measurement(t, t * (300 + 200 * f**3), 300.0, config.clock_mhz, "synthetic")


def test_the_clock_structure_finds_the_best_schedules_clock_frontier():
    truth = {p.config for p in pareto(exhaustive(SPACE, clocked))}
    assert {(c.slot, c.sms) for c in truth} == {(0, 6)} and len(truth) == 9
    found = [
        len(truth & {p.config for p in search(SPACE, clocked, budget=24, seed=seed,
                                              patience=24).points})
        for seed in range(3)
    ]
    # Its two seeded clocks predict the rest: the median seed has all nine within 24
    # evaluations, four of each round exploring schedules (without the clock step, five).
    assert statistics.median(found) == len(truth)


def test_a_knob_with_one_choice_is_searched_over_the_others():
    """Groups without SM caps (gloo, the fake backend) offer only the library's default;
    a device with one clock, only that one: the surrogate proposes the slot."""
    space = Space(slots=tuple(range(12)), resources=(None,), clocks=(1410,))

    def evaluate(config: Config) -> Measurement:
        return synthetic(Config(config.slot % 4, 24, config.clock_mhz))

    result = search(space, evaluate, budget=10, seed=0, patience=100)
    assert len(result.points) == 10 == len({p.config for p in result.points})
    assert {(p.config.sms, p.config.clock_mhz) for p in result.points} == {(None, 1410)}


# 1..20,000,001 MHz in 1 MHz steps: what a GPU spec once asked for, which hung the search.
HUGE = Space(slots=(0, 1, 2, 3), resources=(None, 8, 16), clocks=range(20_000_001, 0, -1))


@pytest.mark.timeout(10)  # a hang, not a speed: listing the grid takes minutes and 20 GB
def test_a_huge_space_builds_and_samples_without_being_listed():
    assert HUGE.size == 4 * 3 * 20_000_001
    start = _start(HUGE, random.Random(0), 6)
    assert start[0] == Config(0, None, 20_000_001) and start[-1] == Config(0, None, 1)
    assert len(set(start)) == 6 and all(HUGE.config(HUGE.index(c)) == c for c in start)
    assert HUGE.config(HUGE.size - 1) == Config(3, 16, 1)


@pytest.mark.timeout(10)
def test_a_search_or_exhaustive_run_refuses_a_space_it_cannot_hold():
    with pytest.raises(SearchSpaceError, match=f"20,000,001 clocks; a search takes at most "
                                                f"{MAX_SEARCH_CLOCKS:,}"):
        search(HUGE, synthetic)
    with pytest.raises(SearchSpaceError, match=f"240,000,012 configurations; an exhaustive run "
                                                f"measures at most {MAX_EXHAUSTIVE:,}"):
        exhaustive(HUGE, synthetic)


def test_clocks_must_strictly_descend():
    for clocks in ((1410, 1410, 900), (900, 1410), range(900, 1411, 30)):
        with pytest.raises(SearchSpaceError, match="clocks must strictly descend"):
            Space(slots=(0,), resources=(None,), clocks=clocks)
    assert Space(slots=(0,), resources=(None,), clocks=range(1410, 899, -30)).size == 18


def test_the_sweep_goes_coarse_to_fine_over_every_clock_once():
    assert sweep((9, 8, 7, 6, 5, 4, 3, 2, 1)) == [9, 1, 5, 7, 3, 8, 6, 4, 2]
    assert sweep((1410,)) == [1410] and sweep((2, 1)) == [2, 1]
    order = sweep(A100_CLOCKS)
    assert sorted(order) == sorted(A100_CLOCKS) and order[:3] == [1410, 900, 1170]


def test_each_round_measures_at_one_clock_and_few_rounds_are_needed():
    rounds: list[int] = []
    result = search(SPACE, synthetic, budget=32, patience=100)

    def counted(config: Config) -> Measurement:
        if not rounds or rounds[-1] != config.clock_mhz:
            rounds.append(config.clock_mhz)
        return synthetic(config)

    again = search(SPACE, counted, budget=32, patience=100)
    assert [p.config for p in again.points] == [p.config for p in result.points]
    # a clock is set once per round, and rounds follow the sweep, pass after pass
    passes = iter(sweep(A100_CLOCKS) * 2)
    assert all(clock in passes for clock in rounds)  # a subsequence of two passes
    assert len(rounds) < len(again.points)


def test_a_round_that_explores_is_filled_from_the_first_pass():
    """Where no clock step is worth it (the clock changes nothing here), every round after
    the start explores ``WIDTH`` schedules: a round costs a clock switch and the counter's
    readings whatever it holds."""

    def flat(config: Config) -> Measurement:
        return synthetic(Config(config.slot, config.sms, SPACE.clocks[0]))

    rounds = search(SPACE, flat, budget=32, patience=100).rounds
    assert rounds[:2] == [5, 1]  # the start: top clock, then the bottom
    assert rounds[2:-1] == [WIDTH] * (len(rounds) - 3) and sum(rounds) == 32


def test_a_budget_below_the_start_measures_a_prefix_of_it():
    long = search(SPACE, synthetic, budget=12, seed=4, patience=100).points
    for budget in (1, 3, 5):
        short = search(SPACE, synthetic, budget=budget, seed=4).points
        assert [p.config for p in short] == [p.config for p in long[:budget]]


def test_searches_side_by_side_measure_what_each_would_alone_in_shared_rounds():
    spaces = [SPACE, Space(slots=(0, 1), resources=(6, 24), clocks=A100_CLOCKS)]
    alone = [search(space, synthetic, budget=20, seed=s) for s, space in enumerate(spaces)]
    rounds: list[tuple[int, list[int]]] = []

    def measure(clock: int, batch: list[tuple[int, Config]]) -> list[Measurement]:
        assert {config.clock_mhz for _, config in batch} == {clock}
        rounds.append((clock, [i for i, _ in batch]))
        return [synthetic(config) for _, config in batch]

    together = lockstep([ClockSearch(space, budget=20, seed=s) for s, space in enumerate(spaces)],
                        A100_CLOCKS, measure)
    for a, t in zip(alone, together, strict=True):
        assert [p.config for p in t.points] == [p.config for p in a.points]
        assert t.stopped == a.stopped and t.hypervolumes == a.hypervolumes
    shared = [r for r in rounds if len(set(r[1])) == 2]
    assert shared and len(rounds) < sum(len(a.rounds) for a in alone)
    # a search's share of the rounds is the rounds it makes alone (what a replica searching
    # a slice of a schedule measures: benchmarks/profiling_cost.py counts it so)
    for i, a in enumerate(alone):
        assert [r[1].count(i) for r in rounds if i in r[1]] == a.rounds

    # a search that joins at the start of a later pass (a replica claiming another slice)
    # still measures what it would alone
    passes = []

    def more() -> list[ClockSearch]:
        passes.append(len(rounds))
        return [ClockSearch(spaces[1], budget=20, seed=1)] if len(passes) == 2 else []

    joined = lockstep([ClockSearch(SPACE, budget=20, seed=0)], A100_CLOCKS, measure, more=more)
    assert passes[1] > passes[0]  # it joined once a pass had measured
    for a, t in zip(alone, joined, strict=True):
        assert [p.config for p in t.points] == [p.config for p in a.points]


def test_a_grid_search_measures_every_configuration_a_clock_at_a_time():
    small = Space(slots=(0, 2), resources=(6, 24), clocks=(1410, 1200, 900))
    clocks: list[int] = []

    def measure(clock: int, batch: list[tuple[int, Config]]) -> list[Measurement]:
        clocks.append(clock)
        return [synthetic(config) for _, config in batch]

    (result,) = lockstep([GridSearch(small)], small.clocks, measure)
    assert sorted(p.config for p in result.points) == sorted(small)
    assert clocks == [1410, 900, 1200] and result.rounds == [4, 4, 4]
