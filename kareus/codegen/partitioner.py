"""AOT autograd's partition of a joint graph, the forward's saved values handed over in pieces.

Inductor calls ``config.custom_partitioner_fn`` (when set) instead of its min-cut
partitioner. kareus's (``SavedPieces``) runs that partitioner, then:

- puts the saved values back in the order AOT autograd's runtime reads them (tensors,
  opaque objects, sizes). The partitioner appends the random state of a recomputed random
  op (a checkpointed attention's) after the opaque objects, so a checkpointed module with
  DTensor parameters (their device mesh is saved, an opaque object, to build their
  gradients) fails at its first call: "expected all tensors_saved_with_vc_check to be
  Tensors, got ... DeviceMesh" (torch 2.13, with Inductor or ``aot_eager`` alike);
- cuts each saved value that the forward splits into nanobatches along its first dim
  (outermost in memory) into ``count`` equal pieces: the forward returns the items of
  ``split(value)`` (views, free where it runs unrewritten), the backward takes them as
  inputs of their own and concatenates them where it needs the value whole. Rewritten
  into ``count`` nanobatches, the forward returns each nanobatch's piece as it is and
  the backward takes the pieces as they come (``placement.Piece``): no concatenation at
  the forward's end and no split in the backward (DESIGN.md 3.4). Other counts take a
  slice of a piece where the count divides, several laid end to end where it is divided.

AOT autograd counts the saved values from the forward's outputs after the partition, so
its contract holds: the same function, the same outputs, more saved tensors.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomPartitionerFn
from torch._library.fake_class_registry import FakeScriptObject
from torch._prims_common import is_non_overlapping_and_dense_or_false
from torch.fx.operator_schemas import normalize_function

from kareus.codegen.nanobatch import join_order
from kareus.passes.analyse import analyse
from kareus.passes.ops import OP_TABLE, OpTable
from kareus.passes.placement import Split
from kareus.passes.sizes import shape, symbolic

aten = torch.ops.aten

Modules = tuple[torch.fx.GraphModule, torch.fx.GraphModule]


class SavedPieces(CustomPartitionerFn):
    """Inductor's partitioner, then the saved values in AOT's order and in ``count``
    pieces (1: not cut). ``key``: what else changes what it does (the kareus build), for
    Inductor's caches, which copy it with the config: it holds nothing else."""

    def __init__(self, count: int, key: str) -> None:
        self.count, self.key = count, key

    def __call__(
        self, gm: torch.fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any
    ) -> Modules:
        forward, backward = min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)
        outputs = kwargs["num_fwd_outputs"]
        _without_unused_random_state(forward, backward, outputs)
        saved = _saved_in_order(forward, backward, outputs)
        if self.count > 1:
            static = kwargs.get("static_lifetime_input_indices") or ()
            for node in to_cut(forward, backward, saved, self.count, static):
                cut_saved(forward, backward, node, self.count)
        return forward, backward

    def uuid(self) -> str:
        return f"kareus-saved-pieces-{self.count}-{self.key}"


def to_cut(
    forward: torch.fx.GraphModule, backward: torch.fx.GraphModule,
    saved: Sequence[torch.fx.Node], count: int, static: Sequence[int],
    table: OpTable = OP_TABLE,
) -> list[torch.fx.Node]:
    """The ``saved`` values of ``forward`` that, rewritten into ``count`` nanobatches, it
    splits along their outermost dim in equal static pieces (``static``: its parameters'
    and buffers' input indices)."""
    analysis = analyse(forward, (), "forward", static_input_idxs=static, table=table)
    if count not in analysis.space.nanobatches or analysis.exchanged:
        return []
    place = analysis.placements[count].placements
    return [n for n in saved if _cuttable(n, place.get(n), count)
            and not _named(piece_names(n, count), forward, backward)]


def _without_unused_random_state(
    forward: torch.fx.GraphModule, backward: torch.fx.GraphModule, outputs: int
) -> None:
    """Recomputed ops that draw no random numbers run as themselves, their random state
    neither saved nor restored.

    The partitioner saves the random state before each op tagged random that the backward
    recomputes (``run_and_save_rng_state``) and restores it there (``run_with_rng_state``),
    so a checkpointed block recomputes its dropout alike. Attention kernels are tagged
    random for their dropout, and at ``dropout_p`` 0 they draw nothing: wrapped, they hide
    the kernel from kareus's rules and cost model (the split region would end at every
    checkpointed attention). Pairs: the forward's states in output order are the
    backward's ``rng_state_output_<i>`` inputs in the order of ``i``, as
    ``functionalize_rng_ops`` makes them."""
    (out,) = forward.graph.find_nodes(op="output")
    values = list(out.args[0])
    wrapped = [n for n in values[outputs:] if _random_state_of(n) is not None]
    restored = sorted(
        (n for n in backward.graph.find_nodes(op="placeholder")
         if n.name.startswith("rng_state_output_")),
        key=lambda n: int(n.name.removeprefix("rng_state_output_")),
    )
    if len(wrapped) != len(restored):
        return
    dropped = set()
    for state, given in zip(wrapped, restored, strict=True):
        run = _random_state_of(state)
        (user,) = given.users
        if not _draws_nothing(run.args[0], run.args[1:], run.kwargs):
            continue
        result = next(u for u in run.users if u is not state and u.args[1] == 1)
        meta = dict(result.meta)  # the op's value (its backward copy has none)
        _unwrap(forward.graph, run, run.args[1:], result, meta)
        _unwrap(backward.graph, user, user.args[2:], user, meta)
        backward.graph.erase_node(given)
        dropped.add(state)
    if dropped:
        out.args = (tuple(v for v in values if v not in dropped),)
        for state in dropped:
            run = state.args[0]
            forward.graph.erase_node(state)
            forward.graph.erase_node(run)
        forward.recompile()
        backward.recompile()


def _random_state_of(node: object) -> torch.fx.Node | None:
    """The ``run_and_save_rng_state`` whose state ``node`` is (None: it is no such state)."""
    if not isinstance(node, torch.fx.Node) or node.target is not operator.getitem:
        return None
    run = node.args[0]
    is_run = isinstance(run, torch.fx.Node) and run.target is _SAVE_STATE
    return run if is_run and node.args[1] == 0 else None


def _draws_nothing(op: object, args: tuple, kwargs: dict) -> bool:
    """Whether ``op(*args, **kwargs)`` draws no random numbers: an attention kernel
    without dropout."""
    if not isinstance(op, torch._ops.OpOverload):
        return False
    pair = normalize_function(op, tuple(args), dict(kwargs), normalize_to_only_use_kwargs=True)
    return pair is not None and pair.kwargs.get("dropout_p", None) == 0


def _unwrap(
    graph: torch.fx.Graph, wrapper: torch.fx.Node, args: tuple, result: torch.fx.Node,
    meta: dict[str, object],
) -> None:
    """``wrapper``'s op called on ``args`` in its place, with ``meta``: ``result`` (its
    value) becomes the op's, and ``wrapper`` goes (with ``result`` where they differ)."""
    op = wrapper.args[0] if wrapper.target is _SAVE_STATE else wrapper.args[1]
    with graph.inserting_before(wrapper):
        call = graph.call_function(op, tuple(args), dict(wrapper.kwargs))
    call.meta = dict(meta)
    result.replace_all_uses_with(call)
    if result is not wrapper:
        graph.erase_node(result)
    if not wrapper.users:
        graph.erase_node(wrapper)


_SAVE_STATE = torch.ops.higher_order.run_and_save_rng_state


def _cuttable(node: torch.fx.Node, p: object, count: int) -> bool:
    val = node.meta.get("val")
    if not isinstance(p, Split) or p.blocks != 1 or p.sizes is not None or p.order is not None:
        return False
    if not isinstance(val, torch.Tensor) or val.ndim < 2 or node.meta.get(
        "saved_tensor_with_no_vc_check"
    ):
        return False
    rows = shape(val)[p.dim]
    # Dense and split on its first dim, outermost in memory: a piece has the whole
    # value's strides, whoever computes it, and the pieces laid end to end in memory
    # order are the value (``cut_saved`` joins them so in the backward).
    return (not symbolic(rows) and rows % count == 0 and p.dim == 0
            and join_order(val)[0] == 0 and is_non_overlapping_and_dense_or_false(val))


def _saved_in_order(
    forward: torch.fx.GraphModule, backward: torch.fx.GraphModule, outputs: int
) -> list[torch.fx.Node]:
    """The forward's saved tensors, after putting every saved value in the order AOT
    autograd reads them: forward outputs (tensors, opaque objects, sizes) and backward
    inputs (sizes, tensors, opaque objects), each group in its order."""
    (out,) = forward.graph.find_nodes(op="output")
    values = list(out.args[0])
    saved = values[outputs:]
    tensors = [n for n in saved if _tensor(n)]
    ordered = tensors + [n for n in saved if _opaque(n)] + [n for n in saved if _size(n)]
    if ordered != saved:
        out.args = (tuple(values[:outputs] + ordered),)
        forward.recompile()
        inputs = backward.graph.find_nodes(op="placeholder")[: len(saved)]
        by_kind = ([n for n in inputs if _size(n)] + [n for n in inputs if _tensor(n)]
                   + [n for n in inputs if _opaque(n)])
        anchor = inputs[0].prev
        for node in by_kind:
            anchor.append(node)
            anchor = node
        backward.recompile()
    return tensors


def piece_names(node: torch.fx.Node, count: int) -> list[str]:
    """The names of saved value ``node``'s pieces, in the forward and in the backward."""
    return [f"{node.name}_piece{j}" for j in range(count)]


def _named(names: Sequence[str], *modules: torch.fx.GraphModule) -> bool:
    """Whether a node of ``modules`` has one of ``names`` (a piece must not be renamed)."""
    taken = {n.name for gm in modules for n in gm.graph.nodes}
    return any(name in taken for name in names)


def _opaque(node: torch.fx.Node) -> bool:
    return isinstance(node, torch.fx.Node) and isinstance(
        node.meta.get("val"), (FakeScriptObject, torch.ScriptObject)
    )


def _size(node: object) -> bool:
    return isinstance(node, torch.fx.Node) and isinstance(
        node.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool)
    )


def _tensor(node: torch.fx.Node) -> bool:
    return not _opaque(node) and not _size(node)


def cut_saved(
    forward: torch.fx.GraphModule, backward: torch.fx.GraphModule, node: torch.fx.Node,
    count: int,
) -> None:
    """Hand saved value ``node`` (a forward node; the backward's input of its name) to the
    backward in ``count`` equal pieces along its split dim: the items of a ``split`` in
    the forward's outputs, in its place; inputs of their own in the backward's, in its
    place, concatenated into the value where the backward read it."""
    (out,) = forward.graph.find_nodes(op="output")
    values = list(out.args[0])
    at = len(values) - 1 - values[::-1].index(node)  # the saved one (a user output comes first)
    dim = 0  # ``_cuttable``: the values cut are split on dim 0, contiguous
    rows = shape(node.meta["val"])[dim] // count
    with forward.graph.inserting_before(out):
        split = forward.graph.call_function(aten.split.Tensor, (node, rows, dim))
        split.meta["val"] = aten.split.Tensor(node.meta["val"], rows, dim)
        pieces = []
        for j, name in enumerate(piece_names(node, count)):
            piece = forward.graph.create_node(
                "call_function", operator.getitem, (split, j), name=name
            )
            piece.meta["val"] = split.meta["val"][j]
            pieces.append(piece)
    out.args = (tuple(values[:at] + pieces + values[at + 1:]),)
    forward.recompile()

    (given,) = (n for n in backward.graph.find_nodes(op="placeholder") if n.name == node.name)
    inputs = []
    for piece in pieces:  # named as the forward's pieces: AOT autograd's convention
        with backward.graph.inserting_before(given):
            inputs.append(backward.graph.placeholder(piece.name))
        inputs[-1].meta["val"] = piece.meta["val"]
    first = next(n for n in backward.graph.nodes if n.op != "placeholder")
    with backward.graph.inserting_before(first):
        whole = _in_layout(backward.graph, inputs, given.meta["val"])
    whole.meta = dict(given.meta)
    given.replace_all_uses_with(whole)
    backward.graph.erase_node(given)
    backward.recompile()


def _in_layout(
    graph: torch.fx.Graph, pieces: Sequence[torch.fx.Node], val: torch.Tensor
) -> torch.fx.Node:
    """The pieces (along dim 0, outermost in memory) concatenated into a value laid out as
    ``val``: a concatenation is contiguous, so pieces of another layout are permuted to
    their memory order first and the result back (an attention's output, whose heads and
    sequence are transposed in memory, is viewed by the backward as it was laid out)."""
    order = join_order(val)
    if order == list(range(val.ndim)):
        return graph.call_function(aten.cat.default, (list(pieces), 0))
    ordered = []
    for piece in pieces:
        ordered.append(graph.call_function(aten.permute.default, (piece, order)))
        ordered[-1].meta["val"] = piece.meta["val"].permute(order)
    joined = graph.call_function(aten.cat.default, (ordered, 0))
    joined.meta["val"] = torch.cat([p.meta["val"] for p in ordered], 0)
    back = [order.index(d) for d in range(val.ndim)]
    return graph.call_function(aten.permute.default, (joined, back))


def partitioner_config(count: int, key: str) -> dict[str, Any]:
    """Inductor's config patch that partitions joint graphs with ``SavedPieces`` (none
    where this torch has no ``custom_partitioner_fn``: saved values are then joined)."""
    if "custom_partitioner_fn" not in inductor_config.get_config_copy():
        return {}
    return {"custom_partitioner_fn": SavedPieces(count, key)}
