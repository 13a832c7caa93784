"""benchmarks/nvml_counter_check.py: its NVML setter guard, and its no-GPU path end to end
on the fake counters (a continuous one it must find integrating, a sampled one it must not,
and multiplexed estimates on the continuous one close to the long references)."""

from __future__ import annotations

import json
import time

import nvml_counter_check as ncc  # benchmarks/ is on the path (conftest)
import pynvml
import pytest
from fake_cuda import FakeCudaGraphs
from fake_pynvml import FakeNvml, opened
from gpu_measure import NvmlSetterError
from rich.console import Console


@pytest.mark.parametrize(
    "name",
    ["nvmlDeviceSetGpuLockedClocks", "nvmlDeviceResetGpuLockedClocks",
     "nvmlDeviceSetPowerManagementLimit", "nvmlDeviceSetApplicationsClocks",
     "nvmlDeviceClearEccErrorCounts", "nvmlDeviceSetNotYetInvented"],
)
def test_the_guard_refuses_every_setter_before_the_driver_sees_it(name: str) -> None:
    fake, handle = opened(FakeNvml())
    guarded = ncc.GuardedNvml(fake)
    with pytest.raises(NvmlSetterError, match=name):
        getattr(guarded, name)(handle, 1200, 1200)
    assert guarded.refused == [name]
    assert fake.setter_calls() == [] and fake.gpus[0].locked is None
    # the real bindings too, without an nvmlInit: the guard raises before any library call
    with pytest.raises(NvmlSetterError):
        getattr(ncc.GuardedNvml(pynvml), name)(None, 1)


def test_the_guard_lets_readers_constants_and_errors_through() -> None:
    fake, handle = opened(FakeNvml())
    guarded = ncc.GuardedNvml(fake)
    assert guarded.nvmlDeviceGetTotalEnergyConsumption(handle) > 0
    assert guarded.nvmlDeviceGetPowerUsage(handle) == 300_000
    assert guarded.nvmlDeviceGetName(handle) == fake.gpus[0].name
    assert guarded.NVML_ERROR_NOT_SUPPORTED == fake.NVML_ERROR_NOT_SUPPORTED
    assert guarded.NVMLError is fake.NVMLError
    assert ncc.GuardedNvml(pynvml).nvmlDeviceGetName is pynvml.nvmlDeviceGetName
    assert not any(map(ncc.refuses, ("nvmlDeviceGetTotalEnergyConsumption", "nvmlInit",
                                     "nvmlDeviceGetFieldValues", "nvmlEventSetCreate")))
    with pytest.raises(AttributeError):
        guarded.nvmlDeviceGetName = None


def test_the_analysis_reads_intervals_and_references() -> None:
    assert ncc.intervals([0.0, 0.1, 0.2, 0.3])["median_ms"] == pytest.approx(100.0)
    assert ncc.intervals([0.0])["median_ms"] is None
    acquired = {"start_s": 0.0, "end_s": 2.0, "lead_s": 0.3, "runs": 1000, "stream_s": None,
                "ticks": [(0.05 + 0.1 * k, 1000.0 * 100 * 0.1 * k) for k in range(20)]}
    ref = ncc.reference_power(acquired, 0.1)
    assert ref["power_w"] == pytest.approx(100.0)
    assert ref["energy_j"] == pytest.approx(100.0 * 2.0 / 1000)
    assert ncc.pct(103.0, 100.0) == pytest.approx(3.0)


@pytest.mark.slow
def test_the_no_gpu_path_runs_end_to_end_on_fake_counters(tmp_path, capsys) -> None:
    out = tmp_path / "check.json"
    assert ncc.main([
        "--fake", "--poll-s", "0.5", "--waves-ms", "100", "200", "--window-updates", "4",
        "--warmup-s", "1", "--reference-s", "1", "--protocol-repeats", "1",
        "--protocol-window-s", "0.2", "--out", str(out),
    ]) == 0
    result = json.loads(out.read_text())
    assert result["fake"] is True and result["note"] == ncc.FAKE_NOTE
    assert ncc.FAKE_NOTE.upper() in capsys.readouterr().out
    assert result["setters_refused"] == []
    by_kind = {c["counter"]["kind"]: c for c in result["counters"]}
    assert by_kind["continuous"]["square_wave"]["integrates"] is True
    assert by_kind["sampled"]["square_wave"]["integrates"] is False
    for c in by_kind.values():
        assert c["update_period_ms"] == pytest.approx(100.0)
        assert c["intervals"]["idle"]["energy_counter"]["median_ms"] == pytest.approx(100.0)
    assert "warmup" in by_kind["continuous"]
    estimates = result["multiplexed"]["estimates"]
    assert set(estimates) == set(result["references"]) == set(ncc.FAKE_DUTY)
    # Energy per run: the fake pins each run's busy share, so it does not move with how
    # the OS schedules this process (a power does, through the runs' wall time).
    for name, est in estimates.items():
        assert abs(est["energy_error_pct"]) < 8.0, (name, est)
    assert all(p["energy_error_pct"] is not None
               for p in result["protocol"]["estimates"].values())
    assert result["replay"] == {"skipped": "no GPU: a CUDA graph needs one"}


def test_replay_times_show_the_launch_gaps_a_replay_removes() -> None:
    """Section 6 on the stand-in graph API: a variant whose host code is slower than its
    kernel is faster replayed; one whose capture fails says why and has no replay time."""
    cuda = FakeCudaGraphs()

    def launched(host_s: float, kernel_s: float):
        def run() -> None:
            time.sleep(host_s)  # the host's launch overhead: not in a replay
            cuda.launch(lambda: time.sleep(kernel_s))
        return run

    rows = ncc.replay_times({"host_bound": launched(0.004, 0.001)}, cuda, time.perf_counter,
                            timed=False, runs=5)
    row = rows["host_bound"]
    assert row["replayed"] and row["eager"] is None
    assert row["replay_ms"] < 0.5 * row["eager_ms"]
    failing = FakeCudaGraphs(fail="operation not permitted when stream is capturing")
    rows = ncc.replay_times({"sync": lambda: None}, failing, time.perf_counter, timed=False,
                            runs=2)
    assert rows["sync"]["eager"].startswith("its capture failed: RuntimeError: operation")
    assert "replay_ms" not in rows["sync"]
    table = ncc.replay_table({"variants": {**rows, "host_bound": row}, "nccl": "2.27.3",
                              "collectives": "torch has no NCCL"})
    console = Console(width=200, record=True)
    console.print(table)
    text = console.export_text()
    assert "NCCL 2.27.3" in text and "collectives not captured: torch has no NCCL" in text
    assert "its capture failed" in text
