"""The plan check's CPU side: its CPU mode end to end, its measured path on the fake NVML
driver, the setter guard, and the fidelity report reading the record it writes."""

import contextlib
import io
import json
import sys
from pathlib import Path

import pynvml
import pytest
import torch
from fake_pynvml import FakeNvml
from rich.console import Console

from kareus.devices import Measurement, Workload
from kareus.devices.errors import ClockResetError
from kareus.devices.nvml.gpu import NvmlGPU
from kareus.passes.ops import DEFAULT_CLOCK_MHZ
from kareus.verify import tolerance

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import fidelity
import gpu_measure
import gpu_plan_check
from gpu_measure import NvmlSetterError, is_setter, setters_refused

TINY = gpu_plan_check.Setup(*gpu_plan_check.TINY_SIZE, device="cpu")


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """The script's CPU mode on the tiny model, as its command line runs it."""
    out = tmp_path_factory.mktemp("plan-check") / "record.json"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert gpu_plan_check.main(["--tiny", "--cpu", "--out", str(out)]) == 0
    return printed.getvalue(), json.loads(out.read_text())


@pytest.fixture(scope="module")
def fake_gpu_run(tmp_path_factory):
    """The check measuring on a dry-run NvmlGPU of the fake driver (CPU tensors, tiny
    windows), its record written where the fidelity report can read it."""
    fake = FakeNvml()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KAREUS_CLOCK_LOCK_DIR", str(tmp_path_factory.mktemp("clock-locks")))
        patch.setattr(torch.cuda, "synchronize", lambda: None)  # no stream to wait for
        record = gpu_plan_check.run_check(
            TINY, "sim:h200", 450.0,
            lambda: NvmlGPU(dry_run=True, nvml_module=fake, cuda=False, min_window_s=0.01),
            fake,
        )
    path = tmp_path_factory.mktemp("h200") / "h200_default.json"
    path.write_text(json.dumps(record))
    return fake, record, path


def skipped(record):
    return [s["what"] for s in record["skipped"]]


def test_the_cpu_mode_runs_end_to_end_and_says_what_it_skipped(cpu_run):
    stdout, record = cpu_run
    assert record["mode"] == "cpu" and record["ok"] is True
    assert {k: record["setup"][k] for k in ("world_size", "process_group", "dtype")} == {
        "world_size": 1, "process_group": "gloo", "dtype": "float32"}
    assert "Triton kernel check" in skipped(record)
    assert any(what.startswith("NVML time, energy and power") for what in skipped(record))
    assert "skipped Triton kernel check" in stdout and "all checks passed" in stdout

    lowering = {(r["graph"], r["k"]): r for r in record["lowering"]}
    assert set(lowering) == {(g, k) for g in ("forward", "backward") for k in (1, 2)}
    for r in lowering.values():
        assert r["ok"] and r["kernel_kind"] == "cpp" and r["kernels"] > 0, r
        assert r["triton_kernels"] == 0 and r["clock_switches"] == 1, r
        assert r["collectives"] == r["expected_collectives"] > 0, r
    for graph in ("forward", "backward"):  # the k = 2 rewrite issues each collective twice
        assert lowering[graph, 2]["collectives"] == 2 * lowering[graph, 1]["collectives"]
    assert [(r["graph"], r["ok"]) for r in record["numerics"]] == [
        ("forward", True), ("backward", True)]

    workloads = record["workloads"]
    graphs = [(r["graph"], r["k"]) for r in workloads if r["workload"] == "graph"]
    assert sorted(graphs) == sorted(lowering)
    partitions = [r for r in workloads if r["workload"] == "partition"]
    assert {r["graph"] for r in partitions} == {"forward", "backward"}
    assert [r["k"] for r in partitions] == [1, 2] * (len(partitions) // 2)
    assert len({(r["key"], r["k"]) for r in partitions}) == len(partitions)  # distinct keys
    for r in workloads:
        assert r["error"] is None and r["predicted_time_s"] > 0 and r["predicted_energy_j"] > 0
        assert r["measured_time_s"] is None and r["time_ratio"] is None
    assert record["dry_run_switches"] is None and record["refused_setter_calls"] == []


def test_on_the_cpu_it_needs_an_out_path_and_keeps_the_h200_record(capsys):
    before = gpu_measure.H200_RECORD.read_bytes() if gpu_measure.H200_RECORD.exists() else None
    assert gpu_plan_check.main(["--tiny", "--cpu"]) == 2
    assert "give --out PATH" in capsys.readouterr().err
    assert gpu_plan_check.main(["--tiny", "--cpu", "--out", str(gpu_measure.H200_RECORD)]) == 2
    assert "--replace-h200-record" in capsys.readouterr().err
    after = gpu_measure.H200_RECORD.read_bytes() if gpu_measure.H200_RECORD.exists() else None
    assert after == before


def test_the_measured_path_records_every_workload_at_default_clocks(fake_gpu_run):
    fake, record, _ = fake_gpu_run
    assert record["ok"] is True and record["gpu"] == fake.gpus[0].name
    assert record["nvml_device"].startswith("nvml-dry-run:")
    assert "Triton kernel check" in skipped(record)  # still CPU tensors
    assert not any(what.startswith("NVML") for what in skipped(record))
    for r in record["workloads"]:
        assert r["error"] is None, r
        assert r["measured_time_s"] > 0 and r["measured_power_w"] == pytest.approx(300, rel=0.05)
        assert r["time_ratio"] == pytest.approx(r["predicted_time_s"] / r["measured_time_s"])
        assert r["measurement_details"]["clock_locked"] == 0.0
    switches = record["dry_run_switches"]
    assert switches and {s["mhz"] for s in switches} == {DEFAULT_CLOCK_MHZ}
    assert record["refused_setter_calls"] == [] and fake.setter_calls() == []


def test_a_measurement_past_the_budget_is_skipped_and_said():
    check = gpu_plan_check.Check(TINY, "sim:h200", None, budget_s=-1.0)
    row = {"name": "forward k=1"}
    predicted = Measurement(1e-3, 0.2, 100.0, DEFAULT_CLOCK_MHZ, "model")
    ran = []
    check._measure(gpu_plan_check.Planned(row, Workload("w", run=lambda: ran.append(1)),
                                          predicted))
    assert ran == [] and check.workloads[0]["measured_time_s"] is None
    assert skipped(check.found()) == ["forward k=1: run and measurement"]


def test_outputs_are_judged_as_verify_judges_them_and_state_is_skipped():
    torch.manual_seed(0)
    grad = torch.randn(64, 64).bfloat16()
    state = torch.empty(2, dtype=torch.int64)  # flash's unused dropout state: any bits
    near = grad + 0.01 * grad.abs().max() * (2 * torch.rand(64, 64) - 1).bfloat16()
    row = gpu_plan_check.numerics_row("backward", (grad, state), (near, state + 1),
                                      torch.bfloat16, frozenset({1}))
    assert row["ok"] and row["mismatch"] is None, row
    assert row["compared"] == 1 and row["outputs"] == 2 and row["state_outputs"] == [1]
    assert 0 < row["worst_scaled_error"] <= tolerance(torch.bfloat16)
    seen = gpu_plan_check.numerics_row("backward", (grad, state), (near, state + 1),
                                       torch.bfloat16, frozenset())
    assert not seen["ok"] and seen["mismatch"].startswith("output 1:")
    far = grad + 0.1 * grad.abs().max()
    assert not gpu_plan_check.numerics_row("backward", (grad,), (far,), torch.bfloat16,
                                           frozenset())["ok"]
    assert not gpu_plan_check.numerics_row("backward", (grad,), (grad, grad), torch.bfloat16,
                                           frozenset())["ok"]
    nan = grad.clone()
    nan[0, 0] = float("nan")
    assert not gpu_plan_check.numerics_row("backward", (grad,), (nan,), torch.bfloat16,
                                           frozenset())["ok"]


def test_collectives_are_counted_in_statements_not_comments():
    code = """
# %all_reduce_8 = call_function[target=torch.ops._c10d_functional.all_reduce_.default]
    torch.ops._c10d_functional.all_reduce_.default(buf15, 'sum', '0')
    torch.ops._c10d_functional.wait_tensor.default(buf15)
    torch.ops.kareus.set_clock.default('g', 0)
    async_compile.triton('k', '')
"""
    low = gpu_plan_check.Lowered("backward", 1, None, 1, code, lambda args: None)
    row = gpu_plan_check.lowering_row(low, "cuda")
    assert row["collectives"] == 1 and row["ok"], row


def test_setters_are_the_functions_that_change_state():
    for name in ("nvmlDeviceSetGpuLockedClocks", "nvmlDeviceResetGpuLockedClocks",
                 "nvmlDeviceSetApplicationsClocks", "nvmlDeviceSetPowerManagementLimit",
                 "nvmlDeviceResetApplicationsClocks", "nvmlDevicePowerSmoothingSetState",
                 "nvmlDeviceClearEccErrorCounts", "nvmlSetVgpuVersion", "nvmlUnitSetLedState"):
        assert is_setter(name), name
    for name in ("nvmlDeviceGetPowerUsage", "nvmlDeviceGetTotalEnergyConsumption",
                 "nvmlInit", "nvmlShutdown", "nvmlEventSetCreate", "nvmlEventSetWait_v2",
                 "nvmlSystemGetTopologyGpuSet", "nvmlDeviceGetThermalSettings"):
        assert not is_setter(name), name
    setters = [n for n in dir(pynvml) if is_setter(n)]
    assert len(setters) > 40  # every Set*/Reset*/Clear* of the bindings


def test_the_guard_refuses_every_setter_and_restores_them():
    fake = FakeNvml()
    fake.nvmlInit()
    gpu = fake.nvmlDeviceGetHandleByIndex(0)
    original = pynvml.nvmlDeviceSetPowerManagementLimit
    with setters_refused(fake) as refused, setters_refused(pynvml) as refused_real:
        with pytest.raises(NvmlSetterError, match="nvmlDeviceSetGpuLockedClocks was called"):
            fake.nvmlDeviceSetGpuLockedClocks(gpu, 1410, 1410)
        with pytest.raises(NvmlSetterError):
            fake.nvmlDeviceResetGpuLockedClocks(gpu)
        assert fake.nvmlDeviceGetPowerUsage(gpu) == 300_000  # getters untouched
        with pytest.raises(NvmlSetterError):
            pynvml.nvmlDeviceSetPowerManagementLimit(None, 100_000)
        with pytest.raises(NvmlSetterError):
            pynvml.nvmlDeviceSetApplicationsClocks(None, 1593, 1980)
    assert refused == ["nvmlDeviceSetGpuLockedClocks", "nvmlDeviceResetGpuLockedClocks"]
    assert refused_real == ["nvmlDeviceSetPowerManagementLimit",
                            "nvmlDeviceSetApplicationsClocks"]
    assert fake.setter_calls() == []  # the driver never saw them
    assert pynvml.nvmlDeviceSetPowerManagementLimit is original
    fake.nvmlDeviceSetGpuLockedClocks(gpu, 1410, 1410)  # restored
    assert fake.gpus[0].locked == (1410, 1410)


def test_a_clock_change_under_the_guard_fails_where_the_dry_run_measures():
    fake = FakeNvml()
    workload = Workload("w", run=lambda: None)
    with setters_refused(fake) as refused:
        with NvmlGPU(dry_run=True, nvml_module=fake, cuda=False, min_window_s=0.01) as dry:
            assert dry.measure(workload, DEFAULT_CLOCK_MHZ).energy_j > 0
        assert refused == []
        real = NvmlGPU(nvml_module=fake, cuda=False, min_window_s=0.01, reset_at_exit=False)
        with real, pytest.raises(ClockResetError) as failed:
            real.measure(workload, DEFAULT_CLOCK_MHZ)  # a real controller resets first
    assert isinstance(failed.value.__cause__, NvmlSetterError)
    # The permission probe at open, then the reset the measurement asked for first.
    assert refused == ["nvmlDeviceResetGpuLockedClocks"] * 2 and fake.setter_calls() == []


def test_the_fidelity_report_reads_the_h200_record_when_present(fake_gpu_run, tmp_path):
    _, record, path = fake_gpu_run
    assert fidelity.main(["--preset", "sim:h200", "--out-dir", str(tmp_path),
                          "--h200", str(path)]) == 0
    measured = json.loads((tmp_path / "fidelity.json").read_text())["h200_default"]
    assert measured["path"] == str(path) and measured["checks_passed"] is True
    assert [r["name"] for r in measured["workloads"]] == [r["name"] for r in record["workloads"]]
    assert measured["time_ratio_geomean"] > 0 and measured["energy_ratio_geomean"] > 0


def test_the_fidelity_report_ignores_an_absent_record_and_says_a_cpu_one_measured_nothing(
    cpu_run, tmp_path
):
    assert fidelity.h200_measured(tmp_path / "absent.json") is None
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(cpu_run[1]))
    measured = fidelity.h200_measured(path)
    assert measured["workloads"] == [] and measured["time_ratio_geomean"] is None
    console = Console(file=io.StringIO(), width=200)
    fidelity.print_h200(console, measured)
    assert "no measurement (cpu mode; skipped: " in console.file.getvalue()


@pytest.mark.parametrize("regions, blocks", [("block", 1), ("stage", 2)])
@pytest.mark.parametrize("pieces", [1, 2])
def test_the_step_is_captured_per_block_or_per_stage_with_saved_values_in_pieces(
    regions, blocks, pieces
):
    """Per block, the graphs are one block's (its 2 all-reduces each way, no embedding);
    per stage, the whole model's. With 2 pieces the forward returns its saved values as
    the backend's partitioner hands them over, and the backward takes them."""
    from probes import fake_world

    from kareus.models.llama import Llama, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(n_layers=2)
    with fake_world(1) as group:
        model = gpu_plan_check.one_rank_tensor_parallel(Llama(cfg), group)
        tokens = torch.randint(0, cfg.vocab_size, (4, 16))
        forward, backward = gpu_plan_check.step_graphs(model, tokens, regions, pieces)
    for graph in (forward, backward):
        reduces = [n for n in graph.gm.graph.nodes
                   if n.target is torch.ops._c10d_functional.all_reduce.default]
        assert len(reduces) == 2 * blocks
    embeds = [n for n in forward.gm.graph.nodes if n.target is torch.ops.aten.embedding.default]
    assert len(embeds) == (regions == "stage")
    (returned,) = (n for n in forward.gm.graph.nodes if n.op == "output")
    names = [a.name for a in returned.args[0] if isinstance(a, torch.fx.Node)]
    taken = [n.name for n in backward.gm.graph.nodes if n.op == "placeholder"]
    for side in (names, taken):
        assert any(name.endswith("_piece1") for name in side) == (pieces == 2), side
