"""An offline plan shown: its frontiers beside each other as a table and a plot, and the
result JSON, each figure marked as the simulator's. Files are written whole or not at all
(a temporary beside the target, then renamed)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from rich.table import Table

from kareus.errors import KareusError

LABELS = {"baseline": "baseline (Megatron-LM)", "perseus": "Perseus",
          "nanobatch_perseus": "Nanobatching + Perseus", "kareus": "kareus"}
STYLES = {"baseline": {"marker": "s", "color": "black", "markersize": 8, "linestyle": "none"},
          "perseus": {"marker": ".", "linestyle": "--", "color": "tab:blue"},
          "nanobatch_perseus": {"marker": "x", "linestyle": ":", "color": "tab:green"},
          "kareus": {"marker": "o", "markersize": 4, "color": "tab:red"}}


class OutputError(KareusError, OSError):
    """An output file cannot be written where asked."""


def title(result: Mapping[str, Any]) -> str:
    """The workload and device of a result JSON (``offline.cli.result_json``)."""
    w = result["workload"]
    return (f"{w['model']}, TP{w['tp']} x PP{w['pp']}{' + SP' if w['sp'] else ''}, "
            f"{w['microbatches']} x {w['microbatch_size']} x {w['seq']} tokens, "
            f"{w['schedule']}, recompute {w['recompute']}, {result['device']} (modelled)")


def per_iteration(result: Mapping[str, Any]) -> str:
    """What a result's times and energies are of: one replica's iteration, on all its
    GPUs."""
    return f"per iteration of {result['workload']['gpus']} GPUs"


def frontier_table(result: Mapping[str, Any]) -> Table:
    """Each method's frontier of a result JSON, per iteration of one replica (energies
    summed over its GPUs), against the baseline."""
    frontiers, c = result["frontiers"], result["chosen"]
    base = frontiers["baseline"][0]
    table = Table(title=f"{title(result)}; time and energy {per_iteration(result)}",
                  title_justify="left")
    # a deep pipeline's plans are proven within a gap (planner.pipeline_large): say it
    gaps = any(p.get("gap", 0.0) > 0 for points in frontiers.values() for p in points)
    for column in ("method", "point", "time (ms)", "energy (J)", "time vs baseline",
                   "energy vs baseline", *(["proven within"] if gaps else [])):
        table.add_column(column, justify="left" if column == "method" else "right")

    def cells(p: Mapping[str, float]) -> tuple[str, ...]:
        within = f"{p.get('gap', 0.0):.2%}" if p.get("gap", 0.0) > 0 else "optimal"
        return (f"{p['time_s'] * 1e3:.4g}", f"{p['energy_j']:.4g}",
                f"{p['time_s'] / base['time_s']:.3f}x", f"{p['energy_j'] / base['energy_j']:.3f}x",
                *([within] if gaps else []))

    for method, points in _by_method(frontiers):
        for i, p in enumerate(points):
            table.add_row(LABELS[method] if i == 0 else "", str(i), *cells(p))
    table.add_row("chosen (kareus)", "", *cells(c), style="bold")
    return table


def metrics_rows(metrics: Mapping[str, Any]) -> dict[str, str]:
    """The metrics (``OfflinePlan.metrics``) in words, percent."""
    vs = metrics["kareus_vs_perseus"]
    fast = metrics["max_throughput_vs_baseline"]
    return {
        "energy saved at iso-time vs Perseus (max / mean)": _pair(vs["energy_at_iso_time"]),
        "time saved at iso-energy vs Perseus (max / mean)": _pair(vs["time_at_iso_energy"]),
        **{f"fastest {LABELS[k]} vs baseline (time / energy saved)":
           f"{_pct(v['time_reduction'])} / {_pct(v['energy_reduction'])}"
           for k, v in _by_method(fast)},
    }


def metrics_table(rows: Mapping[str, str]) -> Table:
    table = Table(title="metrics (modelled)", title_justify="left", show_header=False)
    for name, value in rows.items():
        table.add_row(name, value)
    return table


def figure(result: Mapping[str, Any]) -> Figure:
    """Each method's frontier of a result JSON and the chosen point, per iteration."""
    fig = Figure(figsize=(7.5, 5), layout="constrained")
    ax = fig.subplots()
    for method, points in _by_method(result["frontiers"]):
        ax.plot([p["time_s"] * 1e3 for p in points], [p["energy_j"] for p in points],
                label=LABELS[method], **STYLES[method])
    c = result["chosen"]
    ax.plot([c["time_s"] * 1e3], [c["energy_j"]], marker="*", color="red", markersize=16,
            linestyle="none", label="chosen")
    gpus = result["workload"]["gpus"]
    ax.set(xlabel="iteration time (ms)", ylabel=f"iteration energy of {gpus} GPUs (J)",
           title=title(result))
    ax.title.set_fontsize(8)
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


def write_json(path: Path, data: Any) -> Path:
    return _write(path, lambda tmp: tmp.write_text(json.dumps(data, indent=2, sort_keys=True)))


def write_png(path: Path, fig: Figure) -> Path:
    return _write(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))


def writable(path: Path) -> None:
    """Refuse an output path that cannot be written, before any work is done, by writing
    where ``_write`` will: its temporary beside ``path`` is opened for appending (created,
    with any missing parent directory, and removed again where it was not there), since
    asking ``os.access`` answers yes to root where the file system then says no (``/proc``,
    a read-only mount)."""
    if path.is_dir():
        raise OutputError(f"{path}: is a directory; give a file name")
    tmp = _tmp(path)
    made = [d for d in reversed(path.parents) if not d.exists()]  # outermost first
    existed = tmp.exists()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "ab"):
            pass
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename and exc.filename != str(tmp) else ""
        raise OutputError(f"{path}: cannot write there ({where}{exc.strerror or exc})") from exc
    finally:
        if not existed:
            with contextlib.suppress(OSError):  # not made, or under no directory
                tmp.unlink()
        for directory in reversed(made):  # innermost first
            with contextlib.suppress(OSError):
                directory.rmdir()


def _by_method(values: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """Each method's entry in ``LABELS``'s order (the baseline first, kareus last), however
    the JSON sorted them."""
    return [(method, values[method]) for method in LABELS if method in values]


def _tmp(path: Path) -> Path:
    return path.with_name(path.name + ".tmp")


def _write(path: Path, write: Callable[[Path], Any]) -> Path:
    tmp = _tmp(path)
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
