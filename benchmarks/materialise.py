"""Time to materialise random variants of a Llama-3.2-3B-sized tensor-parallel layer.

A search materialises hundreds of variants of one graph. This captures one layer's forward
and backward graphs as AOT autograd hands them to Inductor (TP8 on a fake process group,
over fake tensors: only the graph structure matters), analyses each once, draws random
variants (a launch slot per partition) at k = 2 and 4 nanobatches with
``VariantSpace.sample``, and applies each as the pipeline does (``codegen.apply``: the
rewrite and the clock switch):

- before: without the k-way cache (``analysis.rewrites`` emptied before every variant:
  emission and whole-graph fake-tensor propagation each time, as before the cache);
- after: with it (the first variant of a graph and k propagates, the others copy).

Both leave Python code generation to the graph's first use; ``code (ms)`` is what that
costs, once per graph that is run or printed, whichever path made it. Times are taken with
the cyclic garbage collector paused, as ``timeit`` does.

    python benchmarks/materialise.py --variants 100 --out benchmarks/results/materialise.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.fx
from overlap_sim import add_layer_arguments, step_layer
from rich.console import Console
from rich.table import Table
from torch._functorch.aot_autograd import make_boxed_func
from torch._inductor.compile_fx import compile_fx
from torch.testing._internal.distributed.fake_pg import FakeStore

from kareus.codegen.apply import apply
from kareus.passes.analyse import GraphAnalysis, analyse
from kareus.passes.decide import Choice


def analysed_layer(
    tp: int, batch: int, seq: int
) -> list[tuple[torch.fx.GraphModule, GraphAnalysis]]:
    """The layer's forward and backward graphs, as Inductor's inner compiler gets them,
    each with its analysis (the backward's from the forward's interfaces)."""
    graphs = []

    def capture(gm, inputs, **kwargs):
        graphs.append((gm, tuple(inputs), kwargs))
        return make_boxed_func(gm.forward)

    step_layer(functools.partial(compile_fx, inner_compile=capture), tp, batch, seq)
    (fw, fw_inputs, fw_kwargs), (bw, bw_inputs, _) = graphs
    forward = analyse(
        fw, fw_inputs, "forward", static_input_idxs=fw_kwargs["static_input_idxs"],
        label="forward",
    )
    backward = analyse(bw, bw_inputs, "backward", forward.interfaces, label="backward")
    return [(fw, forward), (bw, backward)]


def time_graph(
    gm: torch.fx.GraphModule, analysis: GraphAnalysis, k: int, n: int, seed: int
) -> dict[str, Any]:
    """Milliseconds per variant before and after, over ``n`` random variants."""
    rng = random.Random(seed)
    choices = [Choice.of(analysis.space.sample(rng, k)) for _ in range(n)]
    with _paused_gc():
        start = time.perf_counter()
        for c in choices:
            analysis.rewrites.clear()
            apply(gm, analysis, c)
        before_s = time.perf_counter() - start
    analysis.rewrites.clear()
    with _paused_gc():
        start = time.perf_counter()
        first = apply(gm, analysis, choices[0])
        first_s = time.perf_counter() - start
        start = time.perf_counter()
        for c in choices[1:]:
            apply(gm, analysis, c)
        steady_s = time.perf_counter() - start
    with _paused_gc():
        start = time.perf_counter()
        code = first.code  # generated on first use
        code_s = time.perf_counter() - start
    analysis.rewrites.clear()
    if code != apply(gm, analysis, choices[0]).code:
        raise AssertionError(f"{analysis.label} k={k}: the cached variant differs")
    return {
        "graph": analysis.label,
        "nanobatches": k,
        "nodes": len(first.graph.nodes),
        "variants": n,
        "distinct_variants": len(set(choices)),
        "before_ms": before_s / n * 1e3,
        "after_ms": (first_s + steady_s) / n * 1e3,
        "after_steady_ms": steady_s / (n - 1) * 1e3,
        "first_ms": first_s * 1e3,
        "code_ms": code_s * 1e3,
        "speedup": before_s / (first_s + steady_s),
    }


@contextlib.contextmanager
def _paused_gc() -> Iterator[None]:
    """Time with the cyclic garbage collector paused, as ``timeit`` does: a full collection
    here scans the whole process (torch, Dynamo, the captured graphs; ~0.25 s on this CPU),
    which would time the process's heap rather than materialising."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_layer_arguments(parser)
    parser.add_argument("--variants", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/materialise.json"))
    args = parser.parse_args(argv)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.tp)
    graphs = analysed_layer(args.tp, args.batch, args.seq)
    rows = [
        time_graph(gm, analysis, k, args.variants, args.seed)
        for k in (2, 4)
        for gm, analysis in graphs
    ]

    table = Table(
        title=f"Materialising {args.variants} random variants, Llama-3.2-3B-sized layer, "
        f"TP{args.tp} (ms per variant)",
        title_justify="left",
    )
    for column in ("graph", "k", "nodes", "before", "after", "speedup", "after, steady",
                   "first", "code"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(
            r["graph"], str(r["nanobatches"]), str(r["nodes"]), f"{r['before_ms']:.1f}",
            f"{r['after_ms']:.1f}", f"{r['speedup']:.1f}x", f"{r['after_steady_ms']:.1f}",
            f"{r['first_ms']:.0f}", f"{r['code_ms']:.1f}",
        )
    console = Console(width=120)
    console.print(table)
    console.print("after: one NanobatchRewrite and its first materialise (first) amortised over "
                  "all variants; code: Python code generation on a graph's first use")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {"tp": args.tp, "batch": args.batch, "seq": args.seq, "seed": args.seed,
              "torch": torch.__version__, "gc": "paused while timed", "rows": rows}
    args.out.write_text(json.dumps(record, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
