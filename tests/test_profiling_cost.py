"""benchmarks/profiling_cost.py on a tiny model: every measurement the device took is
counted once, per graph, and its GPU-seconds are the protocol's for its run time and clock
switch, as kareus's own GpuTime charged them; a team's graphs (the step's) are measured
together, their partition searches side by side, then their whole graphs, a clock at a
time."""

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
        # each search is charged its share of the rounds it took part in
        rounds = {batch for batch, _, _, _ in g["partition_batches"]}
        assert len(rounds) == g["partition_rounds"]
        assert g["partition_gpu_s"] == pytest.approx(sum(p["kareus_gpu_s"]
                                                         for p in g["partitions"]))
        assert len(g["partition_batches"]) == sum(p["measured"] for p in g["partitions"])
        whole = g["whole_graph"]
        if "error" not in whole:
            assert len(whole["run_s"]) == whole["measured"] > 0
            assert whole["variants"]["unrewritten"] == 1
        assert len(whole["check_run_s"]) <= 1  # the chosen point, once
        assert len(whole.get("round", [])) == len(whole["run_s"])
        assert g["gpu_s"] == pytest.approx(result["kareus_gpu_s"].get(g["label"], 0.0))
    # a team (the step's graphs sharing their collectives' groups) is measured together,
    # its partition searches side by side, then its whole graphs, a round a clock at a
    # time, each batch charged once and split among its graphs
    by_label = {g["label"]: g for g in graphs}
    assert sorted(label for t in result["teams"] for label in t["graphs"]) == sorted(by_label)
    for team in result["teams"]:
        members = [by_label[label] for label in team["graphs"]]
        assert all(g["team"] == team["groups"] for g in members)
        entries = sorted([(b, f, r, "partition") for g in members
                          for b, f, r, _ in g["partition_batches"]]
                         + [(b, f, r, "whole") for g in members for r, f, b in zip(
                             g["whole_graph"]["run_s"], g["whole_graph"]["clock_mhz"],
                             g["whole_graph"]["batch"], strict=True)])
        batches: dict[int, tuple[int, str, list[float]]] = {}
        for b, f, r, kind in entries:
            batches.setdefault(b, (f, kind, []))[2].append(r)
        clocks = [f for f, _, _ in batches.values()]
        switched = [i == 0 or f != clocks[i - 1] for i, f in enumerate(clocks)]
        batched = sum(Protocol().seconds_per_batch(runs, switched=s)
                      for (_, _, runs), s in zip(batches.values(), switched, strict=True))
        checked = sum(Protocol.seconds_per_check(r) for g in members
                      for r in g["whole_graph"]["check_run_s"])
        assert team["gpu_s"] == pytest.approx(batched + checked)
        assert team["gpu_s"] == pytest.approx(sum(g["gpu_s"] for g in members))
        assert team["clock_switches"] == sum(switched)
        kinds = [kind for _, kind, _ in batches.values()]
        assert (team["partition_batches"], team["whole_graph_batches"]) == (
            kinds.count("partition"), kinds.count("whole"))
        # the partitions first, then the whole graphs (they need the partitions' frontiers)
        assert kinds == sorted(kinds, key=lambda kind: kind == "whole")
        alone = sum(seconds(r) for _, _, r, _ in entries)  # each with its own readings
        assert batched <= alone
        if len(members) > 1:  # one batch holds several graphs' variants: shared readings
            owners = {b: {g["label"] for g in members if b in g["whole_graph"]["batch"]
                          or b in {e[0] for e in g["partition_batches"]}} for b in batches}
            assert max(map(len, owners.values())) > 1 and batched < alone
        searching = [g for g in members if g["partition_batches"]]
        if len(searching) > 1:  # their partition searches side by side: shared rounds
            assert len({b for g in searching for b, *_ in g["partition_batches"]}) < sum(
                g["partition_rounds"] for g in searching)
        # replicas claim slices of the searches and each round's clocks: never longer
        # than one measuring all
        assert 0 < team["replicas_node_s"] <= team["gpu_s"] + 1e-9
        # a team without collectives runs on each rank alone: the node's ranks split it
        assert (team["node_s"] < team["gpu_s"]) == (not team["groups"])
    assert totals["partition_evaluations"] > 0 and totals["whole_graph_measurements"] > 0
    assert totals["measurements"] == (totals["partition_evaluations"]
                                      + totals["whole_graph_measurements"] + totals["checks"])
    assert totals["checks"] > 0
    assert totals["gpu_s_per_rank"] == pytest.approx(sum(result["kareus_gpu_s"].values()))
    assert any(not t["groups"] for t in result["teams"])  # the embedding's backward
    assert totals["node_s"] == pytest.approx(sum(t["node_s"] for t in result["teams"]))
    assert totals["gpu_minutes_per_node"] == pytest.approx(totals["node_s"] * 2 / 60)
    assert totals["gpu_minutes_per_node_with_replicas"] < totals["gpu_minutes_per_node"]
    assert totals["sampled_counter_gpu_s_per_rank"] > 10 * totals["gpu_s_per_rank"]
    whole = sum(g["whole_graph_measurements"] for g in graphs)
    assert totals["whole_graph_batches"] < whole  # a clock at a time
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
