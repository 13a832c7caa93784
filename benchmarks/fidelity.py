"""Fidelity report of the simulated GPUs: every published data point, and clock sweeps.

(a) Every point of ``benchmarks/calibration.py``: the published value (or
range), the model's prediction (``probes.predict``), the error (relative to the nearer end
of the published range, absolute for ratios), the tolerance of its quantity's class and the
verdict: PASS, FAIL, or "explained" (a known miss, with its reason). Inputs are constants
read back (regression checks); fidelity points are independent measurements.

(b) Per preset, the modelled clock response of four workloads at every supported clock
from the maximum down to min(search_min_mhz, 0.6 f_max): a bf16 8192^3 GEMM, a 1 GiB bf16
copy, causal SDPA attention forward and backward (FlashAttention-2's benchmark shape: batch
8, seq 2048, 16 heads of 128) and a Llama-3.2-3B-sized block under TP8 forward and backward
(``probes.transformer_layer``: micro-batch 8 x 4096 tokens, as AOT autograd hands the graphs
to Inductor, unrewritten, the two graphs summed): time, average power, energy, t/t_max and
E/E_max, and the energy-optimal clock with its saving and slowdown against the default
(maximum) clock.

(c) Where ``benchmarks/gpu_plan_check.py`` has recorded an H200 (``--h200``, by default
benchmarks/results/h200_default.json; nothing is said where there is no such file): its
graphs and partition workloads as measured through NVML at default clocks, beside the
simulated GPU's estimates of the same graphs, with the geometric mean of the ratios.

(d) Where ``benchmarks/gpu_check.py`` has recorded an H200's kernels (``--h200-kernels``, by
default benchmarks/results/gpu_check_h200.json): one kernel of every class the model
distinguishes, measured at default clocks, beside the model, each judged by the fidelity
tolerances of its quantity (``calibration.TOLERANCES``: time 10%, power 15%).

Everything else is traced over fake tensors in an 8-rank fake process group: no GPU is
needed. Writes ``fidelity.json`` and one ``fidelity_<preset>.png`` per preset (time/t_max,
power and E/E_max against the clock). Exits 0 whatever the verdicts: it is a report.

    python benchmarks/fidelity.py --out-dir benchmarks/results [--preset sim:h200 ...]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import matplotlib
import torch
import torch.fx
from calibration import POINTS, TOLERANCES, DataPoint
from gpu_measure import H200_KERNELS, H200_RECORD
from probes import (
    attention,
    copy,
    fake_world,
    gemm,
    predict,
    transformer_layer,
)
from rich.console import Console
from rich.table import Table

from kareus.devices import SimulatedGPU, Workload, preset_names

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after choosing the backend

TP, BATCH, SEQ = 8, 8, 4096  # the layer of overlap_sim.py
LLAMA_3B = {"dim": 3072, "heads": 24, "ffn_dim": 8192}  # MHA stand-in for 24/8 GQA
ATTENTION = {"batch": 8, "seq": 2048, "heads": 16, "head_dim": 128}  # FlashAttention-2's
VERDICT_STYLE = {"PASS": "green", "FAIL": "bold red", "explained": "yellow", "ERROR": "bold red"}


# --- (a) the points --------------------------------------------------------------------------


def point_row(point: DataPoint) -> dict[str, Any]:
    """The point, its prediction and verdict (ERROR, with the exception, if it cannot be
    predicted: a report of the model as it stands, not a test)."""
    row: dict[str, Any] = {
        "preset": point.preset,
        "quantity": point.quantity,
        "what": point.what or "-",
        "size_bytes": point.size_bytes,
        "params": {name: value for name, value in point.params},
        "role": point.role,
        "published": point.value,
        "published_range": list(point.published),
        "band": list(point.band),
        "tolerance": point.tolerance.amount,
        "tolerance_relative": point.tolerance.relative,
        "source": point.source,
        "known_miss": point.known_miss,
    }
    try:
        predicted = predict(point)
    except Exception as e:  # noqa: BLE001  (reported, never hidden)
        return {**row, "predicted": None, "error": None, "verdict": "ERROR",
                "exception": f"{type(e).__name__}: {e}"}
    verdict = point.verdict(predicted)
    return {
        **row,
        "predicted": predicted,
        "error": point.error(predicted),
        "verdict": verdict,
        "stale_known_miss": bool(point.known_miss) and verdict == "PASS",
    }


def _number(x: float) -> str:
    return f"{x:.4g}"


def points_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="Published data points against the model", title_justify="left")
    for column in ("preset", "quantity", "size / params", "role", "published", "predicted",
                   "error", "tol", "verdict"):
        table.add_column(column, justify="left" if column in ("quantity", "size / params")
                         else "right")
    for r in rows:
        low, high = r["published_range"]
        published = _number(r["published"]) if low == high else f"{_number(low)}-{_number(high)}"
        relative = r["tolerance_relative"]
        error = "" if r["error"] is None else "in range" if low < high and r["error"] == 0 else (
            f"{100 * r['error']:+.1f}%" if relative else f"{r['error']:+.3f}"
        )
        tol = f"{100 * r['tolerance']:.0f}%" if relative else f"±{r['tolerance']:.2f}"
        verdict = r["verdict"] + (" (stale miss)" if r.get("stale_known_miss") else "")
        table.add_row(
            r["preset"].removeprefix("sim:"), r["quantity"], r["what"], r["role"], published,
            "-" if r["predicted"] is None else _number(r["predicted"]), error, tol,
            f"[{VERDICT_STYLE[r['verdict']]}]{verdict}[/]",
        )
    return table


# --- (b) the clock sweeps --------------------------------------------------------------------


def workloads() -> dict[str, tuple[torch.fx.GraphModule, ...]]:
    """Each sweep workload as the graphs whose times and energies add up to it."""
    return {
        "gemm 8192^3 bf16": (gemm(),),
        "copy 1 GiB bf16": (copy(),),
        "attention causal fwd+bwd": (attention(**ATTENTION, causal=True, backward=True),),
        f"llama-3b layer TP{TP} fwd+bwd": transformer_layer(**LLAMA_3B, batch=BATCH, seq=SEQ),
    }


def sweep_clocks(gpu: SimulatedGPU) -> tuple[int, ...]:
    spec = gpu.spec
    lowest = min(spec.search_min_mhz, 0.6 * spec.max_clock_mhz)
    return tuple(c for c in gpu.supported_clocks() if c >= lowest)


def sweep(gpu: SimulatedGPU, graphs: tuple[torch.fx.GraphModule, ...]) -> dict[str, Any]:
    """Time, power and energy of ``graphs`` run one after the other at each clock."""
    clocks = sweep_clocks(gpu)
    parts = [gpu.sweep(Workload(f"graph{i}", gm, world_size=TP), clocks)
             for i, gm in enumerate(graphs)]
    totals = {c: (sum(p[c].time_s for p in parts), sum(p[c].energy_j for p in parts))
              for c in clocks}
    t_max, e_max = totals[clocks[0]]
    rows = [
        {"clock_mhz": c, "time_s": t, "power_w": e / t, "energy_j": e,
         "time_ratio": t / t_max, "energy_ratio": e / e_max}
        for c, (t, e) in totals.items()
    ]
    best = min(rows, key=lambda r: r["energy_j"])
    return {
        "rows": rows,
        "energy_optimal": {
            "clock_mhz": best["clock_mhz"],
            "energy_saving": 1 - best["energy_ratio"],
            "slowdown": best["time_ratio"] - 1,
        },
    }


def preset_report(preset: str) -> dict[str, Any]:
    """The sweeps of every workload; one the model cannot cost holds its error instead."""
    gpu = SimulatedGPU(preset)
    report: dict[str, Any] = {
        "model_version": getattr(gpu.spec, "model_version", None),
        "max_clock_mhz": gpu.spec.max_clock_mhz,
        "clocks": list(sweep_clocks(gpu)),
        "workloads": {},
        "errors": {},
    }
    for name, graphs in workloads().items():
        try:
            report["workloads"][name] = sweep(gpu, graphs)
        except Exception as e:  # noqa: BLE001  (reported, never hidden)
            report["errors"][name] = f"{type(e).__name__}: {e}"
    return report


def summary_table(preset: str, report: dict[str, Any]) -> Table:
    version = report["model_version"]
    table = Table(
        title=f"{preset} clock response ({len(report['clocks'])} clocks, "
        f"{report['clocks'][-1]}-{report['clocks'][0]} MHz"
        + (f", model {version}" if version else "") + ")",
        title_justify="left",
    )
    for column in ("workload", "time at f_max (ms)", "power (W)", "energy (J)",
                   "E-optimal clock", "E saving", "slowdown"):
        table.add_column(column, justify="left" if column == "workload" else "right")
    for name, w in report["workloads"].items():
        top, best = w["rows"][0], w["energy_optimal"]
        table.add_row(
            name, f"{1e3 * top['time_s']:.3f}", f"{top['power_w']:.0f}", f"{top['energy_j']:.3f}",
            f"{best['clock_mhz']} MHz", f"{100 * best['energy_saving']:.1f}%",
            f"{100 * best['slowdown']:+.1f}%",
        )
    return table


def sweep_table(preset: str, report: dict[str, Any], step_mhz: int) -> Table:
    """t/t_max, power and E/E_max per workload, every ``step_mhz`` from the maximum."""
    table = Table(title=f"{preset}: t/t_max, power (W), E/E_max against the clock "
                  f"(every {step_mhz} MHz; all clocks in the JSON)", title_justify="left")
    table.add_column("MHz", justify="right")
    names = list(report["workloads"])
    for name in names:
        short = name.split()[0]
        for column in ("t/t0", "W", "E/E0"):
            table.add_column(f"{short} {column}", justify="right")
    top = report["clocks"][0]
    for i, clock in enumerate(report["clocks"]):
        if (top - clock) % step_mhz:
            continue
        cells = [str(clock)]
        for name in names:
            r = report["workloads"][name]["rows"][i]
            cells += [f"{r['time_ratio']:.3f}", f"{r['power_w']:.0f}", f"{r['energy_ratio']:.3f}"]
        table.add_row(*cells)
    return table


def plot(preset: str, report: dict[str, Any], path: Path) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = (("time_ratio", "t / t(f_max)"), ("power_w", "average power (W)"),
              ("energy_ratio", "E / E(f_max)"))
    for ax, (key, label) in zip(axes, panels, strict=True):
        for name, w in report["workloads"].items():
            ax.plot([r["clock_mhz"] for r in w["rows"]], [r[key] for r in w["rows"]],
                    marker=".", label=name)
        ax.set_xlabel("SM clock (MHz)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    version = report["model_version"]
    fig.suptitle(f"{preset} (simulated{', model ' + version if version else ''})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- (c) the H200 at default clocks ----------------------------------------------------------


def h200_measured(path: Path) -> dict[str, Any] | None:
    """The workloads ``gpu_plan_check.py`` measured, from its record at ``path``, with the
    model's estimates and the geometric means of the predicted/measured ratios; None where
    there is no record."""
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    keys = ("name", "measured_time_s", "predicted_time_s", "time_ratio", "measured_power_w",
            "predicted_power_w", "measured_energy_j", "predicted_energy_j", "energy_ratio")
    rows = [{k: r[k] for k in keys} for r in record["workloads"] if r["time_ratio"] is not None]
    return {
        "path": str(path),
        "gpu": record.get("gpu"),
        "mode": record["mode"],
        "preset": record["preset"],
        "model_version": record["model_version"],
        "checks_passed": record["ok"],
        "workloads": rows,
        "time_ratio_geomean": _geomean([r["time_ratio"] for r in rows]),
        "energy_ratio_geomean": _geomean([r["energy_ratio"] for r in rows]),
        "skipped": record["skipped"],
    }


def _geomean(values: list[float]) -> float | None:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def h200_table(measured: dict[str, Any]) -> Table:
    table = Table(
        title=f"{measured['gpu'] or 'GPU'} at default clocks (NVML) against "
        f"{measured['preset']} ({measured['path']}; checks "
        f"{'passed' if measured['checks_passed'] else 'FAILED'})",
        title_justify="left",
    )
    for column in ("workload", "ms", "model ms", "t model/meas", "W", "model W",
                   "E model/meas"):
        table.add_column(column, justify="left" if column == "workload" else "right")
    for r in measured["workloads"]:
        table.add_row(
            r["name"], f"{1e3 * r['measured_time_s']:.3f}", f"{1e3 * r['predicted_time_s']:.3f}",
            f"{r['time_ratio']:.2f}", f"{r['measured_power_w']:.0f}",
            f"{r['predicted_power_w']:.0f}", f"{r['energy_ratio']:.2f}",
        )
    return table


def print_h200(console: Console, measured: dict[str, Any]) -> None:
    if not measured["workloads"]:
        skipped = "; ".join(s["what"] for s in measured["skipped"]) or "nothing"
        console.print(f"{measured['path']}: no measurement ({measured['mode']} mode; "
                      f"skipped: {skipped})")
        return
    console.print(h200_table(measured))
    console.print(f"model/measured, geometric mean: time x{measured['time_ratio_geomean']:.2f}, "
                  f"energy x{measured['energy_ratio_geomean']:.2f}")


# --- (d) an H200's kernels at default clocks ---------------------------------------------------


def h200_kernels(path: Path) -> dict[str, Any] | None:
    """``gpu_check.py``'s cases from its record at ``path``, each time and power judged by
    the fidelity tolerances; None where there is no record."""
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    rows = []
    for case in record["cases"]:
        time_error = case["predicted_time_s"] / case["measured_time_s"] - 1
        power_error = case["predicted_power_w"] / case["measured_power_w"] - 1
        rows.append({
            "case": case["case"], "kind": case["kind"],
            "measured_time_s": case["measured_time_s"],
            "predicted_time_s": case["predicted_time_s"],
            "measured_power_w": case["measured_power_w"],
            "predicted_power_w": case["predicted_power_w"],
            "time_error": time_error, "power_error": power_error,
            "energy_ratio": case["energy_ratio"],
            "time_verdict": _verdict(time_error, "time"),
            "power_verdict": _verdict(power_error, "power"),
        })
    return {"path": str(path), "gpu": record.get("gpu"), "torch": record.get("torch"),
            "preset": record["preset"], "model_version": record["model_version"],
            "idle_power_w": record.get("idle_power_w"), "cases": rows}


def _verdict(relative_error: float, kind: str) -> str:
    return "PASS" if abs(relative_error) <= TOLERANCES[kind].amount else "FAIL"


def h200_kernels_table(kernels: dict[str, Any]) -> Table:
    table = Table(title=f"{kernels['gpu'] or 'GPU'} kernels at default clocks (NVML) against "
                  f"{kernels['preset']} ({kernels['path']})", title_justify="left")
    for column in ("case", "kind", "ms", "model ms", "time", "W", "model W", "power",
                   "E model/meas"):
        table.add_column(column, justify="left" if column in ("case", "kind") else "right")
    for r in kernels["cases"]:
        table.add_row(
            r["case"], r["kind"], f"{1e3 * r['measured_time_s']:.3f}",
            f"{1e3 * r['predicted_time_s']:.3f}",
            f"[{VERDICT_STYLE[r['time_verdict']]}]{r['time_error']:+.0%}[/]",
            f"{r['measured_power_w']:.0f}", f"{r['predicted_power_w']:.0f}",
            f"[{VERDICT_STYLE[r['power_verdict']]}]{r['power_error']:+.0%}[/]",
            f"{r['energy_ratio']:.2f}",
        )
    return table


# --- main -----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", action="append", choices=preset_names(),
                        help="a preset to report (repeatable; default: all)")
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--h200", type=Path, default=H200_RECORD,
                        help="gpu_plan_check.py's record of an H200 (ignored where absent)")
    parser.add_argument("--h200-kernels", type=Path, default=H200_KERNELS,
                        help="gpu_check.py's record of an H200 (ignored where absent)")
    args = parser.parse_args(argv)
    presets = args.preset or list(preset_names())
    start = time.perf_counter()
    console = Console(width=160)
    with fake_world(TP):
        rows = [point_row(p) for p in POINTS if p.preset in presets]
        points_s = time.perf_counter() - start
        reports = {preset: preset_report(preset) for preset in presets}

    console.print(points_table(rows))
    for r in rows:
        if r["verdict"] == "ERROR":
            console.print(f"[red]ERROR[/] {r['preset']} {r['quantity']} {r['what']}: "
                          f"{r['exception']}")
        elif r["known_miss"]:
            console.print(f"[yellow]{r['verdict']}[/] {r['preset']} {r['quantity']} "
                          f"{r['what']}: {r['known_miss']}")
    counts = Counter((r["role"], r["verdict"]) for r in rows)
    for role in ("input", "fidelity"):
        n = sum(c for (r, _), c in counts.items() if r == role)
        line = ", ".join(f"{counts[role, v]} {v}" for v in VERDICT_STYLE if counts[role, v])
        console.print(f"{role} points: {n} ({line})")

    args.out_dir.mkdir(parents=True, exist_ok=True)
    for preset, report in reports.items():
        for name, error in report["errors"].items():
            console.print(f"[red]ERROR[/] {preset} sweep of {name}: {error}")
        if not report["workloads"]:
            continue
        console.print(summary_table(preset, report))
        spec = SimulatedGPU(preset).spec
        console.print(sweep_table(preset, report, spec.search_step_mhz))
        plot(preset, report, args.out_dir / f"fidelity_{preset.removeprefix('sim:')}.png")
    measured = h200_measured(args.h200)
    if measured is not None:
        print_h200(console, measured)
    kernels = h200_kernels(args.h200_kernels)
    if kernels is not None:
        console.print(h200_kernels_table(kernels))

    elapsed = time.perf_counter() - start
    record = {
        "torch": torch.__version__,
        "counts": {f"{role}/{verdict}": n for (role, verdict), n in sorted(counts.items())},
        "points": rows,
        "presets": reports,
        "h200_default": measured,
        "h200_kernels": kernels,
        "seconds": {"points": points_s, "total": elapsed},
    }
    out = args.out_dir / "fidelity.json"
    out.write_text(json.dumps(_jsonable(record), indent=2))
    console.print(f"wrote {out} and {len(reports)} PNG(s) in {elapsed:.1f} s")
    return 0


def _jsonable(record: dict[str, Any]) -> dict[str, Any]:
    """Tuples in params as lists; non-finite numbers as strings (JSON has neither)."""
    def fix(x: Any) -> Any:
        if isinstance(x, float) and not math.isfinite(x):
            return str(x)
        if isinstance(x, (list, tuple)):
            return [fix(v) for v in x]
        if isinstance(x, dict):
            return {k: fix(v) for k, v in x.items()}
        return x

    return fix(record)


if __name__ == "__main__":
    sys.exit(main())
