"""Cut a graph at its communication boundaries into segments and partitions.

A *segment* is the compute between two consecutive collectives: every compute node is
placed in the segment of the first collective that needs it (its deadline), or, if no
collective needs it (weight gradients, the loss), right after the last wait it depends
on. A *partition* is one overlap opportunity (DESIGN.md section 2): collective ``C_i``
together with segment ``S_i``, the compute that produces its input. Once the batch is
split into nanobatches, ``C_i`` of one nanobatch runs while ``S_i`` of another computes.

Each partition has ordered launch *slots*, the groups of its compute before which the
other nanobatch's collective may be issued: every matmul, attention or convolution is its
own slot, runs of memory-bound ops merge into one, and free ops (views, getitem) ride
along. Its structural *key* hashes the op sequence, shapes, dtypes and the collective,
so identical partitions of repeated layers share one search.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import math
import operator
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.fx
from torch.fx.node import _get_qualified_name
from torch.utils._pytree import tree_leaves

from kareus.passes.collectives import (
    Collective,
    find_collectives,
    group_label,
    is_collective,
    is_wait,
)
from kareus.passes.ops import OP_TABLE, OpTable
from kareus.passes.schema import arguments

aten = torch.ops.aten

@dataclass(frozen=True)
class Slot:
    """A group of a partition's compute; a collective may be issued right before it."""

    index: int
    kind: str  # "memory" | "matmul" | "attention" | "convolution"
    label: str
    nodes: tuple[str, ...]


@dataclass(frozen=True)
class Partition:
    """Collective ``C_i`` and the compute of segment ``S_i`` in canonical order."""

    index: int
    collective: Collective
    nodes: tuple[torch.fx.Node, ...]
    slots: tuple[Slot, ...]
    key: str


@dataclass(frozen=True)
class GraphPartitioning:
    """Segments (one per collective plus the tail after the last wait) and partitions."""

    segments: tuple[tuple[torch.fx.Node, ...], ...]
    partitions: tuple[Partition, ...]
    notes: tuple[str, ...]


def partition_graph(
    graph: torch.fx.Graph, collectives: Sequence[Collective], table: OpTable = OP_TABLE
) -> GraphPartitioning:
    """Segments and partitions of ``graph``; ``notes`` say why a collective got no partition.
    ``table`` says which ops launch kernels and which are heavy (the slots and keys)."""
    segment_of = _assign_segments(graph, collectives)
    segments: list[list[torch.fx.Node]] = [[] for _ in range(len(collectives) + 1)]
    for node in graph.nodes:
        if node in segment_of:
            segments[segment_of[node]].append(node)

    partitions, notes = [], []
    for coll, seg in zip(collectives, segments):
        why_not = _why_no_partition(coll, seg, table)
        if why_not:
            notes.append(f"{coll.name} ({coll.kind}): {why_not}")
            continue
        ordered = canonical_order(seg, table)
        partitions.append(
            Partition(
                index=len(partitions),
                collective=coll,
                nodes=tuple(ordered),
                slots=_slots(ordered, table),
                key=structural_key(ordered, coll, table),
            )
        )
    notes.extend(_in_flight_notes(collectives))
    return GraphPartitioning(tuple(tuple(s) for s in segments), tuple(partitions), tuple(notes))


def _is_free(node: torch.fx.Node, table: OpTable) -> bool:
    return not table.facts_of(node).launches_kernel


def _is_compute(node: torch.fx.Node) -> bool:
    """Not a placeholder, collective, wait, or an element of a coalesced collective's result."""
    if node.op not in ("call_function", "call_method", "call_module"):
        return False
    if node.target is operator.getitem and is_collective(node.args[0]):
        return False
    return not (is_collective(node) or is_wait(node))


def _assign_segments(
    graph: torch.fx.Graph, collectives: Sequence[Collective]
) -> dict[torch.fx.Node, int]:
    """Segment index of every compute node.

    A node goes to the earliest segment among those of its users (a collective ``C_j``
    counts as segment ``j``): as late as its consumers allow, so weight transposes sit
    with their matmuls and values recomputed for the backward are recomputed where they
    are used. A graph output goes right after the last wait it depends on (its level),
    so weight gradients are computed as soon as their inputs exist and those can be
    freed. Segments so assigned never decrease along an edge, so emitting segments in
    order is a valid schedule.
    """
    wait_index = {w: c.index for c in collectives for w in c.waits}
    coll_index = {c.node: c.index for c in collectives}
    level: dict[torch.fx.Node, int] = {}
    for node in graph.nodes:
        own = wait_index[node] + 1 if node in wait_index else 0
        level[node] = max([own, *(level[i] for i in node.all_input_nodes)])
    segment: dict[torch.fx.Node, float] = {}
    for node in reversed(graph.nodes):
        due = [
            level[node] if u.op == "output" else coll_index.get(u, segment.get(u, math.inf))
            for u in node.users
        ]
        segment[node] = min(due, default=math.inf)
        if segment[node] == math.inf:
            segment[node] = level[node]
    return {n: int(segment[n]) for n in graph.nodes if _is_compute(n)}


def _why_no_partition(
    coll: Collective, segment: Sequence[torch.fx.Node], table: OpTable
) -> str | None:
    if not coll.waits:
        return "its result is never waited on, so it has no completion point to overlap up to"
    if all(_is_free(n, table) for n in segment):
        return "no compute produces its input (only graph inputs or views), nothing to overlap"
    return None


def _in_flight_notes(collectives: Sequence[Collective]) -> list[str]:
    """Collectives issued before the previous one was waited: they already overlap each other."""
    notes = []
    order = {n: i for i, n in enumerate(collectives[0].node.graph.nodes)} if collectives else {}
    for prev, cur in itertools.pairwise(collectives):
        if prev.waits and order[cur.node] < min(order[w] for w in prev.waits):
            notes.append(
                f"{cur.name} is issued while {prev.name} is still in flight; "
                "their partitions are measured as if sequential"
            )
    return notes


def _slots(segment: Sequence[torch.fx.Node], table: OpTable) -> tuple[Slot, ...]:
    groups: list[tuple[str, list[torch.fx.Node]]] = []
    pending: list[torch.fx.Node] = []  # free ops waiting for a group to join
    for node in segment:
        cost = table.facts_of(node).cost
        kind = cost.value if cost.heavy else None
        if _is_free(node, table):
            if groups and groups[-1][0] == "memory":
                groups[-1][1].append(node)
            else:
                pending.append(node)
        elif kind is not None:
            groups.append((kind, [*pending, node]))
            pending = []
        elif groups and groups[-1][0] == "memory":
            groups[-1][1].append(node)
        else:
            groups.append(("memory", [*pending, node]))
            pending = []
    if pending and groups:
        groups[-1][1].extend(pending)
    return tuple(
        Slot(i, kind, _slot_label(kind, nodes, table), tuple(n.name for n in nodes))
        for i, (kind, nodes) in enumerate(groups)
    )


def _slot_label(kind: str, nodes: Sequence[torch.fx.Node], table: OpTable) -> str:
    if kind == "memory":
        return f"mem×{sum(1 for n in nodes if not _is_free(n, table))}"
    heavy = next(n for n in nodes if table.facts_of(n).cost.heavy)
    name = heavy.target.overloadpacket.__name__
    if kind == "matmul":
        return name.strip("_")
    suffix = "-bwd" if "backward" in name else ""
    return {"attention": "attn", "convolution": "conv"}[kind] + suffix


def canonical_order(segment: Sequence[torch.fx.Node], table: OpTable) -> list[torch.fx.Node]:
    """The segment in an order that depends on its structure alone, not on node order.

    AOT autograd orders the nodes of different layers' backward differently (recomputed
    ops, saved vs. recomputed weight transposes), so the graph's order cannot be what
    identical partitions share. This is a topological order that issues ready nodes by
    depth (ops on the longest path from the partition's inputs; free ops add nothing),
    then by structural hash: the same for every copy of the same computation, and close
    to program order (the q, k, v projections of attention come out side by side).
    """
    members = set(segment)
    digest = _node_hashes(segment, table)
    depth: dict[torch.fx.Node, int] = {}
    for node in segment:  # graph order is topological
        inputs = [depth[i] for i in node.all_input_nodes if i in members]
        depth[node] = max(inputs, default=0) + (0 if _key_transparent(node, table) else 1)
    waiting = {n: sum(1 for i in n.all_input_nodes if i in members) for n in segment}
    ready = [(depth[n], digest[n], i, n) for i, n in enumerate(segment) if waiting[n] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        *_, node = heapq.heappop(ready)
        order.append(node)
        for user in node.users:
            if user in members:
                waiting[user] -= 1
                if waiting[user] == 0:
                    heapq.heappush(ready, (depth[user], digest[user], len(order), user))
    return order


def _node_hashes(
    segment: Sequence[torch.fx.Node],
    table: OpTable,
    sig: Callable[[torch.fx.Node], object] | None = None,
) -> dict[torch.fx.Node, str]:
    """Merkle hash of every node over its op, constants, output type and inputs' hashes
    (``sig``: how a value's type is described; default its shape and dtype)."""
    sig = sig or _tensor_sig
    members = set(segment)
    digest: dict[torch.fx.Node, str] = {}
    for node in segment:  # graph order is topological
        token = (
            _ref(node, members, digest.__getitem__, table, sig)
            if _key_transparent(node, table)
            else _token(node, lambda a: _ref(a, members, digest.__getitem__, table, sig), sig)
        )
        digest[node] = hashlib.sha1(repr(token).encode()).hexdigest()
    return digest


def graph_hash(graph: torch.fx.Graph, table: OpTable, *, shapes: bool = True) -> str:
    """Structural identity of a whole graph: ops, argument structure, shapes, dtypes, groups.

    Identical on every rank that traced the same program (node names, Python scalars and
    free ops are left out as in the partition keys) and across runs, so ranks can key what
    they must agree on by it without talking to each other. Without ``shapes`` the graphs
    of one program point still match where data decides sizes that differ between ranks
    (tokens routed to each expert of a mixture of experts).
    """
    nodes = list(graph.nodes)
    digest = _node_hashes(nodes, table, None if shapes else _dtype_sig)
    parts: list[object] = sorted(digest[n] for n in nodes if not _key_transparent(n, table))
    # A group is named, not sized, in the graph: the same program on a group of other
    # size is another graph (other costs, other participants).
    parts.append([(c.kind, c.group_size) for c in find_collectives(graph)])
    return hashlib.sha1(repr(parts).encode()).hexdigest()[:16]


_SCALAR_IDENTITY_OPS = frozenset(
    [aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor]
)


def _key_transparent(node: torch.fx.Node, table: OpTable) -> bool:
    """Free, or arithmetic with a Python number (which Inductor drops when it is 0 or 1).

    torch 2.14's ``remove_no_ops`` (joint graph) removes ``x - 0``: a vocab-parallel
    embedding's offset is 0 on rank 0 only, so such ops must not enter the key or the
    canonical order, which every rank must derive alike.
    """
    if _is_free(node, table):
        return True
    return node.target in _SCALAR_IDENTITY_OPS and any(
        isinstance(a, (int, float)) and not isinstance(a, bool) for a in node.args
    )


def _ref(
    arg: torch.fx.Node,
    members: set[torch.fx.Node],
    ident: Callable[[torch.fx.Node], object],
    table: OpTable,
    sig: Callable[[torch.fx.Node], object] | None = None,
) -> tuple[object, ...]:
    """How a partition refers to a value: its source and the value's shape and dtype.

    Chains of free ops are looked through: they cost nothing, and AOT autograd saves a
    transposed weight for one layer and recomputes the transpose for another, which must
    not split their keys (nor may ``getitem`` indices, which pick each rank's own chunk).
    The source is ``ident`` of the first non-free member, or "in" for a value computed
    outside the partition.
    """
    node = arg
    while node in members and _key_transparent(node, table) and node.all_input_nodes:
        node = node.all_input_nodes[0]
    source = ident(node) if node in members and not _key_transparent(node, table) else "in"
    return (source, (sig or _tensor_sig)(arg))


def _token(
    node: torch.fx.Node,
    ref: Callable[[torch.fx.Node], object],
    sig: Callable[[torch.fx.Node], object] | None = None,
) -> tuple[object, ...]:
    group = arguments(node).get("group_name") if is_collective(node) else None

    def describe(arg: object) -> object:
        if isinstance(arg, torch.fx.Node):
            return ref(arg)
        if group is not None and arg == group:
            # Group names differ between ranks of a 2-D mesh; their spacing does not.
            return group_label(group)
        if isinstance(arg, (list, tuple)):
            return tuple(describe(a) for a in arg)
        if isinstance(arg, dict):
            return tuple(sorted((k, describe(v)) for k, v in arg.items()))
        if isinstance(arg, (int, float)) and not isinstance(arg, bool):
            # Ranks differ in scalars (a sharded embedding's vocabulary offset) but not in
            # cost, and every rank must derive the same keys to take the same decisions.
            return type(arg).__name__
        return repr(arg)

    return (
        target_name(node.target), describe(node.args), describe(node.kwargs),
        (sig or _tensor_sig)(node),
    )


def target_name(target: object) -> str:
    """A node's target as keys hold it: a Python function (``torch.sym_sum``) by its
    qualified name, since its ``str`` holds its address, which differs between processes,
    so ranks tracing the same program would derive different keys and never meet."""
    if isinstance(target, types.FunctionType):
        return _get_qualified_name(target)
    return str(target)


def structural_key(ordered: Sequence[torch.fx.Node], coll: Collective, table: OpTable) -> str:
    """Hash of the op sequence, argument structure, shapes and dtypes, and the collective.

    ``ordered`` is the canonical order of the partition's compute. Node names and free
    ops are left out, so the same computation in another layer hashes the same; values
    produced outside the partition are described by their shape and dtype only.
    """
    members = set(ordered)
    work = [n for n in ordered if not _key_transparent(n, table)]
    local = {n: i for i, n in enumerate(work)}

    def ref(arg: torch.fx.Node) -> object:
        return _ref(arg, members, local.__getitem__, table)

    parts: list[object] = [_token(n, ref) for n in work]
    parts.append(
        (coll.kind, coll.reduce_op, coll.group_size, str(coll.dtype), coll.shapes,
         [ref(i) for i in coll.node.all_input_nodes])
    )
    return hashlib.sha1(repr(parts).encode()).hexdigest()[:12]


def _tensor_sig(node: torch.fx.Node) -> tuple[object, ...]:
    return _sig(node.meta.get("val"))


def _dtype_sig(node: torch.fx.Node) -> tuple[object, ...]:
    vals = tree_leaves(node.meta.get("val"))
    return tuple(str(v.dtype) if isinstance(v, torch.Tensor) else type(v).__name__ for v in vals)


def size_key(size: int | torch.SymInt) -> int | str:
    """A size as keys hold it: symbolic sizes by their expression (``int()`` would guard)."""
    return str(size) if isinstance(size, torch.SymInt) else int(size)


def _sig(val: object) -> tuple[object, ...]:
    if isinstance(val, torch.Tensor):
        return (tuple(size_key(d) for d in val.shape), str(val.dtype))
    if isinstance(val, (list, tuple)):
        return tuple(_sig(v) for v in val)
    return (type(val).__name__,)
