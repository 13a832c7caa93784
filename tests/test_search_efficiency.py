"""Smoke test of benchmarks/search_efficiency.py on a tiny layer and grid, and the two
claims it rests on: a search's first n points are the points of a search with budget n,
and its replay of search()'s default stopping rule matches a real default run."""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

from kareus.devices.base import Measurement
from kareus.devices.sim.presets import MODEL_VERSION
from kareus.profiler.search import Config, Space, search

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import search_efficiency as se  # benchmarks/ is not a package

TINY = {"dim": 256, "heads": 8, "ffn_dim": 512, "batch": 2, "seq": 64}


def test_tiny_run_structure(tmp_path):
    result = se.run(layer=TINY, budgets=(4, 8), seeds=range(2),
                    clocks=(1410, 1200, 900), resources=(None, 15, 30))
    json.loads(json.dumps(result))  # JSON-able
    assert result["model_version"] == MODEL_VERSION
    assert result["budgets"] == [4, 8] and result["seeds"] == [0, 1]
    partitions = result["partitions"]
    assert partitions and len({p["key"] for p in partitions}) == len(partitions)
    measured = [p for p in partitions if p["error"] is None]
    assert measured
    for p in measured:
        size = p["space"]["size"]
        assert size == p["space"]["slots"] * 3 * 3
        for metric, fraction in p["truth"]["exhaustive_fraction"].items():
            assert fraction == 1.0, metric  # the exhaustive strategy scores 1
        for strategy in se.STRATEGIES:
            s = p["strategies"][strategy]
            assert s["evaluations"] == (min(8, size) if strategy == "kareus" else size)
            for metric in se.METRICS:
                m = s["metrics"][metric]
                for b in ("4", "8"):
                    values = [m["fractions"][b]["median"], *m["fractions"][b]["seeds"]]
                    assert all(0.0 <= v <= 1.0 + 1e-12 for v in values)
                curve = m["median_curve"]
                assert all(a <= b + 1e-12 for a, b in itertools.pairwise(curve))  # monotone
                for n in m["evals_to"].values():
                    assert n is None or 1 <= n <= s["evaluations"]
                if strategy != "kareus":  # run to the whole grid: every threshold reached
                    assert all(n is not None for n in m["evals_to"].values())
        assert all(1 <= d["evaluations"] <= 8 for d in p["kareus_defaults"])
    for strategy in se.STRATEGIES:
        assert set(result["summary"][strategy]) == set(se.METRICS)
    prof = result["profiling"]
    assert prof["artifact"]["seconds_per_evaluation"] == se.ARTIFACT_SECONDS_PER_EVALUATION
    # 0.1 s settle (a tick comes during it) + run + 0.4 s of blocks (the counter's lag
    # probed: the power, the gap's and two readings beyond them) + 0.15 s of waiting for
    # the counter's report
    assert 0.6 < prof["kareus"]["seconds_per_evaluation"] < 0.7
    assert all(p["distinct_partitions"] == len(partitions) for p in prof.values())
    se.plot(result, tmp_path / "curve.png")
    assert (tmp_path / "curve.png").stat().st_size > 0


def _synthetic(config: Config) -> Measurement:
    """A partition-like response: later slots and starved collectives are slower, a
    lower clock is slower and takes less dynamic power."""
    f = config.clock_mhz / 1410
    t = (1.0 + 0.1 * config.slot + (0.6 if config.sms == 3 else 0.0)) * (0.4 + 0.6 / f) * 1e-3
    return Measurement(t, t * (85.0 + 250.0 * f**2.5), 85.0, config.clock_mhz, "synthetic")


SPACE = Space((0, 1, 2), (None, 3, 6, 9), (1410, 1290, 1170, 1050, 930, 900))


def test_search_prefix_is_a_shorter_budget():
    with se._limited_threads():
        long = search(SPACE, _synthetic, budget=14, seed=3, patience=100).points
        short = search(SPACE, _synthetic, budget=9, seed=3, patience=100).points
    assert [p.config for p in short] == [p.config for p in long[:9]]


def _nearly_flat(config: Config) -> Measurement:
    """Only the clock matters (the slot and SMs by less than the search's tolerance): the
    frontier is six points, so a default search stops early for want of progress."""
    m = _synthetic(Config(0, None, config.clock_mhz))
    wiggle = 1.0 + 1e-5 * (config.slot + (config.sms or 0))
    return Measurement(m.time_s * wiggle, m.energy_j, 85.0, config.clock_mhz, "synthetic")


def test_default_stopping_replay_matches_search():
    # Budgets under which one run stops at its budget and the other converges first.
    for response, budget, stopped in ((_synthetic, 16, "budget"), (_nearly_flat, 20, "converged")):
        with se._limited_threads():
            long = search(SPACE, response, budget=budget, seed=1, patience=100)
            default = search(SPACE, response, budget=budget, seed=1)  # the default patience
        n = se.default_run_length(long.hypervolumes, long.rounds, budget=budget)
        assert n == len(default.points)
        assert default.stopped == stopped
        assert [p.config for p in default.points] == [p.config for p in long.points[:n]]
