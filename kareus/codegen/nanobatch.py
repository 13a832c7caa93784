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

A search materialises many variants of one graph. Variants with the same k emit the same
nodes and differ only in their order and in the process group of some collectives, so a
``NanobatchRewrite`` finds once what no schedule changes (how each node is emitted, the
tensor metadata of every emitted node) and ``materialise`` only re-emits the order.

The profiler measures one partition alone (``isolated_partition``): what the rewrite emits
of its segment for one nanobatch, with the other nanobatch's collective issued at a slot.
It is emitted from the same per-node plan, so it slices, resizes and issues as the rewrite.
"""

from __future__ import annotations

import contextlib
import itertools
import operator
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace

import torch
import torch.fx
from torch._prims_common import is_non_overlapping_and_dense_or_false
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from kareus.errors import KareusError
from kareus.passes.collectives import Collective, size_hint
from kareus.passes.ops import OP_TABLE, OpTable, Resize, Retarget, Sizer
from kareus.passes.partition import GraphPartitioning, Partition, canonical_order
from kareus.passes.placement import (
    Aligned,
    Local,
    LocalIds,
    NodePlacement,
    Partial,
    Piece,
    PlacementResult,
    Replicate,
    Split,
    Whole,
    computed_once,
    in_blocks,
    per_nanobatch,
    sliced_dim,
)
from kareus.passes.schema import arguments, position
from kareus.passes.sizes import chunk_rows, chunk_start, shape, symbolic, units

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


class CannotRewrite(KareusError, ValueError):
    """The graph cannot be rewritten as asked; the message says why."""


class ScheduleError(KareusError, ValueError):
    """A schedule materialised by a rewrite into another number of nanobatches."""


Identity = tuple[object, ...]
"""What an emitted node is, the same in every schedule: (role, original node, indices)."""

ROLE = "kareus_role"
"""``node.meta`` key of an emitted node's role (``Identity``'s first item): "once" (run on
the whole batch), "piece" (a nanobatch's), a join ("cat", "sum", "unsort", ...) or a cut
("input", "slice", "cut", ...), so a cost breakdown can tell the rewrite's own work."""

_PROPAGATED = ("val", "tensor_meta")  # what shape propagation writes in node.meta


@dataclass(frozen=True)
class _NodePlan:
    """What emitting an original node needs that no schedule changes (found once)."""

    placement: NodePlacement
    split: bool  # runs once per nanobatch (and so is resized to one)
    meta: dict[str, object]  # copied to its copies: all but what propagation writes
    # whole operands sliced per nanobatch, along this dim (or cut in the blocks of a split)
    sliced: dict[torch.fx.Node, int | Split]
    resize: Resize | None
    join_early: bool  # a partial sum that whole-batch consumers need: add it once complete
    from_pieces: bool = False  # a concatenation of the batch's pieces: taken as they come
    assembled: bool = False  # an item of a split of the batch into pieces: from nanobatches


@dataclass(frozen=True)
class _SegmentPlan:
    """A segment's nodes by how they run; the schedule adds only where its collective goes."""

    collective: Collective | None
    partition: int | None  # index of its slot and group in a schedule (None: slot 0, own group)
    replicated: tuple[torch.fx.Node, ...]
    slots: tuple[tuple[torch.fx.Node, ...], ...]  # split nodes per launch slot, canonical order
    whole: tuple[torch.fx.Node, ...]
    collective_split: bool


class NanobatchRewrite:
    """One graph's rewrite into ``k`` nanobatches, materialised for many schedules.

    ``exclusive(group_name)``: the collective kinds of which that group's backend cannot
    have two in flight (``GraphAnalysis.exclusive``); one is waited before the next is
    issued. ``table``: the op facts (how an op's arguments resize, which operands it pairs
    with its output), those the graph was analysed with.

    A search materialises hundreds of variants of one graph. Those with the same ``k``
    emit the same nodes, in another order and with collectives on other process groups,
    so all that does not depend on the schedule is found once: per original node how it
    is emitted (``_NodePlan``), per segment which nodes run how (``_SegmentPlan``), and per
    emitted node (by its identity) the metadata fake-tensor propagation gives it, which
    later schedules copy instead of propagating again (only a node not seen before is).
    """

    def __init__(
        self,
        gm: torch.fx.GraphModule,
        partitioning: GraphPartitioning,
        collectives: Sequence[Collective],
        placements: PlacementResult,
        k: int,
        example_inputs: Sequence[object],
        exclusive: Callable[[str], frozenset[str]] = lambda group_name: frozenset(),
        table: OpTable = OP_TABLE,
    ):
        self.gm, self.k, self.exclusive = gm, k, exclusive
        place = placements.placements
        self.nodes = {n: _node_plan(n, place, table) for n in gm.graph.nodes}
        self.segments = _segment_plans(partitioning, collectives, self.nodes, table)
        # Inductor passes fake inputs and reads node.meta["val"] in their mode.
        fake_mode = torch._guards.detect_fake_mode(example_inputs)
        self.fake_mode = fake_mode or FakeTensorMode()
        self.inputs = list(example_inputs) if fake_mode else [
            self.fake_mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
            for a in example_inputs
        ]
        self.meta: dict[Identity, dict[str, object]] = {}

    def materialise(self, schedule: Schedule) -> torch.fx.GraphModule:
        """The graph in ``k`` nanobatches under ``schedule``, its nodes' metadata filled in.

        Its Python code is generated when first used (``.code``, a call): a search that
        only reads the graph never pays for it.
        """
        if schedule.nanobatches != self.k:
            raise ScheduleError(
                f"a schedule of {schedule.nanobatches} nanobatches for a rewrite into {self.k}"
            )
        emitter = _Emitter(self, schedule)
        emitter.emit()
        new = _LazyGraphModule(self.gm, emitter.graph)
        seen = {}
        for node, identity in emitter.identity.items():
            if identity in self.meta:
                node.meta.update(self.meta[identity])
                seen[node] = node.meta.get("val")
        if len(seen) < len(emitter.identity):
            self._propagate(new, seen)
            for node, identity in emitter.identity.items():
                if node not in seen:
                    self.meta[identity] = {m: node.meta[m] for m in _PROPAGATED if m in node.meta}
        return new

    def _propagate(self, gm: torch.fx.GraphModule, seen: dict[torch.fx.Node, object]) -> None:
        """Fake-tensor propagation of the nodes not in ``seen`` (their values)."""
        env = dict(seen)  # the interpreter adds to it and frees from it
        shape_env = self.fake_mode.shape_env
        # Sizes of pieces (``c * (j * R // k)``) are derived expressions that broadcasting's
        # checks for 1 would guard on: a piece meets only values cut alike, so no such check
        # changes a shape, and none may specialise the caller's dynamic graph.
        quiet = shape_env.suppress_guards() if shape_env is not None else contextlib.nullcontext()
        with self.fake_mode, quiet:
            FakeTensorProp(gm, mode=self.fake_mode).run(*self.inputs, initial_env=env)


def _node_plan(
    node: torch.fx.Node, place: dict[torch.fx.Node, NodePlacement], table: OpTable
) -> _NodePlan:
    p = place[node]
    return _NodePlan(
        placement=p,
        split=per_nanobatch(p),
        meta={m: v for m, v in node.meta.items() if m not in _PROPAGATED},
        sliced=_sliced_operands(node, place, table),
        resize=table.facts_of(node).resize,
        join_early=isinstance(p, Partial)
        and any(u.op == "output" or not per_nanobatch(place[u]) for u in node.users),
        from_pieces=isinstance(p, Split) and node.target is aten.cat.default
        and all(isinstance(place[t], Piece) for t in node.args[0]),
        assembled=isinstance(p, Piece) and node.target is _getitem
        and isinstance(place[node.args[0]], tuple),
    )


def _sliced_operands(
    node: torch.fx.Node, place: dict[torch.fx.Node, NodePlacement], table: OpTable
) -> dict[torch.fx.Node, int | Split]:
    """The whole operands that ``node``, run per nanobatch, takes a nanobatch's slice of,
    and along which dim (``_sliced_operand_dim``); none if it runs once."""
    if not per_nanobatch(place[node]):
        return {}
    dims = {arg: _sliced_operand_dim(node, arg, place, table) for arg in node.all_input_nodes}
    return {arg: dim for arg, dim in dims.items() if dim is not None}


def _sliced_operand_dim(
    node: torch.fx.Node,
    arg: torch.fx.Node,
    place: dict[torch.fx.Node, NodePlacement],
    table: OpTable,
) -> int | Split | None:
    """The dim along which split ``node`` slices whole operand ``arg`` per nanobatch: the
    op pairs it element by element with its split operands (an elementwise op's operand
    spanning the split dim, a per-sample attention mask). None: used as is. A split: the
    rows a nanobatch's own ids pick from (``rules.index``), cut in its blocks."""
    p = place[node]
    if isinstance(place[arg], Aligned):
        return place[arg].rows.dim  # the rules took it for that split
    if not isinstance(place[arg], (Replicate, Whole)):
        return None
    if node.target is aten.index.Tensor and arg is node.args[0] and isinstance(
        place.get(node.args[1][0]), LocalIds
    ):
        return place[node.args[1][0]].rows
    facts = table.facts_of(node)
    if facts.pointwise and isinstance(p, Split):
        dim = sliced_dim(arg, p, len(_shape(node)))
        return None if dim == -1 else dim
    if not facts.aligned_operands:
        return None
    aligned = [arguments(node).get(name) for name in facts.aligned_operands]
    if arg not in aligned:
        return None
    if isinstance(p, Partial):  # sliced like the split operand of its shape
        split = next((
            place[a] for a in node.all_input_nodes
            if isinstance(place[a], Split) and _shape(a) == _shape(arg)
        ), None)
        return None if split is None else split.dim
    outs = p if isinstance(p, tuple) else (p,)
    split = next((q for q in outs if isinstance(q, Split)), None)
    out_ndim = len(_shape(node)) if isinstance(p, Split) else len(node.meta["val"][0].shape)
    if split is None or len(_shape(arg)) != out_ndim:
        return None
    return split.dim if _shape(arg)[split.dim] != 1 else None


def _segment_plans(
    partitioning: GraphPartitioning,
    collectives: Sequence[Collective],
    nodes: dict[torch.fx.Node, _NodePlan],
    table: OpTable,
) -> tuple[_SegmentPlan, ...]:
    partition_of = {p.collective.node: p for p in partitioning.partitions}
    plans = []
    for index, segment in enumerate(partitioning.segments):
        coll = collectives[index] if index < len(collectives) else None
        part = partition_of.get(coll.node) if coll else None
        order = list(part.nodes) if part else canonical_order(segment, table)
        slots = [s.nodes for s in part.slots] if part else [[n.name for n in order]]
        plans.append(
            _SegmentPlan(
                collective=coll,
                partition=part.index if part else None,
                replicated=tuple(n for n in order if isinstance(nodes[n].placement, Replicate)),
                slots=_split_by_slot(order, slots, nodes),
                whole=tuple(n for n in order if computed_once(nodes[n].placement)),
                collective_split=coll is not None and nodes[coll.node].split,
            )
        )
    return tuple(plans)


def _split_by_slot(
    order: Sequence[torch.fx.Node],
    slots: Sequence[Collection[str]],
    nodes: dict[torch.fx.Node, _NodePlan],
) -> tuple[tuple[torch.fx.Node, ...], ...]:
    """The split nodes of ``order`` per launch slot (``slots``: each one's node names)."""
    split = [n for n in order if nodes[n].split]
    return tuple(tuple(n for n in split if n.name in names) for names in map(set, slots))


class _Emitter:
    """Emits one schedule of a ``NanobatchRewrite``; ``identity`` names every node it emits."""

    def __init__(self, rewrite: NanobatchRewrite, schedule: Schedule):
        self.rewrite = rewrite
        self.nodes = rewrite.nodes
        self.k = schedule.nanobatches
        self.schedule = schedule
        self.graph = torch.fx.Graph()
        self.in_flight: dict[str, list[tuple[Collective, int]]] = {}
        self.once: dict[torch.fx.Node, torch.fx.Node] = {}
        self.pieces: dict[torch.fx.Node, list[torch.fx.Node | None]] = {}
        self.joined: dict[torch.fx.Node, torch.fx.Node] = {}
        self.deferred_waits: set[tuple[torch.fx.Node, int]] = set()
        self.slices: dict[tuple[torch.fx.Node, int], list[torch.fx.Node]] = {}
        self.sorted_places: dict[torch.fx.Node, torch.fx.Node] = {}
        self.identity: dict[torch.fx.Node, Identity] = {}

    def _record(self, new: torch.fx.Node, identity: Identity) -> torch.fx.Node:
        self.identity[new] = identity
        new.meta[ROLE] = identity[0]
        return new

    def _call(
        self,
        target: Callable[..., object],
        args: tuple,
        identity: Identity,
        kwargs: dict[str, object] | None = None,
    ) -> torch.fx.Node:
        return self._record(_create(self.graph, "call_function", target, args, kwargs), identity)

    # -- values -----------------------------------------------------------------------

    def piece(self, node: torch.fx.Node, j: int) -> torch.fx.Node:
        """Nanobatch ``j``'s value of ``node`` (the value itself if it is not split).

        Emission is demand-driven: a value needed before its place in the schedule (a
        barrier's inputs, a collective waited early) is emitted where it is first needed.
        """
        if not self.nodes[node].split:
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
        if self.nodes[node].assembled:
            self.once[node] = self._assembled(node)
            return self.once[node]
        if not self.nodes[node].split:
            self.once[node] = self._copy_once(node)
            return self.once[node]
        if node not in self.joined:
            self.joined[node] = self._join(node)
        return self.joined[node]

    def _join(self, node: torch.fx.Node) -> torch.fx.Node:
        p = self.nodes[node].placement
        if any(isinstance(q, LocalIds) for q in (p if isinstance(p, tuple) else (p,))):
            # A nanobatch's ids of its own rows (its sort's): the batch's, computed again.
            return self._copy_once(node)
        pieces = [self.piece(node, j) for j in range(self.k)]
        if node in self.joined:  # emitting its last piece joined it (``join_early``)
            return self.joined[node]
        if isinstance(p, Partial):
            total = pieces[0]
            for j, other in enumerate(pieces[1:], 1):
                total = self._call(aten.add.Tensor, (total, other), ("sum", node, j))
            return total
        if isinstance(p, Local):
            # Only attention seeds are local; the rules refuse dropout, so they are unused.
            return pieces[0]
        if isinstance(p, Split) and p.order is not None:
            return self._unsorted(node, p, pieces)
        if isinstance(p, Split):
            return self._concatenate(node, p, pieces)
        raise CannotRewrite(f"{node.name} ({p}) cannot be joined into a whole value")

    def _assembled(self, node: torch.fx.Node) -> torch.fx.Node:
        """A piece of the batch (``Piece``: an item of a split of a split value into equal
        pieces along its split dim) from the nanobatches' own pieces, never joined: with k
        nanobatches and ``count`` pieces, nanobatch ``index``'s piece itself (k equal),
        part of one (more pieces), or several laid end to end (fewer)."""
        p, source = self.nodes[node].placement, node.args[0].args[0]
        k, n, j = self.k, p.count, p.index
        if k == n:
            return self.piece(source, j)
        if k > n:
            m = k // n
            pieces = [self.piece(source, i) for i in range(j * m, (j + 1) * m)]
            return self._concatenate(node, p.rows, pieces)
        m = n // k
        rows = shape(node.meta["val"])[p.rows.dim]
        start = (j % m) * rows
        return self._call(
            aten.slice.Tensor, (self.piece(source, j // m), p.rows.dim, start, start + rows),
            ("assembled", node),
        )

    def _from_pieces(self, node: torch.fx.Node, j: int) -> torch.fx.Node:
        """Nanobatch ``j``'s piece of a concatenation of the batch's pieces in order
        (``placement.pieces_of``: the saved values the backward takes in pieces)."""
        return _of_pieces(node, self.nodes[node].placement.dim, self.k, j, self.whole,
                          lambda target, args: self._call(target, args, ("from pieces", node, j)))

    def _unsorted(
        self, node: torch.fx.Node, p: Split, pieces: list[torch.fx.Node]
    ) -> torch.fx.Node:
        """Rows each nanobatch sorted itself, in the order of the batch's own sort: the
        pieces laid end to end, gathered at the places ``_sorted_places`` gives."""
        if p.dim != 0:
            raise CannotRewrite(f"{node.name}: rows sorted per nanobatch along dim {p.dim}")
        laid = self._cat(pieces, 0, ("cat", node), node.meta["val"].ndim)
        places = self._sorted_places(p)
        return self._call(aten.index.Tensor, (laid, [places]), ("unsort", node))

    def _sorted_places(self, p: Split) -> torch.fx.Node:
        """For each place of the batch's sort ``p.order``, where its row is among the
        nanobatches' sorted rows laid end to end: row ``r`` of nanobatch ``j`` is at
        ``offset_j + inverse_j[r]``; those places joined like the rows, then read in the
        order of the sort of the whole batch (the graph's own, computed again)."""
        (sort,) = (n for n in self.rewrite.gm.graph.nodes if n.name == p.order)
        if sort in self.sorted_places:
            return self.sorted_places[sort]
        call, emit = self._call, self._sizer(("places", sort))
        places, offset = [], 0
        for j in range(self.k):
            ids = call(_getitem, (self.piece(sort, j), 1), ("ids", sort, j))
            inverse = call(_getitem, (call(aten.sort.default, (ids,), ("invert", sort, j)), 1),
                           ("inverse", sort, j))
            places.append(inverse if j == 0 else call(
                aten.add.Tensor, (inverse, offset), ("place", sort, j)
            ))
            rows = emit(aten.sym_size.int, (ids, 0), f"rows{j}")
            offset = _plus(offset, rows, emit, f"offset{j}")
        chunks = self._exchanged_blocks(("places", sort), replace(p, order=None), places, 0)
        by_row = self._cat(chunks, 0, ("places", sort), 1)
        batch = call(_getitem, (self.whole(sort), 1), ("batch ids", sort))
        self.sorted_places[sort] = call(aten.index.Tensor, (by_row, [batch]), ("sorted", sort))
        return self.sorted_places[sort]

    def _concatenate(
        self, node: torch.fx.Node, p: Split, pieces: list[torch.fx.Node]
    ) -> torch.fx.Node:
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
        call = self._call
        val = node.meta["val"]
        order = join_order(val)
        if order != list(range(val.ndim)):
            pieces = [
                call(aten.permute.default, (x, order), ("permute", node, j))
                for j, x in enumerate(pieces)
            ]
        dim = order.index(p.dim)
        if p.sizes is not None:
            pieces = self._exchanged_blocks(node, p, pieces, dim)
        elif p.blocks > 1 and symbolic(val.shape[p.dim]):
            pieces = self._symbolic_blocks(node, p, pieces, dim)
        elif p.blocks > 1:
            chunk = val.shape[p.dim] // (p.blocks * self.k)

            def block(j: int, b: int) -> torch.fx.Node:
                blocks = call(aten.split.Tensor, (pieces[j], chunk, dim), ("blocks", node, j, b))
                return call(_getitem, (blocks, b), ("block", node, j, b))

            parts = [[block(j, b) for b in range(p.blocks)] for j in range(self.k)]
            pieces = [parts[j][b] for b in range(p.blocks) for j in range(self.k)]
        joined = self._cat(pieces, dim, ("cat", node), val.ndim)
        if order != list(range(val.ndim)):
            back = [order.index(d) for d in range(val.ndim)]
            joined = call(aten.permute.default, (joined, back), ("unpermute", node))
        return joined

    def _symbolic_blocks(
        self, node: torch.fx.Node, p: Split, pieces: list[torch.fx.Node], dim: int
    ) -> list[torch.fx.Node]:
        """The pieces' blocks in the order of the whole value (block by block, nanobatch by
        nanobatch in each), each piece's blocks its rows over ``p.blocks``, computed in the
        graph: pieces of a symbolic batch differ in size."""
        call, blocks = self._call, []
        for j, piece in enumerate(pieces):
            rows = call(aten.sym_size.int, (piece, dim), ("rows", node, j))
            chunk = call(operator.floordiv, (rows, p.blocks), ("chunk", node, j))
            bounds = [0, *(
                call(operator.mul, (chunk, b), ("bound", node, j, b)) for b in range(1, p.blocks)
            ), rows]
            blocks.append([
                call(aten.slice.Tensor, (piece, dim, start, end), ("block", node, j, b))
                for b, (start, end) in enumerate(itertools.pairwise(bounds))
            ])
        return [blocks[j][b] for b in range(p.blocks) for j in range(self.k)]

    def _exchanged_blocks(
        self, node: torch.fx.Node, p: Split, pieces: list[torch.fx.Node], dim: int
    ) -> list[torch.fx.Node]:
        """The pieces' chunks of uneven blocks in the order of the whole value: piece ``j``
        holds chunk ``j`` of every block, of the rows ``sizes.chunk_rows`` gives it."""
        sizes_of = [self._size(s) for s in p.sizes]
        chunks = []
        for j, piece in enumerate(pieces):
            emit = self._sizer(("chunks", node, j))
            rows = [chunk_rows(s, j, self.k, emit, f"block{b}") for b, s in enumerate(sizes_of)]
            bounds = _offsets(rows, emit)
            chunks.append([
                self._call(aten.slice.Tensor, (piece, dim, start, end), ("chunk", node, j, b))
                for b, (start, end) in enumerate(itertools.pairwise(bounds))
            ])
        return [chunks[j][b] for b in range(p.blocks) for j in range(self.k)]

    def _cat(
        self, pieces: list[torch.fx.Node], dim: int, identity: Identity, ndim: int
    ) -> torch.fx.Node:
        """``cat`` of pieces of ``ndim`` dims; of 1-D ones as columns: the fake ``cat``
        leaves a 1-D piece whose symbolic size is 0 at its example value out of the joined
        size (torch's legacy empty tensors), and Inductor allocates that size (seen: an
        MoE's expert ids at 1 token from a rank)."""
        if ndim != 1:
            return self._call(aten.cat.default, (pieces, dim), identity)
        columns = [
            self._call(aten.unsqueeze.default, (x, 1), (*identity, "column", i))
            for i, x in enumerate(pieces)
        ]
        joined = self._call(aten.cat.default, (columns, 0), (*identity, "columns"))
        return self._call(aten.squeeze.dim, (joined, 1), identity)

    def _size(self, size: int | torch.fx.Node) -> object:
        """A block size of ``Split.sizes`` in the rewritten graph."""
        return size if isinstance(size, int) else self.whole(size)

    # -- emission ---------------------------------------------------------------------

    def emit(self) -> None:
        graph = self.rewrite.gm.graph
        placeholders = graph.find_nodes(op="placeholder")
        for node in placeholders:
            self.once[node] = self._record(self.graph.node_copy(node), ("once", node))
        for node in placeholders:  # after all: a cut may read a size that comes later
            self._cut_input(node)
        for node in graph.find_nodes(op="get_attr"):
            self.once[node] = self._copy_once(node)
        for segment in self.rewrite.segments:
            self._segment(segment)
        self._output(next(iter(graph.find_nodes(op="output"))))

    def _segment(self, segment: _SegmentPlan) -> None:
        index = segment.partition
        slot = 0 if index is None else self.schedule.slots[index]
        group_name = None if index is None else self.schedule.groups[index]
        for n in segment.replicated:
            self.whole(n)
        coll = segment.collective
        issues = segment.collective_split
        for j in range(self.k):
            for g, nodes in enumerate(segment.slots):
                if issues and j >= 1 and g == slot:
                    self._issue(coll, j - 1, group_name)
                for n in nodes:
                    self.piece(n, j)
            if issues and j >= 1 and slot >= len(segment.slots):
                self._issue(coll, j - 1, group_name)
        if issues:
            self._issue(coll, self.k - 1, group_name)
        for n in segment.whole:
            if not self.nodes[n].assembled and not _split_into_pieces(self.nodes[n].placement):
                self.whole(n)  # (pieces of the batch are assembled where they are used)
        if coll is not None and not issues:
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
        if coll.kind in self.rewrite.exclusive(group):
            for earlier, i in self.in_flight.pop(group, []):
                for w in earlier.waits:
                    self.piece(w, i)
            self.in_flight[group] = [(coll, j)]
        self._copy(coll.node, j, group_name=group_name)
        for w in coll.waits:
            self.pieces.setdefault(w, [None] * self.k)
            self.deferred_waits.add((w, j))

    def _cut_input(self, node: torch.fx.Node) -> None:
        p = self.nodes[node].placement
        if isinstance(p, Split):
            base = new = self.once[node]
            if not is_non_overlapping_and_dense_or_false(node.meta["val"]):
                # Inductor (2.12-2.14) misses that a slice of a padded input overlaps the
                # input and may reinplace a later write into the caller's tensor: slice a
                # dense copy instead (only of such inputs: permuted dense ones are fine).
                base = self._call(
                    aten.clone.default, (new,), ("dense", node),
                    {"memory_format": torch.contiguous_format},
                )
            if p.sizes is not None or p.blocks > 1:
                self.pieces[node] = self._cut_blocks(base, node, p)
                return
            args = _slice_args(base, node, p.dim, self.k, self._sizer(("input", node)))
            self.pieces[node] = [
                self._call(aten.slice.Tensor, args[j], ("input", node, j)) for j in range(self.k)
            ]

    def _cut_blocks(
        self, whole: torch.fx.Node, node: torch.fx.Node, p: Split, role: str = "input"
    ) -> list[torch.fx.Node]:
        """Each nanobatch of input ``whole`` (the value of ``node``) in blocks, uneven or
        equal (of static rows: ``interface.cut_by_part``): chunk ``j`` of every block,
        concatenated in block order."""
        emit = self._sizer((role, "blocks", node))
        if p.sizes is not None:
            sizes_of = [self._size(s) for s in p.sizes]
        else:
            rows = shape(node.meta["val"])[p.dim]
            if symbolic(rows):
                raise CannotRewrite(f"{node.name}: an input of symbolic rows cut in blocks")
            sizes_of = [rows // p.blocks] * p.blocks
        starts = _offsets(sizes_of, emit)
        pieces = []
        for j in range(self.k):
            chunks = []
            for b, size in enumerate(sizes_of):
                step = f"block{b}"
                start, end = (
                    _plus(starts[b], chunk_start(size, i, self.k, emit, step), emit,
                          f"{step}.at{i}")
                    for i in (j, j + 1)
                )
                chunks.append(self._call(
                    aten.slice.Tensor, (whole, p.dim, start, end), (role, node, j, b)
                ))
            pieces.append(self._cat(chunks, p.dim, (role, node, j), node.meta["val"].ndim))
        return pieces

    def _copy_once(self, node: torch.fx.Node) -> torch.fx.Node:
        return self._record(self.graph.node_copy(node, self.whole), ("once", node))

    def _copy(self, node: torch.fx.Node, j: int, group_name: str | None = None) -> torch.fx.Node:
        plan = self.nodes[node]
        if plan.from_pieces:
            new = self._from_pieces(node, j)
            self.pieces.setdefault(node, [None] * self.k)[j] = new
            return new
        target, args, kwargs = _copy_args(
            node, plan, self.k, j, lambda a: self.piece(a, j),
            lambda a, dim: self._slice(a, dim, j), self._sizer(("piece", node, j)), group_name,
        )
        new = _create(self.graph, node.op, target, args, kwargs)
        self._record(new, ("piece", node, j))
        new.meta.update(plan.meta)
        self.pieces.setdefault(node, [None] * self.k)[j] = new
        if j == self.k - 1 and plan.join_early:
            # Add the contributions as soon as they all exist, so that k copies of a
            # weight gradient are not all kept until the end of the graph.
            self.whole(node)
        return new

    def _slice(self, arg: torch.fx.Node, dim: int | Split, j: int) -> torch.fx.Node:
        """Nanobatch ``j``'s slice of whole value ``arg`` along ``dim`` (all k made at once),
        or its cut in the blocks of split ``dim``."""
        key = (arg, dim)
        if key not in self.slices and isinstance(dim, Split):
            self.slices[key] = self._cut_blocks(self.whole(arg), arg, dim, role="cut")
        if key not in self.slices:
            args = _slice_args(self.whole(arg), arg, dim, self.k, self._sizer(("slice", *key)))
            self.slices[key] = [
                self._call(aten.slice.Tensor, args[i], ("slice", *key, i)) for i in range(self.k)
            ]
        return self.slices[key][j]

    def _sizer(self, identity: Identity) -> Sizer:
        """Emits the size arithmetic of a symbolic cut, its nodes named after ``identity``."""
        return lambda target, args, step: self._call(target, args, (*identity, "size", step))

    def _output(self, node: torch.fx.Node) -> None:
        output = self.graph.output(torch.fx.node.map_arg(node.args[0], self.whole))
        self._record(output, ("output",))


@dataclass(frozen=True)
class IsolatedPartition:
    """One partition alone (``isolated_partition``) and what each of its inputs stands for.

    ``inputs[i]``: the node of the analysed graph whose value placeholder ``i`` takes, one
    nanobatch of it where that value is split; the last is the collective's input (the
    other nanobatch's). Outputs: the waited collective, then the compute's sinks.
    """

    gm: torch.fx.GraphModule
    inputs: tuple[torch.fx.Node, ...]


def isolated_partition(
    partition: Partition,
    placements: PlacementResult,
    k: int,
    slot: int,
    group_name: str | None = None,
    *,
    table: OpTable = OP_TABLE,
) -> IsolatedPartition:
    """``partition`` as the rewrite into ``k`` nanobatches runs it, for one nanobatch, to be
    measured alone: its compute, with the other nanobatch's collective issued before
    launch slot ``slot`` (after the compute where ``slot`` is the number of slots) on
    ``group_name`` (None: the graph's own) and waited at the end, where the rewrite joins.

    As the rewrite runs them, nodes independent of the batch run once, before the
    nanobatch's compute, and barriers (Whole) not at all: they run once per graph on joined
    values, outside any one nanobatch's compute, so a barrier's value that the compute uses
    comes in whole, like a value from outside the partition, and is sliced where the
    rewrite slices it.
    """
    return _PartitionEmitter(partition, placements, k, table).emit(slot, group_name)


class _PartitionEmitter:
    """Emits one partition alone from the per-node plans the rewrite emits it from."""

    def __init__(
        self, partition: Partition, placements: PlacementResult, k: int, table: OpTable
    ):
        place = placements.placements
        coll = partition.collective.node
        self.partition, self.k = partition, k
        self.nodes = {n: _node_plan(n, place, table) for n in (*partition.nodes, coll)}
        if not self.nodes[coll].split:
            raise CannotRewrite(
                f"partition {partition.index}: its collective is not split into nanobatches"
            )
        if any(in_blocks(plan.placement) for plan in self.nodes.values()):
            raise CannotRewrite(
                f"partition {partition.index}: rows exchanged in per-rank blocks are not "
                "measured alone (their sizes differ by rank: such graphs are not planned)"
            )
        # An item of a value computed elsewhere (a tuple: an attention backward's gradients)
        # comes in as an input of its own, a tensor, like the values it is taken from.
        self.computed, computed = [], set()
        for n in partition.nodes:
            if not computed_once(place[n]) and not (
                n.target is _getitem and n.args[0] not in computed
            ):
                self.computed.append(n)
                computed.add(n)
        self.graph = torch.fx.Graph()
        self.env: dict[torch.fx.Node, torch.fx.Node] = {}
        self.slices: dict[tuple[torch.fx.Node, int], torch.fx.Node] = {}

    def emit(self, slot: int, group_name: str | None) -> IsolatedPartition:
        graph, coll = self.graph, self.partition.collective
        computed = set(self.computed)
        inputs = dict.fromkeys(
            i for n in self.computed for i in n.all_input_nodes if i not in computed
        )
        for node in inputs:
            self.env[node] = graph.placeholder(node.name)
        source = coll.node.all_input_nodes[0]
        other = graph.placeholder("other_nanobatch_input")
        for node in self.computed:
            if not self.nodes[node].split:
                self._copy(node)
        slots = _split_by_slot(self.computed, [s.nodes for s in self.partition.slots], self.nodes)
        issued = None
        for index, nodes in enumerate(slots):
            if index == slot:
                issued = self._issue(other, group_name)
            for node in nodes:
                self._copy(node)
        if issued is None:
            issued = self._issue(other, group_name)
        waited = _create(graph, "call_function", coll.waits[0].target, (issued,), None)
        sinks = [self.env[n] for n in self.computed if not any(u in computed for u in n.users)]
        graph.output((waited, *sinks))
        gm = torch.fx.GraphModule(torch.nn.Module(), graph)
        return IsolatedPartition(gm, (*inputs, source))

    def _copy(self, node: torch.fx.Node) -> None:
        if self.nodes[node].from_pieces:  # the saved pieces: nanobatch 0's, as they come
            self.env[node] = self._first_from_pieces(node)
            return
        target, args, kwargs = _copy_args(
            node, self.nodes[node], self.k, 0, self.env.__getitem__, self._slice, self._sizer
        )
        self.env[node] = _create(self.graph, node.op, target, args, kwargs)

    def _first_from_pieces(self, node: torch.fx.Node) -> torch.fx.Node:
        """Nanobatch 0's piece of a concatenation of the batch's pieces (``_of_pieces``)."""
        return _of_pieces(node, self.nodes[node].placement.dim, self.k, 0, self.env.__getitem__,
                          lambda target, args: _create(self.graph, "call_function", target,
                                                       args, None))

    def _issue(self, other: torch.fx.Node, group_name: str | None) -> torch.fx.Node:
        """The other nanobatch's collective, on its input ``other`` (whole where the
        rewrite slices that input per nanobatch: an aligned value computed once)."""
        node = self.partition.collective.node

        def slice_other(arg: torch.fx.Node, dim: int) -> torch.fx.Node:
            args = _slice_args(other, arg, dim, self.k, self._sizer)[1]
            return _create(self.graph, "call_function", aten.slice.Tensor, args, None)

        target, args, kwargs = _copy_args(
            node, self.nodes[node], self.k, 0, lambda a: other, slice_other, self._sizer,
            group_name,
        )
        return _create(self.graph, "call_function", target, args, kwargs)

    def _sizer(self, target: Callable[..., object], args: tuple, step: str) -> torch.fx.Node:
        return _create(self.graph, "call_function", target, args, None)

    def _slice(self, arg: torch.fx.Node, dim: int) -> torch.fx.Node:
        """This nanobatch's slice of whole value ``arg`` along ``dim`` (the rewrite's first)."""
        if (arg, dim) not in self.slices:
            args = _slice_args(self.env[arg], arg, dim, self.k, self._sizer)[0]
            self.slices[arg, dim] = _create(
                self.graph, "call_function", aten.slice.Tensor, args, None
            )
        return self.slices[arg, dim]


_getitem = operator.getitem


def _create(
    graph: torch.fx.Graph, op: str, target: object, args: tuple, kwargs: dict[str, object] | None
) -> torch.fx.Node:
    """``graph.create_node`` without its walk over the arguments in search of raw SymInts
    (torch 2.13; a third of the time to emit a variant): arguments hold symbolic sizes
    only as the nodes that compute them (the graph's, or a cut's), never as raw SymInts,
    so they are set after the node is made."""
    node = graph.create_node(op, target)
    node.args = args
    if kwargs:
        node.kwargs = kwargs
    return node


def _of_pieces(
    node: torch.fx.Node,
    dim: int,
    k: int,
    j: int,
    value: Callable[[torch.fx.Node], torch.fx.Node],
    emit: Callable[[object, tuple], torch.fx.Node],
) -> torch.fx.Node:
    """Nanobatch ``j`` of ``k`` of ``node``, a concatenation along ``dim`` of all ``n``
    pieces of the batch in order, from the pieces' ``value``: piece ``j`` itself (k = n),
    the pieces ``j * n/k`` on laid end to end (k < n), or part ``j % (k/n)`` of piece
    ``j // (k/n)`` (k > n); ``emit(target, args)`` adds a node."""
    tensors = node.args[0]
    n = len(tensors)
    if k == n:
        return value(tensors[j])
    if k < n:
        m = n // k
        return emit(aten.cat.default, ([value(t) for t in tensors[j * m:(j + 1) * m]], dim))
    m = k // n
    rows = shape(node.meta["val"])[dim] // k
    start = (j % m) * rows
    return emit(aten.slice.Tensor, (value(tensors[j // m]), dim, start, start + rows))


def _shape(node: torch.fx.Node) -> tuple[object, ...]:
    return shape(node.meta.get("val"))


def _copy_args(
    node: torch.fx.Node,
    plan: _NodePlan,
    k: int,
    j: int,
    value: Callable[[torch.fx.Node], torch.fx.Node],
    slice_of: Callable[[torch.fx.Node, int], torch.fx.Node],
    emit: Sizer,
    group_name: str | None = None,
) -> tuple[object, tuple, dict[str, object]]:
    """``node``'s op and arguments in nanobatch ``j``, in every mode of the emitter: each operand
    its ``value`` there, or ``slice_of`` it along a dim where the op pairs a whole operand
    element by element with its split ones (``_sliced_operand_dim``); the shapes they spell
    out resized to one nanobatch (sizes of a symbolic batch computed with ``emit``); a
    collective issued on ``group_name`` if given."""
    args, kwargs = torch.fx.node.map_arg(
        (node.args, node.kwargs),
        lambda a: slice_of(a, plan.sliced[a]) if a in plan.sliced else value(a),
    )
    target = node.target
    if plan.split and plan.resize is not None:
        args = plan.resize(node, args, plan.placement, k, j, emit)
        if isinstance(args, Retarget):
            target, args = args
    if group_name is not None:
        args = _with_group(node, args, group_name)
    return target, args, kwargs


def _slice_args(
    whole: torch.fx.Node, source: torch.fx.Node, dim: int, k: int, emit: Sizer
) -> list[tuple]:
    """``aten.slice`` arguments taking each nanobatch of ``whole``, the value of ``source``.

    A static dim is cut in k equal parts (analysis checked it divides); a symbolic one of
    ``c * R`` rows at ``c * (j * R // k)`` (``sizes.units``), sizes computed in the graph
    from ``whole``'s own, so that every value of the graph is cut alike and nothing
    guards on the batch size.
    """
    size = shape(source.meta.get("val"))[dim]
    if not symbolic(size):
        step = size // k
        return [(whole, dim, j * step, (j + 1) * step) for j in range(k)]
    coeff, _ = units(size)
    rows = emit(aten.sym_size.int, (whole, dim), "rows")
    batch = emit(operator.floordiv, (rows, coeff), "batch") if coeff > 1 else rows

    def cut(j: int) -> object:
        if j in (0, k):
            return 0 if j == 0 else rows
        share = chunk_start(batch, j, k, emit, "batch")
        return emit(operator.mul, (share, coeff), f"rows{j}") if coeff > 1 else share

    cuts = [cut(j) for j in range(k + 1)]
    return [(whole, dim, cuts[j], cuts[j + 1]) for j in range(k)]


def _plus(a: object, b: object, emit: Sizer, step: str) -> object:
    """``a + b`` of sizes: an int, or computed in the graph where either is a node."""
    if isinstance(a, int) and isinstance(b, int):
        return a + b
    if isinstance(a, int) and a == 0:
        return b
    return emit(operator.add, (a, b), step)


def _offsets(rows: Sequence[object], emit: Sizer) -> list[object]:
    """Where each of blocks of ``rows`` starts, and where the last ends."""
    bounds = [0]
    for b, r in enumerate(rows):
        bounds.append(_plus(bounds[-1], r, emit, f"offset{b}"))
    return bounds


def _with_group(node: torch.fx.Node, args: tuple, group_name: str) -> tuple:
    """The same collective issued on another process group (a resource-capped one)."""
    index = position(node, "group_name")
    return (*args[:index], group_name, *args[index + 1 :])


def _split_into_pieces(p: NodePlacement) -> bool:
    """Whether a node of placement ``p`` splits the batch into pieces (``Piece``)."""
    return isinstance(p, tuple) and bool(p) and all(isinstance(q, Piece) for q in p)


def join_order(val: torch.Tensor) -> list[int]:
    """Dims of ``val`` from outermost to innermost in memory, broadcast (stride-0) dims first."""
    strides = [size_hint(val.stride(d)) for d in range(val.ndim)]  # an order, not a guard
    return sorted(range(val.ndim), key=lambda d: (strides[d] != 0, -strides[d], -d))

