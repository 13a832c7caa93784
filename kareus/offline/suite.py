"""``kareus bench``: kareus against the baseline and Perseus on the method's workloads.

The method's evaluation (its public artifact): Llama 3.2 3B and Qwen3 1.7B at PP2 x TP8,
8 microbatches under 1F1B, bf16, full activation recomputation, (microbatch, sequence) in
{(8, 4096), (8, 8192), (16, 4096)}, on A100-40GB; plus Llama 3.1 8B and 70B at TP8 on H100
and H200. Each workload is planned offline (``plan.plan_offline``) in the same run under
every method; the metrics follow the artifact's (``metrics``). Every figure is the
simulated GPU's, whose model is frozen for the benchmark (nothing here tunes it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kareus.offline import report
from kareus.offline.plan import OfflinePlan, plan_offline
from kareus.offline.workload import Workload
from kareus.planner.budget import Budget
from kareus.version import __version__


@dataclass(frozen=True)
class Case:
    """One workload of the suite, on one simulated GPU."""

    model: str
    device: str
    tp: int = 8
    pp: int = 2
    microbatches: int = 8
    microbatch_size: int = 8
    seq: int = 4096
    recompute: str = "full"

    @property
    def name(self) -> str:
        return (f"{self.model}_tp{self.tp}_pp{self.pp}_mb{self.microbatch_size}_"
                f"seq{self.seq}_{self.device.removeprefix('sim:')}")

    def workload(self) -> Workload:
        return Workload.of(self.model, tp=self.tp, pp=self.pp, microbatches=self.microbatches,
                           microbatch_size=self.microbatch_size, seq=self.seq,
                           recompute=self.recompute)


A100 = "sim:a100-sxm4-40gb"
MATRIX: tuple[Case, ...] = (
    *(Case(model, A100, microbatch_size=mb, seq=seq)
      for model in ("llama3.2-3b", "qwen3-1.7b") for mb, seq in ((8, 4096), (8, 8192), (16, 4096))),
    *(Case(model, device, pp=1, recompute="none")
      for model in ("llama3.1-8b", "llama3.1-70b") for device in ("sim:h100-sxm", "sim:h200")),
)
"""The artifact's six PP2 workloads; then 8B and 70B at TP8 without pipeline parallelism
(its settings say nothing of them: 8 microbatches of 8 x 4096 tokens, no recomputation)."""

MAX_SOLVE_S = 20.0
"""Per solve of a pipeline plan: past it the best plan found is kept with its proven gap
(in suite.json), so the whole matrix runs in bounded time on 2 cores."""

QUICK: tuple[Case, ...] = (
    Case("llama3.2-1b", A100, tp=2, pp=2, microbatches=2, microbatch_size=1, seq=256),
)
"""A small workload for the test suite: seconds, not minutes."""


def run_suite(
    cases: Sequence[Case], out_dir: Path, console: Console, *, cache_dir: str | None = None
) -> dict[str, Any]:
    """Plan every case, print its table and the summary, write a PNG per case and
    ``suite.json`` in ``out_dir``; returns what the JSON holds."""
    for path in [out_dir / "suite.json", *(out_dir / f"suite_{c.name}.png" for c in cases)]:
        report.writable(path)
    workloads = [c.workload() for c in cases]  # every case checked before any is run
    results, plans = [], []
    start = time.perf_counter()
    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/"
               "{task.total}"), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("kareus bench", total=len(cases))
        for case, workload in zip(cases, workloads, strict=True):
            progress.update(task, description=f"kareus bench: {case.name}")
            began = time.perf_counter()
            with contextlib.redirect_stdout(io.StringIO()):  # the profiler's own tables
                plan = plan_offline(workload, case.device, Budget("fastest"),
                                    cache_dir=cache_dir, max_solve_s=MAX_SOLVE_S)
            seconds = time.perf_counter() - began
            plans.append(plan)
            console.print(report.frontier_table(plan))
            report.write_png(out_dir / f"suite_{case.name}.png", report.figure(plan))
            results.append({"case": dataclasses.asdict(case), "name": case.name,
                            "seconds": seconds, **plan.to_json()})
            progress.advance(task)
    console.print(summary_table(cases, plans))
    data = {
        "kareus_version": __version__,
        "modelled": "every figure is the simulated GPU's (kareus/devices/sim), frozen for "
                    "the benchmark",
        "options": {"search": "grid", "budget": "fastest", "schedule": "1f1b",
                    "frontier_points": 10, "max_solve_s": MAX_SOLVE_S},
        "seconds": time.perf_counter() - start,
        "workloads": results,
    }
    report.write_json(out_dir / "suite.json", data)
    return data


def summary_table(cases: Sequence[Case], plans: Sequence[OfflinePlan]) -> Table:
    table = Table(title="kareus bench: kareus against Perseus and the baseline (modelled)",
                  title_justify="left")
    for column in ("workload", "energy at iso-time vs Perseus (max / mean)",
                   "time at iso-energy vs Perseus (max / mean)",
                   "fastest vs baseline: time / energy (kareus)",
                   "fastest vs baseline: time / energy (Perseus)"):
        if column == "workload":
            table.add_column(column, no_wrap=True)
        else:
            table.add_column(column, justify="right")
    for case, plan in zip(cases, plans, strict=True):
        rows = list(report.metrics_rows(plan).values())
        table.add_row(case.name, rows[0], rows[1], rows[-1], rows[2])
    return table
