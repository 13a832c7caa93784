"""How the energy-optimal clocks on Hopper move with the assumed voltage knee.

No published point fixes where Hopper's voltage starts to rise above its 0.685 V floor
(presets.HOPPER_KNEE_BOUNDS). For each Hopper preset and knee fractions across those bounds
(the preset's own in the middle), this sweeps the workloads of ``fidelity.py`` (a GEMM, a
copy, causal attention forward and backward, a TP8 Llama-3.2-3B-sized block forward and
backward) over the supported clocks and reports each one's energy-optimal clock, its
energy saving and slowdown against the default clock: the clock a per-graph energy plan
would pick. The power coefficient is recalibrated for each knee (a GEMM still draws the
power limit at its measured clock), so only the shape of V(f) changes.

    python benchmarks/knee_sensitivity.py --out-dir benchmarks/results
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import matplotlib
from fidelity import sweep, workloads
from probes import fake_world
from rich.console import Console
from rich.table import Table

from kareus.devices import SimulatedGPU
from kareus.devices.sim.presets import HOPPER_KNEE_BOUNDS, PRESETS, GPUSpec

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after choosing the backend

HOPPER = ("sim:h100-sxm", "sim:h200")


def knee_fractions(spec: GPUSpec) -> tuple[float, ...]:
    """The bounds, their midpoint and the preset's own fraction, ascending."""
    low, high = HOPPER_KNEE_BOUNDS
    own = spec.knee_mhz / spec.max_clock_mhz
    return tuple(sorted({low, (low + high) / 2, own, high}))


def with_knee(spec: GPUSpec, fraction: float) -> GPUSpec:
    step = spec.clock_step_mhz
    knee = round(spec.max_clock_mhz * fraction / step) * step
    return dataclasses.replace(spec, name=f"{spec.name}@knee{knee}", knee_mhz=knee)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    rows = []
    curves: dict[str, dict[float, list[dict]]] = {}
    with fake_world():
        graphs = workloads()
        for preset in HOPPER:
            spec = PRESETS[preset]
            curves[preset] = {}
            for fraction in knee_fractions(spec):
                variant = with_knee(spec, fraction)
                gpu = SimulatedGPU(variant)
                for name, gms in graphs.items():
                    result = sweep(gpu, gms)
                    best = result["energy_optimal"]
                    rows.append({
                        "preset": preset, "knee_fraction": round(fraction, 3),
                        "knee_mhz": variant.knee_mhz, "is_preset": variant.knee_mhz
                        == spec.knee_mhz, "workload": name, **best,
                    })
                    if name.startswith("llama"):
                        curves[preset][variant.knee_mhz] = result["rows"]
    table = Table(title="Energy-optimal clock per assumed Hopper knee (* the preset's)",
                  title_justify="left")
    for column in ("preset", "knee (MHz)", "workload", "E-optimal (MHz)", "E saving",
                   "slowdown"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(
            r["preset"], f"{r['knee_mhz']}{'*' if r['is_preset'] else ''}", r["workload"],
            str(r["clock_mhz"]), f"{100 * r['energy_saving']:.1f}%",
            f"{100 * r['slowdown']:+.1f}%",
        )
    Console(width=120).print(table)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / "knee_sensitivity.json"
    out.write_text(json.dumps({
        "bounds": HOPPER_KNEE_BOUNDS,
        "model_version": PRESETS[HOPPER[0]].model_version,
        "rows": rows,
    }, indent=2))
    figure, axes = plt.subplots(1, len(HOPPER), figsize=(11, 4), sharey=True)
    for ax, preset in zip(axes, HOPPER, strict=True):
        for knee, points in sorted(curves[preset].items()):
            ax.plot([p["clock_mhz"] for p in points], [p["energy_ratio"] for p in points],
                    label=f"knee {knee} MHz")
        ax.set_title(f"{preset}: TP8 Llama block, fwd+bwd")
        ax.set_xlabel("SM clock (MHz)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("E / E(f_max)")
    axes[0].legend()
    figure.tight_layout()
    figure.savefig(args.out_dir / "knee_sensitivity.png", dpi=120)
    print(f"wrote {out} and knee_sensitivity.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
