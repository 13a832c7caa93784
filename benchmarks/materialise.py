"""Time to materialise random variants of a Llama-3.2-3B-sized tensor-parallel layer.

A search materialises hundreds of variants of one graph. This captures one layer's forward
and backward graphs as AOT autograd hands them to Inductor (TP8 on a fake process group,
over fake tensors: only the graph structure matters), draws random launch slots per
partition at k = 2 and 4 nanobatches, and materialises each variant twice:

- before: ``nanobatch_graph`` per variant (emission and fake-tensor propagation each time);
- after: one ``NanobatchRewrite`` per graph and k (its first ``materialise`` propagates),
  then ``materialise`` per variant (metadata copied from the first).

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.fx
from overlap_sim import step_layer
from rich.console import Console
from rich.table import Table
from torch._functorch.aot_autograd import make_boxed_func
from torch._inductor.compile_fx import compile_fx
from torch.testing._internal.distributed.fake_pg import FakeStore

from kareus.passes.collectives import find_collectives
from kareus.passes.interface import backward_inputs, forward_inputs, record_forward
from kareus.passes.nanobatch import NanobatchRewrite, Schedule, nanobatch_graph
from kareus.passes.ops import OP_TABLE
from kareus.passes.partition import GraphPartitioning, partition_graph
from kareus.passes.placement import PlacementResult, per_nanobatch, propagate


@dataclass(frozen=True)
class Captured:
    gm: torch.fx.GraphModule
    inputs: tuple[Any, ...]
    kwargs: dict[str, Any]


def capture_layer(tp: int, batch: int, seq: int) -> tuple[Captured, Captured]:
    """The forward and backward graphs of one layer, as Inductor's inner compiler gets them."""
    graphs = []

    def capture(gm, inputs, **kwargs):
        graphs.append(Captured(gm, tuple(inputs), kwargs))
        return make_boxed_func(gm.forward)

    step_layer(functools.partial(compile_fx, inner_compile=capture), tp, batch, seq)
    forward, backward = graphs
    return forward, backward


def random_schedules(
    partitioning: GraphPartitioning, placements: PlacementResult, k: int, n: int, seed: int
) -> list[Schedule]:
    """``n`` schedules with a random launch slot per partition (as ``VariantSpace.sample``)."""
    rng = random.Random(seed)
    parts = partitioning.partitions
    slots = [len(p.slots) + 1 if per_nanobatch(placements.placements[p.collective.node]) else 1
             for p in parts]
    own = (None,) * len(parts)
    return [Schedule(k, tuple(rng.randrange(s) for s in slots), own) for _ in range(n)]


def time_graph(
    name: str, c: Captured, placements: PlacementResult, k: int, n: int, seed: int
) -> dict[str, Any]:
    """Milliseconds per variant before and after, over ``n`` random schedules."""
    graph = c.gm.graph
    collectives = find_collectives(graph)
    partitioning = partition_graph(graph, collectives)
    args = (c.gm, partitioning, collectives, placements)
    schedules = random_schedules(partitioning, placements, k, n, seed)
    with _paused_gc():
        start = time.perf_counter()
        for s in schedules:
            nanobatch_graph(*args, s, c.inputs)
        before_s = time.perf_counter() - start
    with _paused_gc():
        start = time.perf_counter()
        rewrite = NanobatchRewrite(*args, k, c.inputs)
        materialised = rewrite.materialise(schedules[0])
        first_s = time.perf_counter() - start
        start = time.perf_counter()
        for s in schedules[1:]:
            rewrite.materialise(s)
        steady_s = time.perf_counter() - start
    with _paused_gc():
        start = time.perf_counter()
        code = materialised.code  # generated on first use
        code_s = time.perf_counter() - start
    if code != nanobatch_graph(*args, schedules[0], c.inputs).code:
        raise AssertionError(f"{name} k={k}: materialise differs from nanobatch_graph")
    return {
        "graph": name,
        "nanobatches": k,
        "nodes": len(materialised.graph.nodes),
        "variants": n,
        "distinct_schedules": len(set(schedules)),
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
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--variants", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/materialise.json"))
    args = parser.parse_args(argv)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.tp)
    fw, bw = capture_layer(args.tp, args.batch, args.seq)
    rows = []
    for k in (2, 4):
        static = fw.kwargs["static_input_idxs"]
        fw_placements = propagate(fw.gm.graph, forward_inputs(fw.gm.graph, static), k, OP_TABLE)
        interface = record_forward(fw.gm.graph, fw_placements)
        bw_placements = propagate(
            bw.gm.graph, backward_inputs(bw.gm.graph, interface), k, OP_TABLE
        )
        graphs = (("forward", fw, fw_placements), ("backward", bw, bw_placements))
        for name, c, placements in graphs:
            rows.append(time_graph(name, c, placements, k, args.variants, args.seed))

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
