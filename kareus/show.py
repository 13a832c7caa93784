"""``kareus show``: what a plan chose, or what a profile store holds, as a table and a plot.

A plan (JSON) shows each graph's choice and the step's predicted cost against the baseline,
and plots the step frontier it was chosen from beside the frequency-only one; a pipeline's
plan also shows each instruction's choice and when it runs, in start order, and draws the
iteration's timeline (a row per rank, a bar per instruction, coloured by its clock) beside
its frontier. A profile store (``profiles.sqlite``, or the directory holding it) shows one
row per profile key and plots each key's evaluations with their (time, energy) frontier.
Showing only reads: a store is opened read-only (``ProfileStore(read_only=True)``), so
that showing creates, renames and writes no file beside it (no lock file, no WAL
companions), and a damaged, foreign, old-schema or locked file is refused with what is
wrong with it, where a profiling run would set it aside and start an empty store.
"""

from __future__ import annotations

import math
import os
import sqlite3
from collections.abc import Sequence
from pathlib import Path

from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.cm import ScalarMappable
from matplotlib.colors import Normalize
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle
from matplotlib.text import Text
from rich.console import Console
from rich.table import Table

from kareus.errors import KareusError
from kareus.passes.ops import DEFAULT_CLOCK_MHZ
from kareus.planner.budget import Budget
from kareus.planner.plan import InstructionPlan, PipelineLayout, Plan, PlanError
from kareus.profiler.progress import make_console
from kareus.profiler.store import (
    FILENAME,
    Evaluation,
    ProfileKey,
    ProfileStore,
    ProfileStoreError,
)

MAX_PLOTS = 12  # subplots of a store's figure: more would be too small to read
CLOCK_COLORMAP = "viridis"
DEFAULT_CLOCK_COLOR = "lightgrey"  # outside viridis, so the default clocks stand apart
_TAKES = "kareus show takes a plan JSON file, a profile store file or the directory holding one"


class ShowError(KareusError, ValueError):
    """What was given to show is missing, or neither a plan nor a profile store."""


def show(
    target: str | os.PathLike[str],
    out: str | os.PathLike[str] | None = None,
    console: Console | None = None,
) -> Path:
    """Print the table of a plan or a profile store and write its plot; returns the PNG path
    (``out``, inside it where it is a directory, else ``<target stem>.png`` beside the
    target, ``<dir>/profiles.png`` for a directory)."""
    for name, given in (("target", target), ("--out", out)):
        # Path("") is the current directory, which nobody means by an empty string.
        if given is not None and not os.fspath(given).strip():
            raise ShowError(f"{name}: an empty path; {_TAKES}" if name == "target"
                            else "--out: an empty path; give the PNG to write")
    path = Path(target)
    console = console or make_console()
    store = _store_file(path)
    png = _default_png(path) if out is None else Path(out)
    if png.is_dir():
        png = png / _default_png(path).name
    if store is None:
        _show_plan(_read_plan(path), path, png, console)
    else:
        _show_store(store, png, console)
    _print(console, f"wrote {png}")
    return png


# -- telling plan from store ----------------------------------------------------------------


def _store_file(path: Path) -> Path | None:
    """The store file ``path`` names (a directory holds it, a ``.sqlite`` file is one, and
    so is any SQLite database), or None for a plan file."""
    if not path.exists():
        raise ShowError(f"{path}: no such file or directory; {_TAKES}")
    if path.is_dir():
        store = path / FILENAME
        if not store.is_file():
            raise ShowError(f"{path}: the directory holds no {FILENAME}; {_TAKES}")
        return store
    return path if path.suffix == ".sqlite" or _is_sqlite(path) else None


def _is_sqlite(path: Path) -> bool:
    """Whether SQLite reads ``path`` as a database. SQLite reads the header, not Python:
    closing a descriptor of a store this process has open would drop its connections'
    locks."""
    if path.stat().st_size == 0:
        return False
    try:
        conn = sqlite3.connect(f"{path.resolve().as_uri()}?immutable=1", uri=True)
        try:
            conn.execute("PRAGMA schema_version").fetchone()
        finally:
            conn.close()
    except sqlite3.DatabaseError as exc:
        if getattr(exc, "sqlite_errorname", "SQLITE_NOTADB") == "SQLITE_NOTADB":
            return False
        raise ShowError(f"{path}: cannot read it ({exc})") from exc
    except sqlite3.Error as exc:
        raise ShowError(f"{path}: cannot read it ({exc})") from exc
    return True


def _default_png(path: Path) -> Path:
    return path / "profiles.png" if path.is_dir() else path.with_suffix(".png")


def _read_plan(path: Path) -> Plan:
    """The plan in ``path``, read and checked as the ``plan`` option reads it; a
    ``ShowError`` with the loader's one line (the file and the field) if it is none."""
    try:
        return Plan.load(path)
    except PlanError as exc:
        raise ShowError(str(exc)) from exc


# -- a plan ---------------------------------------------------------------------------------


def _show_plan(plan: Plan, path: Path, png: Path, console: Console) -> None:
    layout = plan.pipeline
    pipeline = "" if layout is None else (
        f", {len(plan.instructions)} instructions ({layout.schedule} pipeline: "
        f"{layout.stages} stages on {layout.ranks} ranks, {layout.microbatches} microbatches)")
    _print(console, f"plan {path}: {len(plan.graphs)} graphs{pipeline}")
    console.print(_plan_table(plan))
    if layout is not None:
        console.print(_instruction_table(layout, plan.instructions))
    for line in _plan_summary(plan):
        _print(console, line)
    _save(_plan_figure(plan), png)


def _plan_table(plan: Plan) -> Table:
    table = Table()
    for name in ("graph", "k", "clock MHz", "slots", "resources", "time ms", "eff. energy mJ"):
        table.add_column(name, justify="left" if name == "graph" else "right")
    for g in plan.graphs:
        c = g.choice
        table.add_row(
            g.label, str(c.nanobatches), _clock(c.clock_mhz),
            ", ".join(str(slot) for slot, _ in c.partitions),
            ", ".join("default" if sms is None else str(sms) for _, sms in c.partitions),
            _num(g.time_s * 1e3), _num(g.effective_energy_j * 1e3),
        )
    return table


def _instruction_table(layout: PipelineLayout,
                       instructions: Sequence[InstructionPlan]) -> Table:
    table = Table()
    for name in ("stage", "rank", "microbatch", "kind", "clock MHz", "start ms", "time ms",
                 "eff. energy mJ", "graphs (k x calls)"):
        table.add_column(name, justify="left" if name in ("kind", "graphs (k x calls)")
                         else "right")
    for i in _in_start_order(instructions):
        table.add_row(
            str(i.stage), str(_rank(layout, i.stage)), str(i.microbatch), i.kind,
            _clock(i.clock_mhz), _num(i.start_s * 1e3), _num(i.time_s * 1e3),
            _num(i.effective_energy_j * 1e3),
            ", ".join(f"{g.label} k={g.choice.nanobatches} x{g.calls}" for g in i.graphs),
        )
    return table


def _in_start_order(instructions: Sequence[InstructionPlan]) -> list[InstructionPlan]:
    return sorted(instructions, key=lambda i: (i.start_s, i.stage))


def _rank(layout: PipelineLayout, stage: int) -> int:
    """The rank running ``stage``: its own, or with interleaved 1F1B every ``ranks``-th
    stage from the rank's."""
    return stage % layout.ranks


def _unit(plan: Plan) -> str:
    """What the plan's costs are of: a pipeline's, one replica's iteration."""
    return "step" if plan.pipeline is None else "iteration"


def _plan_summary(plan: Plan) -> list[str]:
    p, b = plan.predicted, plan.baseline
    model = f", model {plan.model_version}" if plan.model_version else ""
    replica = "" if plan.pipeline is None else " (one pipeline replica, all its GPUs)"
    return [
        (f"predicted {_unit(plan)}{replica}: {_num(p.time_s * 1e3)} ms, {_num(p.energy_j)} J; "
         f"baseline {_num(b.time_s * 1e3)} ms, {_num(b.energy_j)} J: time "
         f"{_ratio(p.time_s, b.time_s)}, energy {_ratio(p.energy_j, b.energy_j)} of the "
         "baseline"),
        (f"budget: {_budget_text(plan.budget)}; frontier {len(plan.frontier)} points, "
         f"frequency-only {len(plan.frequency_only)}"),
        (f"device: {plan.device}{model}, static power {_num(plan.static_power_w)} W; "
         f"kareus {plan.kareus_version}"),
    ]


def _budget_text(budget: Budget) -> str:
    if budget.kind == "fastest":
        return "fastest"
    if budget.kind == "tradeoff":
        return f"energy-time tradeoff, eta {budget.value:g}"
    unit = "J" if budget.kind == "energy" else "s"
    limit = (f"{budget.fraction:g} of the baseline" if budget.fraction is not None
             else f"{_num(budget.value)} {unit}")
    return f"{budget.kind} <= {limit}"


def _plan_figure(plan: Plan) -> Figure:
    """The plan's frontier; a pipeline's, its timeline first (its axes, then the
    frontier's, then the clocks' colorbar where any clock is not the default)."""
    if plan.pipeline is None:
        fig = Figure(figsize=(7, 5), layout="constrained")
        _plot_frontier(fig.subplots(), plan, f"plan on {plan.device}")
        return fig
    fig = Figure(figsize=(15, 5.5), layout="constrained")
    timeline, frontier = fig.subplots(1, 2, width_ratios=(2.2, 1))
    _plot_timeline(timeline, plan.pipeline, plan)
    _plot_frontier(frontier, plan, "iteration frontier")
    # A simulated device's plan is the model's word alone: nothing of it was measured.
    # model_version marks every simulated device; a custom GPU file's name need not start
    # with "sim:".
    modelled = " (modelled: the device is simulated)" if plan.model_version is not None else ""
    fig.suptitle(f"{plan.pipeline.schedule} pipeline plan on {plan.device}: "
                 f"predicted{modelled}")
    return fig


def _plot_frontier(ax: Axes, plan: Plan, title: str) -> None:
    unit = _unit(plan)

    def curve(points: Sequence, **style: object) -> None:
        ax.plot([q.time_s * 1e3 for q in points], [q.energy_j for q in points], **style)

    curve(plan.frontier, marker="o", markersize=4, label=f"{unit} frontier")
    curve(plan.frequency_only, linestyle="--", marker=".", label="frequency only")
    for cost, name, style in (
        (plan.baseline, "baseline", {"marker": "s", "color": "black", "markersize": 8}),
        (plan.predicted, "chosen", {"marker": "*", "color": "red", "markersize": 18}),
    ):
        curve([cost], linestyle="none", label=name, **style)
        ax.annotate(name, (cost.time_s * 1e3, cost.energy_j), xytext=(8, 8),
                    textcoords="offset points")
    ax.set(xlabel=f"{unit} time (ms)", ylabel=f"{unit} energy (J)", title=title)
    ax.grid(alpha=0.3)
    ax.legend()


def _plot_timeline(ax: Axes, layout: PipelineLayout, plan: Plan) -> None:
    """A Gantt chart: a row per rank, a bar per instruction (backwards hatched), coloured
    by its clock, labelled F<microbatch> or B<microbatch> where the label fits (s<stage>
    first where a rank runs several stages)."""
    clocks = sorted({i.clock_mhz for i in plan.instructions} - {DEFAULT_CLOCK_MHZ})
    norm, cmap = _clock_norm(clocks), colormaps[CLOCK_COLORMAP]
    labels = [_draw_instruction(ax, layout, i, DEFAULT_CLOCK_COLOR if norm is None
                                or i.clock_mhz == DEFAULT_CLOCK_MHZ else cmap(norm(i.clock_mhz)))
              for i in plan.instructions]
    end = ax.axvline(plan.predicted.time_s * 1e3, color="red", linestyle="--", linewidth=1,
                     label="predicted iteration end")
    ax.set_yticks(range(layout.ranks), [_rank_label(layout, r) for r in range(layout.ranks)])
    ax.set_ylim(layout.ranks - 0.5, -0.5)  # rank 0 on top
    ax.set(xlabel="time from the iteration's start (ms)",
           title=f"timeline: {len(plan.instructions)} instructions, {layout.microbatches} "
                 "microbatches")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(handles=[
        Patch(facecolor="white", edgecolor="black", label="forward"),
        Patch(facecolor="white", edgecolor="black", hatch="//", label="backward"),
        Patch(facecolor=DEFAULT_CLOCK_COLOR, edgecolor="black", label="default clocks"),
        end,
    ], loc="upper left", bbox_to_anchor=(0, -0.12), ncols=4, fontsize="small")
    if norm is not None:
        scale = ax.figure.colorbar(ScalarMappable(norm, cmap), ax=ax, label="clock (MHz)")
        if len(clocks) == 1:
            scale.set_ticks(clocks)
    _keep_labels_that_fit(ax.figure, labels)


def _draw_instruction(ax: Axes, layout: PipelineLayout, i: InstructionPlan,
                      color: object) -> tuple[Rectangle, Text]:
    """Instruction ``i``'s bar on its rank's row, and its label at the bar's middle."""
    (bar,) = ax.barh(_rank(layout, i.stage), i.time_s * 1e3, left=i.start_s * 1e3,
                     height=0.8, color=color, edgecolor="black", linewidth=0.6,
                     hatch="//" if i.kind == "backward" else None)
    stage = f"s{i.stage} " if layout.stages > layout.ranks else ""
    text = ax.text(bar.get_x() + bar.get_width() / 2, bar.get_y() + bar.get_height() / 2,
                   f"{stage}{i.kind[0].upper()}{i.microbatch}", ha="center", va="center",
                   fontsize="x-small", clip_on=True,
                   bbox={"facecolor": "white", "alpha": 0.8, "pad": 1, "linewidth": 0})
    return bar, text


def _clock_norm(clocks: Sequence[int]) -> Normalize | None:
    """The clocks' colour scale (None: every instruction runs at the default clocks); one
    clock takes the middle of a range around it, where the colorbar shows it."""
    if not clocks:
        return None
    low, high = min(clocks), max(clocks)
    return Normalize(low, high) if low < high else Normalize(low - 1, high + 1)


def _rank_label(layout: PipelineLayout, rank: int) -> str:
    stages = [s for s in range(layout.stages) if _rank(layout, s) == rank]
    return f"rank {rank}\nstage{'s' if len(stages) > 1 else ''} {', '.join(map(str, stages))}"


def _keep_labels_that_fit(fig: Figure, labels: Sequence[tuple[Rectangle, Text]]) -> None:
    """Drop each bar's label that is wider than its bar, once the figure is laid out (its
    extents are then the saved figure's, in proportion)."""
    fig.draw_without_rendering()
    for bar, text in labels:
        if text.get_window_extent().width > 0.9 * bar.get_window_extent().width:
            text.remove()


# -- a profile store ------------------------------------------------------------------------


def _show_store(path: Path, png: Path, console: Console) -> None:
    try:
        with ProfileStore(path, read_only=True) as store:
            keys = store.keys()
            profiles = [(key, store.evaluations(key)) for key in keys]
    except ProfileStoreError as exc:  # it names the file and what is wrong with it
        raise ShowError(str(exc)) from exc
    if not profiles:
        raise ShowError(f"{path}: the profile store holds no profiles yet")
    left_out = len(profiles) - MAX_PLOTS
    plotted = f" (plotted the first {MAX_PLOTS}, {left_out} left out)" if left_out > 0 else ""
    _print(console, f"profile store {path}: {len(profiles)} keys{plotted}")
    console.print(_store_table(profiles))
    _save(_store_figure(profiles[:MAX_PLOTS]), png)


def _frontier(evaluations: Sequence[Evaluation]) -> list[Evaluation]:
    """The evaluations no other is both faster and cheaper in energy than, fastest first."""
    front: list[Evaluation] = []
    for e in sorted(evaluations, key=lambda e: (e.measurement.time_s, e.measurement.energy_j)):
        if not front or e.measurement.energy_j < front[-1].measurement.energy_j:
            front.append(e)
    return front


def _store_table(profiles: list[tuple[ProfileKey, list[Evaluation]]]) -> Table:
    table = Table()
    for name in ("partition", "device", "group", "k", "evaluations", "frontier", "fastest",
                 "least energy"):
        table.add_column(name, justify="right" if name in ("group", "evaluations", "frontier")
                         else "left")
    for key, evaluations in profiles:
        front = _frontier(evaluations)
        counts = sorted({e.knobs.nanobatches for e in evaluations})
        table.add_row(
            key.partition_key[:12], key.device, str(key.group_size), ", ".join(map(str, counts)),
            str(len(evaluations)), str(len(front)),
            _point(front[0]) if front else "-",
            _point(min(front, key=lambda e: e.measurement.energy_j)) if front else "-",
        )
    return table


def _point(e: Evaluation) -> str:
    m = e.measurement
    return f"{_num(m.time_s * 1e3)} ms, {_num(m.energy_j * 1e3)} mJ @ {m.clock_mhz} MHz"


def _store_figure(profiles: list[tuple[ProfileKey, list[Evaluation]]]) -> Figure:
    cols = min(len(profiles), 3)
    rows = math.ceil(len(profiles) / cols)
    fig = Figure(figsize=(4.5 * cols, 3.5 * rows), layout="constrained")
    grid = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax, (key, evaluations) in zip(grid, profiles):
        _plot_profile(ax, key, evaluations)
    for ax in grid[len(profiles):]:  # the last row's unused cells
        ax.set_axis_off()
    return fig


def _plot_profile(ax: Axes, key: ProfileKey, evaluations: Sequence[Evaluation]) -> None:
    def xy(points: Sequence[Evaluation]) -> tuple[list[float], list[float]]:
        return ([e.measurement.time_s * 1e3 for e in points],
                [e.measurement.energy_j * 1e3 for e in points])

    ax.scatter(*xy(evaluations), s=12, alpha=0.5, label="evaluations")
    ax.step(*xy(_frontier(evaluations)), where="post", color="red", marker="o", markersize=4,
            label="frontier")
    ax.set(xlabel="time (ms)", ylabel="energy (mJ)",
           title=f"{key.partition_key[:12]} on {key.device}, group {key.group_size}")
    ax.title.set_fontsize("small")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")


# -- formatting and saving ------------------------------------------------------------------


def _print(console: Console, line: str) -> None:
    """A plain line: paths and labels may hold brackets rich would read as markup."""
    console.print(line, markup=False, highlight=False, soft_wrap=True)


def _save(fig: Figure, png: Path) -> None:
    """Write ``fig``; a bare ``Figure`` needs no pyplot, no backend and no closing."""
    try:
        png.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(png, dpi=120)
    except (OSError, ValueError) as exc:  # ValueError: a suffix matplotlib writes no format of
        raise ShowError(f"{png}: cannot write the plot there ({exc})") from exc


def _clock(mhz: int) -> str:
    return "default" if mhz == DEFAULT_CLOCK_MHZ else str(mhz)


def _num(x: float) -> str:
    return f"{x:.4g}" if abs(x) < 1e4 else f"{x:,.0f}"


def _ratio(value: float, baseline: float) -> str:
    return f"{value / baseline:.3f}x"
