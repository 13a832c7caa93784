"""How long planning a pipeline takes as it deepens, and how far from optimal its plans are.

Llama 3.1 70B under TP8 on a simulated H100 SXM (``kareus plan``'s trace: 4096 tokens a
microbatch of 1 sequence, the Megatron-LM layout), its stages' kareus instruction options
at every search clock, and the 1F1B DAG of PP stages x M microbatches for PP in 2..32 and
M in 8..128 (1F1B needs M >= PP). Per (PP, M) the kareus frontier is planned as ``kareus
plan`` plans it (10 points, at most 20 s of HiGHS a solve): exactly up to
``pipeline_large.EXACT_INSTRUCTIONS`` instructions (clocks a plan hardly gains by merged,
``planner.clock_merge``, their loss in the gap), else by the large-DAG planner (the
program of shared options, its gap proven against the relaxation without switches and the
rank bound). The table: instructions, the method, the seconds, the largest and the median
stated gap over the frontier's points.

Then, on a DAG small enough for the exact solve (PP2 x 8, at most ``EXACT_SOLVE_S`` a
solve, its own proven gap said, every clock weighed: none merged), the large-DAG planner
is run on it too (``exact_up_to`` 0), at each point of the exact frontier's own time: its
least energy against the exact one (the true gap, where the exact point is proven), and
the gap it stated (which must be at least the true one).

    python benchmarks/pipeline_scaling.py [--out-dir benchmarks/results] [--only 32x128]

Writes ``pipeline_scaling.json`` and ``pipeline_scaling.png`` there; about 25 minutes on
2 cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from kareus.cli import build_parser
from kareus.devices.resolve import resolve_device
from kareus.offline.cli import workload_of
from kareus.offline.plan import method_options
from kareus.offline.trace import trace_stages
from kareus.planner import pipeline
from kareus.planner.iteration import energy_model
from kareus.planner.pipeline_large import EXACT_INSTRUCTIONS

DEVICE = "sim:h100-sxm"
STAGES = (2, 4, 8, 16, 32)
MICROBATCHES = {2: (8, 32, 128), 4: (8, 128), 8: (8, 32, 128), 16: (16, 64, 128),
                32: (32, 128)}  # 1F1B needs M >= PP; 16 x 64 is the workload
EXACT = ((2, 8),)  # (PP, M) compared with the exact solve
MAX_SOLVE_S = 20.0  # kareus plan's default
EXACT_SOLVE_S = 60.0  # the exact comparison's, per solve (its unproven points are said)


def options_at(pp: int) -> tuple[dict, pipeline.EnergyModel]:
    """The kareus options of 70B's stages at ``pp`` on the device, and the replica's
    energy model."""
    workload = workload_of(build_parser().parse_args([
        "plan", "llama3.1-70b", "--tp", "8", "--pp", str(pp), "--microbatches", str(pp),
        "--microbatch-size", "1", "--seq", "4096", "--device", DEVICE]))
    gpu = resolve_device(DEVICE)
    stages = trace_stages(workload, DEVICE)
    return (method_options(stages, "kareus", 8),
            energy_model(gpu.static_power_w, gpu.clock_switch_s, 8 * pp))


def frontier(pp: int, m: int, options, model, exact_instructions: int = EXACT_INSTRUCTIONS,
             max_solve_s: float | None = MAX_SOLVE_S, merge_loss: float | None = None):
    dag = pipeline.one_f_one_b(pp, m)
    start = time.perf_counter()
    points = pipeline.pipeline_frontier(dag, options, model=model, points=10,
                                        max_solve_s=max_solve_s,
                                        best_found=max_solve_s is not None,
                                        exact_up_to=exact_instructions, merge_loss=merge_loss)
    return points, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--only", default=None,
                        help='re-plan these cases ("16x128,32x128") and the exact comparison '
                        "only, the other rows kept from the JSON already there")
    args = parser.parse_args(argv)
    only = None if args.only is None else {tuple(map(int, c.split("x")))
                                           for c in args.only.split(",") if c}
    kept = []
    if only is not None:
        kept = [r for r in json.loads((args.out_dir / "pipeline_scaling.json").read_text())[
            "rows"] if (r["pp"], r["microbatches"]) not in only]
    rows, checks = [], []
    print(f"{'PP':>3} {'M':>4} {'instr':>6} {'method':>6} {'seconds':>8} {'max gap':>8} "
          f"{'median gap':>10}")
    for pp in STAGES:
        if only is not None and not any(p == pp for p, _ in only | set(EXACT)):
            continue
        options, model = options_at(pp)
        cases = [m for m in MICROBATCHES[pp] if only is None or (pp, m) in only]
        if not cases and not any(pp == p for p, _ in EXACT):
            continue
        for m in cases:
            points, seconds = frontier(pp, m, options, model)
            n = 2 * pp * m
            gaps = [p.gap for p in points]
            row = {"pp": pp, "microbatches": m, "instructions": n,
                   "method": "exact" if n <= EXACT_INSTRUCTIONS else "large",
                   "seconds": seconds, "max_gap": max(gaps),
                   "median_gap": statistics.median(gaps), "points": len(points)}
            rows.append(row)
            print(f"{pp:>3} {m:>4} {n:>6} {row['method']:>6} {seconds:>8.1f} "
                  f"{row['max_gap']:>8.2%} {row['median_gap']:>10.2%}", flush=True)
        if any(pp == p for p, _ in EXACT):
            for p, m in EXACT:
                if p != pp:
                    continue
                exact, exact_s = frontier(pp, m, options, model, max_solve_s=EXACT_SOLVE_S,
                                          merge_loss=0.0)  # every clock weighed
                dag = pipeline.one_f_one_b(pp, m)
                start = time.perf_counter()
                large = [pipeline.least_energy(dag, options, time_limit_s=q.time_s,
                                               model=model, max_solve_s=MAX_SOLVE_S,
                                               best_found=True, exact_up_to=0)
                         for q in exact]  # at each exact point's own time
                large_s = time.perf_counter() - start
                for q, best in zip(exact, large):
                    checks.append({"pp": pp, "microbatches": m, "time_s": q.time_s,
                                   "exact_j": q.energy_j, "exact_gap": q.gap,
                                   "large_j": best.energy_j,
                                   "true_gap": (best.energy_j - q.energy_j) / best.energy_j,
                                   "stated_gap": best.gap, "exact_s": exact_s,
                                   "large_s": large_s})
    print("\nthe large-DAG planner against the exact solve (per point of the exact frontier)")
    print("(exact gap: what HiGHS proved of the exact point within its time; true gap: the "
          "large plan's energy above the exact point's)")
    print(f"{'PP':>3} {'M':>4} {'time (s)':>9} {'exact J':>10} {'exact gap':>9} "
          f"{'large J':>10} {'true gap':>9} {'stated':>8}")
    for c in checks:
        print(f"{c['pp']:>3} {c['microbatches']:>4} {c['time_s']:>9.4f} {c['exact_j']:>10.1f} "
              f"{c['exact_gap']:>9.2%} {c['large_j']:>10.1f} {c['true_gap']:>9.2%} "
              f"{c['stated_gap']:>8.2%}")
    for pp, m in EXACT:
        mine = [c for c in checks if (c["pp"], c["microbatches"]) == (pp, m)]
        print(f"PP{pp} x {m}: exact frontier {mine[0]['exact_s']:.1f} s, the large planner "
              f"at its points {mine[0]['large_s']:.1f} s")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    rows = sorted([*kept, *rows], key=lambda r: (r["pp"], r["microbatches"]))
    data = {"device": DEVICE, "model": "llama3.1-70b", "tp": 8, "schedule": "1f1b",
            "exact_instructions": EXACT_INSTRUCTIONS, "max_solve_s": MAX_SOLVE_S,
            "rows": rows, "exact_checks": checks}
    (args.out_dir / "pipeline_scaling.json").write_text(json.dumps(data, indent=1) + "\n")
    plot(rows, args.out_dir / "pipeline_scaling.png")
    print(f"wrote {args.out_dir / 'pipeline_scaling.json'} and pipeline_scaling.png")
    return 0


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for pp in STAGES:
        mine = [r for r in rows if r["pp"] == pp]
        if not mine:
            continue
        x = [r["instructions"] for r in mine]
        left.plot(x, [r["seconds"] for r in mine], marker="o", label=f"PP{pp}")
        right.plot(x, [100 * r["max_gap"] for r in mine], marker="o", label=f"PP{pp}")
    for ax in (left, right):
        ax.set_xscale("log")
        ax.axvline(EXACT_INSTRUCTIONS, color="grey", ls=":", lw=1)
        ax.set_xlabel("instructions (stages x microbatches x 2)")
        ax.legend(fontsize=8)
    left.set_yscale("log")
    left.set_ylabel("seconds to plan the kareus frontier (10 points)")
    right.set_ylabel("largest stated gap over the frontier (%)")
    fig.suptitle("Llama 3.1 70B TP8, 1F1B, sim:h100-sxm: planning time and proven gap "
                 "(exact left of the dotted line)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
