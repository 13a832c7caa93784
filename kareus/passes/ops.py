"""One table of what kareus knows about each op.

For every op a pass may meet: whether it launches a kernel and its cost class (free,
memory-bound, or heavy: matmul / attention / convolution), whether it is pointwise or
random, its placement rule (``placement.py``), how its arguments resize to one nanobatch,
which of its operands are laid out like its output (per-sample masks), which input a
gather reads only in part, which operands it reads only the shape of (fills), and whether
Inductor runs it as a kernel that allocates its own output (a concatenation copies it).
Partitioning (slots, keys), placement, the rewrite and the simulated GPU all read this
table, so adding an op is one entry here. Each is given the table (``OP_TABLE`` unless a
caller passes another, ``OpTable.with_entries``); the analysis keeps the one it used.

Ops missing from the table get facts from their ATen tags and schema: ``pointwise`` ops
follow the broadcasting rule, ``nondeterministic_seeded`` ops are random (they end a split
region fed by split values), ops whose results all alias an input are free views (without
a placement rule), everything else is a memory-bound kernel without a rule (another
library's op allocates its own output: Inductor falls back to it).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType
from typing import NamedTuple

import torch
import torch.fx

from kareus.passes import placement as rules
from kareus.passes import sizes
from kareus.passes.placement import NodePlacement, Rule, Split
from kareus.passes.schema import position

aten = torch.ops.aten
prims = torch.ops.prims
c10d = torch.ops._c10d_functional


class Cost(Enum):
    FREE = "free"  # no kernel: views, aliases, getitem, allocation
    MEMORY = "memory"  # a memory-bound kernel
    MATMUL = "matmul"
    ATTENTION = "attention"
    CONVOLUTION = "convolution"

    @property
    def heavy(self) -> bool:
        """Its own launch slot: a compute-bound kernel."""
        return self in (Cost.MATMUL, Cost.ATTENTION, Cost.CONVOLUTION)


Sizer = sizes.Emit

class Retarget(NamedTuple):
    """What a resize returns where one nanobatch needs another op (``_resize_split``)."""

    target: object
    args: tuple


Resize = Callable[[torch.fx.Node, tuple, NodePlacement, int, int, Sizer], "tuple | Retarget"]
"""Arguments of ``node`` for nanobatch ``j`` of ``k``, placed ``p``."""


@dataclass(frozen=True)
class OpFacts:
    cost: Cost = Cost.MEMORY
    placement: Rule | None = None  # None: no rule, a split region ends at the op
    resize: Resize | None = None  # rewrites arguments that spell out a batch-sized shape
    pointwise: bool = False
    random: bool = False
    # Operands laid out like the output (a per-sample attention mask, a scatter's target):
    # when replicated or whole, sliced along the output's split dim unless of size 1 there;
    # where the output is a partial sum, like the split operand of their shape (the values
    # a scatter_add pairs with its split indices).
    aligned_operands: tuple[str, ...] = ()
    partial_read: str | None = None  # a gather reads of this input only the rows it returns
    shape_only: tuple[str, ...] = ()  # operands it reads the shape of, not the data
    # Inductor runs it as a kernel that allocates its own output (a fallback to ATen, or an
    # extern kernel of fixed layout), so a concatenation copies that output into its own
    # buffer. Kernels Inductor generates and its matmuls (``extern_kernels.mm(..., out=)``)
    # write into a slice of the concatenation's buffer instead (torch/_inductor/ir.py,
    # ``ConcatKernel.can_realize_into_without_copy``: a flexible layout, no ExternKernelAlloc).
    allocates_output: bool = False

    @property
    def launches_kernel(self) -> bool:
        return self.cost is not Cost.FREE


# -- resizing the arguments that spell out a shape ---------------------------------------


def _shape(node: torch.fx.Node) -> tuple[sizes.Size, ...]:
    return sizes.shape(node.meta["val"])  # int() of a symbolic size would guard on it


def _resize_shape(
    node: torch.fx.Node, args: tuple, p: NodePlacement, k: int, j: int, emit: Sizer
) -> tuple:
    """view / reshape / expand: the target shape's split dim holds one nanobatch.

    Static dims are spelt out; a symbolic split dim, or one in uneven blocks, is left to
    the op (-1: inferred, or kept by an expand), as its size differs by nanobatch; other
    symbolic dims keep the graph's own nodes (``rules.view`` refused one it spells -1
    beside a symbolic split)."""
    if not isinstance(p, Split):
        return args
    shape = [
        (-1 if sizes.symbolic(size) or p.sizes is not None else size // k) if d == p.dim
        else given if sizes.symbolic(size) else size
        for d, (size, given) in enumerate(zip(sizes.shape(node.meta["val"]), args[1], strict=True))
    ]
    return (args[0], shape, *args[2:])  # the shape is the second argument of all four


def _resize_split(
    node: torch.fx.Node, args: tuple, p: NodePlacement, k: int, j: int, emit: Sizer
) -> tuple | Retarget:
    """split / split_with_sizes along the split dim (of a blocked value): sizes per nanobatch,
    for a symbolic dim the piece's rows over the parts (``rules.split``: equal parts), as
    ``split_with_sizes``: a split by size gives one part of an empty piece, not n."""
    dims = {q.dim for q in p if isinstance(q, Split)} if isinstance(p, tuple) else set()
    source = node.args[0]
    dim_index = position(node, "dim")
    dim = node.kwargs.get("dim", node.args[dim_index] if len(node.args) > dim_index else 0)
    shape = _shape(source)
    if dims != {dim % len(shape)}:
        return args
    given = args[1]
    if sizes.symbolic(shape[dim % len(shape)]):
        parts = len(node.meta["val"])
        rows = emit(aten.sym_size.int, (args[0], dim), "rows")
        part = emit(operator.floordiv, (rows, parts), "part")
        return Retarget(aten.split_with_sizes.default, (args[0], [part] * parts, dim))
    new = [s // k for s in given] if isinstance(given, (list, tuple)) else given // k
    return (args[0], new, *args[2:])


_WHOLE_DIM = 2**63 - 1  # an end past any dim: aten.slice clamps it


def _resize_slice(
    node: torch.fx.Node, args: tuple, p: NodePlacement, k: int, j: int, emit: Sizer
) -> tuple:
    """slice / slice_scatter along the split dim that the rule accepted (the whole dim, or
    whole blocks of a blocked one): one nanobatch's bounds, each block's chunk 1/k of it."""
    if not isinstance(p, Split):
        return args
    index = position(node, "dim")
    dim = args[index] if len(args) > index else 0
    size = _shape(node.args[0])
    if dim % len(size) != p.dim:
        return args
    if sizes.symbolic(size[p.dim]):  # the rule took only the whole dim: the whole piece
        return (*args[: index + 1], 0, _WHOLE_DIM, *args[index + 3 :])
    given = (*args[index + 1 : index + 3], None, None)[:2]
    start, end = rules.slice_bounds(*given, size[p.dim])
    return (*args[: index + 1], start // k, end // k, *args[index + 3 :])


def _resize_all_to_all(
    node: torch.fx.Node, args: tuple, p: NodePlacement, k: int, j: int, emit: Sizer
) -> tuple:
    """An all-to-all of split rows (``rules.all_to_all``): each rank's block holds one
    nanobatch's share; of uneven blocks, chunk ``j`` of each (sizes computed in the graph
    where they are symbolic)."""
    if not isinstance(p, Split) or p.dim != 0:
        return args
    resized = list(args)
    for name in ("output_split_sizes", "input_split_sizes"):
        index = position(node, name)
        resized[index] = [
            sizes.chunk_rows(size, j, k, emit, f"{name}{b}") if p.sizes is not None
            else size // k
            for b, size in enumerate(args[index])
        ]
    return tuple(resized)


def _resize_inverse(
    node: torch.fx.Node, args: tuple, p: NodePlacement, k: int, j: int, emit: Sizer
) -> tuple:
    """``inverse[perm] = arange(n)`` of a nanobatch's own sort (``rules.index_put``): the
    arange's first rows, as many as the nanobatch's, written into a fresh tensor of its
    own (not a slice of a whole one: Inductor writes an index_put into its target, and
    the nanobatches' inverses would share it)."""
    if not isinstance(p, rules.LocalIds):
        return args
    (ids,), values = args[1:3]
    rows = emit(aten.sym_size.int, (ids, 0), "rows")
    fresh = emit(aten.empty_like.default, (ids,), "target")
    return (fresh, [ids], emit(aten.slice.Tensor, (values, 0, 0, rows), "arange"), *args[3:])


# -- the table --------------------------------------------------------------------------

_FREE = OpFacts(Cost.FREE)


def _view(rule: Rule, resize: Resize | None = None) -> OpFacts:
    return OpFacts(Cost.FREE, rule, resize)


def _attention(batched: tuple[str, ...], outputs: str, mask: str | None = None) -> OpFacts:
    kinds = tuple({"s": "split", "l": "local"}[c] for c in outputs)
    return OpFacts(
        Cost.ATTENTION,
        rules.AttentionKernel(batched, kinds, mask),
        aligned_operands=(mask,) if mask else (),
        allocates_output=True,  # an ATen fallback in Inductor
    )


_QKV = ("query", "key", "value")
_QKV_BWD = ("grad_out", "query", "key", "value", "out", "logsumexp")

# ``allocates_output``: the ops Inductor (torch 2.13) falls back to ATen for or lowers to an
# extern kernel of fixed layout: attention; histc and _grouped_mm (lowering.py
# ``make_fallback``; on CUDA kernel/mm_grouped.py ``grouped_mm_args`` gives a FixedLayout);
# topk (a fallback unless config.triton.decompose_sort_ops); convolutions (kernel/conv.py
# ``conv_layout``: FixedLayout); collectives (fallback kernels writing the buffer they
# reduce into); other libraries' ops (``_from_tags``).
_ENTRIES: dict[object, OpFacts] = {
    operator.getitem: _FREE,
    # identity-like
    aten.clone: OpFacts(Cost.MEMORY, rules.same),
    aten.alias: _view(rules.same),
    aten.detach: _view(rules.same),
    aten._to_copy: OpFacts(Cost.MEMORY, rules.same),
    aten.contiguous: OpFacts(Cost.MEMORY, rules.same),
    aten.lift_fresh_copy: OpFacts(Cost.MEMORY, rules.same),
    c10d.wait_tensor: OpFacts(Cost.FREE, rules.same),
    aten.sym_size: OpFacts(Cost.FREE, rules.size_of),
    aten.sym_numel: OpFacts(Cost.FREE, rules.size_of),
    aten.sym_stride: OpFacts(Cost.FREE, rules.size_of),
    # views and shape changes
    aten.view: _view(rules.view, _resize_shape),
    aten._unsafe_view: _view(rules.view, _resize_shape),
    aten.reshape: _view(rules.view, _resize_shape),
    aten.expand: _view(rules.expand, _resize_shape),
    aten.permute: _view(rules.permute),
    aten.transpose: _view(rules.transpose),
    aten.t: _view(rules.transpose),
    aten.unsqueeze: _view(rules.unsqueeze),
    aten.squeeze: _view(rules.squeeze),
    aten.slice: _view(rules.slice_, _resize_slice),
    aten.select: _view(rules.select),
    aten.slice_scatter: OpFacts(
        Cost.MEMORY, rules.scatter_into, _resize_slice, aligned_operands=("input",)
    ),
    aten.select_scatter: OpFacts(Cost.MEMORY, rules.scatter_into, aligned_operands=("input",)),
    aten.split: _view(rules.split, _resize_split),
    aten.split_with_sizes: _view(rules.split, _resize_split),
    aten.unbind: _view(rules.unbind),
    aten.view_as_complex: _view(rules.view_as_complex),
    aten.view_as_real: _view(rules.view_as_real),
    aten.as_strided: _FREE,
    aten.empty: _FREE,
    aten.empty_strided: _FREE,
    aten.empty_like: OpFacts(Cost.FREE, rules.fill_like),
    # fills write their output and read no data (``input`` gives a shape); copy reads ``src``
    aten.copy: OpFacts(
        Cost.MEMORY, rules.copy_into, shape_only=("input",), aligned_operands=("input",)
    ),
    aten.copy_: OpFacts(Cost.MEMORY, shape_only=("input",)),
    **{
        op: OpFacts(Cost.MEMORY, rules.fill_like, shape_only=("input",))
        for op in (aten.zeros_like, aten.ones_like, aten.full_like)
    },
    **{
        op: OpFacts(Cost.MEMORY, shape_only=("input",))
        for op in (
            aten.new_zeros,
            aten.new_ones,
            aten.new_full,
            aten.zero,
            aten.zero_,
            aten.fill.Scalar,
            aten.fill_.Scalar,
        )
    },
    # Inductor's ConcatKernel allocates a buffer of fixed layout for its inputs to be
    # written into (ir.py ``ConcatKernel.create``): a concatenation of it copies it
    aten.cat: OpFacts(Cost.MEMORY, rules.cat, allocates_output=True),
    aten.stack: OpFacts(Cost.MEMORY, rules.stack, allocates_output=True),  # a cat, lowered
    aten.constant_pad_nd: OpFacts(Cost.MEMORY, rules.constant_pad),
    # indexing
    aten.gather: OpFacts(Cost.MEMORY, rules.gather, partial_read="input"),
    aten.index_select: OpFacts(Cost.MEMORY, rules.index_select, partial_read="input"),
    aten.index: OpFacts(Cost.MEMORY, rules.index, partial_read="input"),
    aten.embedding: OpFacts(Cost.MEMORY, rules.embedding, partial_read="weight"),
    aten.embedding_dense_backward: OpFacts(Cost.MEMORY, rules.embedding_backward),
    aten._unsafe_masked_index_put_accumulate: OpFacts(Cost.MEMORY, rules.masked_accumulate),
    aten.index_put: OpFacts(Cost.MEMORY, rules.index_put, _resize_inverse),
    aten.scatter_add: OpFacts(Cost.MEMORY, rules.scatter_add, aligned_operands=("src",)),
    # matmuls
    aten.mm: OpFacts(Cost.MATMUL, rules.mm),
    aten.addmm: OpFacts(Cost.MATMUL, rules.addmm),
    aten.bmm: OpFacts(Cost.MATMUL, rules.bmm),
    aten.baddbmm: OpFacts(Cost.MATMUL),
    aten._scaled_mm: OpFacts(Cost.MATMUL),
    aten._grouped_mm: OpFacts(Cost.MATMUL, rules.grouped_mm, allocates_output=True),
    # transformers' grouped matmul where aten's has no kernel (CPU), by its name: the op
    # exists once transformers is imported
    "transformers::grouped_mm_fallback": OpFacts(
        Cost.MATMUL, rules.grouped_mm, allocates_output=True
    ),
    aten.convolution: OpFacts(Cost.CONVOLUTION, allocates_output=True),
    aten.convolution_backward: OpFacts(Cost.CONVOLUTION, allocates_output=True),
    # reductions and normalisations
    aten.sum: OpFacts(Cost.MEMORY, rules.sum_),
    **{
        op: OpFacts(Cost.MEMORY, rules.reduction)
        for op in (
            aten.mean,
            aten.amax,
            aten.amin,
            aten.argmax,
            aten.argmin,
            aten.prod,
            aten.var,
            aten.std,
            aten.any,
            aten.all,
        )
    },
    aten.var_mean: OpFacts(Cost.MEMORY, rules.var_mean),
    aten._softmax: OpFacts(Cost.MEMORY, rules.along_dim),
    aten._log_softmax: OpFacts(Cost.MEMORY, rules.along_dim),
    aten.cumsum: OpFacts(Cost.MEMORY, rules.cumsum),
    aten.histc: OpFacts(Cost.MEMORY, rules.histogram, allocates_output=True),
    aten.sort: OpFacts(Cost.MEMORY, rules.sort),
    aten.div.Tensor_mode: OpFacts(Cost.MEMORY, rules.floor_divide, pointwise=True),
    aten.floor_divide: OpFacts(Cost.MEMORY, rules.floor_divide, pointwise=True),
    aten.topk: OpFacts(Cost.MEMORY, rules.along_dim, allocates_output=True),
    aten._softmax_backward_data: OpFacts(Cost.MEMORY, rules.softmax_backward),
    aten._log_softmax_backward_data: OpFacts(Cost.MEMORY, rules.softmax_backward),
    aten.nll_loss_forward: OpFacts(Cost.MEMORY, rules.nll_loss),
    aten.nll_loss_backward: OpFacts(Cost.MEMORY, rules.nll_loss_backward),
    # attention kernels (CPU, and CUDA's flash / efficient / cuDNN / overrideable)
    aten._scaled_dot_product_flash_attention_for_cpu: _attention(_QKV, "ss", "attn_mask"),
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _attention(
        _QKV_BWD, "sss", "attn_mask"
    ),
    aten._scaled_dot_product_flash_attention: _attention(_QKV, "ssl" + "l" * 6),
    aten._scaled_dot_product_flash_attention_backward: _attention(_QKV_BWD, "sss"),
    aten._scaled_dot_product_efficient_attention: _attention(_QKV, "ssll", "attn_bias"),
    aten._scaled_dot_product_efficient_attention_backward: _attention(
        ("grad_out_", *_QKV_BWD[1:]), "sssl", "attn_bias"
    ),
    aten._scaled_dot_product_cudnn_attention: _attention(_QKV, "ss" + "l" * 7, "attn_bias"),
    aten._scaled_dot_product_cudnn_attention_backward: _attention(_QKV_BWD, "sss", "attn_bias"),
    aten._scaled_dot_product_fused_attention_overrideable: _attention(
        _QKV, "ss" + "l" * 7, "attn_bias"
    ),
    aten._scaled_dot_product_fused_attention_overrideable_backward: _attention(
        _QKV_BWD, "sssl", "attn_bias"
    ),
    **{
        op: OpFacts(Cost.ATTENTION, allocates_output=True)
        for op in (
            aten._flash_attention_forward,
            aten._flash_attention_backward,
            aten._efficient_attention_forward,
            aten._efficient_attention_backward,
        )
    },
    # collectives
    c10d.all_reduce: OpFacts(Cost.MEMORY, rules.all_reduce, allocates_output=True),
    c10d.all_gather_into_tensor: OpFacts(Cost.MEMORY, rules.all_gather, allocates_output=True),
    c10d.reduce_scatter_tensor: OpFacts(
        Cost.MEMORY, rules.reduce_scatter, allocates_output=True
    ),
    c10d.all_to_all_single: OpFacts(
        Cost.MEMORY, rules.all_to_all, _resize_all_to_all, allocates_output=True
    ),
}


class OpTable:
    """Facts per op: an entry for the overload, else for its packet, else from tags."""

    def __init__(self, entries: Mapping[object, OpFacts]) -> None:
        self._entries = MappingProxyType(dict(entries))

    def facts(self, target: object) -> OpFacts:
        found = self._entries.get(target)
        if found is None:
            found = self._entries.get(getattr(target, "overloadpacket", None))
        if found is None and isinstance(target, torch._ops.OpOverload):
            found = self._entries.get(target._schema.name)  # an op of another library
        if found is not None:
            return found
        return _from_tags(target)

    def facts_of(self, node: torch.fx.Node) -> OpFacts:
        """The facts of the op ``node`` calls (placeholders and outputs: free, no rule)."""
        if node.op != "call_function":
            return _FREE
        return self.facts(node.target)

    def rule(self, target: object) -> Rule | None:
        return self.facts(target).placement

    def with_entries(self, entries: Mapping[object, OpFacts]) -> OpTable:
        """A copy with ``entries`` added or replaced (tests, experiments)."""
        return OpTable({**self._entries, **entries})


def _from_tags(target: object) -> OpFacts:
    if not isinstance(target, torch._ops.OpOverload):
        return OpFacts()
    if torch.Tag.nondeterministic_seeded in target.tags:
        return OpFacts(Cost.MEMORY, rules.random_op, random=True)
    if torch.Tag.pointwise in target.tags:
        return OpFacts(Cost.MEMORY, rules.pointwise, pointwise=True)
    returns = target._schema.returns
    if returns and all(r.alias_info is not None and not r.alias_info.is_write for r in returns):
        return _FREE
    # Inductor lowers aten and prims ops (or decomposes them); another library's op is a
    # fallback kernel that allocates its output.
    return OpFacts(allocates_output=target.namespace not in ("aten", "prims"))


OP_TABLE = OpTable(_ENTRIES)


# kareus's own op. ``kareus::set_clock(graph, mhz)`` asks for an SM clock as a graph
# starts (``codegen.clock_switch`` puts it there; the runtime registers what it does,
# ``runtime.ops``; the simulated GPU reads it as a clock change). It returns nothing, so it
# is declared side-effectful: FX dead-code elimination and Inductor's scheduler keep it.
_KAREUS_OPS = torch.library.Library("kareus", "DEF")
_KAREUS_OPS.define("set_clock(str graph, int mhz) -> ()")
torch.library.register_fake("kareus::set_clock", lambda graph, mhz: None, lib=_KAREUS_OPS)
SET_CLOCK = torch.ops.kareus.set_clock.default
torch.fx.node.has_side_effect(SET_CLOCK)

DEFAULT_CLOCK_MHZ = 0
"""The clock a ``set_clock`` asks for to mean "the device's default clocks" (no lock): the
one spelling of the default clock, in decisions, plans and every device."""

