"""The GPU check script's CPU side: its graphs cost on the model; without a GPU it says so."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check


def test_predictions_cover_every_case_with_the_expected_regimes():
    predicted = gpu_check.predict("sim:h200")
    assert set(predicted) == {c.name for c in gpu_check.CASES}
    gemm, copy, relu = (predicted[c.name] for c in gpu_check.CASES)
    tflops = gpu_check.CASES[0].flops / gemm.time_s / 1e12
    assert 700 < tflops < 900  # CALIBRATION.md: 790 TFLOP/s measured on H200
    assert copy.time_s > 100 * relu.time_s
    assert gemm.average_power_w > copy.average_power_w > relu.average_power_w


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="checks the message shown without a GPU"
)
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
