"""The GPU check script's CPU side: every case costs on the model with sane regime relations;
without a GPU it says so.

The simulated numbers are recalibrated from time to time, so these tests assert only
relations any sane model satisfies (orderings, orders of magnitude), not values.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import fidelity
import gpu_check
import gpu_measure

PRESET = "sim:h200"
CASES = {c.name: c for c in gpu_check.CASES}


@pytest.fixture(scope="module")
def predicted():
    return gpu_check.predict(PRESET)


@pytest.fixture(scope="module")
def spec():
    return gpu_check.SimulatedGPU(PRESET).spec


def tflops(predicted, name):
    return CASES[name].flops / predicted[name].time_s / 1e12


def gb_per_s(predicted, name):
    return CASES[name].bytes / predicted[name].time_s / 1e9


def test_every_case_is_predicted_within_the_gpus_power_envelope(predicted, spec):
    assert len(CASES) == len(gpu_check.CASES)  # names are unique
    assert set(predicted) == set(CASES)
    for name, m in predicted.items():
        assert m.time_s > 0 and m.energy_j > 0, name
        assert spec.static_power_w <= m.average_power_w <= spec.tdp_w * 1.001, name
    assert {c.kind for c in gpu_check.CASES} >= {
        "gemm", "gemm_small", "gemm_fp32", "attention",
        "memory_copy", "memory_write", "memory_read", "memory_triad", "tiny",
    }


def test_gemm_regimes(predicted, spec):
    big = tflops(predicted, "gemm_bf16_8192")
    assert 700 < big < 900  # CALIBRATION.md: 790 TFLOP/s measured on H200
    # Wave quantisation and launch latency can only lose against the large square GEMM.
    assert tflops(predicted, "gemm_fp16_3456x4096x8192") <= 1.01 * big
    assert tflops(predicted, "gemm_bf16_1024") < big
    assert predicted["gemm_bf16_1024"].time_s < 1e-4
    # Without TF32 (PyTorch's default) fp32 runs on the FP32 CUDA cores: H200's 67 against
    # 989 TFLOP/s peak (TF32 tensor cores would take only twice as long as bf16).
    fp32, bf16 = predicted["gemm_fp32_8192_no_tf32"], predicted["gemm_bf16_8192"]
    assert fp32.time_s >= 8 * bf16.time_s


def test_attention_regimes(predicted):
    fwd, both = predicted["sdpa_bf16_causal_fwd"], predicted["sdpa_bf16_causal_fwd_bwd"]
    assert both.time_s > 2 * fwd.time_s  # the backward does 2.5x the forward's matmuls
    big = tflops(predicted, "gemm_bf16_8192")
    for name in ("sdpa_bf16_causal_fwd", "sdpa_bf16_causal_fwd_bwd"):
        assert 50 < tflops(predicted, name) <= big, name  # compute-bound, never above a GEMM
        assert predicted[name].average_power_w > predicted["copy_bf16_1gib"].average_power_w


def test_memory_bound_cases_scale_with_their_bytes(predicted, spec):
    memory = ("copy_bf16_1gib", "zero_fp16_2gib", "sum_bf16_2gib", "triad_fp32_3x1gib")
    rates = {name: gb_per_s(predicted, name) for name in memory}
    for name, rate in rates.items():
        assert 0.2 * spec.hbm_bytes_per_s <= rate * 1e9 <= spec.hbm_bytes_per_s, (name, rate)
    assert max(rates.values()) <= 3 * min(rates.values()), rates
    assert predicted["triad_fp32_3x1gib"].time_s > predicted["copy_bf16_1gib"].time_s
    assert predicted["copy_bf16_1gib"].time_s > 100 * predicted["relu_fp32_4k"].time_s


def test_power_orders_gemm_over_copy_over_a_tiny_kernel(predicted):
    gemm, copy, relu = (
        predicted[n].average_power_w for n in ("gemm_bf16_8192", "copy_bf16_1gib", "relu_fp32_4k")
    )
    assert gemm > copy > relu


def test_the_tf32_setting_is_applied_and_restored():
    flags = torch.backends.cuda.matmul
    before = flags.allow_tf32
    try:
        flags.allow_tf32 = True
        with gpu_check.applied({"cuda.matmul.allow_tf32": False}):
            assert flags.allow_tf32 is False
        assert flags.allow_tf32 is True
        gpu_check.traced(CASES["gemm_fp32_8192_no_tf32"])
        assert flags.allow_tf32 is True
    finally:
        flags.allow_tf32 = before


def test_the_joint_attention_graph_holds_forward_and_backward():
    gm = gpu_check.traced(CASES["sdpa_bf16_causal_fwd_bwd"])
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert any("flash_attention" in t and "backward" not in t for t in targets), targets
    assert any("flash_attention" in t and "backward" in t for t in targets), targets


def test_the_record_keeps_its_fields_and_adds_the_rates(predicted):
    rows = gpu_check.compare(predicted, predicted)
    assert [r["case"] for r in rows] == list(CASES)
    for row in rows:
        for key in (
            "measured_time_s", "predicted_time_s", "time_ratio", "measured_energy_j",
            "predicted_energy_j", "energy_ratio", "measured_power_w", "predicted_power_w",
            "measurement_details", "kind", "shapes", "dtype", "useful_flops", "useful_bytes",
        ):
            assert key in row, (row["case"], key)
        assert row["time_ratio"] == pytest.approx(1.0)
        assert "measured_tflops" in row or "measured_gb_per_s" in row
    settings = {r["case"]: r["settings"] for r in rows}
    assert settings["gemm_fp32_8192_no_tf32"] == {"torch.backends.cuda.matmul.allow_tf32": False}
    assert settings["gemm_bf16_8192"] == {}
    assert gpu_measure.model_version(PRESET) == getattr(
        gpu_check.SimulatedGPU(PRESET).spec, "model_version", None
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_without_a_gpu_it_exits_with_a_clear_message(tmp_path):
    out = subprocess.run(
        [
            sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"),
            "--out", str(tmp_path / "x.json"),
        ],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert out.returncode == 2
    assert "needs a CUDA GPU" in out.stderr
    assert not (tmp_path / "x.json").exists()


def test_the_fidelity_report_judges_each_kernel_by_its_tolerances(predicted, tmp_path):
    rows = gpu_check.compare(predicted, predicted)
    rows[0] |= {"measured_time_s": rows[0]["predicted_time_s"] / 1.2}  # the model 20% slow
    rows[1] |= {"measured_power_w": rows[1]["predicted_power_w"] * 1.1}  # 9% low: within 15%
    path = tmp_path / "gpu_check.json"
    path.write_text(json.dumps({**gpu_measure.header(PRESET), "gpu": "G", "cases": rows}))
    kernels = fidelity.h200_kernels(path)
    verdicts = [(r["time_verdict"], r["power_verdict"]) for r in kernels["cases"]]
    assert verdicts[0] == ("FAIL", "PASS") and verdicts[1] == ("PASS", "PASS")
    assert kernels["cases"][0]["time_error"] == pytest.approx(0.2)
    assert set(verdicts[2:]) == {("PASS", "PASS")}
    assert fidelity.h200_kernels(tmp_path / "absent.json") is None


@pytest.mark.regression
def test_the_committed_h200_record_reads():
    kernels = fidelity.h200_kernels(gpu_measure.H200_KERNELS)
    assert kernels["gpu"] == "NVIDIA H200" and [r["case"] for r in kernels["cases"]] == list(CASES)
