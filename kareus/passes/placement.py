"""Which dimension of every value can be split into nanobatches.

Placements (DESIGN.md section 3), propagated through the graph from its inputs:

- ``Split(dim, blocks)``: nanobatch ``i`` holds the ``i``-th of ``k`` equal chunks of
  ``dim``. With ``blocks > 1`` the dim is ``blocks`` equal blocks laid end to end (a
  concatenation or an all-gather along the split dim) and nanobatch ``i`` holds the
  ``i``-th chunk of every block, in block order.
- ``Replicate()``: one value that does not depend on the batch (parameters, constants),
  used as is by every nanobatch.
- ``Partial()``: one contribution per nanobatch; the value is their sum (a contraction
  over the split dim: weight gradients, losses).
- ``Local()``: one value per nanobatch without a batch dim (an attention kernel's seed);
  usable by the same nanobatch only.
- ``Whole(reason)``: computed once from the whole batch. An op without a rule, or whose
  inputs a rule cannot keep split, becomes such a barrier: its split inputs are joined
  (concatenated, or summed) first, so the result is always right, and ``reason`` says
  why the split region ended there.

Rules cover the ops of the post-AOT graphs of Llama-style models under tensor and
sequence parallelism; a rule returns a placement or a string saying why it cannot split.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.fx

from kareus.passes.collectives import WAIT_OP

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


@dataclass(frozen=True)
class Split:
    dim: int
    blocks: int = 1


@dataclass(frozen=True)
class Replicate:
    pass


@dataclass(frozen=True)
class Partial:
    pass


@dataclass(frozen=True)
class Local:
    pass


@dataclass(frozen=True)
class Whole:
    reason: str


Placement = Split | Replicate | Partial | Local | Whole
NodePlacement = Placement | tuple[Placement, ...]

REPLICATE = Replicate()
PARTIAL = Partial()
LOCAL = Local()


def per_nanobatch(p: NodePlacement) -> bool:
    """Whether a node with this placement runs once per nanobatch."""
    if isinstance(p, tuple):
        return any(per_nanobatch(q) for q in p)
    return isinstance(p, (Split, Partial, Local))


@dataclass(frozen=True)
class Barrier:
    """Where a split region ended, and why."""

    node: str
    reason: str


@dataclass(frozen=True)
class PlacementResult:
    placements: dict[torch.fx.Node, NodePlacement]
    barriers: tuple[Barrier, ...]


class _Ctx:
    """What a rule sees: the node, ``k`` and the placement and value of every argument."""

    def __init__(self, node: torch.fx.Node, k: int, placements: dict[torch.fx.Node, NodePlacement]):
        self.node, self.k, self._placements = node, k, placements

    def pl(self, arg: object) -> NodePlacement:
        return self._placements[arg] if isinstance(arg, torch.fx.Node) else REPLICATE

    def arg(self, name: str, index: int, default: object = None) -> object:
        if name in self.node.kwargs:
            return self.node.kwargs[name]
        return self.node.args[index] if index < len(self.node.args) else default

    @property
    def out(self) -> object:
        return self.node.meta.get("val")


Rule = Callable[[_Ctx], NodePlacement | str]
RULES: dict[object, Rule] = {}


def _rule(*ops: object) -> Callable[[Rule], Rule]:
    def register(fn: Rule) -> Rule:
        for op in ops:
            RULES[op] = fn
        return fn

    return register


def propagate(graph: torch.fx.Graph, inputs: dict[torch.fx.Node, NodePlacement], k: int) -> PlacementResult:
    """Placements of every node given those of the placeholders (missing: replicated)."""
    placements: dict[torch.fx.Node, NodePlacement] = {}
    barriers: list[Barrier] = []
    for node in graph.nodes:
        if node.op == "placeholder":
            placements[node] = inputs.get(node, REPLICATE)
        elif node.op in ("get_attr", "output"):
            placements[node] = REPLICATE
        else:
            placements[node] = _place(node, k, placements, barriers)
    return PlacementResult(placements, tuple(barriers))


def _place(
    node: torch.fx.Node, k: int, placements: dict[torch.fx.Node, NodePlacement], barriers: list[Barrier]
) -> NodePlacement:
    ins = [placements[i] for i in node.all_input_nodes]
    flat = [q for p in ins for q in (p if isinstance(p, tuple) else (p,))]
    if node.target is operator.getitem:
        source = placements[node.args[0]]
        return source[node.args[1]] if isinstance(source, tuple) else source
    if all(isinstance(p, Replicate) for p in flat):
        return REPLICATE
    whole = next((p for p in flat if isinstance(p, Whole)), None)
    if whole is not None:
        return whole
    target = node.target
    packet = getattr(target, "overloadpacket", target)
    rule = RULES.get(target) or RULES.get(packet)
    if rule is None and isinstance(target, torch._ops.OpOverload):
        if torch.Tag.nondeterministic_seeded in target.tags:
            rule = _random
        elif torch.Tag.pointwise in target.tags:
            rule = _pointwise
    result = rule(_Ctx(node, k, placements)) if rule else f"no placement rule for {target}"
    if isinstance(result, str):
        if any(isinstance(p, Local) for p in flat):
            result += "; it consumes a per-nanobatch value that cannot be joined"
        barriers.append(Barrier(node.name, result))
        return Whole(f"{node.name}: {result}")
    return result


def _norm(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _shape(x: object) -> tuple[int, ...]:
    return tuple(int(d) for d in x.shape) if isinstance(x, torch.Tensor) else ()


def _random(ctx: _Ctx) -> str:
    return "random op: splitting it would change the random stream, so it runs on the whole batch"


def _pointwise(ctx: _Ctx) -> NodePlacement | str:
    """Elementwise ops with broadcasting: every split input must land on one output dim."""
    out_ndim = len(_shape(ctx.out))
    tensors = [a for a in ctx.node.all_input_nodes]
    splits = {}
    partial = []
    for a in tensors:
        p = ctx.pl(a)
        if isinstance(p, Split):
            splits[a] = Split(p.dim + out_ndim - len(_shape(a.meta.get("val"))), p.blocks)
        elif isinstance(p, Partial):
            partial.append(a)
        elif isinstance(p, Local):
            return "per-nanobatch value in an elementwise op"
    if partial:
        return _linear_partial(ctx, partial, bool(splits))
    placements = set(splits.values())
    if len(placements) != 1:
        return f"elementwise inputs split along different dims ({sorted(placements, key=str)})"
    (split,) = placements
    for a in tensors:
        if a not in splits and sliced_dim(a, split, out_ndim) is None:
            return f"{a.name} is replicated but not broadcast along the split dim"
    return split


def sliced_dim(arg: torch.fx.Node, split: Split, out_ndim: int) -> int | None:
    """The dim of a replicated elementwise operand to slice per nanobatch (-1: broadcast).

    A replicated operand as long as the split dim (a dropout mask drawn once for the
    whole batch) is sliced like the split operands; one of size 1 there broadcasts.
    """
    shape = _shape(arg.meta.get("val"))
    aligned = split.dim - (out_ndim - len(shape))
    if not 0 <= aligned < len(shape) or shape[aligned] == 1:
        return -1
    return aligned if split.blocks == 1 else None


_LINEAR = {
    aten.add.Tensor, aten.sub.Tensor, aten.neg.default, aten.mul.Tensor, aten.mul.Scalar,
    aten.div.Tensor, aten.div.Scalar, aten.clone.default, aten.alias.default,
}


def _linear_partial(ctx: _Ctx, partial: list[torch.fx.Node], has_split: bool) -> NodePlacement | str:
    """Sums survive linear maps: p1 + p2, -p, p * r, p / r (r replicated)."""
    target = ctx.node.target
    if has_split or target not in _LINEAR:
        return f"{target} is not linear in a partial sum"
    if target in (aten.add.Tensor, aten.sub.Tensor):
        operands = ctx.node.args[:2]
        both = all(isinstance(a, torch.fx.Node) and a in partial for a in operands)
        return PARTIAL if both else "partial sum plus a replicated value"
    if len(partial) > 1 or (target is aten.div.Tensor and ctx.node.args[0] is not partial[0]):
        return "product of partial sums"
    return PARTIAL


# -- identity-like --------------------------------------------------------------------


@_rule(aten.clone, aten.alias, aten.detach, aten._to_copy, aten.contiguous, aten.lift_fresh_copy,
       WAIT_OP)
def _same(ctx: _Ctx) -> NodePlacement | str:
    return ctx.pl(ctx.node.args[0])


# -- views and shape changes ----------------------------------------------------------


@_rule(aten.view, aten._unsafe_view, aten.reshape)
def _view(ctx: _Ctx) -> NodePlacement | str:
    p = ctx.pl(ctx.node.args[0])
    if not isinstance(p, Split):
        return _replicate_or_partial(p)
    return _reshaped(p, _shape(ctx.node.args[0].meta.get("val")), _shape(ctx.out), ctx.k)


def _reshaped(p: Split, src: Sequence[int], dst: Sequence[int], k: int) -> Split | str:
    """Follow the split dim through a reshape, group by group of dims with equal products.

    Chunk ``i`` of the split dim is a contiguous chunk of its group only if the dims
    before it in the group are 1; it is chunk ``i`` of the group's first non-1 output dim
    if that dim divides by ``k`` (by ``blocks * k`` for a blocked split).
    """
    i = j = 0
    while i < len(src) or j < len(dst):
        gi, gj = [i], [j]
        a = src[i] if i < len(src) else 1
        b = dst[j] if j < len(dst) else 1
        while a != b:
            if a < b:
                i += 1
                gi.append(i)
                a *= src[i]
            else:
                j += 1
                gj.append(j)
                b *= dst[j]
        if p.dim in gi:
            if any(src[d] != 1 for d in gi[: gi.index(p.dim)]):
                return "reshape merges the split dim into a dim it is not the outer part of"
            lead = next((d for d in gj if d < len(dst) and dst[d] != 1), None)
            if lead is None or dst[lead] % (k * p.blocks) or (p.blocks > 1 and dst[lead] != src[p.dim]):
                return "reshape splits the split dim in a way nanobatches cannot follow"
            return Split(lead, p.blocks)
        i, j = gi[-1] + 1, gj[-1] + 1
    raise AssertionError(f"split dim {p.dim} outside a reshape of {src} to {dst}")


def _replicate_or_partial(p: NodePlacement) -> NodePlacement | str:
    if isinstance(p, (Partial, Replicate)):
        return p  # a view of a sum is the sum of the views
    return f"cannot follow a {type(p).__name__} placement"


@_rule(aten.expand)
def _expand(ctx: _Ctx) -> NodePlacement | str:
    p = ctx.pl(ctx.node.args[0])
    if not isinstance(p, Split):
        return _replicate_or_partial(p)
    src, dst = _shape(ctx.node.args[0].meta.get("val")), _shape(ctx.out)
    dim = p.dim + len(dst) - len(src)
    return Split(dim, p.blocks) if dst[dim] == src[p.dim] else "expand broadcasts the split dim"


@_rule(aten.permute)
def _permute(ctx: _Ctx) -> NodePlacement | str:
    p = ctx.pl(ctx.node.args[0])
    if not isinstance(p, Split):
        return _replicate_or_partial(p)
    dims = [_norm(d, len(ctx.node.args[1])) for d in ctx.node.args[1]]
    return Split(dims.index(p.dim), p.blocks)


@_rule(aten.transpose, aten.t)
def _transpose(ctx: _Ctx) -> NodePlacement | str:
    p = ctx.pl(ctx.node.args[0])
    if not isinstance(p, Split):
        return _replicate_or_partial(p)
    ndim = len(_shape(ctx.out))
    a, b = (0, 1) if ctx.node.target is aten.t.default else (_norm(ctx.node.args[1], ndim), _norm(ctx.node.args[2], ndim))
    return Split({a: b, b: a}.get(p.dim, p.dim), p.blocks)


@_rule(aten.unsqueeze)
def _unsqueeze(ctx: _Ctx) -> NodePlacement | str:
    p = ctx.pl(ctx.node.args[0])
    if not isinstance(p, Split):
        return _replicate_or_partial(p)
    dim = _norm(ctx.node.args[1], len(_shape(ctx.out)))
    return Split(p.dim + (dim <= p.dim), p.blocks)


@_rule(aten.squeeze)
def _squeeze(ctx: _Ctx) -> NodePlacement | str:
    p = ctx.pl(ctx.node.args[0])
    if not isinstance(p, Split):
        return _replicate_or_partial(p)
    src = _shape(ctx.node.args[0].meta.get("val"))
    dims = ctx.node.args[1] if len(ctx.node.args) > 1 else range(len(src))
    dims = [_norm(d, len(src)) for d in ([dims] if isinstance(dims, int) else dims)]
    removed = [d for d in dims if src[d] == 1]
    if p.dim in removed:
        return "squeeze removes the split dim"
    return Split(p.dim - sum(d < p.dim for d in removed), p.blocks)


@_rule(aten.slice)
def _slice(ctx: _Ctx) -> NodePlacement | str:
    p = ctx.pl(ctx.node.args[0])
    if not isinstance(p, Split):
        return _replicate_or_partial(p)
    src = _shape(ctx.node.args[0].meta.get("val"))
    dim = _norm(ctx.arg("dim", 1, 0), len(src))
    if dim == p.dim and _shape(ctx.out) != src:
        return "slice along the split dim"
    return p


@_rule(aten.select)
def _select(ctx: _Ctx) -> NodePlacement | str:
    p = ctx.pl(ctx.node.args[0])
    if not isinstance(p, Split):
        return _replicate_or_partial(p)
    dim = _norm(ctx.node.args[1], len(_shape(ctx.node.args[0].meta.get("val"))))
    if dim == p.dim:
        return "select along the split dim"
    return Split(p.dim - (dim < p.dim), p.blocks)


@_rule(aten.split, aten.split_with_sizes)
def _split(ctx: _Ctx) -> NodePlacement | str:
    p = ctx.pl(ctx.node.args[0])
    n = len(ctx.out)
    if not isinstance(p, Split):
        return _replicate_or_partial(p) if isinstance(p, (Partial, Replicate)) else "cannot split this value"
    src = _shape(ctx.node.args[0].meta.get("val"))
    dim = _norm(ctx.arg("dim", 2, 0), len(src))
    if dim != p.dim:
        return (p,) * n
    # Splitting a blocked dim into its blocks (an all-gather followed by DTensor's
    # re-layout) leaves each block chunked the same way.
    if p.blocks > 1 and n == p.blocks and all(_shape(o)[dim] == src[dim] // n for o in ctx.out):
        return (Split(dim),) * n
    return "split along the split dim"


@_rule(aten.cat)
def _cat(ctx: _Ctx) -> NodePlacement | str:
    tensors = ctx.node.args[0]
    ps = {ctx.pl(t) for t in tensors}
    if len(ps) != 1:
        return "concatenation of differently placed tensors"
    (p,) = ps
    if not isinstance(p, Split):
        return _replicate_or_partial(p) if isinstance(p, Replicate) else "concatenation of partial sums"
    ndim = len(_shape(ctx.out))
    dim = _norm(ctx.arg("dim", 1, 0), ndim)
    if dim != p.dim:
        return p
    sizes = {_shape(t.meta.get("val"))[dim] for t in tensors}
    if p.blocks == 1 and len(sizes) == 1:
        return Split(dim, len(tensors))
    return "concatenation along the split dim of unequal or blocked pieces"


# -- matmuls, reductions, normalisations ------------------------------------------------


@_rule(aten.mm)
def _mm(ctx: _Ctx) -> NodePlacement | str:
    a, b = (ctx.pl(x) for x in ctx.node.args[:2])
    return _matmul(a, b, 0, 1)


@_rule(aten.addmm)
def _addmm(ctx: _Ctx) -> NodePlacement | str:
    bias, a, b = (ctx.pl(x) for x in ctx.node.args[:3])
    if not isinstance(bias, Replicate):
        return "addmm with a split bias"
    result = _matmul(a, b, 0, 1)
    return result if isinstance(result, Split) else "addmm adds its bias once per contribution"


@_rule(aten.bmm)
def _bmm(ctx: _Ctx) -> NodePlacement | str:
    a, b = (ctx.pl(x) for x in ctx.node.args[:2])
    if a == b == Split(0):
        return Split(0)
    return _matmul(a, b, 1, 2, batch=True)


def _matmul(a: NodePlacement, b: NodePlacement, row: int, col: int, batch: bool = False) -> NodePlacement | str:
    """C = A @ B: split rows of A or columns of B stay split; a split contraction is a partial sum."""
    rep_a, rep_b = isinstance(a, Replicate), isinstance(b, Replicate)
    if isinstance(a, Split) and rep_b and a.dim == row and not batch:
        return a
    if rep_a and isinstance(b, Split) and b.dim == col and not batch:
        return b
    if isinstance(a, Split) and isinstance(b, Split) and (a.dim, b.dim) == (col, row) and a.blocks == b.blocks:
        return PARTIAL
    if (isinstance(a, Partial) and rep_b) or (rep_a and isinstance(b, Partial)):
        return PARTIAL
    return f"matmul of {a} and {b}"


def _reduced_dims(ctx: _Ctx, index: int) -> list[int]:
    ndim = len(_shape(ctx.node.args[0].meta.get("val")))
    dims = ctx.arg("dim", index, None)
    if dims is None or dims == []:
        return list(range(ndim))
    return [_norm(d, ndim) for d in ([dims] if isinstance(dims, int) else dims)]


def _reduction(ctx: _Ctx, linear: bool) -> NodePlacement | str:
    p = ctx.pl(ctx.node.args[0])
    if isinstance(p, Partial):
        return PARTIAL if linear else "nonlinear reduction of a partial sum"
    if not isinstance(p, Split):
        return "cannot reduce this value"
    dims = _reduced_dims(ctx, 1)
    if p.dim in dims:
        return PARTIAL if linear else "reduction over the split dim"
    keepdim = bool(ctx.arg("keepdim", 2, False))
    return Split(p.dim if keepdim else p.dim - sum(d < p.dim for d in dims), p.blocks)


@_rule(aten.sum)
def _sum(ctx: _Ctx) -> NodePlacement | str:
    return _reduction(ctx, linear=True)


@_rule(aten.mean, aten.amax, aten.amin, aten.prod, aten.var, aten.std, aten.any, aten.all)
def _other_reduction(ctx: _Ctx) -> NodePlacement | str:
    return _reduction(ctx, linear=False)


@_rule(aten.var_mean)
def _var_mean(ctx: _Ctx) -> NodePlacement | str:
    result = _reduction(ctx, linear=False)
    return result if isinstance(result, str) else (result, result)


@_rule(aten._softmax, aten._log_softmax)
def _softmax(ctx: _Ctx) -> NodePlacement | str:
    p = ctx.pl(ctx.node.args[0])
    dim = _norm(ctx.node.args[1], len(_shape(ctx.out)))
    return p if isinstance(p, Split) and p.dim != dim else "softmax along the split dim"


@_rule(aten._softmax_backward_data, aten._log_softmax_backward_data)
def _softmax_backward(ctx: _Ctx) -> NodePlacement | str:
    a, b = ctx.pl(ctx.node.args[0]), ctx.pl(ctx.node.args[1])
    dim = _norm(ctx.node.args[2], len(_shape(ctx.out)))
    return a if isinstance(a, Split) and a == b and a.dim != dim else "softmax backward along the split dim"


# -- attention ----------------------------------------------------------------------------


def _attention(outputs: Sequence[str], tensors: int, dropout_index: int, bias_index: int | None = None) -> Rule:
    """Attention kernels are batched over dim 0 of q, k, v (and of their gradients)."""

    def rule(ctx: _Ctx) -> NodePlacement | str:
        if ctx.arg("dropout_p", dropout_index, 0.0):
            return "attention with dropout: splitting it would change the random stream"
        ps = [ctx.pl(a) for a in ctx.node.args[:tensors]]
        if any(p != Split(0) for p in ps if not isinstance(p, Local)):
            return "attention inputs not split along the batch dim"
        bias = ctx.node.kwargs.get("attn_mask")
        if bias_index is not None:
            bias = ctx.arg("attn_bias", bias_index, None)
        if bias is not None and not _broadcast_over_batch(ctx, bias):
            return "attention mask or bias that varies over the batch"
        return tuple({"split": Split(0), "local": LOCAL}[o] for o in outputs)

    return rule


def _broadcast_over_batch(ctx: _Ctx, mask: object) -> bool:
    """A replicated mask of (batch, heads, q, k) layout of size 1 along the batch, or of fewer dims."""
    if not isinstance(mask, torch.fx.Node) or not isinstance(ctx.pl(mask), Replicate):
        return False
    shape = _shape(mask.meta.get("val"))
    return len(shape) < 4 or shape[0] == 1


RULES[aten._scaled_dot_product_flash_attention_for_cpu.default] = _attention(["split"] * 2, 3, 3)
RULES[aten._scaled_dot_product_flash_attention_for_cpu_backward.default] = _attention(["split"] * 3, 6, 6)
RULES[aten._scaled_dot_product_flash_attention.default] = _attention(
    ["split", "split"] + ["local"] * 7, 3, 3
)
RULES[aten._scaled_dot_product_flash_attention_backward.default] = _attention(["split"] * 3, 6, 10)
RULES[aten._scaled_dot_product_efficient_attention.default] = _attention(
    ["split", "split", "local", "local"], 3, 5, bias_index=3
)


# -- embeddings and masked writes ---------------------------------------------------------


@_rule(aten.embedding)
def _embedding(ctx: _Ctx) -> NodePlacement | str:
    weight, indices = ctx.pl(ctx.node.args[0]), ctx.pl(ctx.node.args[1])
    return indices if isinstance(weight, Replicate) and isinstance(indices, Split) else "embedding of split weights"


@_rule(aten.embedding_dense_backward)
def _embedding_backward(ctx: _Ctx) -> NodePlacement | str:
    grad, indices = ctx.pl(ctx.node.args[0]), ctx.pl(ctx.node.args[1])
    if ctx.arg("scale_grad_by_freq", 4, False):
        return "embedding backward scaled by frequency"
    # grad is indices' shape plus the embedding dim: the same split pairs rows with ids
    ok = isinstance(grad, Split) and grad == indices and grad.blocks == 1
    return PARTIAL if ok else "embedding backward of unsplit or misaligned gradients"


@_rule(aten._unsafe_masked_index_put_accumulate)
def _masked_accumulate(ctx: _Ctx) -> NodePlacement | str:
    return _accumulate_into_zeros(ctx, ctx.node.args[0], [ctx.node.args[1], *ctx.node.args[2], ctx.node.args[3]])


def _accumulate_into_zeros(ctx: _Ctx, base: object, operands: list[object]) -> NodePlacement | str:
    """Scatter-adding the batch into zeros (an embedding's weight gradient) is a partial sum:
    each nanobatch scatters its rows into its own zeros, and the results add up."""
    zeros = (
        isinstance(base, torch.fx.Node)
        and base.target is aten.full.default
        and base.args[1] == 0
        and isinstance(ctx.pl(base), Replicate)
    )
    if not zeros:
        return "accumulation into a tensor other than fresh zeros"
    if any(ctx.pl(o) != Split(0) for o in operands if isinstance(o, torch.fx.Node)):
        return "accumulation of indices and values not split along their leading dim"
    return PARTIAL


@_rule(aten.index_put)
def _index_put(ctx: _Ctx) -> NodePlacement | str:
    """``x[mask] = value`` with a boolean mask split like ``x`` and a replicated value; or
    a scatter-add of the batch into zeros."""
    x, indices, values = ctx.node.args[:3]
    if ctx.arg("accumulate", 3, False):
        return _accumulate_into_zeros(ctx, x, [*indices, values])
    p = ctx.pl(x)
    if not isinstance(p, Split) or len(indices) != 1:
        return "index_put other than a masked fill"
    (mask,) = indices
    mask_val = mask.meta.get("val") if isinstance(mask, torch.fx.Node) else None
    if mask_val is None or mask_val.dtype != torch.bool or p.dim >= mask_val.ndim:
        return "index_put other than a masked fill of leading dims"
    if ctx.pl(mask) != p or not isinstance(ctx.pl(values), Replicate) or _shape(values.meta.get("val")):
        return "masked fill with a mask or value not placed like its target"
    return p


# -- collectives -----------------------------------------------------------------------


@_rule(c10d.all_reduce)
def _all_reduce(ctx: _Ctx) -> NodePlacement | str:
    p = ctx.pl(ctx.node.args[0])
    if isinstance(p, Partial) and ctx.node.args[1] != "sum":
        return "all-reduce of a partial sum with an op other than sum"
    return p if isinstance(p, (Split, Partial)) else "all-reduce of this value"


@_rule(c10d.all_gather_into_tensor)
def _all_gather(ctx: _Ctx) -> NodePlacement | str:
    p, n = ctx.pl(ctx.node.args[0]), ctx.node.args[1]
    if not isinstance(p, Split):
        return "all-gather of an unsplit value"
    if p.dim != 0:
        return p
    return Split(0, n) if p.blocks == 1 else "all-gather of a blocked split dim"


@_rule(c10d.reduce_scatter_tensor)
def _reduce_scatter(ctx: _Ctx) -> NodePlacement | str:
    p, n = ctx.pl(ctx.node.args[0]), ctx.node.args[2]
    if isinstance(p, Partial):
        return p if ctx.node.args[1] == "sum" else "reduce-scatter of a partial sum with an op other than sum"
    if not isinstance(p, Split):
        return "reduce-scatter of this value"
    if p.dim != 0:
        return p
    return Split(0) if p.blocks == n else "reduce-scatter along the batch dim"

