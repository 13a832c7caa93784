"""Stage 1 of 3 (analyse -> decide -> apply): everything about a graph that no decision changes.

``analyse`` finds the collectives, cuts the graph into partitions, propagates placements
for every nanobatch count, says which counts apply and why the others do not, and builds
the variant space. It is pure: no device, no collective call, no process group created.
Its result keys everything later stages store (profiles, plans, caches) by the graph's
structural hash, identical on every rank and across runs of the same program.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from kareus.errors import KareusError
from kareus.passes import sizes
from kareus.passes.backends import exclusive_kinds
from kareus.passes.collectives import Collective, find_collectives
from kareus.passes.interface import (
    ForwardInterface,
    backward_inputs,
    by_exchanges_only,
    cut_in_blocks,
    exchanged,
    forward_inputs,
    record_forward,
)
from kareus.passes.ops import OP_TABLE, OpTable
from kareus.passes.partition import GraphPartitioning, graph_hash, partition_graph
from kareus.passes.placement import (
    Aligned,
    Piece,
    PlacementResult,
    Split,
    per_nanobatch,
    propagate,
)
from kareus.passes.reasons import Reason, ReasonKind
from kareus.passes.variants import NANOBATCH_COUNTS, VariantSpace, variant_space

GRAPH_KINDS = ("forward", "backward", "inference")


class GraphKindError(KareusError, ValueError):
    """A graph kind ``analyse`` does not know."""


ForwardInterfaces = Mapping[int, ForwardInterface]
"""What a forward tells its backward, per nanobatch count."""


@dataclass(frozen=True)
class GraphAnalysis:
    label: str  # for display and clock-switch records ("r0/forward"); not an identity
    kind: str  # "forward" | "backward" | "inference"
    key: str  # structural hash (ops, shapes, dtypes, groups): what stored results are keyed by
    shape_free_key: str  # the same without shapes: ranks whose data decides sizes still match
    num_nodes: int
    example_inputs: tuple[Any, ...]
    collectives: tuple[Collective, ...]
    partitioning: GraphPartitioning
    placements: Mapping[int, PlacementResult]  # per count k > 1
    space: VariantSpace
    interfaces: ForwardInterfaces  # forward graphs: what their backward needs, per k > 1
    exclusive: Mapping[str, frozenset[str]]  # group -> collective kinds never two in flight
    table: OpTable = field(compare=False, repr=False)  # the op facts it was analysed with
    exchanged: bool = False
    """Its rows are exchanged in per-rank blocks (``Split.sizes``): split only by those
    exchanges, whatever else its inputs carry, so every version of it (its sizes differ by
    rank and step) is analysed alike; never planned, nor agreed (``runtime.materialise``)."""
    rewrites: dict[int, Any] = field(default_factory=dict, compare=False, repr=False)
    """A cache for codegen: per count, the k-way emitted graph (``NanobatchRewrite``) that
    ``apply`` materialises every variant of that count from."""

    def placements_at(self, k: int) -> PlacementResult:
        """What ``k`` nanobatches split (k = 1 reports what k = 2 would)."""
        return self.placements[max(k, 2)]


def analyse(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    kind: str,
    forward: ForwardInterfaces | None = None,
    *,
    backend: str | None = None,
    static_input_idxs: Sequence[int] = (),
    label: str | None = None,
    table: OpTable = OP_TABLE,
) -> GraphAnalysis:
    """Analyse ``gm`` (an AOT graph with ``node.meta["val"]``) of the given ``kind``.

    ``forward``: for a backward graph, the ``interfaces`` of its forward's analysis;
    ``backend``: the kind of its collectives' process-group backend ("nccl", "gloo",
    "fake"; None offline), which says what resources a collective can have and what may
    not be in flight twice (``passes.backends``); ``static_input_idxs``: for a forward, its
    parameters and buffers (as Inductor passes them); ``table``: the op facts every stage
    reads (kept on the result, so the rewrite and the profiler read the same).
    """
    if kind not in GRAPH_KINDS:
        raise GraphKindError(f"kind must be one of {GRAPH_KINDS}, got {kind!r}")
    graph = gm.graph
    collectives = tuple(find_collectives(graph))
    partitioning = partition_graph(graph, collectives, table)
    placements, infeasible = {}, {}
    for k in NANOBATCH_COUNTS[1:]:
        if kind == "backward":
            inputs = backward_inputs(graph, forward.get(k) if forward else None)
        else:
            inputs = forward_inputs(graph, static_input_idxs)
        placements[k] = propagate(graph, inputs, k, table)
        inputs, placements[k] = cut_in_blocks(graph, inputs, placements[k], collectives, k, table)
        if exchanged(placements[k]):
            placements[k] = propagate(graph, by_exchanges_only(inputs), k, table)
        why = feasibility(graph, placements[k], k, collectives)
        if why:
            infeasible[k] = why
    exchanges = any(exchanged(result) for result in placements.values())
    for k, result in placements.items():
        if exchanges and not exchanged(result):  # split by its size, not its exchanges
            infeasible.setdefault(k, Reason(
                ReasonKind.DATA_DEPENDENT_SIZES, None,
                f"at {k} nanobatches the graph's all-to-all rows would not be cut by "
                "destination, and every version of it (sizes differ by rank) must split alike",
            ))
    interfaces = (
        {k: record_forward(graph, result) for k, result in placements.items()}
        if kind == "forward"
        else {}
    )
    return GraphAnalysis(
        label=label or kind,
        kind=kind,
        key=graph_hash(graph, table),
        shape_free_key=graph_hash(graph, table, shapes=False),
        num_nodes=len(graph.nodes),
        example_inputs=tuple(example_inputs),
        collectives=collectives,
        partitioning=partitioning,
        placements=placements,
        space=variant_space(partitioning, placements, infeasible, backend),
        interfaces=interfaces,
        exclusive={c.group_name: exclusive_kinds(backend) for c in collectives},
        table=table,
        exchanged=exchanges,
    )


def feasibility(
    graph: torch.fx.Graph, result: PlacementResult, k: int, collectives: Sequence[Collective]
) -> Reason | None:
    """Why ``k`` nanobatches cannot apply to ``graph`` (None when they can)."""
    split_inputs = [
        n for n in graph.find_nodes(op="placeholder")
        if isinstance(result.placements[n], (Split, Piece))
    ]
    if not split_inputs:
        return Reason(ReasonKind.NO_SPLIT_INPUT, None, "no graph input is split along a batch dim")
    batches = set()  # how split dims are cut: "static", or each symbolic batch expression
    for node, p in result.placements.items():
        for q in p if isinstance(p, tuple) else (p,):
            q = q.rows if isinstance(q, Aligned) else q  # sliced per nanobatch like a split
            # Rows in per-rank blocks are cut block by block, whatever their sizes (which
            # the graph reads at run time): nothing to check here.
            if isinstance(q, Split) and q.sizes is None and node.op != "output":
                size = _split_size(node, p, q)
                if sizes.symbolic(size):
                    unit = sizes.units(size)
                    # a blocked dim: blocks of whole batch units, each cut alike
                    batches.add(unit[1] if unit and unit[0] % q.blocks == 0 else None)
                    if unit and size.hint // unit[0] < k:
                        # An empty piece at the example size: Inductor cannot lower its
                        # reshapes (torch 2.13), and the overlap would be k - 1 pieces.
                        return Reason(
                            ReasonKind.NOT_DIVISIBLE,
                            node.name,
                            f"dim {q.dim} of symbolic size {size} ({size.hint} at compile "
                            f"time): fewer than {k} units of {unit[1]}, a nanobatch empty",
                        )
                elif size is not None:
                    batches.add("static")
                if len(batches) > 1 or None in batches:
                    return Reason(
                        ReasonKind.SYMBOLIC_SHAPES,
                        node.name,
                        f"dim {q.dim} of size {size}: nanobatches cut symbolic split dims only "
                        "as whole multiples of one batch expression (per block), and then no "
                        f"split dim of static size (split dims: {_cuts(batches)})",
                    )
                if size is not None and not sizes.symbolic(size) and size % (k * q.blocks):
                    blocks = f" x {q.blocks} blocks" if q.blocks > 1 else ""
                    return Reason(
                        ReasonKind.NOT_DIVISIBLE,
                        node.name,
                        f"dim {q.dim} of size {size} does not divide into {k} nanobatches{blocks}",
                    )
    if not any(per_nanobatch(result.placements[c.node]) for c in collectives):
        first = result.barriers[0] if result.barriers else None
        why = f" (the split region ends at {first})" if first else ""
        return Reason(
            ReasonKind.NO_SPLIT_COLLECTIVE,
            None,
            f"no collective stays split, so nothing could overlap{why}",
        )
    return None


def _split_size(node: torch.fx.Node, p: object, q: Split) -> sizes.Size | None:
    val = node.meta.get("val")
    if isinstance(p, tuple):
        val = val[p.index(q)] if isinstance(val, (list, tuple)) else None
    return sizes.size(val.shape[q.dim]) if isinstance(val, torch.Tensor) else None


def _cuts(batches: set[object]) -> str:
    return ", ".join(sorted("unsupported" if b is None else str(b) for b in batches))
