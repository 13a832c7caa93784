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

import json
import math
import os
import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import Any

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
_TAKES = ("kareus show takes a plan JSON file, a plan result (kareus plan --json), a profile "
          "store file or the directory holding one")
RESULT_FIELDS = ("workload", "device", "frontiers", "chosen", "metrics")
"""What a plan result of ``kareus plan --json`` holds (``offline.cli.result_json``), and no
plan does: a plan has a ``schema`` field."""
RESULT_WORKLOAD = ("model", "tp", "pp", "sp", "microbatches", "microbatch_size", "seq",
                   "schedule", "recompute", "gpus")
"""The workload fields a plan result's table title and units read."""


class ShowError(KareusError, ValueError):
    """What was given to show is missing, or neither a plan nor a profile store."""


def show(
    target: str | os.PathLike[str],
    out: str | os.PathLike[str] | None = None,
    console: Console | None = None,
) -> Path:
    """Print the table of a plan or a profile store and write its plot; returns the PNG path
    (``out``, inside it where it is or is written as a directory, else ``<target
    stem>.png`` beside the target, ``<dir>/profiles.png`` for a directory)."""
    for name, given in (("target", target), ("--out", out)):
        # Path("") is the current directory, which nobody means by an empty string.
        if given is not None and not os.fspath(given).strip():
            raise ShowError(f"{name}: an empty path; {_TAKES}" if name == "target"
                            else "--out: an empty path; give the PNG to write")
    path = Path(target)
    console = console or make_console()
    store = _store_file(path)
    png = _default_png(path) if out is None else _out_png(out, _default_png(path).name)
    if store is None:
        read = _read_plan_or_result(path)
        if isinstance(read, Plan):
            _show_plan(read, path, png, console)
        else:
            _show_result(read, path, png, console)
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


def _out_png(out: str | os.PathLike[str], name: str) -> Path:
    """The PNG ``--out`` names: ``name`` inside it where it is a directory, or is written
    as one (a trailing separator; made if missing); else the file, ``.png`` added where it
    has no suffix (matplotlib adds it: the path said is the path written)."""
    text = os.fspath(out)
    png = Path(text)
    if png.is_dir() or text.endswith(("/", os.sep)):
        return png / name
    return png if png.suffix else png.with_name(png.name + ".png")


def _default_png(path: Path) -> Path:
    return path / "profiles.png" if path.is_dir() else path.with_suffix(".png")


def _read_plan_or_result(path: Path) -> Plan | dict[str, Any]:
    """The plan in ``path``, read and checked as the ``plan`` option reads it, or the plan
    result ``kareus plan --json`` wrote; a ``ShowError`` naming the file, and the field
    where it is a plan with a bad one, if it is neither."""
    try:
        return Plan.load(path)
    except PlanError as exc:
        try:
            raw = json.loads(path.read_bytes())
        except (OSError, ValueError, RecursionError):  # not JSON: the loader's one line
            raise ShowError(str(exc)) from exc
        if isinstance(raw, dict) and "schema" in raw:  # a plan with a bad field: its name
            raise ShowError(str(exc)) from exc
        if isinstance(raw, dict) and all(field in raw for field in RESULT_FIELDS):
            return _checked_result(raw, path)
        missing = ("it is a JSON " + type(raw).__name__ if not isinstance(raw, dict) else
                   f"it has no schema field, nor {', '.join(RESULT_FIELDS)} fields")
        raise ShowError(f"{path}: neither a kareus plan nor a plan result of kareus plan "
                        f"--json ({missing}); {_TAKES}") from exc


def _checked_result(raw: dict[str, Any], path: Path) -> dict[str, Any]:
    """A plan result, checked for what showing it reads: a ``ShowError`` naming the file
    and the first field that is missing or malformed."""
    from kareus.offline import report

    problem = _result_problem(raw, tuple(report.LABELS))
    if problem is None:
        try:
            report.metrics_rows(raw["metrics"])
        except (KeyError, TypeError, AttributeError) as exc:
            problem = "metrics", f"as kareus plan --json writes them (no {exc})"
    if problem is not None:
        field, expected = problem
        raise ShowError(f"{path}: a plan result whose {field} is not {expected}")
    return raw


def _result_problem(raw: dict[str, Any], methods: tuple[str, ...]) -> tuple[str, str] | None:
    """The first field of a plan result that showing cannot read, and what it should be."""
    w, frontiers = raw["workload"], raw["frontiers"]
    if not (isinstance(w, dict) and all(k in w for k in RESULT_WORKLOAD)
            and isinstance(w["gpus"], int) and w["gpus"] >= 1):
        return "workload", f"an object of {', '.join(RESULT_WORKLOAD)} (gpus an integer >= 1)"
    if not (isinstance(frontiers, dict) and set(frontiers) <= set(methods)
            and frontiers.get("baseline")
            and all(isinstance(ps, list) and all(map(_is_cost, ps)) for ps in frontiers.values())):
        return "frontiers", (f"lists of {{time_s, energy_j}} > 0 by method ({', '.join(methods)}"
                             "), the baseline's not empty")
    if not _is_cost(raw["chosen"]):
        return "chosen", "{time_s, energy_j} > 0"
    return None


def _is_cost(point: object) -> bool:
    """A ``{time_s, energy_j}`` point, each a finite number > 0."""
    return isinstance(point, dict) and all(
        type(point.get(k)) in (int, float) and 0 < point[k] < math.inf
        for k in ("time_s", "energy_j"))


# -- a plan result --------------------------------------------------------------------------


def _show_result(result: dict[str, Any], path: Path, png: Path, console: Console) -> None:
    """A plan result as ``kareus plan`` printed it: every method's frontier against the
    baseline and the metrics, times and energies per iteration of all the replica's GPUs."""
    from kareus.offline import report

    version = result.get("kareus_version")
    made = f" by kareus {version}" if isinstance(version, str) else ""
    _print(console, f"plan result {path}{made} (kareus plan --json; the plan a compile loads "
           "is its --plan-json)")
    console.print(report.frontier_table(result))
    console.print(report.metrics_table(report.metrics_rows(result["metrics"])))
    _save(report.figure(result), png)


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
    for name in ("graph", "k", "clock MHz", "slots", "resources", "time ms",
                 "eff. energy mJ per GPU"):
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
                 "eff. energy mJ of the stage's GPUs", "graphs (k x calls)"):
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


def _whose(plan: Plan) -> str:
    """Whose energy the plan's costs are: one GPU's, a pipeline's of all its replica's."""
    return "per GPU" if plan.pipeline is None else "of one pipeline replica, all its GPUs"


def _plan_summary(plan: Plan) -> list[str]:
    p, b = plan.predicted, plan.baseline
    model = f", model {plan.model_version}" if plan.model_version else ""
    replica = " (per GPU)" if plan.pipeline is None else " (one pipeline replica, all its GPUs)"
    return [
        (f"predicted {_unit(plan)}{replica}: {_num(p.time_s * 1e3)} ms, {_num(p.energy_j)} J; "
         f"baseline {_num(b.time_s * 1e3)} ms, {_num(b.energy_j)} J: time "
         f"{_ratio(p.time_s, b.time_s)}, energy {_ratio(p.energy_j, b.energy_j)} of the "
         "baseline"),
        _measured_text(plan),
        (f"budget: {plan.budget.describe()}; frontier {len(plan.frontier)} points, "
         f"frequency-only {len(plan.frequency_only)}"),
        (f"device: {plan.device}{model}, static power {_num(plan.static_power_w)} W per GPU; "
         f"kareus {plan.kareus_version}"),
        "options given: " + ("; ".join(
            f"{name}={plan.options.get(name)!r} ({source})"
            for name, source in sorted(plan.option_sources.items())) or "none (all defaults)"),
    ]


def _measured_text(plan: Plan) -> str:
    """What the plan's steps took where it ran, measured (``Plan.measured``), beside the
    prediction; or why nothing was."""
    m = plan.measured
    if m is None:
        return "measured: nothing" + (
            " (the device is simulated: every cost here is modelled)"
            if plan.model_version is not None
            else " (a pipeline's iterations are not measured)" if plan.pipeline is not None
            else " yet (no window of steps ran with this plan)")
    total = m.total_energy_j
    every = (f"; {_num(total)} J on all {m.world_size} GPUs" if total is not None
             else f"; the total waits for all {m.world_size} ranks")
    p = plan.predicted
    against = (f": time {_ratio(m.time_s, p.time_s)}, energy {_ratio(m.energy_j, p.energy_j)}"
               " of the prediction" if p.time_s > 0 and p.energy_j > 0 else "")
    return (f"measured per step (rank {m.rank}, steps {m.first_step}-"
            f"{m.first_step + m.steps - 1}, {m.method}): {_num(m.time_s * 1e3)} ms, "
            f"{_num(m.energy_j)} J on its GPU{every}{against}")


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
    ax.set(xlabel=f"{unit} time (ms)", ylabel=f"{unit} energy {_whose(plan)} (J)", title=title)
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
