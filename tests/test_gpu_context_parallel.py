"""The GPU probe of torch's SDPA context parallelism (benchmarks/gpu_context_parallel.py) on
the CPU: it runs every case and records the CPU's failure, the same with and without kareus
(on an H200 its record is benchmarks/results/gpu_context_parallel.json)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
NO_STRATEGY = "does not have a sharding strategy registered"


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's record")
def test_the_probe_records_every_run_and_kareus_graphs(tmp_path):
    out = tmp_path / "cp.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_context_parallel.py"), "--cpu",
         "--out", str(out)],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads(out.read_text())
    assert record["device"] == "cpu" and record["refused_setter_calls"] == []
    assert [c["dtype"] for c in record["cases"]] == ["bfloat16", "float32"]
    runs = {(c["dtype"], name): run for c in record["cases"] for name, run in c["runs"].items()}
    assert {name for _, name in runs} == {"eager", "aot_eager", "kareus-eager",
                                          "kareus-inductor"}
    for (dtype, name), run in runs.items():
        assert not run["ran"] and NO_STRATEGY in run["error"], (dtype, name)
        if name.startswith("kareus"):  # the graphs before the attention's break
            assert run["graphs"] and all(g["total"] == 0 and g["nanobatches"] == 1
                                         for g in run["graphs"]), run["graphs"]
