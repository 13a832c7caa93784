"""``kareus plan`` from its command-line arguments: check every input and output first,
then trace, plan, print and write."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kareus.devices.resolve import check_device
from kareus.offline.workload import Workload
from kareus.planner.budget import Budget
from kareus.version import __version__

PAPER_WORKLOAD = "llama3.2-3b --tp 8 --microbatches 8 --microbatch-size 8 --seq 4096"
"""What the demo plans at its end: the method's Llama 3.2 3B at TP8, one stage, on the
simulated A100 (the parser's default device)."""


def workload_of(args: argparse.Namespace) -> Workload:
    return Workload.of(args.model, tp=args.tp, pp=args.pp, microbatches=args.microbatches,
                       microbatch_size=args.microbatch_size, seq=args.seq, sp=args.sp,
                       recompute=args.recompute)


def plan_command(args: argparse.Namespace, budget: dict[str, Any], console: Console) -> None:
    from kareus.offline import report
    from kareus.offline.plan import plan_offline, step_plan

    workload = workload_of(args)
    check_device(args.device)
    chosen_budget = Budget.parse(**budget)
    result = Path(args.json)
    png = Path(args.png) if args.png else result.with_suffix(".png")
    plan_json = Path(args.plan_json) if args.plan_json else result.with_suffix(".plan.json")
    for path in (result, png, plan_json):
        report.writable(path)
    start = time.perf_counter()
    plan = plan_offline(workload, args.device, chosen_budget, schedule=args.schedule,
                        cache_dir=args.cache_dir, search=args.search,
                        search_budget=args.search_budget)
    elapsed = time.perf_counter() - start
    console.print(report.frontier_table(plan))
    metrics = Table(title="metrics (modelled)", title_justify="left", show_header=False)
    for name, value in report.metrics_rows(plan).items():
        metrics.add_row(name, value)
    console.print(metrics)
    step, what = step_plan(plan, __version__)
    if step is not None:
        step.save(plan_json)
        console.print(f"plan for the plan option: {plan_json} ({what})", markup=False)
    else:
        console.print(what, markup=False)
    report.write_png(png, report.figure(plan))
    report.write_json(result, {**plan.to_json(), "seconds": elapsed,
                               "kareus_version": __version__})
    console.print(f"wrote {result} and {png}; planned in {elapsed:.1f} s", markup=False)
