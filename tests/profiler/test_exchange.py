"""The leader/follower protocol of a group's search, on an in-memory store with threads as
ranks: the same result on every rank, a slow rank waited for, no wait past the timeout."""

import threading
import time

import pytest
import torch.distributed as dist

from kareus.devices.base import Measurement
from kareus.profiler.exchange import ProfilingAborted, Team
from kareus.profiler.interrupt import ProfilingInterrupted
from kareus.profiler.search import Config, Space, search

SPACE = Space((0, 1), (None,), (1410, 1200, 900))


def reading(rank, config):
    """Rank-dependent times and energies: the group's are the max and the sum."""
    t = 1e-3 * (1 + config.slot) * 1410 / config.clock_mhz * (1 + 0.1 * rank)
    return Measurement(t, 300.0 * t * config.clock_mhz / 1410, 85.0, config.clock_mhz, "x")


def run_group(ranks, store, *, prefix="p", timeout_s=10.0, delay=None, fail=None, budget=8,
              agreed=None, stops=None):
    """Every rank in a thread; rank -> (result, measured) or the exception it raised.
    ``agreed``: rank -> the counts its measurements agreed on (each proposes its rank + 1,
    then 0). ``stops``: rank -> the event that interrupts it."""
    outcome = {}

    def rank_main(rank):
        stop = (stops or {}).get(rank)
        team = Team(tuple(ranks), rank, len(ranks), prefix, timeout_s, store, stop)

        def measure_here(config, agree):
            if delay and rank in delay:
                time.sleep(delay[rank])
            if fail == rank:
                raise RuntimeError("GPU fell off the bus")
            if agreed is not None:
                agreed.setdefault(rank, []).append((agree(rank + 1), agree(0)))
            return reading(rank, config)

        try:
            if team.leads:
                measured, step = {}, 0

                def evaluate(config):
                    nonlocal step
                    measured[config] = team.measure(step, config, measure_here)
                    step += 1
                    return measured[config]

                try:
                    result = search(SPACE, evaluate, budget=budget, seed=0)
                except BaseException as exc:
                    team.abort(f"leader failed: {exc}")
                    raise
                team.finish(step, [(result, measured)])
                outcome[rank] = (result, measured)
            else:
                (outcome[rank],) = team.follow(measure_here)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            outcome[rank] = exc

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return outcome


def test_every_rank_ends_with_the_leaders_result_of_group_measurements():
    outcome = run_group([0, 1, 2], dist.HashStore(), delay={2: 0.05})
    (result, measured), *others = (outcome[r] for r in (0, 1, 2))
    assert len(result.points) == 6  # budget 8 > the 6 configurations: exhausted
    for other_result, other_measured in others:
        assert other_result.points == result.points and other_measured == measured
        assert other_result.stopped == result.stopped
        assert other_result.hypervolumes == result.hypervolumes
    config = result.points[0].config
    slowest = reading(2, config)
    assert measured[config].time_s == slowest.time_s  # the slowest rank's time
    assert measured[config].energy_j == pytest.approx(sum(reading(r, config).energy_j
                                                          for r in range(3)))


def test_groups_side_by_side_do_not_mix():
    """Two tensor-parallel groups profile the same partition under the same prefix."""
    store, outcomes = dist.HashStore(), {}
    threads = [
        threading.Thread(target=lambda g=g: outcomes.update({g: run_group(g, store)}))
        for g in ((0, 1), (2, 3))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for (leader, follower), outcome in outcomes.items():
        result, measured = outcome[leader]
        assert outcome[follower][0].points == result.points
        config = result.points[0].config  # the group's own ranks' readings
        assert measured[config].time_s == reading(follower, config).time_s


def test_a_rank_that_never_comes_costs_the_timeout_only():
    started = time.monotonic()
    outcome = run_group([0, 1], dist.HashStore(), timeout_s=0.5, delay={1: 3.0}, budget=3)
    assert time.monotonic() - started < 10
    assert isinstance(outcome[0], ProfilingAborted)
    assert "waited 0.5 s for the measurements of step 0 by ranks [1]" in str(outcome[0])


def test_a_failing_rank_stops_the_others_at_once():
    started = time.monotonic()
    outcome = run_group([0, 1], dist.HashStore(), timeout_s=30.0, fail=1)
    assert time.monotonic() - started < 5
    assert isinstance(outcome[1], RuntimeError) and not isinstance(outcome[1], ProfilingAborted)
    assert isinstance(outcome[0], ProfilingAborted)
    assert "rank 1 failed to measure: RuntimeError: GPU fell off the bus" in str(outcome[0])


@pytest.mark.parametrize("interrupted", [0, 1])
def test_an_interrupted_rank_stops_waiting_and_the_others_at_once(interrupted):
    """A signal on one rank (``interrupt.DeferredSignals`` sets its stop event) ends its
    wait for the others at the next poll, and its abort ends theirs."""
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    started = time.monotonic()
    # The other rank is slow to measure, so the interrupted one is waiting when it is set.
    slow = {1 - interrupted: 0.2}
    outcome = run_group([0, 1], dist.HashStore(), timeout_s=30.0, delay=slow, budget=50,
                        stops={interrupted: stop})
    assert time.monotonic() - started < 5
    assert isinstance(outcome[interrupted], ProfilingInterrupted)
    assert isinstance(outcome[1 - interrupted], ProfilingAborted)
    told = ("leader failed: profiling stopped" if interrupted == 0
            else "rank 1 stopped: ProfilingInterrupted")
    assert told in str(outcome[1 - interrupted])


def test_a_failing_leader_stops_the_others_at_once():
    outcome = run_group([0, 1], dist.HashStore(), timeout_s=30.0, fail=0)
    assert isinstance(outcome[0], RuntimeError)
    assert isinstance(outcome[1], ProfilingAborted) and "leader failed" in str(outcome[1])


def test_one_rank_alone_needs_no_store():
    team = Team((0,), 0, 8, "p", 1.0)
    m = team.measure(0, Config(0, None, 1410), lambda c, agree: reading(0, c))
    assert m.energy_j == pytest.approx(8 * reading(0, Config(0, None, 1410)).energy_j)


def test_ranks_measuring_together_agree_on_every_count():
    """Window sizes and repeats: a rank running its collective once more than another
    would wait forever, so each count is the largest any rank proposes."""
    agreed = {}
    outcome = run_group([0, 1, 2], dist.HashStore(), agreed=agreed, budget=4)
    assert not any(isinstance(o, Exception) for o in outcome.values())
    assert agreed[0] == agreed[1] == agreed[2] == [(3, 0)] * 4


def test_a_graph_without_collectives_or_on_fake_groups_is_measured_alone(fake_pg):
    alone = Team.of_groups([], "g", 1.0)
    assert (alone.ranks, alone.group_size, alone.alone) == ((0,), 1, True)
    world = Team.of_groups([dist.group.WORLD.group_name] * 2, "g", 1.0)
    assert world.alone and world.group_size == 2  # the fake group's process stands for both
