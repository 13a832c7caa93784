"""An offline plan shown: its frontiers beside each other as a table and a plot, and the
result JSON, each figure marked as the simulator's. Files are written whole or not at all
(a temporary beside the target, then renamed)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from rich.table import Table

from kareus.errors import KareusError
from kareus.offline.plan import OfflinePlan

LABELS = {"baseline": "baseline (Megatron-LM)", "perseus": "Perseus",
          "nanobatch_perseus": "Nanobatching + Perseus", "kareus": "kareus"}
STYLES = {"baseline": {"marker": "s", "color": "black", "markersize": 8, "linestyle": "none"},
          "perseus": {"marker": ".", "linestyle": "--", "color": "tab:blue"},
          "nanobatch_perseus": {"marker": "x", "linestyle": ":", "color": "tab:green"},
          "kareus": {"marker": "o", "markersize": 4, "color": "tab:red"}}


class OutputError(KareusError, OSError):
    """An output file cannot be written where asked."""


def title(plan: OfflinePlan) -> str:
    w = plan.workload
    return (f"{w.name}, TP{w.tp} x PP{w.pp}{' + SP' if w.sp else ''}, {w.microbatches} x "
            f"{w.microbatch_size} x {w.seq} tokens, {plan.schedule}, recompute {w.recompute}, "
            f"{plan.device} (modelled)")


def frontier_table(plan: OfflinePlan) -> Table:
    """Each method's frontier per iteration of one replica, against the baseline."""
    base = plan.baseline
    table = Table(title=title(plan), title_justify="left")
    for column in ("method", "point", "time (ms)", "energy (J)", "time vs baseline",
                   "energy vs baseline"):
        table.add_column(column, justify="left" if column == "method" else "right")
    for method, points in plan.frontiers.items():
        for i, p in enumerate(points):
            table.add_row(LABELS[method] if i == 0 else "", str(i), f"{p.time_s * 1e3:.4g}",
                          f"{p.energy_j:.4g}", f"{p.time_s / base.time_s:.3f}x",
                          f"{p.energy_j / base.energy_j:.3f}x")
    c = plan.chosen
    table.add_row("chosen (kareus)", "", f"{c.time_s * 1e3:.4g}", f"{c.energy_j:.4g}",
                  f"{c.time_s / base.time_s:.3f}x", f"{c.energy_j / base.energy_j:.3f}x",
                  style="bold")
    return table


def metrics_rows(plan: OfflinePlan) -> dict[str, str]:
    """The metrics in words, percent."""
    m = plan.metrics()
    vs = m["kareus_vs_perseus"]
    fast = m["max_throughput_vs_baseline"]
    return {
        "energy saved at iso-time vs Perseus (max / mean)": _pair(vs["energy_at_iso_time"]),
        "time saved at iso-energy vs Perseus (max / mean)": _pair(vs["time_at_iso_energy"]),
        **{f"fastest {LABELS[k]} vs baseline (time / energy saved)":
           f"{_pct(v['time_reduction'])} / {_pct(v['energy_reduction'])}"
           for k, v in fast.items()},
    }


def figure(plan: OfflinePlan) -> Figure:
    fig = Figure(figsize=(7.5, 5), layout="constrained")
    ax = fig.subplots()
    for method, points in plan.frontiers.items():
        ax.plot([p.time_s * 1e3 for p in points], [p.energy_j for p in points],
                label=LABELS[method], **STYLES[method])
    c = plan.chosen
    ax.plot([c.time_s * 1e3], [c.energy_j], marker="*", color="red", markersize=16,
            linestyle="none", label="chosen")
    ax.set(xlabel="iteration time (ms)", ylabel="iteration energy of a replica (J)",
           title=title(plan))
    ax.title.set_fontsize(8)
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


def write_json(path: Path, data: Any) -> Path:
    return _write(path, lambda tmp: tmp.write_text(json.dumps(data, indent=2, sort_keys=True)))


def write_png(path: Path, fig: Figure) -> Path:
    return _write(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))


def writable(path: Path) -> None:
    """Refuse an output path that cannot be written, before any work is done."""
    if path.exists() and path.is_dir():
        raise OutputError(f"{path}: is a directory; give a file name")
    parent = path.parent if str(path.parent) else Path(".")
    probe = parent
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        raise OutputError(f"{path}: cannot write there ({probe} is not a writable directory)")


def _write(path: Path, write: Callable[[Path], Any]) -> Path:
    tmp = path.with_name(path.name + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(tmp)
        tmp.replace(path)
    except (OSError, ValueError) as exc:
        tmp.unlink(missing_ok=True)
        raise OutputError(f"{path}: cannot write it ({exc})") from exc
    return path


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{round(100 * x, 1) + 0.0:.1f}%"  # + 0.0: no "-0.0%"


def _pair(s: dict[str, float | None]) -> str:
    return f"{_pct(s['max'])} / {_pct(s['mean'])}"
