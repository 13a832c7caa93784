"""benchmarks/profiling_cost.py on a tiny model: every measurement the device took is
counted once, per graph, and its GPU-seconds are the protocol's for its run time and clock
switch, as kareus's own GpuTime charged them; whole graphs are measured a clock at a time."""

from __future__ import annotations

import json

import profiling_cost as pc  # benchmarks/ is on the path (conftest)
import pytest

from kareus.models.llama import LlamaConfig
from kareus.offline.workload import Workload
from kareus.profiler.measure import Protocol

MODEL = LlamaConfig(dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128, n_layers=3, max_seq_len=64)
TINY = Workload(MODEL, "tiny", tp=2, microbatch_size=2, seq=16)


def test_the_counted_measurements_add_up_to_what_kareus_charged(tmp_path):
    result = pc.count(TINY, search_budget=3, cache_dir=tmp_path)
    json.loads(json.dumps(result))
    graphs, totals = result["graphs"], result["totals"]

    def seconds(run_s, switched=True):
        return Protocol().seconds_per_batch([run_s], switched=switched)

    assert sorted(g["role"] for g in graphs) == sorted(
        f"{piece}/{kind}" for piece in ("embed", "block", "tail")
        for kind in ("forward", "backward"))
    for g in graphs:
        for p in g["partitions"]:
            assert len(p["run_s"]) == p["measured"] <= p["evaluations"] <= 3
        # the searches of a graph measure in rounds, one clock each (a batch), the clock
        # switched between rounds only; each search is charged its share of a round
        rounds: dict[int, tuple[int, list[float]]] = {}
        for batch, clock, run_s, _search in g["partition_batches"]:
            rounds.setdefault(batch, (clock, []))[1].append(run_s)
        clocks = [clock for clock, _ in rounds.values()]
        partition_s = sum(
            Protocol().seconds_per_batch(runs, switched=i == 0 or clock != clocks[i - 1])
            for i, (clock, runs) in enumerate(rounds.values()))
        assert len(rounds) == g["partition_rounds"]
        assert partition_s == pytest.approx(g["partition_gpu_s"])
        assert partition_s == pytest.approx(sum(p["kareus_gpu_s"] for p in g["partitions"]))
        assert len(g["partition_batches"]) == sum(p["measured"] for p in g["partitions"])
        whole = g["whole_graph"]
        if "error" not in whole:
            assert len(whole["run_s"]) == whole["measured"] > 0
            assert whole["variants"]["unrewritten"] == 1
        clocks = whole["clock_mhz"]
        switched = [i == 0 or f != clocks[i - 1] for i, f in enumerate(clocks)]
        assert g["whole_graph_clock_switches"] == sum(switched) <= len(clocks)
        alone = sum(map(seconds, whole["run_s"], switched))
        checked = sum(map(Protocol.seconds_per_check, whole["check_run_s"]))
        assert len(whole["check_run_s"]) <= 1  # the chosen point, once
        batched = len(set(whole["batch"])) < len(whole["batch"])
        assert g["gpu_s"] - partition_s - checked == (pytest.approx(alone) if not batched else
                                            pytest.approx(g["whole_graph_gpu_s"] - checked))
        assert not batched or g["whole_graph_gpu_s"] - checked < alone  # shared readings
        assert g["gpu_s"] == pytest.approx(result["kareus_gpu_s"].get(g["label"], 0.0))
        # replicas share the partition searches and each round's clocks, a slice each:
        # the node waits for the longest, never longer than one replica measuring all
        assert 0 < g["replicas_gpu_s"] <= g["gpu_s"] + 1e-9
        assert len(whole.get("round", [])) == len(whole["run_s"])
    assert totals["partition_evaluations"] > 0 and totals["whole_graph_measurements"] > 0
    assert totals["measurements"] == (totals["partition_evaluations"]
                                      + totals["whole_graph_measurements"] + totals["checks"])
    assert totals["checks"] > 0
    assert totals["gpu_s_per_rank"] == pytest.approx(sum(result["kareus_gpu_s"].values()))
    # a graph without collectives runs on each rank alone: the node's ranks split it
    alone = [g for g in graphs if not g["partitions"] and g["node_s"] < g["gpu_s"]]
    assert alone and all(g["node_s"] == pytest.approx(g["gpu_s"]) for g in graphs
                         if g not in alone and g["partitions"])
    assert totals["node_s"] == pytest.approx(sum(g["node_s"] for g in graphs))
    assert totals["gpu_minutes_per_node"] == pytest.approx(totals["node_s"] * 2 / 60)
    assert totals["gpu_minutes_per_node_with_replicas"] < totals["gpu_minutes_per_node"]
    assert totals["sampled_counter_gpu_s_per_rank"] > 10 * totals["gpu_s_per_rank"]
    whole = sum(g["whole_graph_measurements"] for g in graphs)
    assert sum(g["whole_graph_clock_switches"] for g in graphs) < whole  # a clock at a time
    assert totals["partition_rounds"] < totals["partition_evaluations"]  # and partitions
    # beside it, what it plans against profiling that costs nothing, in the same run
    quality = result["quality"]
    assert {q["role"] for q in quality["graphs"].values()} == {g["role"] for g in graphs
                                                               if "error" not in g["whole_graph"]}
    for q in quality["graphs"].values():
        assert 0 < q["planned_j"] <= q["baseline_j"] and 0 < q["reference_j"] <= q["baseline_j"]
        assert 0 < q["hypervolume_vs_reference"] <= 1.05
    assert quality["step"]["baseline_j"] == pytest.approx(sum(
        q["runs"] * q["baseline_j"] for q in quality["graphs"].values()))


def test_the_comparison_scores_a_frontier_against_the_reference():
    reference = ((1.0, 10.0), [(0.8, 9.0), (1.0, 6.0), (1.3, 4.0)])
    worse = ((1.0, 10.0), [(0.8, 9.0), (1.0, 7.0)])
    assert pc._volume_ratio(reference, reference) == pytest.approx(1.0)
    assert 0 < pc._volume_ratio(worse, reference) < 1
    assert pc._least_energy(reference) == (1.0, 6.0)  # no slower than the baseline
    assert pc._least_energy(((1.0, 10.0), [(1.2, 3.0)])) == (1.0, 10.0)


def test_the_last_line_is_the_figure_per_node(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(pc.Training, "of", lambda *a, **k: TINY)
    assert pc.main(["--search-budget", "2", "--cache-dir", str(tmp_path / "c"),
                    "--out", str(tmp_path / "r.json")]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    figure = json.loads((tmp_path / "r.json").read_text())["totals"]["gpu_minutes_per_node"]
    assert last == f"{figure:.1f} GPU-minutes per node"
