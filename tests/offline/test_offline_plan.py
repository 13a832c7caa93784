"""``kareus plan`` and ``kareus bench`` on small workloads: the four frontiers in order, the
plan JSON a matching compile accepts and other shapes refuse, and every bad input refused
with one line before anything is written."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import re

import pytest
from rich.console import Console

import kareus
from kareus.cli import main
from kareus.errors import KareusError
from kareus.models.llama import LlamaConfig
from kareus.offline import report
from kareus.offline.plan import plan_offline, step_plan
from kareus.offline.suite import MATRIX, QUICK, run_suite
from kareus.offline.trace import compile_microbatch, trace_stages
from kareus.offline.workload import Workload
from kareus.planner.budget import Budget, BudgetError
from kareus.planner.plan import Plan
from kareus.profiler.progress import make_console
from kareus.show import ShowError, show

MODEL = LlamaConfig(dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128, n_layers=2, max_seq_len=64)
DEVICE = "sim:a100-sxm4-40gb"
ONE_STAGE = Workload(MODEL, "tiny", tp=2, pp=1, microbatches=2, microbatch_size=2, seq=32)


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    return trace_stages(ONE_STAGE, DEVICE, cache_dir=tmp_path_factory.mktemp("store"))


def _never_above(upper, lower):
    """Every point of ``upper`` has a point of ``lower`` no slower and no costlier."""
    return all(any(q.time_s <= p.time_s * (1 + 1e-9) and q.energy_j <= p.energy_j * (1 + 1e-9)
                   for q in lower) for p in upper)


def test_the_quick_bench_orders_its_frontiers_and_writes_its_results(tmp_path):
    data = run_suite(QUICK, tmp_path, make_console(), cache_dir=str(tmp_path / "store"))
    (result,) = data["workloads"]
    assert (tmp_path / f"suite_{result['name']}.png").stat().st_size > 0
    assert json.loads((tmp_path / "suite.json").read_text()) == json.loads(json.dumps(data))
    f = {m: [type("C", (), p) for p in points] for m, points in result["frontiers"].items()}
    assert _never_above(f["perseus"], f["kareus"])  # kareus never above Perseus
    assert _never_above(f["baseline"], f["perseus"])  # Perseus never above the baseline
    assert _never_above(f["baseline"], f["kareus"])
    for points in result["frontiers"].values():
        times = [p["time_s"] for p in points]
        assert times == sorted(times)  # fastest first
    assert "modelled" in data and result["metrics"]["kareus_vs_perseus"]["points"]
    # whether the case fits its GPU, with the figures (it does)
    assert result["memory"]["fits"] and result["memory"]["capacity_bytes"] == 40e9
    assert 0 < result["memory"]["total_bytes"] == pytest.approx(
        result["memory"]["model_state_bytes"] + result["memory"]["activation_bytes"])
    # the quick case is traced as Megatron runs it, and its result says so
    assert {k: result["workload"][k] for k in ("layout", "loss", "stage_layers")} == {
        "layout": "megatron", "loss": "vocab-parallel", "stage_layers": [8, 8]}


def test_a_plan_json_loads_in_a_matching_compile_and_is_refused_by_other_shapes(
    stages, tmp_path
):
    plan = plan_offline(ONE_STAGE, DEVICE, Budget.parse(time_budget=1.0), stages=stages)
    step, what = step_plan(plan, kareus.__version__)
    assert step is not None, what
    path = step.save(tmp_path / "plan.json")
    backend = kareus.KareusBackend({"plan": str(path), "lowering": "eager", "device": DEVICE,
                                    "microbatches": 2})
    compile_microbatch(ONE_STAGE, backend)
    reports = backend.reports()
    assert len(reports) == 6
    assert all(any("choice from the plan" in n for n in r.notes) for r in reports)
    chosen = {g.graph_hash: g.choice for g in step.graphs}
    assert {r.key: r.choice for r in reports} == chosen
    other = dataclasses.replace(ONE_STAGE, seq=16)
    backend = kareus.KareusBackend({"plan": str(path), "lowering": "eager", "device": DEVICE,
                                    "microbatches": 2})
    with pytest.raises(Exception, match="made for another graph"):
        compile_microbatch(other, backend)


def test_a_pipeline_plan_json_holds_every_instruction_and_loads_where_its_graphs_run(tmp_path):
    """With pipeline parallelism the plan JSON is a choice per instruction; a compile of
    the same graphs takes each graph's choice from it, other shapes are refused, and a
    pipeline of another layout would be (``Plan.check_layout``)."""
    two = dataclasses.replace(ONE_STAGE, pp=2)
    plan = plan_offline(two, DEVICE, Budget.parse(time_budget=1.0),
                        cache_dir=tmp_path / "store")
    step, what = step_plan(plan, kareus.__version__)
    assert step is not None and "a choice per instruction of the 1f1b pipeline" in what
    assert len(step.instructions) == 2 * 2 * two.microbatches
    assert step.pipeline.stages == 2 and step.predicted.time_s == plan.chosen.time_s
    for i, c in zip(plan.dag.instructions, plan.chosen.choices, strict=True):
        entry = step.instruction(i.stage, i.microbatch, i.kind)
        assert entry.clock_mhz == c.clock_mhz
        assert tuple(g.choice for g in entry.graphs) == c.graphs
    last = max(step.instructions, key=lambda i: i.start_s + i.time_s)
    assert last.start_s + last.time_s == pytest.approx(plan.chosen.time_s)
    path = step.save(tmp_path / "plan.json")
    assert Plan.load(path) == step
    backend = kareus.KareusBackend({"plan": str(path), "lowering": "eager", "device": DEVICE})
    compile_microbatch(two, backend)
    assert all(any("choice from the plan" in n for n in r.notes) for r in backend.reports())
    with pytest.raises(Exception, match="made for another graph"):
        compile_microbatch(dataclasses.replace(two, seq=16), kareus.KareusBackend(
            {"plan": str(path), "lowering": "eager", "device": DEVICE}))
    with pytest.raises(KareusError, match="made for another pipeline"):
        step.check_layout(2, 2, 4, "1f1b", "plan.json")


def test_a_budget_outside_the_frontier_states_the_range(stages):
    with pytest.raises(BudgetError, match="baseline"):
        plan_offline(ONE_STAGE, DEVICE, Budget.parse(time_budget=0.1), stages=stages)


@pytest.mark.parametrize(("args", "message"), [
    (["llama9"], "unknown model 'llama9'.*llama3.2-1b"),
    (["llama3.2-1b", "--tp", "3"], "tp=3"),
    (["llama3.2-1b", "--pp", "17", "--microbatches", "17"], "pp=17 is more than"),
    (["llama3.2-1b", "--pp", "4", "--microbatches", "2"], "microbatches=2 is fewer than pp=4"),
    (["llama3.2-1b", "--device", "sim:tpu"], "sim:tpu"),
    (["llama3.2-1b", "--device", "nvml"], "simulated"),
    (["llama3.2-1b", "--json", "{tmp}/a-file/plan.json"], "cannot write there"),
    (["llama3.2-1b", "--json", "{tmp}"], "is a directory"),
    (["llama3.2-1b", "--pp", "2", "--first-stage-layers", "half"],
     "workload first_stage_layers must be an integer >= 1 or 'even', got 'half'"),
    (["llama3.2-1b", "--pp", "2", "--first-stage-layers", "16"],
     "workload first_stage_layers=16 leaves 0 of llama3.2-1b's 16 layers"),
    (["llama3.2-1b", "--first-stage-layers", "8"], "first_stage_layers=8 needs pp >= 2"),
])
def test_bad_input_is_refused_in_one_line_before_any_work(args, message, capsys, tmp_path):
    (tmp_path / "a-file").write_text("")
    args = [a.format(tmp=tmp_path) for a in args]
    assert main(["plan", *args, "--cache-dir", str(tmp_path)]) == 2
    out = capsys.readouterr().out
    assert out.startswith("kareus plan:") and out.count("\n") == 1
    assert re.search(message, out), out
    assert not list(tmp_path.glob("*.json"))


@pytest.mark.parametrize("argv, layout, shares", [
    (["llama3.2-3b", "--pp", "2"], "megatron", [15, 13]),
    (["qwen3-1.7b", "--pp", "2", "--layout", "torchtitan"], "torchtitan", [15, 13]),
    (["llama3.2-3b", "--pp", "2", "--first-stage-layers", "even"], "megatron", [14, 14]),
    (["llama3.2-3b", "--pp", "2", "--first-stage-layers", "12"], "megatron", [12, 16]),
    (["llama3.1-8b", "--pp", "2"], "megatron", [16, 16]),
    (["llama3.2-3b", "--pp", "4", "--microbatches", "8"], "megatron", [7, 7, 7, 7]),
])
def test_kareus_plan_traces_megatron_by_default_with_the_artifacts_split(argv, layout, shares):
    """The Megatron layout unless --layout torchtitan; the first stage's layers as given,
    "even", or by default the artifact's where it ran the preset at that pp (15 of 28 at
    PP2 for the 3B and the 1.7B), else even."""
    from kareus.cli import parser_for_plan
    from kareus.offline.cli import traced_words, workload_of

    workload = workload_of(parser_for_plan().parse_args(argv))
    assert (workload.layout, [len(r) for r in workload.stage_layers]) == (layout, shares)
    words = traced_words(workload)
    assert ("Megatron-LM layout" in words) == (layout == "megatron")
    assert ("torchtitan / Hugging Face layout" in words) == (layout == "torchtitan")
    assert f"stages of {'/'.join(map(str, shares))} layers" in words


def test_the_bench_traces_the_paper_workloads_as_megatron_runs_them():
    """The artifact's six PP2 cases, each compiled per block and per stage: the Megatron
    layout and its 15/13 split; the 8B and 70B cases the Megatron layout too."""
    paper = [c for c in MATRIX if c.pp == 2]
    assert len(paper) == 12
    assert {(c.model, c.microbatches, c.seq, c.regions) for c in paper} == {
        (c.model, c.microbatches, c.seq, regions) for c in paper
        for regions in ("block", "stage")}
    for case in MATRIX:
        workload = case.workload()
        assert workload.layout == "megatron" and workload.vocab_parallel_loss
    assert {tuple(len(r) for r in c.workload().stage_layers) for c in paper} == {(15, 13)}


def test_a_config_json_that_is_no_decoder_lm_is_refused(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    config = tmp_path / "config.json"
    transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=128).to_json_file(config)
    assert main(["plan", str(config)]) == 2
    assert str(config) in capsys.readouterr().out


def test_every_refusal_is_a_kareus_error():
    with pytest.raises(KareusError):
        Workload.of("llama3.2-1b", tp=3)


# -- kareus plan's outputs, as kareus show reads them --------------------------------------

SMALL = ["llama3.2-1b", "--tp", "2", "--microbatches", "1", "--microbatch-size", "1",
         "--seq-len", "32"]
"""The smallest workload planned through the command line (seconds)."""


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """``kareus plan`` of the small workload once: its directory and what it printed."""
    out = tmp_path_factory.mktemp("planned")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["plan", *SMALL, "--json", str(out / "result.json"),
                     "--cache-dir", str(out / "store")]) == 0
    return out, " ".join(printed.getvalue().split())


def test_kareus_plan_names_its_two_jsons_and_show_reads_both(planned, tmp_path):
    """--json is the result, --plan-json (beside it, .plan.json) the plan option's file;
    the output says which is which, and kareus show takes either."""
    out, printed = planned
    result, plan = out / "result.json", out / "result.plan.json"
    assert sorted(p.name for p in out.glob("*.json")) == ["result.json", "result.plan.json"]
    assert f"wrote the plan for the plan option: {plan} " in printed
    assert "wrote the plan result (every method's frontier" in printed
    assert printed.index(f": {result} ") > printed.index("wrote the plan result")
    assert Plan.load(plan).pipeline is None
    text = Console(record=True, width=200)
    png = show(result, tmp_path / "result.png", text)
    assert png.read_bytes().startswith(b"\x89PNG")
    shown = text.export_text()
    assert f"plan result {result} by kareus {kareus.__version__} (kareus plan --json" in shown
    assert "chosen (kareus)" in shown and "metrics (modelled)" in shown
    assert show(plan, tmp_path / "plan.png", Console(record=True)).exists()


def test_plan_and_show_say_whose_energy_they_print(planned, tmp_path):
    """The result's costs are per iteration of all tp x pp GPUs, the plan option's per GPU;
    each output says which."""
    out, printed = planned
    result = json.loads((out / "result.json").read_text())
    step = Plan.load(out / "result.plan.json")
    assert step.predicted.energy_j == pytest.approx(result["chosen"]["energy_j"] / 2)
    assert "time and energy per iteration of 2 GPUs" in printed  # the frontier table
    assert f"{result['chosen']['energy_j']:.4g} J per iteration of 2 GPUs" in printed
    assert f"the plan holds costs per GPU, {step.predicted.energy_j:.4g} J" in printed
    text = Console(record=True, width=200)
    show(out / "result.json", tmp_path / "result.png", text)
    assert "time and energy per iteration of 2 GPUs" in text.export_text()
    text = Console(record=True, width=200)
    show(out / "result.plan.json", tmp_path / "plan.png", text)
    shown = text.export_text()
    assert f"predicted step (per GPU): {step.predicted.time_s * 1e3:.4g} ms" in shown
    assert "eff. energy mJ per GPU" in shown and "W per GPU" in shown


NEITHER = ("neither a kareus plan nor a plan result of kareus plan --json (it has no schema "
           "field, nor workload, device, frontiers, chosen, metrics fields)")


@pytest.mark.parametrize("damage, message", [
    (lambda r: r.pop("chosen"), NEITHER),
    (lambda r: r["frontiers"].pop("baseline"),
     "a plan result whose frontiers is not lists of {time_s, energy_j}"),
    (lambda r: r["workload"].pop("gpus"), "a plan result whose workload is not an object of"),
    (lambda r: r["metrics"].pop("kareus_vs_perseus"),
     "a plan result whose metrics is not as kareus plan --json writes them"),
])
def test_a_result_show_cannot_read_is_one_short_line(planned, tmp_path, damage, message):
    out, _ = planned
    raw = json.loads((out / "result.json").read_text())
    damage(raw)
    path = tmp_path / "damaged.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ShowError) as info:
        show(path, console=Console(record=True))
    said = str(info.value)
    assert said.startswith(f"{path}: ") and message in said, said
    assert len(said) < 400 and "\n" not in said
    assert not (tmp_path / "damaged.png").exists()


def test_an_output_the_file_system_refuses_fails_before_planning(monkeypatch, capsys):
    """Run as root, os.access says yes to /proc and the planning took 20 s before writing
    failed; opening the file is asked instead, before anything is traced."""
    if not os.path.isdir("/proc/self"):
        pytest.skip("no /proc")
    monkeypatch.setattr(os, "access", lambda *args, **kwargs: True)

    def plan_offline(*args, **kwargs):
        raise AssertionError("planned before the outputs were checked")

    monkeypatch.setattr("kareus.offline.plan.plan_offline", plan_offline)
    assert main(["plan", *SMALL, "--json", "/proc/kareus-test.json"]) == 2
    out = capsys.readouterr().out
    assert out.startswith("kareus plan: /proc/kareus-test.json: cannot write there")
    assert out.count("\n") == 1


def test_the_writability_probe_leaves_nothing_behind(tmp_path):
    (tmp_path / "kept.json").write_text("kept")
    report.writable(tmp_path / "kept.json")
    report.writable(tmp_path / "new" / "deeper" / "result.json")
    assert [p.name for p in tmp_path.iterdir()] == ["kept.json"]
    assert (tmp_path / "kept.json").read_text() == "kept"


def test_two_outputs_of_one_name_are_refused(tmp_path, capsys):
    path = str(tmp_path / "plan.json")
    assert main(["plan", *SMALL, "--json", path, "--plan-json", path]) == 2
    assert "--json and --plan-json name the same file" in capsys.readouterr().out
