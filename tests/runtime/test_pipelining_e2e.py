"""A pipeline under torch.distributed.pipelining, each stage compiled with kareus, on gloo:
planned as one pipeline (a choice per instruction), exact against the same pipeline run
eagerly, and never stuck on a stage that is slow or never reports.

The simulated GPU here is the A100 preset with a clock switch of 1 us
(``QUICK_SWITCH``): the test's instructions take about 0.1 ms on it, where the preset's
15 ms switch would make any per-instruction clock cost more than it saves.
"""

import contextlib
import json
import re
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from gloo import leave, report, run_ranks

pytestmark = pytest.mark.slow

MICROBATCHES = 4
QUICK_SWITCH = {"base": "sim:a100-sxm4-40gb", "name": "a100-quick-switch",
                "clock_switch_s": 1e-6, "min_switch_interval_s": 0}


class Block(torch.nn.Module):
    def __init__(self, tp_group=None, extra_graph=False, dim=256):
        super().__init__()
        self.a, self.b = torch.nn.Linear(dim, 4 * dim), torch.nn.Linear(4 * dim, dim)
        self.tp_group, self.extra_graph = tp_group, extra_graph

    def forward(self, x):
        h = torch.relu(self.a(x))
        if self.extra_graph:
            torch._dynamo.graph_break()
        h = self.b(h)
        if self.tp_group is not None:
            h = funcol.all_reduce(h, "sum", self.tp_group)
        return x + h


def _loss(out, target):
    return ((out - target) ** 2).mean()


def _worker(rank, port, out_dir, world, tp, schedule, options, case):
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    import kareus
    from kareus.backend import backend_for
    from kareus.planner import pipeline_step

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        pp = world // tp
        mesh = dist.device_mesh.init_device_mesh("cpu", (pp, tp), mesh_dim_names=("pp", "tp"))
        stage_index = mesh.get_local_rank("pp")
        tp_group = mesh.get_group("tp") if tp > 1 else None
        extra = case.get("extra_graph_stage") == stage_index
        dim, tokens = case.get("dim", 256), case.get("tokens", 32)
        virtual = case.get("virtual", 1)  # stages per rank (interleaved 1F1B)
        local = [stage_index + v * pp for v in range(virtual)]
        eager, compiled = [], []
        for s in local:
            torch.manual_seed(s)
            eager.append(Block(tp_group, extra, dim))
            compiled.append(Block(tp_group, extra, dim))
            compiled[-1].load_state_dict(eager[-1].state_dict())
        if case.get("silent_stage") == stage_index:  # a stage that never reports
            pipeline_step.PipelinePlanning.__call__ = lambda self, shape: None
        if case.get("no_exchange"):  # the stored plan must serve
            def refuse(*args, **kwargs):
                raise AssertionError("exchanged frontiers though a plan was stored")
            pipeline_step.exchange = refuse
        if case.get("slow_stage") == stage_index:
            time.sleep(2.0)
        kind = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe,
                "interleaved_1f1b": ScheduleInterleaved1F1B}[schedule]
        if case.get("own_schedule"):
            kind = type("MySchedule", (kind,), {})  # a class kareus does not know
        group = mesh.get_group("pp")

        def pipeline(modules):
            stages = [PipelineStage(m, s, pp * virtual, torch.device("cpu"), group=group)
                      for m, s in zip(modules, local, strict=True)]
            return kind(stages if virtual > 1 else stages[0], n_microbatches=MICROBATCHES,
                        loss_fn=_loss)

        backend = (kareus.KareusBackend(options, device=_measuring_only(options["device"]))
                   if case.get("measured") else backend_for(options))
        runs = {"eager": pipeline(eager), "kareus": pipeline(
            [torch.compile(m, backend=backend) for m in compiled])}
        modules = {"eager": eager, "kareus": compiled}
        recorder = kareus.RecordingClockController()
        worst = 0.0
        for step in range(case.get("steps", 3)):
            x = torch.randn(MICROBATCHES * tokens, dim,
                            generator=torch.Generator().manual_seed(step))
            losses, grads = {}, {}
            for name, run in runs.items():
                for m in modules[name]:
                    m.zero_grad()
                losses[name] = []
                recorder.switches.clear()  # what the last step switched, only
                clocked = kareus.use_controller(recorder) if name == "kareus" else None
                with clocked or contextlib.nullcontext():
                    if stage_index == 0:
                        run.step(x)
                    else:
                        run.step(target=torch.zeros_like(x), losses=losses[name])
                grads[name] = [p.grad.clone() for m in modules[name] for p in m.parameters()]
            for a, b in zip(grads["eager"], grads["kareus"], strict=True):
                torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
            for a, b in zip(losses["eager"], losses["kareus"], strict=True):
                torch.testing.assert_close(b, a)
                worst = max(worst, float((a - b).abs().detach()))
        plan = kareus.current_plan()
        planner = backend.planner
        frontiers = planner.graph_frontiers()
        baseline = {}  # each of this rank's instructions at default clocks, unrewritten
        for i in plan.instructions if plan else ():
            if all(g.label in frontiers for g in i.graphs):
                baseline[i.stage, i.microbatch, i.kind] = sum(
                    g.calls * frontiers[g.label].baseline.time_s for g in i.graphs)
        # torch 2.11's stages also run once without gradients, on meta tensors, to infer
        # their shapes: inference graphs that no instruction runs.
        labels = [r.label for r in kareus.graph_reports() if r.kind != "inference"]
        planning = backend.pipeline
        orders = planning.shape.orders if planning else None
        notes = [n for r in kareus.graph_reports() for n in r.notes]
        split = {label: [list(p) for p in next(o.choice.partitions for o in f.nanobatched
                                               if o.choice.nanobatches == 2)]
                 for label, f in frontiers.items()
                 if label in labels and any(o.choice.nanobatches == 2 for o in f.nanobatched)}
        report(out_dir, rank, {
            "plan": plan.to_json() if plan else None, "stage": stage_index,
            "switches": [(s.graph, s.mhz) for s in recorder.switches],
            "baseline": baseline, "labels": labels, "worst_loss_gap": worst, "split": split,
            "notes": notes, "orders": orders,
        })
        dist.barrier()
    except Exception as exc:
        if not case.get("report_error"):
            raise
        # torch 2.11's stages exchange shapes first: a stage whose compile refuses a plan
        # leaves the next one with a closed connection, which spawn may report instead.
        report(out_dir, rank, {"error": f"{type(exc).__name__}: {exc}"})
    finally:
        dist.destroy_process_group()
    leave()


def _measuring_only(spec):
    """The simulated GPU of ``spec`` as a real GPU is to the planner: a graph is costed only
    by running it (at its first call), never by the model."""
    from kareus.devices.resolve import resolve_device

    device = resolve_device(spec)
    device.costs_graphs = False
    device.estimate_at = lambda *args, **kwargs: None
    return device


def _options(tmp_path, **more):
    gpu = tmp_path / "gpu.json"
    gpu.write_text(json.dumps(QUICK_SWITCH))
    return {"lowering": "eager", "device": str(gpu), "cache_dir": str(tmp_path / "cache"),
            "nanobatches": "auto", "search_budget": 4, "agreement_timeout_s": 30.0, **more}


def _run(tmp_path, schedule="1f1b", world=2, tp=1, case=None, **options):
    return run_ranks(_worker, world, tp, schedule, _options(tmp_path, **options), case or {},
                     nprocs=world)


def _order(schedule, stage, stages=2):
    from kareus.planner.pipeline import gpipe, one_f_one_b

    dag = {"1f1b": one_f_one_b, "gpipe": gpipe}[schedule](stages, MICROBATCHES)
    return [(dag.instructions[i].kind, dag.instructions[i].microbatch)
            for i in dag.orders[stage]]


def _slack(plan, durations):
    """Each instruction's slack in the plan's DAG at ``durations``: how much later it could
    start without delaying the iteration (0: on the critical path)."""
    from kareus.planner.pipeline import gpipe, one_f_one_b, schedule

    layout = plan["pipeline"]
    build = {"1f1b": one_f_one_b, "gpipe": gpipe}[layout["schedule"]]
    dag = build(layout["stages"], layout["microbatches"])
    keys = [(i.stage, i.microbatch, i.kind) for i in dag.instructions]
    d = [durations[k] for k in keys]
    start, makespan = schedule(dag, d)
    latest = [makespan - d[n] for n in range(len(d))]
    for a, b in sorted(dag.edges, key=lambda e: -start[e[1]]):
        latest[a] = min(latest[a], latest[b] - d[a])
    return {k: latest[n] - start[n] for n, k in enumerate(keys)}


def test_a_pp2_pipeline_plans_as_one_and_trains_exactly(tmp_path):
    """(GPipe: with PP2 x TP2 below.)"""
    results = _run(tmp_path, "1f1b", time_budget=1.0)
    _check_plan(results, "1f1b")
    for r in results:  # graph labels name their stage
        assert {label.split("/")[0] for label in r["labels"]} == {f"s{r['stage']}"}


def _check_plan(results, schedule):
    """One plan on every rank, within the budget; the instructions off the critical path at
    default clocks slower, those on it not; the last step switched per instruction in the
    schedule's order."""
    plans = {r["plan"] for r in results}
    assert len(plans) == 1 and None not in plans
    plan = json.loads(plans.pop())
    assert plan["pipeline"] == {"schedule": schedule, "stages": 2, "ranks": 2,
                                "microbatches": MICROBATCHES}
    assert len(plan["instructions"]) == 2 * 2 * MICROBATCHES
    assert plan["predicted"]["time_s"] <= plan["baseline"]["time_s"] * (1 + 1e-9)
    assert plan["predicted"]["energy_j"] < plan["baseline"]["energy_j"]
    durations = {tuple(k): v for r in results for k, v in r["baseline"].items()}
    slack = _slack(plan, durations)
    clocks = {(i["stage"], i["microbatch"], i["kind"]): i["clock_mhz"]
              for i in plan["instructions"]}
    critical = [clocks[k] for k, s in slack.items() if s <= 1e-12]
    relaxed = [clocks[k] for k, s in slack.items() if s > 1e-12]
    assert critical and all(c == 0 for c in critical)  # 0: the default (highest) clocks
    assert relaxed and all(c != 0 for c in relaxed)
    for r in results:
        stage = r["stage"]
        assert [(name.rsplit(" ", 1)[1], mhz) for name, mhz in r["switches"]] == [
            (f"{kind[0]}{m}", clocks[stage, m, kind]) for kind, m in _order(schedule, stage)]
    return plan


def test_a_stage_that_never_reports_leaves_every_rank_unplanned(tmp_path):
    results = _run(tmp_path, case={"silent_stage": 1, "steps": 2}, agreement_timeout_s=2.0)
    assert [r["plan"] for r in results] == [None, None]  # and the steps stayed exact


def test_a_slow_stage_and_one_compiling_an_extra_graph_still_plan_one_pipeline(tmp_path):
    results = _run(tmp_path, case={"slow_stage": 0, "extra_graph_stage": 1})
    assert results[0]["plan"] is not None and results[0]["plan"] == results[1]["plan"]
    plan = json.loads(results[0]["plan"])
    forward = next(i for i in plan["instructions"] if i["stage"] == 1 and i["kind"] == "forward")
    assert len(forward["graphs"]) == 2  # the graph break's two regions, one instruction
    assert len(set(results[1]["labels"])) == 4


def test_a_schedule_of_one_s_own_is_planned_as_one_where_the_options_name_it(tmp_path):
    # (Without pipeline_schedule it is refused: tests/runtime/test_pipelining.py.)
    named = _run(tmp_path, case={"steps": 2, "own_schedule": True}, pipeline_schedule="1f1b")
    assert named[0]["plan"] is not None and named[0]["plan"] == named[1]["plan"]
    assert json.loads(named[0]["plan"])["pipeline"]["schedule"] == "1f1b"


def test_a_second_run_reuses_the_stored_plan_and_one_for_another_pipeline_is_refused(tmp_path):
    first = _run(tmp_path, case={"steps": 2}, time_budget=1.0)
    second = _run(tmp_path, case={"steps": 2, "no_exchange": True}, time_budget=1.0)
    assert first[0]["plan"] is not None
    assert [r["plan"] for r in second] == [first[0]["plan"]] * 2
    plan = json.loads(first[0]["plan"])
    plan["pipeline"]["microbatches"] = 8  # a whole plan of 8: the instructions of 4 more
    plan["instructions"] += [{**i, "microbatch": i["microbatch"] + 4}
                             for i in plan["instructions"]]
    path = tmp_path / "other.json"
    path.write_text(json.dumps(plan))
    refused = _run(tmp_path, case={"steps": 1, "report_error": True}, plan=str(path),
                   nanobatches=1)
    assert re.search(r"the plan was made for another pipeline \(1f1b, 2 stages on 2 ranks, 8 "
                     r"microbatches\) than this one \(1f1b, 2 stages on 2 ranks, 4 "
                     r"microbatches\)", refused[0]["error"]), refused[0]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_pp2_by_tp2_plans_as_one_and_runs_a_plan_of_its_instructions_choices_exactly(
    tmp_path, schedule
):
    """4 ranks plan one pipeline; then a plan that splits every other instruction's graphs
    into 2 nanobatches, at its own clock, loads as the plan option and trains exactly."""
    results = _run(tmp_path, schedule, world=4, tp=2, time_budget=1.0)
    plan = _check_plan(results, schedule)
    if schedule == "gpipe":  # the given plan's run: once is enough (1F1B)
        return
    split = {**results[0]["split"], **results[2]["split"]}
    assert len(split) == 4  # every graph has its 2-nanobatch variant
    for i in plan["instructions"]:
        if i["microbatch"] % 2:
            for g in i["graphs"]:
                g["choice"] = {"nanobatches": 2, "clock_mhz": i["clock_mhz"],
                               "partitions": split[g["label"]]}
    path = tmp_path / "split.json"
    path.write_text(json.dumps(plan))
    again = _run(tmp_path, schedule, world=4, tp=2, plan=str(path), nanobatches=1)  # exact
    clocks = {(i["stage"], i["microbatch"], i["kind"]): i["clock_mhz"]
              for i in plan["instructions"]}
    for r in again:
        assert r["plan"] is not None and json.loads(r["plan"]) == plan
        ran = [n for n in r["notes"] if n.startswith("pipeline instructions run")]
        assert len(ran) == 4 and not any("falls back" in n for n in ran)  # 2 graphs x 2 k
        assert sum("run k=2," in n for n in ran) == 2
        stage = r["stage"]
        assert [(name.rsplit(" ", 1)[1], mhz) for name, mhz in r["switches"]] == [
            (f"{kind[0]}{m}", clocks[stage, m, kind]) for kind, m in _order(schedule, stage)]


def test_interleaved_1f1b_with_2_stages_per_rank_plans_every_stage_s_instructions(tmp_path):
    results = _run(tmp_path, "interleaved_1f1b", case={"virtual": 2}, time_budget=1.0)
    assert results[0]["plan"] is not None and results[0]["plan"] == results[1]["plan"]
    plan = json.loads(results[0]["plan"])
    assert plan["pipeline"] == {"schedule": "interleaved_1f1b", "stages": 4, "ranks": 2,
                                "microbatches": MICROBATCHES}
    assert {(i["stage"], i["kind"]) for i in plan["instructions"]} == {
        (s, k) for s in range(4) for k in ("forward", "backward")}
    assert plan["predicted"]["energy_j"] < plan["baseline"]["energy_j"]
    # each rank switched per instruction, in the order torch's schedule runs its stages'
    clocks = {(i["stage"], i["microbatch"], i["kind"]): i["clock_mhz"]
              for i in plan["instructions"]}
    for rank, r in enumerate(results):
        order = r["orders"][rank]
        assert len(order) == 2 * 2 * MICROBATCHES
        assert [tuple(name.split(" ")[-2:]) + (mhz,) for name, mhz in r["switches"]] == [
            (f"s{s}", f"{kind[0]}{m}", clocks[s, m, kind]) for s, m, kind in order]


def test_stages_on_a_device_that_must_run_graphs_are_measured_then_planned_as_one(tmp_path):
    """As on a real GPU: each stage's graphs are measured at their first call, then the
    pipeline is planned as one from those measurements."""
    results = _run(tmp_path, case={"measured": True}, time_budget=1.0)
    _check_plan(results, "1f1b")
    for r in results:
        assert any("whole graph measured on its first call's inputs" in n for n in r["notes"])
