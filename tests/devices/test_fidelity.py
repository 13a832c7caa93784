"""The calibration records and their judging (tolerances, ranges, known misses), the
probes' process group, and the fidelity report's re-prediction of the GPU records with the
current model; the points themselves are checked in test_simulated.py."""

from __future__ import annotations

import dataclasses
import io
import json

import fidelity
import gpu_check
import gpu_plan_check
import pytest
import torch.distributed as dist
from calibration import POINTS, QUANTITIES, TOLERANCES, DataPoint
from conftest import init_fake_pg
from probes import _PREDICTORS, fake_world, predict
from rich.console import Console

from kareus.devices import preset_names
from kareus.devices.sim import presets

H200 = "sim:h200"


def point(quantity: str = "all_reduce_us", value: float = 100.0, **kw) -> DataPoint:
    return DataPoint(H200, quantity, value, "a source", kw.pop("role", "fidelity"), **kw)


def test_every_quantity_has_a_tolerance_class_and_a_prediction():
    assert {q.kind for q in QUANTITIES.values()} <= set(TOLERANCES)
    assert set(_PREDICTORS) == set(QUANTITIES)


def test_points_are_labelled_uniquely_and_cite_a_source():
    assert len({p.label for p in POINTS}) == len(POINTS)
    assert all(p.source and p.preset in preset_names() for p in POINTS)
    assert {p.role for p in POINTS} == {"input", "fidelity"}


@pytest.mark.parametrize(
    ("quantity", "low", "high"),
    [("all_reduce_us", 90.0, 110.0), ("gemm_power_w", 85.0, 115.0)],
    ids=["time-10%", "power-15%"],
)
def test_relative_tolerance_by_quantity_class(quantity, low, high):
    p = point(quantity)
    assert p.band == pytest.approx((low, high))
    assert p.passes(low * 1.0001) and p.passes(high * 0.9999)
    assert not p.passes(low * 0.999) and not p.passes(high * 1.001)
    assert p.error(105.0) == pytest.approx(0.05) and p.error(80.0) == pytest.approx(-0.2)


def test_ratios_are_judged_absolutely():
    p = point("memory_clock_saving", 0.32)
    assert p.band == pytest.approx((0.29, 0.35))
    assert p.error(0.25) == pytest.approx(-0.07)
    assert p.verdict(0.34) == "PASS" and p.verdict(0.36) == "FAIL"


def test_a_published_range_widens_by_the_tolerance_and_errs_from_its_nearer_end():
    p = point("idle_power_w", 85.0, published_low=75.0, published_high=100.0)
    assert p.band == pytest.approx((75 * 0.85, 100 * 1.15))
    assert p.error(90.0) == 0.0
    assert p.error(120.0) == pytest.approx(0.2)
    assert p.error(60.0) == pytest.approx(-0.2)


def test_a_known_miss_is_explained_not_hidden():
    p = point(known_miss="protocol switch not modelled")
    assert p.verdict(200.0) == "explained"
    assert p.verdict(100.0) == "PASS"  # the miss went away: reported as a pass


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"quantity": "speed"}, "unknown quantity"),
        ({"role": "guess"}, "role must be"),
        ({"published_low": 1.0}, "needs both"),
        ({"published_low": 1.0, "published_high": 2.0}, "outside the published range"),
    ],
    ids=["quantity", "role", "half-range", "value-outside"],
)
def test_malformed_points_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        point(**kw)


def test_best_of_sizes_is_the_best_single_size():
    sizes = (1024, 4096)
    best = predict(point("gemm_tflops", 1.0, params=(("square_sizes", sizes),)))
    each = [predict(point("gemm_tflops", 1.0, params=(("shape", (s, s, s)),))) for s in sizes]
    assert best == max(each)


def test_fake_world_makes_a_group_only_when_none_exists():
    assert not dist.is_initialized()
    with fake_world() as group:
        assert dist.get_world_size() == 8 and group == dist.group.WORLD.group_name
        with fake_world() as inner:  # reused, not replaced
            assert inner == group
        assert dist.is_initialized()
    assert not dist.is_initialized()
    init_fake_pg(2)
    try:
        with pytest.raises(ValueError, match="2 ranks"), fake_world():
            pass
        assert dist.get_world_size() == 2
    finally:
        dist.destroy_process_group()


# --- re-predicting the GPU records with the current model -------------------------------------

OLD_MODEL = "sim-gpu-0"  # a model version the records below claim their predictions came from
TINY = gpu_plan_check.Setup(*gpu_plan_check.TINY_SIZE, device="cpu")
MEASURED = {"measured_time_s": 1e-3, "measured_energy_j": 0.5, "measured_power_w": 500.0,
            "predicted_time_s": 9e-4, "predicted_energy_j": 0.45, "predicted_power_w": 500.0,
            "time_ratio": 0.9, "energy_ratio": 0.9, "error": None}


def slower_preset(monkeypatch, **scaled: float) -> None:
    """``sim:h200`` with each named constant multiplied, for every SimulatedGPU made after."""
    spec = presets.PRESETS[H200]
    changed = dataclasses.replace(spec, **{k: getattr(spec, k) * f for k, f in scaled.items()})
    monkeypatch.setitem(presets.PRESETS, H200, changed)


@pytest.fixture(scope="module")
def tiny_rows():
    """The rows the plan check records for its tiny model: each step graph at k = 1 and 2,
    and each distinct partition (``gpu_plan_check.partition_rows``)."""
    with fake_world(1):
        graphs = fidelity.plan_check_graphs(TINY.describe())
    rows = [{"name": f"{g.analysis.kind} k={k}", "workload": "graph", "graph": g.analysis.kind,
             "k": k, "partition": None, "key": None, "instances": None, "slot": None}
            for g in graphs for k in (1, 2)]
    return rows + [r for g in graphs for r in gpu_plan_check.partition_rows(g)]


def plan_record(tmp_path, rows, lowering=()) -> object:
    record = {"preset": H200, "model_version": OLD_MODEL, "torch": "2.11", "mode": "cuda",
              "gpu": "G", "ok": True, "skipped": [], "setup": TINY.describe(),
              "lowering": list(lowering), "workloads": [{**r, **MEASURED} for r in rows]}
    path = tmp_path / "h200_default.json"
    path.write_text(json.dumps(record))
    return path


def test_the_plan_check_record_is_repredicted_by_the_current_model(
    tiny_rows, tmp_path, monkeypatch
):
    rows = [dict(r) for r in tiny_rows]
    for r in rows:
        if r["graph"] == "backward" and r["partition"] == 1:
            r["key"] = "another-key"  # as a GPU graph's ops would make it
        if r["graph"] == "backward" and r["partition"] == 0:
            r["key"] = "another-key"
            r["slot"] += r["k"] == 1  # one launch slot more than the rebuilt partition
    rows.append({**rows[-1], "name": "backward partition 9 k=1", "partition": 9, "key": "x"})
    lowering = [{"graph": "forward", "k": 2, "expected_collectives": 999}]
    measured = fidelity.h200_measured(plan_record(tmp_path, rows, lowering))

    assert measured["model_version"] == OLD_MODEL
    assert measured["now"]["model_version"] == presets.MODEL_VERSION
    by_name = {r["name"]: r for r in measured["workloads"]}
    how = {name: r["rebuilt"] for name, r in by_name.items()}
    assert how["forward k=1"] == "rebuilt"
    assert how["forward k=2"] == "stand-in" and "999 measured" in by_name["forward k=2"][
        "rebuilt_note"]
    assert {how[f"forward partition {i} k={k}"] for i in (0, 1) for k in (1, 2)} == {"exact"}
    assert how["backward partition 1 k=1"] == how["backward partition 1 k=2"] == "rebuilt"
    assert how["backward partition 0 k=1"] == how["backward partition 0 k=2"] == "stand-in"
    assert "launch slots" in by_name["backward partition 0 k=2"]["rebuilt_note"]
    assert how["backward k=1"] == how["backward k=2"] == "stand-in"  # its partitions differ
    assert how["backward partition 9 k=1"] is None
    assert by_name["backward partition 9 k=1"]["now_time_s"] is None
    assert "backward partition 9 k=1" in measured["now"]["not_rebuilt"]
    again = [r for r in measured["workloads"] if r["rebuilt"] is not None]
    assert measured["now"]["repredicted"] == len(again) == len(rows) - 1
    for r in again:
        assert r["predicted_time_s"] == MEASURED["predicted_time_s"]  # stored, kept
        assert r["now_time_s"] > 0
        assert r["now_time_ratio"] == pytest.approx(r["now_time_s"] / 1e-3)
        assert r["now_time_verdict"] == ("PASS" if abs(r["now_time_ratio"] - 1) <= 0.1
                                         else "FAIL")

    slower_preset(monkeypatch, launch_overhead_s=100.0)
    slowed = {r["name"]: r for r in fidelity.h200_measured(plan_record(tmp_path, rows))[
        "workloads"]}
    assert slowed["forward k=1"]["now_time_s"] > by_name["forward k=1"]["now_time_s"]
    assert slowed["forward k=1"]["predicted_time_s"] == MEASURED["predicted_time_s"]


def test_a_plan_check_record_that_cannot_be_rebuilt_says_why(tmp_path):
    path = plan_record(tmp_path, [{"name": "forward k=1", "workload": "graph",
                                   "graph": "forward", "k": 1}])
    record = json.loads(path.read_text())
    record["setup"]["world_size"] = 2
    path.write_text(json.dumps(record))
    measured = fidelity.h200_measured(path)
    (row,) = measured["workloads"]
    assert row["rebuilt"] is None and row["now_time_s"] is None
    assert "world size 2" in row["rebuilt_note"]
    assert measured["now"]["repredicted"] == 0 and measured["now"]["time_ratio_geomean"] is None


def test_the_kernels_record_is_repredicted_by_the_current_model(tmp_path, monkeypatch):
    def row(name: str, **changes: object) -> dict[str, object]:
        case = next((c for c in gpu_check.CASES if c.name == name), gpu_check.CASES[-1])
        return {"case": name, **gpu_check.describe(case), **MEASURED, **changes}

    record = {"preset": H200, "model_version": OLD_MODEL, "gpu": "G", "cases": [
        row("copy_bf16_1gib"), row("gemm_bf16_1024", shapes=[[512, 512], [512, 512]]),
        row("a_case_since_removed")]}
    path = tmp_path / "gpu_check.json"
    path.write_text(json.dumps(record))
    kernels = fidelity.h200_kernels(path)
    assert kernels["model_version"] == OLD_MODEL
    assert kernels["now"]["model_version"] == presets.MODEL_VERSION
    copy, gemm, gone = kernels["cases"]
    assert copy["rebuilt"] == "rebuilt" and copy["now_time_s"] > 0
    assert gemm["rebuilt"] == "stand-in" and "shapes" in gemm["rebuilt_note"]
    assert gone["rebuilt"] is None and gone["now_time_s"] is None
    assert kernels["now"]["not_rebuilt"] == {"a_case_since_removed": gone["rebuilt_note"]}

    slower_preset(monkeypatch, hbm_efficiency=0.5)  # a memory-bound copy takes about twice
    slowed = fidelity.h200_kernels(path)["cases"][0]
    assert slowed["now_time_s"] > 1.5 * copy["now_time_s"]
    assert slowed["predicted_time_s"] == copy["predicted_time_s"] == MEASURED["predicted_time_s"]


def test_the_artifact_record_is_summarised_as_fidelity_points(tmp_path):
    record = json.loads(fidelity.ARTIFACT_RECORD.read_text())
    path = tmp_path / "artifact_check.json"
    path.write_text(json.dumps(record))
    points = fidelity.artifact_points(path)
    assert points["role"] == "fidelity" and "independent measurements" in points["what"]
    assert len(points["rows"]) == 2 * len(record["results"])
    assert sum(points["counts"].values()) == sum(record["counts"].values())
    first = points["rows"][0]
    assert {"time_fast", "clock_response", "energy_fast"} <= set(first)
    assert first["clock_response"]["kind"] == "ratio"
    stale = points["model_versions"] != [presets.MODEL_VERSION]
    assert points["stale"] is stale

    for result in record["results"]:
        result["model_version"] = OLD_MODEL
    path.write_text(json.dumps(record))
    points = fidelity.artifact_points(path)
    assert points["stale"] and points["model_versions"] == [OLD_MODEL]
    console = Console(file=io.StringIO(), width=200)
    fidelity.print_artifact(console, points)
    printed = console.file.getvalue()
    assert "Fidelity points" in printed and "independent measurements" in printed
    assert f"the model is now {presets.MODEL_VERSION}" in printed and "--rerun-artifact" in printed
    assert fidelity.artifact_points(tmp_path / "absent.json") is None
