"""``kareus show``: what a plan chose, or what a profile store holds, as a table and a plot.

A plan (JSON) shows each graph's choice and the step's predicted cost against the baseline,
and plots the step frontier it was chosen from beside the frequency-only one. A profile
store (``profiles.sqlite``, or the directory holding it) shows one row per profile key and
plots each key's evaluations with their (time, energy) frontier. Showing only reads: a
store is opened read-only (``ProfileStore(read_only=True)``), so that showing creates,
renames and writes no file beside it (no lock file, no WAL companions), and a damaged,
foreign, old-schema or locked file is refused with what is wrong with it, where a
profiling run would set it aside and start an empty store.
"""

from __future__ import annotations

import math
import os
import sqlite3
from collections.abc import Sequence
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from rich.console import Console
from rich.table import Table

from kareus.errors import KareusError
from kareus.passes.ops import DEFAULT_CLOCK_MHZ
from kareus.planner.budget import Budget
from kareus.planner.plan import Plan, PlanError
from kareus.profiler.progress import make_console
from kareus.profiler.store import (
    FILENAME,
    Evaluation,
    ProfileKey,
    ProfileStore,
    ProfileStoreError,
)

MAX_PLOTS = 12  # subplots of a store's figure: more would be too small to read
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
    _print(console, f"plan {path}: {len(plan.graphs)} graphs")
    console.print(_plan_table(plan))
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
            g.label, str(c.nanobatches),
            "default" if c.clock_mhz == DEFAULT_CLOCK_MHZ else str(c.clock_mhz),
            ", ".join(str(slot) for slot, _ in c.partitions),
            ", ".join("default" if sms is None else str(sms) for _, sms in c.partitions),
            _num(g.time_s * 1e3), _num(g.effective_energy_j * 1e3),
        )
    return table


def _plan_summary(plan: Plan) -> list[str]:
    p, b = plan.predicted, plan.baseline
    model = f", model {plan.model_version}" if plan.model_version else ""
    return [
        (f"predicted step: {_num(p.time_s * 1e3)} ms, {_num(p.energy_j)} J; baseline "
         f"{_num(b.time_s * 1e3)} ms, {_num(b.energy_j)} J: time {_ratio(p.time_s, b.time_s)}, "
         f"energy {_ratio(p.energy_j, b.energy_j)} of the baseline"),
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
    fig = Figure(figsize=(7, 5), layout="constrained")
    ax = fig.subplots()

    def curve(points: Sequence, **style: object) -> None:
        ax.plot([q.time_s * 1e3 for q in points], [q.energy_j for q in points], **style)

    curve(plan.frontier, marker="o", markersize=4, label="step frontier")
    curve(plan.frequency_only, linestyle="--", marker=".", label="frequency only")
    for cost, name, style in (
        (plan.baseline, "baseline", {"marker": "s", "color": "black", "markersize": 8}),
        (plan.predicted, "chosen", {"marker": "*", "color": "red", "markersize": 18}),
    ):
        curve([cost], linestyle="none", label=name, **style)
        ax.annotate(name, (cost.time_s * 1e3, cost.energy_j), xytext=(8, 8),
                    textcoords="offset points")
    ax.set(xlabel="step time (ms)", ylabel="step energy (J)", title=f"plan on {plan.device}")
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


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


def _num(x: float) -> str:
    return f"{x:.4g}" if abs(x) < 1e4 else f"{x:,.0f}"


def _ratio(value: float, baseline: float) -> str:
    return f"{value / baseline:.3f}x"
