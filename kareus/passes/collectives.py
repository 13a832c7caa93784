"""Find the functional collectives of a graph and pair each with its waits.

AOT autograd graphs carry communication as ``_c10d_functional`` ops whose results are
only usable after a ``wait_tensor``. Everything later (partitioning, nanobatching, cost
models) reasons about a collective as one record: what it moves, over which group, and
which nodes issue and complete it.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch
import torch.distributed as dist
import torch.fx

from kareus.errors import KareusError
from kareus.passes.schema import arguments

try:
    from torch.fx.experimental.symbolic_shapes import optimization_hint
except ImportError:  # torch 2.11: the older name, which needs a fallback for a data-dependent
    from torch.fx.experimental.symbolic_shapes import hint_int  # size (Inductor's default)

    def optimization_hint(size: torch.SymInt) -> int:
        return hint_int(size, fallback=8192)

_c10d = torch.ops._c10d_functional

# op -> (kind, whether it takes a list of tensors)
COLLECTIVE_OPS: Mapping[torch._ops.OpOverload, tuple[str, bool]] = MappingProxyType({
    _c10d.all_reduce.default: ("all_reduce", False),
    _c10d.all_gather_into_tensor.default: ("all_gather", False),
    _c10d.reduce_scatter_tensor.default: ("reduce_scatter", False),
    _c10d.all_to_all_single.default: ("all_to_all", False),
    _c10d.all_reduce_coalesced.default: ("all_reduce", True),
    _c10d.all_gather_into_tensor_coalesced.default: ("all_gather", True),
    _c10d.reduce_scatter_tensor_coalesced.default: ("reduce_scatter", True),
})
WAIT_OP = _c10d.wait_tensor.default


class MalformedGraphError(KareusError, ValueError):
    """A graph without what AOT autograd gives it (tensor metadata on a collective's input)."""


@dataclass(frozen=True)
class Collective:
    """One functional collective and the waits that complete it."""

    index: int
    kind: str
    coalesced: bool
    group_name: str
    group_size: int | None
    reduce_op: str | None
    dtype: torch.dtype
    shapes: tuple[tuple[int, ...], ...]
    payload_bytes: int
    node: torch.fx.Node
    waits: tuple[torch.fx.Node, ...]

    @property
    def ring_passes(self) -> int:
        """Passes over the ring: reduce-scatter then all-gather for an all-reduce, else one."""
        return 2 if self.kind == "all_reduce" else 1

    def bus_bytes(self, group_size: int) -> float:
        """Bytes each rank sends with a ring algorithm (nccl-tests bus-bandwidth convention).

        ``payload_bytes`` is the nccl-tests "size": the buffer of an all-reduce or
        all-to-all, the gathered output of an all-gather, the input of a reduce-scatter.
        """
        n = group_size
        return self.payload_bytes * self.ring_passes * (n - 1) / n

    @property
    def bytes_per_rank(self) -> int | None:
        return None if self.group_size is None else int(self.bus_bytes(self.group_size))

    @property
    def name(self) -> str:
        return self.node.name


def find_collectives(graph: torch.fx.Graph) -> list[Collective]:
    """All collectives of ``graph`` in issue order, each with its wait nodes."""
    found = []
    for node in graph.nodes:
        if node.op == "call_function" and node.target in COLLECTIVE_OPS:
            found.append(_record(len(found), node))
    return found


def _record(index: int, node: torch.fx.Node) -> Collective:
    kind, coalesced = COLLECTIVE_OPS[node.target]
    args = arguments(node)
    inputs = args["inputs"] if coalesced else [args["input"]]
    vals = [_meta_val(n) for n in inputs]
    group_name = str(args["group_name"])
    group_size = args.get("group_size")
    if group_size is None:
        group_size = _resolve_group_size(group_name)
    input_bytes = sum(size_hint(v.numel()) * v.element_size() for v in vals)
    # nccl-tests size: all-gather is counted on its (group_size x larger) output.
    payload = input_bytes * group_size if kind == "all_gather" and group_size else input_bytes
    return Collective(
        index=index,
        kind=kind,
        coalesced=coalesced,
        group_name=group_name,
        group_size=group_size,
        reduce_op=args.get("reduce_op"),
        dtype=vals[0].dtype,
        shapes=tuple(tuple(size_hint(d) for d in v.shape) for v in vals),
        payload_bytes=int(payload),
        node=node,
        waits=_waits_of(node),
    )


def size_hint(size: int | torch.SymInt) -> int:
    """A size as an int, without guarding on a symbolic one (its example value)."""
    return optimization_hint(size) if isinstance(size, torch.SymInt) else int(size)


def _meta_val(node: torch.fx.Node) -> torch.Tensor:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise MalformedGraphError(f"collective input {node.name} has no tensor metadata")
    return val


def group_label(group_name: str) -> str:
    """A group as structural keys hold it: the spacing of its ranks, alike on every rank
    whose group is the same line of a device mesh (on CP x TP, rank 0's TP group {0, 1}
    and rank 2's {2, 3} both read "group[0, 1]", where their names differ); its name where
    this process cannot resolve it (a graph planned offline)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        ranks = dist.get_process_group_ranks(_resolve_process_group(group_name))
    except (RuntimeError, ValueError):
        return group_name
    return f"group{[r - min(ranks) for r in ranks]}"


def _resolve_group_size(group_name: str) -> int | None:
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        return _resolve_process_group(group_name).size()
    except RuntimeError:  # not registered in this process, e.g. a graph planned offline
        return None


def _waits_of(node: torch.fx.Node) -> tuple[torch.fx.Node, ...]:
    """Wait nodes on the collective's result, or on each ``getitem`` of a coalesced result."""
    waits = []
    for user in node.users:
        if user.target is WAIT_OP:
            waits.append(user)
        elif user.target is operator.getitem:
            waits.extend(u for u in user.users if u.target is WAIT_OP)
    return tuple(waits)


def is_collective(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in COLLECTIVE_OPS


def is_wait(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is WAIT_OP
