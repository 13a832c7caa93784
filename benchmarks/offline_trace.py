"""How long tracing and profiling a paper-sized workload's stages takes, offline.

Traces every distinct graph of the workload's pipeline stages for one rank over fake
tensors under a fake process group (``kareus.offline.trace``), profiles and costs them on
the simulated GPU, and prints each stage's instructions (graphs and counts) with their
baseline time and energy, and the seconds it took. Run it under ``/usr/bin/time -v`` for
the peak RSS; a fresh ``--cache-dir`` measures a cold profile store.

    python benchmarks/offline_trace.py --model llama3.2-3b --tp 8 --pp 2 \\
        --microbatches 8 --microbatch-size 8 --seq 4096 --device sim:a100-sxm4-40gb \\
        --out benchmarks/results/offline_trace_llama3.2-3b.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from kareus.offline.trace import stage_graphs, trace_model
from kareus.offline.workload import Workload


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3.2-3b", help="a preset or a config.json")
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--microbatch-size", type=int, default=8)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--sp", action="store_true")
    parser.add_argument("--recompute", default="none", choices=("none", "full"))
    parser.add_argument("--device", default="sim:a100-sxm4-40gb")
    parser.add_argument("--search-budget", type=int, default=32)
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="the profile store's directory (default: a fresh one)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    workload = Workload.of(
        args.model, tp=args.tp, pp=args.pp, microbatches=args.microbatches,
        microbatch_size=args.microbatch_size, seq=args.seq, sp=args.sp,
        recompute=args.recompute,
    )
    cache_dir = args.cache_dir or Path(tempfile.mkdtemp(prefix="kareus-offline-"))
    start = time.perf_counter()
    traced = trace_model(workload, args.device, cache_dir=cache_dir,
                         search_budget=args.search_budget)
    seconds = time.perf_counter() - start
    stages = stage_graphs(workload, traced)
    rows = []
    for stage in stages:
        row = {"stage": stage.stage, "layers": [stage.layers.start, stage.layers.stop]}
        for instruction in ("forward", "backward"):
            base = stage.baseline(instruction)
            graphs = stage.forward if instruction == "forward" else stage.backward
            row[instruction] = {
                "graphs": [[g.label, n] for g, n in graphs],
                "baseline_ms": base.time_s * 1e3,
                "baseline_effective_j": base.effective_energy_j,
            }
            print(f"stage {stage.stage} (layers {stage.layers.start}-{stage.layers.stop - 1}) "
                  f"{instruction}: {', '.join(f'{g.label} x{n}' for g, n in graphs)}; "
                  f"baseline {base.time_s * 1e3:.2f} ms, {base.effective_energy_j:.2f} J")
        rows.append(row)
    graphs = {
        g.label: {
            "points": len(g.points),
            "baseline_ms": g.baseline.time_s * 1e3,
            "baseline_effective_j": g.baseline.effective_energy_j,
            "fastest_ms": min(o.time_s for o in g.points) * 1e3,
            "least_effective_j": min(o.effective_energy_j for o in g.points),
        }
        for g in traced.graphs
    }
    for label, g in graphs.items():
        print(f"{label}: {g['points']} frontier points; baseline {g['baseline_ms']:.2f} ms, "
              f"{g['baseline_effective_j']:.3f} J; fastest {g['fastest_ms']:.2f} ms; "
              f"least energy {g['least_effective_j']:.3f} J (effective)")
    print(f"traced and profiled in {seconds:.1f} s (profile store {cache_dir})")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "model": workload.name, "tp": workload.tp, "pp": workload.pp,
            "microbatch_size": workload.microbatch_size, "seq": workload.seq,
            "sp": workload.sp, "recompute": workload.recompute, "device": args.device,
            "search_budget": args.search_budget, "seconds": seconds,
            "graphs": graphs, "stages": rows,
        }, indent=2))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
