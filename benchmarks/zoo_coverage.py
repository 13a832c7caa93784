"""How much of real models' communication kareus's nanobatch rewrite covers, and whether
the rewritten models still train exactly.

For each zoo model (torchtitan Llama 3, Hugging Face Llama / Qwen3 / Mixtral under their
own tensor-parallel plans; see tests/zoo/models.py) and each option set (k = 1, 2, 4 with
Inductor, k = 2, 4 with eager lowering), 2 gloo CPU ranks train the kareus-compiled model
and an eager copy 2 SGD steps and compare losses and every parameter gradient; the graph
reports say, per forward and backward graph, how many collectives stay split into
nanobatches, where the first split region ends and why, and why a graph fell back.

    python benchmarks/zoo_coverage.py                        # every model, every option set
    python benchmarks/zoo_coverage.py --models hf-llama-auto,titan-llama3 --options k1,k2-eager

Prints one table and writes benchmarks/results/zoo_coverage.json. Needs torchtitan and
transformers (+ accelerate) installed; a model whose library is missing is skipped.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.zoo: a namespace package, importable from the root

from rich.console import Console
from rich.table import Table

from tests.zoo.harness import (
    OPTION_SETS,
    ZooResult,
    error_message,
    error_origin,
    options_label,
    run_zoo,
)
from tests.zoo.models import BUILDERS, REQUIRES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    labels = [options_label(o) for o in OPTION_SETS]
    parser.add_argument(
        "--models", default=",".join(BUILDERS), help=f"comma list of {', '.join(BUILDERS)}"
    )
    parser.add_argument(
        "--options", default=",".join(labels), help=f"comma list of {', '.join(labels)}"
    )
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument(
        "--timeout", type=float, default=900.0, help="seconds per model (the whole spawn)"
    )
    parser.add_argument(
        "--shared-group", action="store_true",
        help="one process group for all option sets (default: a fresh one per option set)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/zoo_coverage.json")
    args = parser.parse_args(argv)

    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in BUILDERS]
    if unknown:
        parser.error(f"unknown models {unknown}; known: {', '.join(BUILDERS)}")
    by_label = {options_label(o): o for o in OPTION_SETS}
    if bad := [o for o in args.options.split(",") if o not in by_label]:
        parser.error(f"unknown option sets {bad}; known: {', '.join(by_label)}")
    options_list = [by_label[o] for o in args.options.split(",")]

    console = Console(width=None if sys.stdout.isatty() else 220)
    records, table = [], _table()
    for model in models:
        if missing := [m for m in REQUIRES[model] if importlib.util.find_spec(m) is None]:
            console.print(f"[yellow]{model}: skipped, {', '.join(missing)} not installed")
            continue
        console.print(f"{model}: {len(options_list)} option sets on 2 gloo ranks ...")
        start = time.perf_counter()
        results = run_zoo(
            model, options_list, steps=args.steps, timeout_s=args.timeout,
            isolate=not args.shared_group,
        )
        wall = time.perf_counter() - start
        console.print(f"{model}: {wall:.1f} s")
        for options in options_list:
            ranks = [r for r in results if r.options == options]
            table.add_row(*_row(model, options, ranks))
        table.add_section()
        records.append(_record(model, wall, options_list, results))

    console.print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    summary = {"steps": args.steps, "environment": _environment(), "models": records}
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    console.print(f"wrote {args.out}")
    return 0


def _table() -> Table:
    table = Table(
        title="kareus on the zoo: 2 gloo CPU ranks, 2 SGD steps vs eager", title_justify="left"
    )
    for column in (
        "model", "options", "numerics", "fwd split", "bwd split",
        "first barrier (fwd / bwd)", "fallback reasons", "s",
    ):
        table.add_column(column, overflow="fold")
    return table


def _row(model: str, options: dict, ranks: list[ZooResult]) -> list[str]:
    first = ranks[0]
    errors = [r for r in ranks if r.error]
    if errors:
        e = errors[0]
        numerics = f"[red]rank {e.rank} failed in {error_origin(e.error)}: {error_message(e.error)}"
    else:
        loss = max(r.max_loss_rel_diff for r in ranks)
        grad = max(max(r.max_grad_diff, default=float("nan")) for r in ranks)
        same = len({tuple(r.losses) for r in ranks}) == 1
        numerics = f"loss rel {loss:.1e}, grad {grad:.1e}" + ("" if same else " [red]ranks differ")
    fwd, bwd = (_kind_summary(first.reports, kind) for kind in ("forward", "backward"))
    return [
        model,
        options_label(options),
        numerics,
        fwd["split"],
        bwd["split"],
        f"{fwd['barrier']} / {bwd['barrier']}",
        "; ".join(_fallbacks(first.reports)) or "-",
        f"{max(r.seconds for r in ranks):.0f}",
    ]


def _kind_summary(reports: list, kind: str) -> dict[str, str]:
    """Split/total summed over the graphs of one kind (graph breaks make several)."""
    graphs = [r for r in reports if r.kind == kind]
    if not graphs:
        return {"split": "-", "barrier": "-"}
    coverages = [getattr(r, "coverage", None) for r in graphs]
    if any(c is None for c in coverages):
        split = "-"
    else:
        split = f"{sum(c.split for c in coverages)}/{sum(c.total for c in coverages)}"
    applied = sorted({r.nanobatches for r in graphs})
    split += f" k={','.join(map(str, applied))}"
    if len(graphs) > 1:
        split += f" ({len(graphs)} graphs)"
    barriers = [c.first_barrier for c in coverages if c is not None and c.first_barrier is not None]
    barrier = "-" if None in coverages else (
        _short(str(barriers[0]), 70) if barriers else "none"
    )
    return {"split": split, "barrier": barrier}


def _fallbacks(reports: list, limit: int = 4) -> list[str]:
    """Distinct reasons (kind: reason, shortened), most frequent first; the JSON has them whole."""
    seen: dict[str, int] = {}
    for r in reports:
        if r.fallback:
            key = f"{r.kind}: {_short(str(r.fallback))}"
            seen[key] = seen.get(key, 0) + 1
    ranked = sorted(seen.items(), key=lambda item: -item[1])
    lines = [f"{k} (x{n})" if n > 1 else k for k, n in ranked[:limit]]
    if len(ranked) > limit:
        lines.append(f"+{len(ranked) - limit} more")
    return lines


def _short(text: str, width: int = 90) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _record(model: str, wall: float, options_list: list[dict], results: list[ZooResult]) -> dict:
    return {
        "model": model,
        "wall_s": round(wall, 1),
        "option_sets": [
            {
                "options": options,
                "label": options_label(options),
                "ranks": [_rank_record(r) for r in results if r.options == options],
            }
            for options in options_list
        ],
    }


def _rank_record(r: ZooResult) -> dict:
    return {
        "rank": r.rank,
        "compile_options": r.compile_options,
        "seconds": round(r.seconds, 1),
        "losses": r.losses,
        "reference_losses": r.reference_losses,
        "max_grad_diff": r.max_grad_diff,
        "error": None if r.error is None else {
            "origin": error_origin(r.error),
            "message": error_message(r.error),
            "traceback": r.error,
        },
        "graphs": [_graph_record(g) for g in r.reports],
    }


def _graph_record(g) -> dict:
    coverage = getattr(g, "coverage", None)
    return {
        "label": g.label,
        "kind": g.kind,
        "nanobatches": g.nanobatches,
        "fallback": _reason_record(g.fallback),
        "collectives": [c.kind for c in g.collectives],
        "coverage": None if coverage is None else {
            "split": coverage.split,
            "total": coverage.total,
            "first_barrier": _reason_record(coverage.first_barrier),
        },
        "barriers": [_reason_record(b) for b in g.barriers[:5]],
        "barrier_count": len(g.barriers),
    }


def _reason_record(reason) -> dict | None:
    return None if reason is None else {
        "kind": reason.kind.value, "node": reason.node, "detail": reason.detail
    }


def _environment() -> dict[str, object]:
    """What the numbers were measured with: library versions and the kareus tree."""
    import subprocess
    from importlib.metadata import PackageNotFoundError, version

    def git(*args: str) -> str:
        # read-only queries; an empty answer where git is missing
        run = subprocess.run(
            ["git", *args], check=False, cwd=ROOT, capture_output=True, text=True
        )
        return run.stdout.strip()

    versions = {}
    for package in ("torch", "transformers", "accelerate", "torchtitan"):
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            versions[package] = None
    return {
        "versions": versions,
        "kareus_commit": git("rev-parse", "HEAD"),
        "kareus_uncommitted_changes": bool(git("status", "--porcelain", "--", "kareus")),
    }


if __name__ == "__main__":
    sys.exit(main())
