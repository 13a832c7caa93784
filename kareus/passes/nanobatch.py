"""Rewrite a graph into k nanobatches whose collectives hide behind each other's compute.

Given placements (``placement.py``), the graph is re-emitted segment by segment
(``partition.py``): nodes that do not depend on the batch run once, split nodes run once
per nanobatch, and barriers run once on joined inputs. Inside segment ``i`` nanobatch
``j``'s compute is emitted in the partition's canonical order, and collective ``C_i`` of
nanobatch ``j - 1`` is issued right before the variant's launch slot of it; its wait is
placed where its first consumer starts. So with k = 2::

    S_i(nb0) | S_i(nb1) with C_i(nb0) issued at the slot | C_i(nb1) issued | S_i+1(nb0) ...

and ``C_i(nb1)`` runs while ``S_i+1(nb0)`` computes. Split graph outputs are concatenated
and partial sums added once at the end, so the graph computes the same function and its
signature (what AOT autograd saves for the backward) is unchanged.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.fx
from torch._prims_common import is_non_overlapping_and_dense_or_false
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from kareus.passes.collectives import Collective
from kareus.passes.ops import facts_of, resize_args
from kareus.passes.partition import GraphPartitioning, canonical_order
from kareus.passes.placement import (
    Local,
    NodePlacement,
    Partial,
    PlacementResult,
    Replicate,
    Split,
    Whole,
    per_nanobatch,
    sliced_dim,
)
from kareus.passes.schema import arguments, position

aten = torch.ops.aten


@dataclass(frozen=True)
class Schedule:
    """Where each partition's collective is issued and on what communication resources.

    ``slots[p]``: the launch slot of partition ``p`` (0: before the first slot of the next
    nanobatch's compute; ``len(slots)``: after it). ``groups[p]``: the process group to
    issue it on (None: the graph's own; a capped sub-communicator otherwise).
    """

    nanobatches: int
    slots: tuple[int, ...]
    groups: tuple[str | None, ...]


class CannotRewrite(Exception):
    """The graph cannot be rewritten as asked; the message says why."""


def nanobatch_graph(
    gm: torch.fx.GraphModule,
    partitioning: GraphPartitioning,
    collectives: Sequence[Collective],
    placements: PlacementResult,
    schedule: Schedule,
    example_inputs: Sequence[object],
    exclusive: Callable[[str], frozenset[str]] = lambda group_name: frozenset(),
) -> torch.fx.GraphModule:
    """A new GraphModule computing what ``gm`` computes, in ``schedule.nanobatches`` pieces.

    ``exclusive(group_name)``: the collective kinds of which that group's backend cannot
    have two in flight (``comm_groups.exclusive_kinds``); one is waited before the next
    is issued.
    """
    emitter = _Emitter(gm.graph, placements.placements, schedule, exclusive)
    emitter.emit(partitioning, collectives)
    new = torch.fx.GraphModule(gm, emitter.graph)
    fake_mode = torch._guards.detect_fake_mode(example_inputs)
    if fake_mode is not None:  # Inductor and the cost model read node.meta["val"]
        with fake_mode:
            FakeTensorProp(new, mode=fake_mode).propagate_dont_convert_inputs(*example_inputs)
    else:
        FakeTensorProp(new).propagate(*example_inputs)
    return new


class _Emitter:
    def __init__(
        self,
        graph: torch.fx.Graph,
        placements: dict[torch.fx.Node, NodePlacement],
        schedule: Schedule,
        exclusive: Callable[[str], frozenset[str]],
    ):
        self.old = graph
        self.exclusive = exclusive
        self.in_flight: dict[str, list[tuple[Collective, int]]] = {}
        self.graph = torch.fx.Graph()
        self.placements = placements
        self.k = schedule.nanobatches
        self.schedule = schedule
        self.once: dict[torch.fx.Node, torch.fx.Node] = {}
        self.pieces: dict[torch.fx.Node, list[torch.fx.Node | None]] = {}
        self.joined: dict[torch.fx.Node, torch.fx.Node] = {}
        self.deferred_waits: set[tuple[torch.fx.Node, int]] = set()
        self.slices: dict[tuple[torch.fx.Node, int], list[torch.fx.Node]] = {}

    # -- values -----------------------------------------------------------------------

    def piece(self, node: torch.fx.Node, j: int) -> torch.fx.Node:
        """Nanobatch ``j``'s value of ``node`` (the value itself if it is not split).

        Emission is demand-driven: a value needed before its place in the schedule (a
        barrier's inputs, a collective waited early) is emitted where it is first needed.
        """
        if not per_nanobatch(self.placements[node]):
            return self.whole(node)
        if (node, j) in self.deferred_waits:
            self.deferred_waits.discard((node, j))
            self._copy(node, j)
        value = self.pieces.get(node, [None] * self.k)[j]
        return value if value is not None else self._copy(node, j)

    def whole(self, node: torch.fx.Node) -> torch.fx.Node:
        """The whole-batch value of ``node``: joining its pieces if it was split."""
        if node in self.once:
            return self.once[node]
        if not per_nanobatch(self.placements[node]):
            self.once[node] = self._copy_once(node)
            return self.once[node]
        if node not in self.joined:
            self.joined[node] = self._join(node)
        return self.joined[node]

    def _join(self, node: torch.fx.Node) -> torch.fx.Node:
        p = self.placements[node]
        pieces = [self.piece(node, j) for j in range(self.k)]
        call = self.graph.call_function
        if isinstance(p, Partial):
            total = pieces[0]
            for other in pieces[1:]:
                total = call(aten.add.Tensor, (total, other))
            return total
        if isinstance(p, Local):
            # Only attention seeds are local; the rules refuse dropout, so they are unused.
            return pieces[0]
        if isinstance(p, Split):
            return self._concatenate(node, p, pieces)
        raise CannotRewrite(f"{node.name} ({p}) cannot be joined into a whole value")

    def _concatenate(self, node: torch.fx.Node, p: Split, pieces: list[torch.fx.Node]) -> torch.fx.Node:
        """Join split pieces in the memory layout of the original value.

        Consumers may view the value (an attention output is a transposed view of a
        contiguous buffer, and the backward reshapes it back) and kernels may need its
        layout (the CPU flash-attention kernel reads garbage unless the last dim has
        stride 1), so the join concatenates in the order of the original strides and
        permutes back to the logical order. Broadcast (stride-0) dims, such as grouped-
        query attention's K/V expanded over heads, have no place in that order: they go
        outermost, so every dim with a stride keeps its relative order and the innermost
        one stays innermost.
        """
        call = self.graph.call_function
        val = node.meta["val"]
        order = join_order(val)
        if order != list(range(val.ndim)):
            pieces = [call(aten.permute.default, (x, order)) for x in pieces]
        dim = order.index(p.dim)
        if p.blocks > 1:
            chunk = val.shape[p.dim] // (p.blocks * self.k)
            parts = [
                [call(_getitem, (call(aten.split.Tensor, (x, chunk, dim)), b)) for b in range(p.blocks)]
                for x in pieces
            ]
            pieces = [parts[j][b] for b in range(p.blocks) for j in range(self.k)]
        joined = call(aten.cat.default, (pieces, dim))
        if order != list(range(val.ndim)):
            joined = call(aten.permute.default, (joined, [order.index(d) for d in range(val.ndim)]))
        return joined

    # -- emission ---------------------------------------------------------------------

    def emit(self, partitioning: GraphPartitioning, collectives: Sequence[Collective]) -> None:
        for node in self.old.find_nodes(op="placeholder"):
            self._placeholder(node)
        for node in self.old.find_nodes(op="get_attr"):
            self.once[node] = self.graph.node_copy(node, lambda a: self.whole(a))
        partition_of = {p.collective.node: p for p in partitioning.partitions}
        for index, segment in enumerate(partitioning.segments):
            coll = collectives[index] if index < len(collectives) else None
            part = partition_of.get(coll.node) if coll else None
            order = list(part.nodes) if part else canonical_order(segment)
            groups = [set(s.nodes) for s in part.slots] if part else [set(n.name for n in order)]
            slot = self.schedule.slots[part.index] if part else 0
            group_name = self.schedule.groups[part.index] if part else None
            self._segment(order, groups, coll, slot, group_name)
        self._output(next(iter(self.old.find_nodes(op="output"))))

    def _segment(
        self,
        order: list[torch.fx.Node],
        groups: list[set[str]],
        coll: Collective | None,
        slot: int,
        group_name: str | None,
    ) -> None:
        split = [n for n in order if per_nanobatch(self.placements[n])]
        for n in order:
            if isinstance(self.placements[n], Replicate):
                self.whole(n)
        coll_split = coll is not None and per_nanobatch(self.placements[coll.node])
        for j in range(self.k):
            for g, names in enumerate(groups):
                if coll_split and j >= 1 and g == slot:
                    self._issue(coll, j - 1, group_name)
                for n in split:
                    if n.name in names:
                        self.piece(n, j)
            if coll_split and j >= 1 and slot >= len(groups):
                self._issue(coll, j - 1, group_name)
        if coll_split:
            self._issue(coll, self.k - 1, group_name)
        for n in order:
            if isinstance(self.placements[n], Whole):
                self.whole(n)
        if coll is not None and not coll_split:
            self.whole(coll.node)
            for w in coll.waits:
                self._wait_once(w)

    def _wait_once(self, wait: torch.fx.Node) -> None:
        source = wait.args[0]
        if source.op == "call_function" and source.target is _getitem:
            self.whole(source)
        self.whole(wait)

    def _issue(self, coll: Collective, j: int, group_name: str | None) -> None:
        """Issue nanobatch ``j``'s collective; its waits are emitted at their first use."""
        if self.pieces.get(coll.node, [None] * self.k)[j] is not None:
            return  # a consumer needed it earlier (see ``piece``)
        group = group_name or coll.group_name
        if coll.kind in self.exclusive(group):
            for earlier, i in self.in_flight.pop(group, []):
                for w in earlier.waits:
                    self.piece(w, i)
            self.in_flight[group] = [(coll, j)]
        self._copy(coll.node, j, group_name=group_name)
        for w in coll.waits:
            self.pieces.setdefault(w, [None] * self.k)
            self.deferred_waits.add((w, j))

    def _placeholder(self, node: torch.fx.Node) -> None:
        new = self.graph.node_copy(node)
        self.once[node] = new
        p = self.placements[node]
        if isinstance(p, Split):
            size = _shape(node)[p.dim] // self.k
            base = new
            if not is_non_overlapping_and_dense_or_false(node.meta["val"]):
                # Inductor (2.12-2.14) misses that a slice of a padded input overlaps the
                # input and may reinplace a later write into the caller's tensor: slice a
                # dense copy instead (only of such inputs: permuted dense ones are fine).
                base = self.graph.call_function(
                    aten.clone.default, (new,), {"memory_format": torch.contiguous_format}
                )
            self.pieces[node] = [
                self.graph.call_function(aten.slice.Tensor, (base, p.dim, j * size, (j + 1) * size))
                for j in range(self.k)
            ]

    def _copy_once(self, node: torch.fx.Node) -> torch.fx.Node:
        return self.graph.node_copy(node, self.whole)

    def _copy(self, node: torch.fx.Node, j: int, group_name: str | None = None) -> torch.fx.Node:
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: self._operand(node, a, j))
        args = resize_args(node, args, self.placements[node], self.k)
        if group_name is not None:
            args = with_group(node, args, group_name)
        new = self.graph.create_node(node.op, node.target, args, kwargs)
        new.meta.update({k: v for k, v in node.meta.items() if k not in ("val", "tensor_meta")})
        self.pieces.setdefault(node, [None] * self.k)[j] = new
        if j == self.k - 1 and isinstance(self.placements[node], Partial) and self._needed_whole(node):
            # Add the contributions as soon as they all exist, so that k copies of a
            # weight gradient are not all kept until the end of the graph.
            self.whole(node)
        return new

    def _operand(self, node: torch.fx.Node, arg: torch.fx.Node, j: int) -> torch.fx.Node:
        """Nanobatch ``j``'s operand; a whole-batch operand that the op pairs element by
        element with its split operands (an elementwise op's operand spanning the split
        dim, a per-sample attention mask) is sliced like them."""
        dim = self._sliced_operand_dim(node, arg)
        if dim is not None:
            key = (arg, dim)
            if key not in self.slices:
                whole = self.whole(arg)
                size = _shape(arg)[dim] // self.k
                self.slices[key] = [
                    self.graph.call_function(aten.slice.Tensor, (whole, dim, i * size, (i + 1) * size))
                    for i in range(self.k)
                ]
            return self.slices[key][j]
        return self.piece(arg, j)

    def _sliced_operand_dim(self, node: torch.fx.Node, arg: torch.fx.Node) -> int | None:
        p = self.placements[node]
        if not isinstance(self.placements[arg], (Replicate, Whole)) or not per_nanobatch(p):
            return None
        facts = facts_of(node)
        if facts.pointwise and isinstance(p, Split):
            dim = sliced_dim(arg, p, len(_shape(node)))
            return None if dim == -1 else dim
        if not facts.aligned_operands:
            return None
        outs = p if isinstance(p, tuple) else (p,)
        split = next((q for q in outs if isinstance(q, Split)), None)
        aligned = [arguments(node).get(name) for name in facts.aligned_operands]
        if split is None or arg not in aligned:
            return None
        out_ndim = len(_shape(node)) if isinstance(p, Split) else len(node.meta["val"][0].shape)
        if len(_shape(arg)) != out_ndim:
            return None
        return split.dim if _shape(arg)[split.dim] != 1 else None

    def _needed_whole(self, node: torch.fx.Node) -> bool:
        return any(u.op == "output" or not per_nanobatch(self.placements[u]) for u in node.users)

    def _output(self, node: torch.fx.Node) -> None:
        self.graph.output(torch.fx.node.map_arg(node.args[0], self.whole))


def feasibility(
    graph: torch.fx.Graph, result: PlacementResult, k: int, collectives: Sequence[Collective]
) -> str | None:
    """Why ``k`` nanobatches cannot apply to ``graph`` (None when they can)."""
    split_inputs = [
        n for n in graph.find_nodes(op="placeholder") if isinstance(result.placements[n], Split)
    ]
    if not split_inputs:
        return "no graph input is split along a batch dim"
    for node, p in result.placements.items():
        for q in p if isinstance(p, tuple) else (p,):
            if isinstance(q, Split) and node.op != "output":
                size = _value_shape(node, p, q)
                if size is not None and size % (k * q.blocks):
                    return (
                        f"{node.name}: dim {q.dim} of size {size} does not divide into {k} "
                        f"nanobatches{f' x {q.blocks} blocks' if q.blocks > 1 else ''}"
                    )
    if not any(per_nanobatch(result.placements[c.node]) for c in collectives):
        first = result.barriers[0] if result.barriers else None
        why = f" (the split region ends at {first.node}: {first.reason})" if first else ""
        return f"no collective stays split, so nothing could overlap{why}"
    return None


def _value_shape(node: torch.fx.Node, p: NodePlacement, q: Split) -> int | None:
    val = node.meta.get("val")
    if isinstance(p, tuple):
        val = val[p.index(q)] if isinstance(val, (list, tuple)) else None
    return int(val.shape[q.dim]) if isinstance(val, torch.Tensor) else None


_getitem = operator.getitem


def _shape(node: torch.fx.Node) -> tuple[int, ...]:
    val = node.meta.get("val")
    return tuple(int(d) for d in val.shape)


def with_group(node: torch.fx.Node, args: tuple, group_name: str) -> tuple:
    """The same collective issued on another process group (a resource-capped one)."""
    index = position(node, "group_name")
    return (*args[:index], group_name, *args[index + 1 :])


def join_order(val: torch.Tensor) -> list[int]:
    """Dims of ``val`` from outermost to innermost in memory, broadcast (stride-0) dims first."""
    return sorted(range(val.ndim), key=lambda d: (val.stride(d) != 0, -val.stride(d), -d))

