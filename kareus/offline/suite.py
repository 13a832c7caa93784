"""``kareus bench``: kareus against the baseline and Perseus on the method's workloads.

The method's evaluation (its public artifact): Llama 3.2 3B and Qwen3 1.7B at PP2 x TP8,
8 microbatches under 1F1B, bf16, full activation recomputation, (microbatch, sequence) in
{(8, 4096), (8, 8192), (16, 4096)}, on A100-40GB; plus Llama 3.1 8B and 70B at TP8 on H100
and H200. Each workload is planned offline (``plan.plan_offline``) in the same run under
every method; the metrics follow the artifact's (``metrics``). Every figure is the
simulated GPU's, whose model is frozen for the benchmark (nothing here tunes it).

Every case is traced as Megatron-LM runs it (the artifact ran Megatron-Core, and the
baseline is Megatron-LM): the Megatron layout (fused QKV and gate-up projections, a
vocab-parallel loss) and, at PP2, the artifact's stage split (15/13 for both 28-layer
models, ``models.ARTIFACT_FIRST_STAGE_LAYERS``). The 8B and 70B cases, which the artifact
did not run, take the Megatron layout too, so every baseline is the same framework's.
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

from kareus.offline import memory, report
from kareus.offline.cli import result_json
from kareus.offline.models import artifact_first_stage_layers
from kareus.offline.plan import OfflinePlan, plan_offline
from kareus.offline.workload import Workload
from kareus.planner.budget import Budget
from kareus.version import __version__


@dataclass(frozen=True)
class Case:
    """One workload of the suite, on one simulated GPU: traced in ``layout``, its first
    stage holding ``first_stage_layers`` (None: an even split), compiled per ``regions``
    ("block" or "stage")."""

    model: str
    device: str
    tp: int = 8
    pp: int = 2
    microbatches: int = 8
    microbatch_size: int = 8
    seq: int = 4096
    recompute: str = "full"
    layout: str = "megatron"
    first_stage_layers: int | None = None
    regions: str = "block"

    @classmethod
    def of_artifact(cls, model: str, device: str, **fields: Any) -> Case:
        """A case with the artifact's stage split for ``model`` at its pp (even where it
        did not run it)."""
        pp = fields.get("pp", cls.pp)
        return cls(model, device, first_stage_layers=artifact_first_stage_layers(model, pp),
                   **fields)

    @property
    def name(self) -> str:
        layout = "" if self.layout == "megatron" else f"_{self.layout}"
        regions = "" if self.regions == "block" else f"_per-{self.regions}"
        return (f"{self.model}_tp{self.tp}_pp{self.pp}_mb{self.microbatch_size}_"
                f"seq{self.seq}_{self.device.removeprefix('sim:')}{layout}{regions}")

    def workload(self) -> Workload:
        return Workload.of(self.model, tp=self.tp, pp=self.pp, microbatches=self.microbatches,
                           microbatch_size=self.microbatch_size, seq=self.seq,
                           recompute=self.recompute, layout=self.layout,
                           first_stage_layers=self.first_stage_layers, regions=self.regions)


A100 = "sim:a100-sxm4-40gb"
MATRIX: tuple[Case, ...] = (
    *(Case.of_artifact(model, A100, microbatch_size=mb, seq=seq, regions=regions)
      for model in ("llama3.2-3b", "qwen3-1.7b") for mb, seq in ((8, 4096), (8, 8192), (16, 4096))
      for regions in ("block", "stage")),
    *(Case(model, device, pp=1, recompute="none")
      for model in ("llama3.1-8b", "llama3.1-70b") for device in ("sim:h100-sxm", "sim:h200")),
)
"""The artifact's six PP2 workloads (Megatron layout, its 15/13 split), each compiled per
block (as torchtitan compiles) and per stage (as the method's engine runs a stage); then 8B
and 70B at
TP8 without pipeline parallelism (its settings say nothing of them: 8 microbatches of
8 x 4096 tokens, no recomputation, the Megatron layout)."""

@dataclass(frozen=True)
class MethodFigures:
    """What the method's artifact reports for a workload (REFERENCE.md section 8; ml-energy/
    kareus@98f0255, its ``freqs_pipeline_*`` frontiers): Nanobatching + Perseus, measured
    from Megatron stage profiles, against Perseus (its fastest point's time, the energy it
    saves at iso-time at best), and its predicted Kareus where it states one."""

    nbp_fastest_vs_perseus: float  # time of NBP's fastest point over Perseus's, less 1
    nbp_energy_at_iso_time: float | None
    kareus_fastest_vs_perseus: float | None = None  # predicted, not measured
    kareus_energy_at_iso_time: float | None = None


METHOD_FIGURES: dict[tuple[str, int, int], MethodFigures] = {
    ("llama3.2-3b", 8, 4096): MethodFigures(-0.095, 0.198, -0.149, 0.182),
    ("qwen3-1.7b", 8, 4096): MethodFigures(-0.087, 0.189),
    ("qwen3-1.7b", 16, 4096): MethodFigures(-0.113, 0.212),
    # freqs_pipeline fastest files: Perseus 6.955 s, NBP 6.246 s (benchmarks/artifact_check.py)
    ("qwen3-1.7b", 8, 8192): MethodFigures(6.246 / 6.955 - 1, None),
}
"""By (model, microbatch size, sequence), TP8 PP2 on A100. The artifact ran the 3B at
8 x 8192 and 16 x 4096 as CP2 x TP4, which kareus does not trace: no figures."""

HEADLINE = ("the method's headline (arXiv 2601.17654): up to 28.3% less energy at iso-time "
            "and up to 27.5% less time at iso-energy against Perseus")

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
            result = result_json(plan)
            found, capacity, short = memory.warning(workload, case.device)
            console.print(report.frontier_table(result))
            if short is not None:
                console.print(short, markup=False, highlight=False, soft_wrap=True)
            report.write_png(out_dir / f"suite_{case.name}.png", report.figure(result))
            results.append({"case": dataclasses.asdict(case), "name": case.name,
                            "seconds": seconds, **result,
                            "memory": memory.record(found, capacity)})
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
    """A row per case: kareus against Perseus and the baseline, and Nanobatching + Perseus
    against Perseus beside what the method's artifact measured for it (and predicted for
    Kareus), computed on this run's frontiers."""
    table = Table(title="kareus bench: kareus against Perseus and the baseline (modelled)",
                  title_justify="left", caption=HEADLINE, caption_justify="left")
    for column in ("workload", "layout, stage layers",
                   "energy at iso-time vs Perseus (max / mean)",
                   "time at iso-energy vs Perseus (max / mean)",
                   "fastest vs baseline: time / energy (kareus)",
                   "fastest vs baseline: time / energy (Perseus)",
                   "NBP vs Perseus: fastest time / iso-time energy (here; artifact measured)",
                   "Kareus vs Perseus: fastest time / iso-time energy (artifact predicted)"):
        if column == "workload":
            table.add_column(column, no_wrap=True)
        else:
            table.add_column(column, justify="right")
    for case, plan in zip(cases, plans, strict=True):
        rows = list(report.metrics_rows(plan.metrics()).values())
        shares = "/".join(str(len(r)) for r in plan.workload.stage_layers)
        method = METHOD_FIGURES.get((case.model, case.microbatch_size, case.seq))
        nbp = plan.metrics()["nanobatch_perseus_vs_perseus"]["energy_at_iso_time"]["max"]
        here = f"{_pct(_fastest(plan, 'nanobatch_perseus'))} / {_pct(nbp)}"
        measured = predicted = "-"
        if method is not None and case.pp == 2 and case.tp == 8:
            measured = (f"{_pct(method.nbp_fastest_vs_perseus)} / "
                        f"{_pct(method.nbp_energy_at_iso_time)}")
            if method.kareus_fastest_vs_perseus is not None:
                predicted = (f"{_pct(method.kareus_fastest_vs_perseus)} / "
                             f"{_pct(method.kareus_energy_at_iso_time)}")
        table.add_row(case.name, f"{plan.workload.layout}, {shares}", rows[0], rows[1],
                      rows[-1], rows[2], f"{here}; {measured}", predicted)
    return table


def _fastest(plan: OfflinePlan, method: str) -> float:
    """``method``'s fastest plan's time over Perseus's, less 1."""
    return min(p.time_s for p in plan.frontiers[method]) / min(
        p.time_s for p in plan.frontiers["perseus"]) - 1


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:+.1f}%"
