"""Which inputs of an AOT graph carry the batch, and how the backward inherits that.

Forward (and inference) graphs: parameters and buffers are Inductor's static inputs; the
other inputs that feed compute are the user's activations, split along dim 0 when their
leading size is the batch size (that of the first of them). Backward graphs: AOT autograd
names each saved value after the forward node it came from, so a saved value is placed
as it was in the forward (joined pieces of a split value are split again); ``tangents_i``
is the gradient of the forward's ``i``-th user output and is placed like it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx
from torch.utils._pytree import tree_leaves

from kareus.passes.placement import (
    REPLICATE,
    Aligned,
    NodePlacement,
    PlacementResult,
    RowIds,
    Split,
)
from kareus.passes.sizes import shape


@dataclass(frozen=True)
class ForwardInterface:
    """What a backward graph needs from its forward: placements of saved and output values."""

    placements: dict[str, NodePlacement]
    outputs: tuple[str | None, ...]


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
    return ForwardInterface({n.name: p for n, p in result.placements.items()}, outputs)


def backward_inputs(
    graph: torch.fx.Graph, forward: ForwardInterface | None
) -> dict[torch.fx.Node, NodePlacement]:
    if forward is None:
        return {}
    inputs = list(graph.find_nodes(op="placeholder"))
    tangents = [n for n in inputs if n.name.startswith("tangents")]
    saved = [n for n in inputs if not n.name.startswith("tangents")]
    user_outputs = forward.outputs[: len(forward.outputs) - len(saved)]
    placements = {n: _as_input(forward.placements.get(n.name)) for n in saved}
    for i, tangent in enumerate(tangents):
        source = user_outputs[i] if len(tangents) == len(user_outputs) else None
        # A tangent whose output is unknown is a full tensor like any other: replicated.
        placements[tangent] = _as_input(forward.placements.get(source) if source else None)
    return placements


def _as_input(p: NodePlacement | None) -> NodePlacement:
    """A forward value as the backward receives it: whole, joined from its pieces.

    Split again where the forward split it along one dim, or laid it out so; row ids stay
    row ids (the same value: the forward computed it once). Anything else is, to the
    backward, one full tensor used as is (replicated): a joined sum, nanobatch 0's
    attention seed (unused without dropout, which the rules refuse), a value the forward
    computed on the whole batch. Its consumers slice it where they pair it element by
    element with split values, so the backward's split region does not end there.
    """
    if isinstance(p, Aligned):
        p = p.rows  # the very value the forward computed once, laid out like the batch
    if isinstance(p, Split) and p.blocks == 1:
        return p
    return p if isinstance(p, RowIds) else REPLICATE


def _tensor(node: torch.fx.Node) -> torch.Tensor | None:
    val = node.meta.get("val")
    return val if isinstance(val, torch.Tensor) else None
