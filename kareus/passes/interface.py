"""Which inputs of an AOT graph carry the batch, and how the backward inherits that.

Forward (and inference) graphs: parameters and buffers are Inductor's static inputs; the
other inputs that feed compute are the user's activations, split along dim 0 when their
leading size is the batch size (that of the first of them), and cut in blocks instead where
that splits more collectives: one per rank where a rank takes its part of them
(``cut_by_part``), one per destination where they are exchanged (``cut_by_destination``).
Backward graphs: AOT autograd names each saved value after the forward node it came from,
so a saved value is placed as it was in the forward (joined pieces of a split value are
split again); ``tangents_i`` is the gradient of the forward's ``i``-th user output that can
have one (a floating-point tensor) and is placed like it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.fx
from torch.utils._pytree import tree_leaves

from kareus.passes.collectives import Collective
from kareus.passes.placement import (
    REPLICATE,
    Aligned,
    NodePlacement,
    Piece,
    PlacementResult,
    RowIds,
    RuleTable,
    Split,
    ancestors,
    exchanged_blocks,
    in_blocks,
    per_nanobatch,
    propagate,
)
from kareus.passes.reasons import ReasonKind
from kareus.passes.schema import arguments
from kareus.passes.sizes import shape


@dataclass(frozen=True)
class ForwardInterface:
    """What a backward graph needs from its forward: placements of saved and output values."""

    placements: dict[str, NodePlacement]
    outputs: tuple[str | None, ...]
    differentiable: tuple[bool, ...] = ()
    """Per output: whether it can have a gradient (a floating-point tensor); AOT autograd
    gives the backward a tangent for such user outputs only (never for token counts)."""


def forward_inputs(
    graph: torch.fx.Graph, static_input_idxs: Sequence[int]
) -> dict[torch.fx.Node, NodePlacement]:
    static = set(static_input_idxs)
    inputs = list(graph.find_nodes(op="placeholder"))
    activations = [
        n for i, n in enumerate(inputs)
        if i not in static and _tensor(n) is not None and _tensor(n).ndim >= 1
        and any(u.op != "output" for u in n.users)
    ]
    if not activations:
        return {}
    batch = shape(_tensor(activations[0]))[0]
    return {n: Split(0) if shape(_tensor(n))[0] == batch else REPLICATE for n in activations}


def record_forward(graph: torch.fx.Graph, result: PlacementResult) -> ForwardInterface:
    (output,) = graph.find_nodes(op="output")
    values = tree_leaves(output.args[0])  # AOT graphs return a tuple; make_fx ones may not
    outputs = tuple(a.name if isinstance(a, torch.fx.Node) else None for a in values)
    differentiable = tuple(
        isinstance(a, torch.fx.Node) and _tensor(a) is not None
        and (_tensor(a).is_floating_point() or _tensor(a).is_complex())
        for a in values
    )
    return ForwardInterface(
        {n.name: p for n, p in result.placements.items()}, outputs, differentiable
    )


def backward_inputs(
    graph: torch.fx.Graph, forward: ForwardInterface | None
) -> dict[torch.fx.Node, NodePlacement]:
    if forward is None:
        return {}
    inputs = list(graph.find_nodes(op="placeholder"))
    tangents = [n for n in inputs if n.name.startswith("tangents")]
    saved = [n for n in inputs if not n.name.startswith("tangents")]
    users = len(forward.outputs) - len(saved)
    user_outputs = forward.outputs[:users]
    if len(tangents) != users:  # a tangent per output that can have a gradient
        user_outputs = tuple(
            name for name, grad in zip(user_outputs, forward.differentiable) if grad
        )
    named = {n.name: n for n in saved}
    placements = {n: _as_input(forward.placements.get(n.name), named) for n in saved}
    for i, tangent in enumerate(tangents):
        source = user_outputs[i] if len(tangents) == len(user_outputs) else None
        # A tangent whose output is unknown is a full tensor like any other: replicated.
        placements[tangent] = _as_input(
            forward.placements.get(source) if source else None, named
        )
    return placements


def _as_input(p: NodePlacement | None, saved: dict[str, torch.fx.Node]) -> NodePlacement:
    """A forward value as the backward receives it: whole, joined from its pieces, or a
    piece of the batch (``Piece``) where the forward hands it over in pieces.

    Split again where the forward split it along one dim (in uneven blocks or not, in row
    order), or laid it out so; row ids stay
    row ids (the same value: the forward computed it once). Anything else is, to the
    backward, one full tensor used as is (replicated): a joined sum, nanobatch 0's
    attention seed (unused without dropout, which the rules refuse), a value the forward
    computed on the whole batch. Its consumers slice it where they pair it element by
    element with split values, so the backward's split region does not end there.
    """
    if isinstance(p, Piece):
        return p  # a piece of the batch, handed over as it is (``codegen.partitioner``)
    if isinstance(p, Aligned):
        p = p.rows  # the very value the forward computed once, laid out like the batch
    if isinstance(p, Split) and p.order is not None:
        return REPLICATE  # joined into the order of the batch's sort, as the forward has it
    if isinstance(p, Split) and p.blocks == 1:
        return p
    if isinstance(p, Split) and p.sizes is not None:
        # Rows in uneven per-rank blocks, cut alike where the backward has their sizes
        # (saved with the same names: AOT autograd saves the forward's symbolic sizes).
        # Otherwise any cut of the inputs is one where all are cut alike.
        sizes = tuple(s if isinstance(s, int) else saved.get(s.name) for s in p.sizes)
        return replace(p, sizes=sizes) if None not in sizes else Split(p.dim)
    return p if isinstance(p, RowIds) else REPLICATE


def cut_in_blocks(
    graph: torch.fx.Graph,
    inputs: dict[torch.fx.Node, NodePlacement],
    result: PlacementResult,
    collectives: Sequence[Collective],
    k: int,
    table: RuleTable,
) -> tuple[dict[torch.fx.Node, NodePlacement], PlacementResult]:
    """The inputs, and their placements, cut in blocks where that splits more of the
    graph's collectives than ``result`` (theirs as given): by part (``cut_by_part``), then
    by destination (``cut_by_destination``)."""
    for cut in (cut_by_part, cut_by_destination):
        relaid = cut(graph, inputs, result)
        if relaid != inputs:
            relaid_result = propagate(graph, relaid, k, table)
            if _split_count(relaid_result, collectives) > _split_count(result, collectives):
                inputs, result = relaid, relaid_result
    return inputs, result


def cut_by_destination(
    graph: torch.fx.Graph, inputs: dict[torch.fx.Node, NodePlacement], result: PlacementResult
) -> dict[torch.fx.Node, NodePlacement]:
    """The inputs laid out by destination where an all-to-all of their rows is not split.

    An MoE's dispatch sends its routed tokens in one block per destination rank, of sizes
    that differ by rank; a nanobatch's share of them is a chunk of every block
    (``Split.sizes``), not a contiguous chunk of the rows. So where an all-to-all of rows
    from the graph's inputs, split or not (computed once: an MoE's experts, which sort
    them), is not split, the inputs its rows come from
    (those of as many rows) are cut by its blocks instead (the backward's tangents alike:
    its exchange back)."""
    relaid = dict(inputs)
    for node in graph.find_nodes(op="call_function", target=_ALL_TO_ALL):
        source, placed = node.args[0], result.placements.get(node.args[0])
        if per_nanobatch(result.placements[node]) or (
            per_nanobatch(placed) and placed != Split(0)
        ):
            continue
        blocks = exchanged_blocks(arguments(node)["input_split_sizes"])
        rows = shape(_tensor(source))[:1]
        leaves = [n for n in ancestors(source) if n.op == "placeholder"]
        for leaf in leaves if isinstance(blocks, Split) else ():
            # Any cut of an input is exact where every value is cut alike: a tangent the
            # backward knows nothing of (replicated) is cut by destination as well.
            given = inputs.get(leaf, REPLICATE)
            if given in (Split(0), REPLICATE) and _tensor(leaf) is not None and (
                shape(_tensor(leaf))[:1] == rows
            ):
                kept = relaid.get(leaf, REPLICATE)  # an earlier exchange's cut stays
                relaid[leaf] = blocks if kept in (Split(0), REPLICATE, blocks) else kept
    return relaid


def cut_by_part(
    graph: torch.fx.Graph, inputs: dict[torch.fx.Node, NodePlacement], result: PlacementResult
) -> dict[torch.fx.Node, NodePlacement]:
    """The inputs cut in equal blocks where a rank takes its part of their rows.

    DTensor's Replicate -> Shard(0) of a batch-split input (an MoE router taking its rank's
    tokens) splits the rows into one part per rank and keeps one: a contiguous chunk of the
    rows is all in one part, so the split region ends there (or the part is a ``Piece``,
    computed once). Cut as that many blocks
    (``Split(0, parts)``), each nanobatch holds a chunk of every part, and of the part the
    rank keeps."""
    relaid = dict(inputs)
    ended = {r.node for r in result.barriers if r.kind is ReasonKind.ALONG_SPLIT_DIM}
    for node in graph.nodes:
        place = result.placements.get(node)
        into_pieces = isinstance(place, tuple) and all(isinstance(q, Piece) for q in place)
        if node.target not in _SPLITS or not (node.name in ended or into_pieces):
            continue
        source, parts = node.args[0], len(node.meta["val"])
        rows = shape(_tensor(source))[0]
        dim = arguments(node).get("dim", 0)
        if result.placements[source] != Split(0) or dim % _tensor(source).ndim or not (
            isinstance(rows, int) and all(parts * shape(o)[0] == rows for o in node.meta["val"])
        ):
            continue
        for leaf in (n for n in ancestors(source) if n.op == "placeholder"):
            if inputs.get(leaf) == Split(0) and shape(_tensor(leaf))[:1] == (rows,):
                relaid[leaf] = Split(0, parts)
    return relaid


def exchanged(result: PlacementResult) -> bool:
    """Whether some value is cut in uneven per-rank blocks (``Split.sizes``)."""
    return any(in_blocks(p) for p in result.placements.values())


def by_exchanges_only(
    inputs: dict[torch.fx.Node, NodePlacement],
) -> dict[torch.fx.Node, NodePlacement]:
    """The inputs of a graph that exchanges rows in per-rank blocks, split by those blocks
    only: an input split because its leading size is the batch's depends on sizes that
    differ by rank and step, and every version of the graph must split alike."""
    return {
        n: p for n, p in inputs.items()
        if not (isinstance(p, Split) and p.sizes is None)
    }


def _split_count(result: PlacementResult, collectives: Sequence[Collective]) -> int:
    return sum(per_nanobatch(result.placements[c.node]) for c in collectives)


_ALL_TO_ALL = torch.ops._c10d_functional.all_to_all_single.default
_SPLITS = frozenset({torch.ops.aten.split.Tensor, torch.ops.aten.split_with_sizes.default})


def _tensor(node: torch.fx.Node) -> torch.Tensor | None:
    val = node.meta.get("val")
    return val if isinstance(val, torch.Tensor) else None
