"""Open the custom ops that hide functional collectives inside them.

Some libraries wrap their communication in a ``torch.library.custom_op`` so that tracing
does not see it: torch's context parallelism gathers K and V with
``cplib::flex_cp_allgather`` (and reduce-scatters dK and dV with its backward). AOT
autograd keeps such an op whole, so its collective is neither found nor split, and its
wait cannot move. ``unwrap_collectives`` replaces each one by the functional collectives
its body calls, in the form AOT autograd gives ``funcol.all_gather_tensor`` and
``funcol.reduce_scatter_tensor`` along a dim other than 0 (gather on dim 0, then chunk and
cat; chunk and cat, then reduce-scatter on dim 0). The same data moves over the same
group with the same reduction, so the graph computes what it did, and every later pass
reads ordinary collectives.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
import torch.fx

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


@dataclass(frozen=True)
class Unwrapped:
    """One custom op replaced by its collectives."""

    node: str  # the replaced node's name
    op: str  # its qualified name ("cplib::flex_cp_allgather")
    collectives: int  # how many functional collectives it became


class _Emitter:
    """Appends nodes before ``anchor``, each with the fake value its op computes."""

    def __init__(self, graph: torch.fx.Graph, anchor: torch.fx.Node) -> None:
        self.graph, self.anchor = graph, anchor
        vals = [a.meta.get("val") for a in anchor.all_input_nodes]
        self.fake_mode = torch._guards.detect_fake_mode(vals)
        self.collectives = 0

    def __call__(self, target: Callable, *args: Any) -> torch.fx.Node:
        vals = torch.fx.node.map_arg(args, lambda n: n.meta["val"])
        with self.fake_mode:
            val = target(*vals)
        with self.graph.inserting_before(self.anchor):
            node = self.graph.call_function(target, args)
        node.meta.update({k: v for k, v in self.anchor.meta.items() if k != "val"})
        node.meta["val"] = val
        self.collectives += target in (
            c10d.all_gather_into_tensor.default, c10d.reduce_scatter_tensor.default)
        return node

    def contiguous(self, x: torch.fx.Node) -> torch.fx.Node:
        if x.meta["val"].is_contiguous():
            return x
        return self(aten.clone.default, x)


def _gather(emit: _Emitter, x: torch.fx.Node, dim: int, group: str, n: int) -> torch.fx.Node:
    """``funcol.all_gather_tensor(x, dim, group)``: gather on dim 0, then move the ranks'
    blocks to ``dim``."""
    x = emit.contiguous(x)
    rows = x.meta["val"].shape[0]
    out = emit(c10d.wait_tensor.default, emit(c10d.all_gather_into_tensor.default, x, n, group))
    if dim == 0:
        return out
    parts = emit(aten.split.Tensor, out, rows)
    return emit(aten.cat.default, [emit(operator.getitem, parts, i) for i in range(n)], dim)


def _scatter(emit: _Emitter, x: torch.fx.Node, dim: int, group: str, n: int) -> torch.fx.Node:
    """``funcol.reduce_scatter_tensor(x, "sum", dim, group)``: move ``dim``'s blocks to
    dim 0, then reduce-scatter on dim 0."""
    x = emit.contiguous(x)
    if dim != 0:
        block = x.meta["val"].shape[dim] // n
        parts = emit(aten.split.Tensor, x, block, dim)
        x = emit(aten.cat.default, [emit(operator.getitem, parts, i) for i in range(n)])
    return emit(c10d.wait_tensor.default,
                emit(c10d.reduce_scatter_tensor.default, x, "sum", n, group))


def _pair(move: Callable) -> Callable[[_Emitter, tuple], tuple[torch.fx.Node, ...]]:
    """A ``(k, v, seq_dim, group_name)`` op that moves both tensors alike."""

    def body(emit: _Emitter, args: tuple) -> tuple[torch.fx.Node, ...]:
        k, v, dim, group = args
        n = _group_size(str(group))
        return tuple(move(emit, x, int(dim), str(group), n) for x in (k, v))

    return body


def _group_size(group: str) -> int:
    from torch.distributed.distributed_c10d import _get_group_size_by_name

    return _get_group_size_by_name(group)


# qualified op name -> its body in functional collectives (arguments -> results)
WRAPPED_COLLECTIVES: Mapping[str, Callable[[_Emitter, tuple], tuple[torch.fx.Node, ...]]] = (
    MappingProxyType({
        # torch.distributed.tensor.experimental._context_parallel._cp_custom_ops
        "cplib::flex_cp_allgather": _pair(_gather),
        "cplib::flex_cp_allgather_backward": _pair(_scatter),
    })
)


def unwrap_collectives(
    gm: torch.fx.GraphModule,
    table: Mapping[str, Callable[[_Emitter, tuple], tuple[torch.fx.Node, ...]]] = (
        WRAPPED_COLLECTIVES),
) -> list[Unwrapped]:
    """Replace, in place, every op of ``table`` in ``gm`` by its functional collectives."""
    done = []
    graph = gm.graph
    for node in list(graph.nodes):
        name = _qualified_name(node)
        if name not in table or node.kwargs:
            continue
        if any(user.target is not operator.getitem for user in node.users):
            continue  # its tuple is used whole: left as it is
        emit = _Emitter(graph, node)
        results = table[name](emit, node.args)
        for user in list(node.users):
            # Each item becomes its result's last op, under its own name: a backward names
            # each saved value after the forward node it came from.
            result = results[user.args[1]]
            user.target, user.args, user.kwargs = result.target, result.args, result.kwargs
            user.meta["val"] = result.meta["val"]
            result.replace_all_uses_with(user)
            graph.erase_node(result)
        graph.erase_node(node)
        done.append(Unwrapped(node.name, name, emit.collectives))
    if done:
        gm.recompile()
    return done


def opened_notes(done: list[Unwrapped]) -> tuple[str, ...]:
    """One line per kind of op opened, for a graph's report."""
    counts: dict[str, list[int]] = {}
    for u in done:
        counts.setdefault(u.op, []).append(u.collectives)
    return tuple(f"{len(c)} {op} opened into their {sum(c)} functional collectives"
                 for op, c in counts.items())


def _qualified_name(node: torch.fx.Node) -> str | None:
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return None
    return node.target._schema.name
