"""``kareus plan`` from its command-line arguments: check every input and output first,
then trace, plan, print and write."""

from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from kareus.interrupts import raise_if_interrupted
from kareus.offline import memory, report
from kareus.offline.models import artifact_first_stage_layers, resolve_model
from kareus.offline.report import OutputError
from kareus.offline.workload import Workload, WorkloadError
from kareus.planner.budget import Budget, constrains_nothing
from kareus.version import __version__

if TYPE_CHECKING:
    from kareus.offline.plan import OfflinePlan

PAPER_WORKLOAD = "llama3.2-3b --tp 8 --microbatches 8 --microbatch-size 8 --seq-len 4096"
"""What the demo plans at its end: the method's Llama 3.2 3B at TP8, one stage, on the
simulated A100 (the parser's default device), in the Megatron layout."""

LAYOUT_WORDS = {
    "megatron": "Megatron-LM layout (fused QKV and gate-up projections, vocab-parallel loss)",
    "torchtitan": "torchtitan / Hugging Face layout (separate q, k, v, gate and up "
                  "projections, logits all-gathered)",
}
"""What each ``--layout`` traces, in words."""


def workload_of(args: argparse.Namespace) -> Workload:
    """The workload the arguments name. ``--first-stage-layers``: a count, "even", or not
    given: the artifact's split where it ran the preset at this pp (``models.
    artifact_first_stage_layers``), else even."""
    name, model = resolve_model(args.model)
    return Workload(model, name, tp=args.tp, pp=args.pp, microbatches=args.microbatches,
                    microbatch_size=args.microbatch_size, seq=args.seq_len,
                    sp=args.sequence_parallel,
                    recompute=args.recompute, layout=args.layout, regions=args.regions,
                    first_stage_layers=first_stage_layers(args.first_stage_layers, name,
                                                          args.pp))


def first_stage_layers(text: str | None, name: str, pp: int) -> int | None:
    """``--first-stage-layers`` as a ``Workload`` field: None for an even split."""
    if text is None:
        return artifact_first_stage_layers(name, pp)
    if text == "even":
        return None
    try:
        return int(text)
    except ValueError:
        raise WorkloadError(f"workload first_stage_layers must be an integer >= 1 or 'even', "
                            f"got {text!r}") from None


def traced_words(workload: Workload) -> str:
    """What was traced, beyond the shapes: the layout and each stage's layers."""
    shares = "/".join(str(len(r)) for r in workload.stage_layers)
    split = ("" if workload.pp == 1 else
             f"; stages of {shares} layers" + (" (first stage given)"
                                               if workload.first_stage_layers else ""))
    regions = "a region per pipeline stage" if workload.regions == "stage" else (
        "a region per block")
    return (f"traced: {workload.name} in the {LAYOUT_WORDS[workload.layout]}{split}; "
            f"compiled as {regions}")


def result_json(plan: OfflinePlan) -> dict[str, Any]:
    """``plan``'s result JSON, its workload saying the layout traced, the loss and each
    stage's layers (``Workload.describe``)."""
    data = plan.to_json()
    return {**data, "workload": {**data["workload"], **plan.workload.describe()}}


def output_paths(args: argparse.Namespace) -> tuple[Path, Path, Path]:
    """The result JSON, its plot and the plan JSON, the latter two beside the result unless
    given; an ``OutputError`` where two are one file."""
    result = Path(args.json)
    png = Path(args.png) if args.png else result.with_suffix(".png")
    plan_json = Path(args.plan_json) if args.plan_json else result.with_suffix(".plan.json")
    named = {"--json": result, "--png": png, "--plan-json": plan_json}
    for (a, x), (b, y) in itertools.combinations(named.items(), 2):
        if x.resolve() == y.resolve():
            raise OutputError(f"{a} and {b} name the same file {x}; give each its own")
    return result, png, plan_json


def solving(console: Console, workload: Workload) -> Progress:
    """A spinner with the seconds elapsed while the iteration's plans are solved (each
    method's frontier, a solve a point: a minute or more for a deep pipeline), gone once
    they are: never a silent wait. Ctrl-C stops it (``planner.pipeline.stoppable``)."""
    progress = Progress(SpinnerColumn(), TextColumn("{task.description}"),
                        TimeElapsedColumn(), console=console, transient=True,
                        disable=not console.is_terminal)
    progress.add_task(f"solving the plans of {workload.pp} stage(s) x {workload.microbatches} "
                      "microbatches for each method (Ctrl-C stops)", total=None)
    return progress


def plan_command(args: argparse.Namespace, budget: dict[str, Any], console: Console) -> None:
    from kareus.offline.plan import check_offline_device, plan_offline, step_plan
    from kareus.offline.trace import trace_stages

    workload = workload_of(args)
    check_offline_device(args.device)
    _, _, short = memory.warning(workload, args.device, args.schedule)
    if short is not None:
        console.print(short, markup=False, highlight=False, soft_wrap=True)
    chosen_budget = Budget.parse(**budget)
    result, png, plan_json = output_paths(args)
    for path in (result, png, plan_json):
        report.writable(path)
    start = time.perf_counter()
    stages = trace_stages(workload, args.device, cache_dir=args.cache_dir, search=args.search,
                          search_budget=args.search_budget)
    with solving(console, workload):
        plan = plan_offline(workload, args.device, chosen_budget, schedule=args.schedule,
                            stages=stages, max_solve_s=args.max_solve_s or None)
    raise_if_interrupted()
    elapsed = time.perf_counter() - start
    data = {**result_json(plan), "seconds": elapsed, "kareus_version": __version__}
    console.print(traced_words(workload), markup=False)
    idle = constrains_nothing(plan.frontiers["kareus"], plan.baseline, chosen_budget,
                              per="iteration")
    if idle:
        console.print(f"note: {idle}", markup=False, highlight=False, soft_wrap=True)
    console.print(report.frontier_table(data))
    console.print(report.metrics_table(report.metrics_rows(data["metrics"])))
    step, what = step_plan(plan, __version__)
    step.save(plan_json)
    report.write_png(png, report.figure(data))
    report.write_json(result, data)
    for line in (
        f"wrote the plan for the plan option: {plan_json} ({what})",
        (f"wrote the plan result (every method's frontier, the chosen point, the metrics; "
         f"{report.per_iteration(data)}): {result}"),
        f"wrote the frontier plot: {png}",
        f"kareus show reads either JSON; planned in {elapsed:.1f} s",
    ):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
