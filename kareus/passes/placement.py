"""Which dimension of every value can be split into nanobatches.

Placements (DESIGN.md section 3), propagated through the graph from its inputs:

- ``Split(dim, blocks)``: nanobatch ``i`` holds the ``i``-th of ``k`` equal chunks of
  ``dim``. With ``blocks > 1`` the dim is ``blocks`` equal blocks laid end to end (a
  concatenation or an all-gather along the split dim) and nanobatch ``i`` holds the
  ``i``-th chunk of every block, in block order. With ``sizes`` the blocks are uneven,
  one per rank of an all-to-all (an MoE's tokens by destination or by source), and
  chunk ``i`` of a block of ``s`` rows is rows ``i * s // k`` to ``(i + 1) * s // k``:
  a rank and its peer cut the block they exchange alike, from the size both know.
  With ``order`` the rows of each nanobatch are in the order its own sort gave them (an
  MoE's experts, run per nanobatch on the tokens it received, grouped by expert).
- ``Replicate()``: one value that does not depend on the batch (parameters, constants),
  used as is by every nanobatch.
- ``Partial()``: one contribution per nanobatch; the value is their sum (a contraction
  over the split dim: weight gradients, losses).
- ``Local()``: one value per nanobatch without a batch dim (an attention kernel's seed);
  usable by the same nanobatch only.
- ``LocalIds(rows, order, inverse)``: per nanobatch, ids of its own rows (its sort's
  indices, or their inverse): they reorder its rows into the sort's order and back.
- ``Whole(reason)``: computed once from the whole batch. An op without a rule, or whose
  inputs a rule cannot keep split, becomes such a barrier: its split inputs are joined
  (concatenated, or summed) first, so the result is always right, and ``reason`` (a
  ``Reason``) says why the split region ended there. Two kinds of whole value carry what
  lets the split resume after them: ``RowIds(reason, extent)``, ids of the rows of a split
  dim of ``extent`` rows (a sort's indices along the split dim), and ``Aligned(reason,
  rows)``, a value laid out like the split ``rows`` (those ids' rows scattered back into
  batch order), which every rule sees as that split and the rewrite slices per nanobatch;
  ``Piece(reason, rows, index, count)``, one of ``count`` equal pieces of the split
  ``rows`` (a split of the batch along its split dim: how kareus's partitioner hands the
  forward's saved values to the backward), which the rewrite assembles from the
  nanobatches' own pieces instead of joining them, and whose concatenation in order is
  split like ``rows`` again, each nanobatch taking its pieces as they come.

A rule (one per op, found in ``ops.OP_TABLE``) returns a placement or a ``Reason`` saying
why it cannot split, of a kind that reports and tests group by. Rules cover the ops of the
post-AOT graphs of Llama-family models as torchtitan and Hugging Face write them, under
tensor, sequence and loss parallelism, all-gathers of blocked values and slices of their
blocks (context parallelism's keys and values), and all-to-alls whose split sizes every rank
knows (sequence parallelism over heads, a ring's shift) or whose rows are laid out by
destination (an MoE's token exchange, its sizes token counts: ``Split.sizes``), and the
experts between an MoE's exchanges, each nanobatch sorting, grouping and multiplying the
tokens it received (``Split.order``, ``LocalIds``).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from kareus.passes import sizes
from kareus.passes.reasons import Reason, ReasonKind
from kareus.passes.schema import arguments
from kareus.passes.sizes import Size, SymbolicSize, SymbolicSizeRead

aten = torch.ops.aten


@dataclass(frozen=True)
class Split:
    dim: int
    blocks: int = 1
    sizes: tuple[int | torch.fx.Node, ...] | None = None
    """Uneven blocks: the rows of each, as the graph spells them (an int, or the node of a
    symbolic size); each block is cut at ``j * size // k`` (``blocks == len(sizes)``)."""
    order: str | None = None
    """Rows in uneven blocks that each nanobatch sorted itself: its rows, in the order of
    the sort of that name (an MoE's experts grouping their tokens). Row-wise ops keep it;
    ops that read rows by position refuse it; its pieces are joined by gathering them into
    the order of the whole batch's sort."""


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
    reason: Reason


@dataclass(frozen=True)
class RowIds(Whole):
    """Computed once: ids of the rows of a dim split into nanobatches, ``extent`` rows in
    all; ``permutation``: each id once (a sort's indices)."""

    extent: int
    permutation: bool


@dataclass(frozen=True)
class Aligned(Whole):
    """Computed once, laid out like the split ``rows``: a nanobatch may take its slice."""

    rows: Split


@dataclass(frozen=True)
class Piece(Whole):
    """Piece ``index`` of ``count`` equal pieces along the split ``rows``: computed once in
    that it is one tensor, but assembled from the nanobatches' pieces (one of them, part of
    one, or several laid end to end, as k and ``count`` divide each other), never joined."""

    rows: Split
    index: int
    count: int


@dataclass(frozen=True)
class LocalIds:
    """Per nanobatch, ids of its own rows of ``rows`` (0 to its rows), from the sort
    ``order`` of them: ``inverse=False``, the row at each sorted place (the sort's indices);
    ``inverse=True``, each row's sorted place. Joined by computing them again on the whole
    batch (the graph's own sort)."""

    rows: Split
    order: str
    inverse: bool = False


Placement = Split | Replicate | Partial | Local | LocalIds | Whole
NodePlacement = Placement | tuple[Placement, ...]

REPLICATE = Replicate()
PARTIAL = Partial()
LOCAL = Local()


def computed_once(p: NodePlacement) -> bool:
    """Whether a node with this placement is computed once, on the whole batch (a barrier)."""
    if isinstance(p, tuple):
        return all(computed_once(q) for q in p)
    return isinstance(p, Whole)


def in_blocks(p: NodePlacement) -> bool:
    """Whether ``p`` cuts rows in uneven per-rank blocks (``Split.sizes``)."""
    return any(isinstance(q, Split) and q.sizes is not None
               for q in (p if isinstance(p, tuple) else (p,)))


def per_nanobatch(p: NodePlacement) -> bool:
    """Whether a node with this placement runs once per nanobatch."""
    if isinstance(p, tuple):
        return any(per_nanobatch(q) for q in p)
    return isinstance(p, (Split, Partial, Local, LocalIds))


@dataclass(frozen=True)
class PlacementResult:
    placements: dict[torch.fx.Node, NodePlacement]
    barriers: tuple[Reason, ...]  # where split regions end, and why (``node`` always set)


class RuleContext:
    """What a rule sees: the node, ``k``, its arguments by name and their placements.

    A ``Whole`` value (computed once on the whole batch) is, to the rules, a replicated one:
    a full tensor used as is, or sliced along the split dim where a rule pairs its elements
    with a split operand (``sliced_dim``). That is what lets a split region resume after a
    barrier (a loss gradient, a per-sample mask built on the whole batch).
    """

    def __init__(self, node: torch.fx.Node, k: int, placements: dict[torch.fx.Node, NodePlacement]):
        self.node, self.k, self._placements = node, k, placements
        self.args = {name: _sizes_in(a) for name, a in arguments(node).items()}

    def pl(self, arg: object) -> NodePlacement:
        if not isinstance(arg, torch.fx.Node):
            return REPLICATE
        p = self._placements[arg]
        if isinstance(p, Aligned):
            return p.rows
        return REPLICATE if isinstance(p, Whole) else p

    def whole(self, arg: object) -> Whole | None:
        """``arg``'s placement where it is computed once (what ids-aware rules read)."""
        p = self._placements.get(arg) if isinstance(arg, torch.fx.Node) else None
        return p if isinstance(p, Whole) else None

    def arg(self, name: str, default: object = None) -> object:
        return self.args.get(name, default)

    @property
    def out(self) -> object:
        return self.node.meta.get("val")


def _sizes_in(arg: object) -> object:
    """An argument with its symbolic scalars (nodes of a ``SymInt``) as ``SymbolicSize``:
    a rule reads a view's target shape or a slice's bounds as sizes, never as nodes."""
    if isinstance(arg, (list, tuple)):
        return type(arg)(_sizes_in(a) for a in arg)
    if isinstance(arg, torch.fx.Node) and isinstance(arg.meta.get("val"), torch.SymInt):
        return sizes.size(arg.meta["val"])
    return arg


Rule = Callable[[RuleContext], "NodePlacement | Reason"]


class RuleTable(Protocol):
    """Where propagation looks up the placement rule of an op (``ops.OpTable``)."""

    def rule(self, target: object) -> Rule | None: ...


def propagate(
    graph: torch.fx.Graph,
    inputs: dict[torch.fx.Node, NodePlacement],
    k: int,
    table: RuleTable,
) -> PlacementResult:
    """Placements of every node given those of the placeholders (missing: replicated)."""
    placements: dict[torch.fx.Node, NodePlacement] = {}
    barriers: list[Reason] = []
    for node in graph.nodes:
        if node.op == "placeholder":
            placements[node] = inputs.get(node, REPLICATE)
        elif node.op in ("get_attr", "output"):
            placements[node] = REPLICATE
        else:
            placements[node] = _place(node, k, placements, barriers, table)
    return PlacementResult(placements, tuple(barriers))


def _place(
    node: torch.fx.Node,
    k: int,
    placements: dict[torch.fx.Node, NodePlacement],
    barriers: list[Reason],
    table: RuleTable,
) -> NodePlacement:
    ins = [placements[i] for i in node.all_input_nodes]
    flat = [q for p in ins for q in (p if isinstance(p, tuple) else (p,))]
    if node.target is operator.getitem:
        source = placements[node.args[0]]
        return source[node.args[1]] if isinstance(source, tuple) else source
    if all(isinstance(p, Replicate) for p in flat):
        return REPLICATE
    rule = table.rule(node.target)
    if all(isinstance(p, (Replicate, Whole)) for p in flat):
        # Computed once from values computed once: no new barrier. Unless the rule resumes
        # the split from an aligned value, or finds row ids or batch order again.
        whole = Whole(next(p for p in flat if isinstance(p, Whole)).reason)
        if rule is None or not any(isinstance(p, (RowIds, Aligned, Piece)) for p in flat):
            return whole
        result = _apply(rule, RuleContext(node, k, placements))
        resumed = not isinstance(result, Reason) and (
            per_nanobatch(result) or isinstance(result, (RowIds, Aligned, Piece))
        )
        return result if resumed else whole
    result = (
        _apply(rule, RuleContext(node, k, placements))
        if rule
        else Reason(ReasonKind.NO_RULE, None, f"no placement rule for {node.target}")
    )
    if not isinstance(result, Reason):
        barrier = _own_barrier(node, result)
        if barrier is not None:
            barriers.append(barrier)
        return result
    detail = result.detail
    if result.kind is not ReasonKind.PER_NANOBATCH_VALUE and any(
        isinstance(p, Local) for p in flat
    ):
        # Joining keeps one nanobatch's copy of such a value: say so, whatever the kind.
        detail += "; it consumes a per-nanobatch value that cannot be joined"
    reason = replace(result, node=node.name, detail=detail)
    barriers.append(reason)
    return Whole(reason)


def _apply(rule: Rule, ctx: RuleContext) -> NodePlacement | Reason:
    """``rule`` on ``ctx``; one that would guard on a symbolic size cannot split."""
    try:
        return rule(ctx)
    except SymbolicSizeRead as e:
        return Reason(ReasonKind.SYMBOLIC_SHAPES, None, str(e))


def _own_barrier(node: torch.fx.Node, result: NodePlacement) -> Reason | None:
    """The reason of a whole value a rule returns for ``node`` itself (a sort's row ids)."""
    for p in result if isinstance(result, tuple) else (result,):
        if isinstance(p, Whole) and p.reason.node == node.name:
            return p.reason
    return None


# Why a rule cannot split, by kind; ``_place`` names the node.
_along_split_dim = functools.partial(Reason, ReasonKind.ALONG_SPLIT_DIM, None)
_operands_split_apart = functools.partial(Reason, ReasonKind.OPERANDS_SPLIT_APART, None)
_batch_varying_operand = functools.partial(Reason, ReasonKind.BATCH_VARYING_OPERAND, None)
_partial_sum = functools.partial(Reason, ReasonKind.PARTIAL_SUM, None)
_random = functools.partial(Reason, ReasonKind.RANDOM, None)
_per_nanobatch_value = functools.partial(Reason, ReasonKind.PER_NANOBATCH_VALUE, None)
_unsupported_form = functools.partial(Reason, ReasonKind.UNSUPPORTED_FORM, None)
_data_dependent_sizes = functools.partial(Reason, ReasonKind.DATA_DEPENDENT_SIZES, None)


def _norm(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


_shape = sizes.shape  # ints, and symbolic sizes read without a guard


def _shape_of(arg: object) -> tuple[Size, ...]:
    return _shape(arg.meta.get("val")) if isinstance(arg, torch.fx.Node) else ()


def _input(ctx: RuleContext) -> NodePlacement:
    """The placement of the op's first argument (``input``, or ``tensor`` of a wait)."""
    return ctx.pl(next(iter(ctx.args.values()), None))


# -- elementwise --------------------------------------------------------------------------


def random_op(ctx: RuleContext) -> Reason:
    return _random(
        "random op: splitting it would change the random stream, so it runs on the whole batch"
    )


def pointwise(ctx: RuleContext) -> NodePlacement | Reason:
    """Elementwise ops with broadcasting: every split input must land on one output dim."""
    out_ndim = len(_shape(ctx.out))
    tensors = list(ctx.node.all_input_nodes)
    splits = {}
    partial = []
    for a in tensors:
        p = ctx.pl(a)
        if isinstance(p, Split):
            splits[a] = replace(p, dim=p.dim + out_ndim - len(_shape_of(a)))
        elif isinstance(p, Partial):
            partial.append(a)
        elif isinstance(p, Local):
            return _per_nanobatch_value("per-nanobatch value in an elementwise op")
    if partial:
        return _linear_partial(ctx, partial, bool(splits))
    placements = set(splits.values())
    if len(placements) != 1:
        return _operands_split_apart(
            f"elementwise inputs split along different dims ({sorted(placements, key=str)})"
        )
    (split,) = placements
    for a in tensors:
        if a not in splits and sliced_dim(a, split, out_ndim) is None:
            return _batch_varying_operand(
                f"{a.name} is replicated but not broadcast along the split dim"
            )
    return split


def sliced_dim(arg: torch.fx.Node, split: Split, out_ndim: int) -> int | None:
    """The dim of a replicated elementwise operand to slice per nanobatch (-1: broadcast).

    A replicated operand as long as the split dim (a dropout mask drawn once for the
    whole batch, a value computed once after a barrier) is sliced like the split operands;
    one of size 1 there broadcasts.
    """
    shape = _shape_of(arg)
    aligned = split.dim - (out_ndim - len(shape))
    if not 0 <= aligned < len(shape) or shape[aligned] == 1:
        return -1
    return aligned if split.blocks == 1 else None


_LINEAR = frozenset({
    aten.add.Tensor,
    aten.sub.Tensor,
    aten.neg.default,
    aten.mul.Tensor,
    aten.mul.Scalar,
    aten.div.Tensor,
    aten.div.Scalar,
    aten.clone.default,
    aten.alias.default,
})


def _linear_partial(
    ctx: RuleContext, partial: list[torch.fx.Node], has_split: bool
) -> NodePlacement | Reason:
    """Sums survive linear maps: p1 + p2, -p, p * r, p / r (r replicated)."""
    target = ctx.node.target
    if has_split or target not in _LINEAR:
        return _partial_sum(f"{target} is not linear in a partial sum")
    if target in (aten.add.Tensor, aten.sub.Tensor):
        operands = ctx.node.args[:2]
        both = all(isinstance(a, torch.fx.Node) and a in partial for a in operands)
        return PARTIAL if both else _partial_sum("partial sum plus a replicated value")
    if len(partial) > 1 or (target is aten.div.Tensor and ctx.node.args[0] is not partial[0]):
        return _partial_sum("product of partial sums")
    return PARTIAL


# -- identity-like --------------------------------------------------------------------


def same(ctx: RuleContext) -> NodePlacement | Reason:
    return _input(ctx)


def size_of(ctx: RuleContext) -> NodePlacement:
    """A size of a value (``sym_size``): the whole value's, as the graph reads it (a mean's
    count), one number every nanobatch uses as is; a shape the rewrite resizes itself."""
    return REPLICATE


# -- views and shape changes ----------------------------------------------------------


def view(ctx: RuleContext) -> NodePlacement | Reason:
    p = _input(ctx)
    if not isinstance(p, Split):
        return _replicate_or_partial(p)
    out = _shape(ctx.out)
    result = _reshaped(p, _shape_of(ctx.arg("input")), out, ctx.k)
    target = list(ctx.args.values())[1]
    if isinstance(result, Split) and sizes.symbolic(out[result.dim]) and any(
        given == -1 and sizes.symbolic(size)
        for d, (size, given) in enumerate(zip(out, target)) if d != result.dim
    ):
        # The rewrite leaves the symbolic split dim to be inferred (-1): one -1 at most.
        raise SymbolicSizeRead(
            f"a reshape to {list(target)} infers a symbolic dim besides the split one"
        )
    return result


def _reshaped(p: Split, src: Sequence[int], dst: Sequence[int], k: int) -> Split | Reason:
    """Follow the split dim through a reshape, group by group of dims with equal products.

    Chunk ``i`` of the split dim is a contiguous chunk of its group only if the dims
    before it in the group are 1; it is chunk ``i`` of the group's first non-1 output dim
    if that dim divides by ``k`` (by ``blocks * k`` for a blocked split). Rows in uneven
    blocks are followed only through a reshape that leaves them alone (the rewrite would
    spell a piece's rows).
    """
    if p.sizes is not None:
        return _blocked_reshape(p, src, dst)
    i = j = 0
    while i < len(src) or j < len(dst):
        gi, gj = [i], [j]
        a = src[i] if i < len(src) else 1
        b = dst[j] if j < len(dst) else 1
        while a != b:
            if (i + 1 >= len(src) and a < b) or (j + 1 >= len(dst) and not a < b):
                raise SymbolicSizeRead(f"a reshape of {src} to {dst}: no group's sizes match")
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
                return _along_split_dim(
                    "reshape merges the split dim into a dim it is not the outer part of"
                )
            lead = next((d for d in gj if d < len(dst) and dst[d] != 1), None)
            if lead is not None and sizes.symbolic(src[p.dim]):
                return _symbolic_reshape(p, src[p.dim], dst[lead], lead)
            if (
                lead is None
                or dst[lead] % (k * p.blocks)
                or (p.blocks > 1 and dst[lead] != src[p.dim])
            ):
                return _along_split_dim(
                    "reshape splits the split dim in a way nanobatches cannot follow"
                )
            return replace(p, dim=lead)
        i, j = gi[-1] + 1, gj[-1] + 1
    raise AssertionError(f"split dim {p.dim} outside a reshape of {src} to {dst}")


def _blocked_reshape(p: Split, src: Sequence[Size], dst: Sequence[Size]) -> Split | Reason:
    """Rows in uneven blocks through a reshape that leaves them alone: the dims before and
    including the split one kept as they are, the inner ones regrouped (a unit dim added
    or removed), so the rewrite spells the rows -1."""
    dims = p.dim + 1
    if tuple(src[:dims]) != tuple(dst[:dims]) or any(sizes.symbolic(d) for d in src[dims:]) or (
        any(sizes.symbolic(d) for d in dst[dims:])
    ):
        return _along_split_dim("reshape of rows cut in uneven per-rank blocks")
    return p


def _symbolic_reshape(p: Split, src: SymbolicSize, lead: Size, dim: int) -> Split | Reason:
    """A symbolic split dim is cut in units of its batch expression (``sizes.units``):
    the reshape may merge it with inner dims or split inner ones off, not cut those units."""
    unit, lead_unit = sizes.units(src), sizes.units(lead) if sizes.symbolic(lead) else None
    if (p.blocks > 1 and lead != src) or unit is None or lead_unit is None or (
        lead_unit[1] != unit[1]
    ):
        return Reason(
            ReasonKind.SYMBOLIC_SHAPES, None,
            f"reshape of a symbolic split dim ({src} rows to {lead}) other than by whole "
            "batch units",
        )
    return Split(dim)


def _replicate_or_partial(p: NodePlacement) -> NodePlacement | Reason:
    if isinstance(p, (Partial, Replicate)):
        return p  # a view of a sum is the sum of the views
    return _per_nanobatch_value(f"cannot follow a {type(p).__name__} placement")


def _unsplit(p: NodePlacement, op: str) -> NodePlacement | Reason:
    """An unsplit input of an op that does not keep partial sums (it is not linear, or
    its rule does not follow them): replicated values stay replicated."""
    if isinstance(p, Partial):
        return _partial_sum(f"{op} of a partial sum")
    return _replicate_or_partial(p)


def expand(ctx: RuleContext) -> NodePlacement | Reason:
    p = _input(ctx)
    if not isinstance(p, Split):
        return _replicate_or_partial(p)
    src, dst = _shape_of(ctx.arg("input")), _shape(ctx.out)
    dim = p.dim + len(dst) - len(src)
    if dst[dim] != src[p.dim]:
        return _along_split_dim("expand broadcasts the split dim")
    return replace(p, dim=dim)


def permute(ctx: RuleContext) -> NodePlacement | Reason:
    order = ctx.arg("dims")
    dims = [_norm(d, len(order)) for d in order]
    piece = ctx.whole(ctx.arg("input"))
    if isinstance(piece, Piece):  # a piece of the batch laid out otherwise: still one
        return replace(piece, rows=replace(piece.rows, dim=dims.index(piece.rows.dim)))
    p = _input(ctx)
    if not isinstance(p, Split):
        return _replicate_or_partial(p)
    return replace(p, dim=dims.index(p.dim))


def transpose(ctx: RuleContext) -> NodePlacement | Reason:
    p = _input(ctx)
    if not isinstance(p, Split):
        return _replicate_or_partial(p)
    ndim = len(_shape(ctx.out))
    if "dim0" in ctx.args:
        a, b = _norm(ctx.arg("dim0"), ndim), _norm(ctx.arg("dim1"), ndim)
    else:  # aten.t
        a, b = 0, 1
    return replace(p, dim={a: b, b: a}.get(p.dim, p.dim))


def unsqueeze(ctx: RuleContext) -> NodePlacement | Reason:
    p = _input(ctx)
    if not isinstance(p, Split):
        return _replicate_or_partial(p)
    dim = _norm(ctx.arg("dim"), len(_shape(ctx.out)))
    return replace(p, dim=p.dim + (dim <= p.dim))


def squeeze(ctx: RuleContext) -> NodePlacement | Reason:
    p = _input(ctx)
    if not isinstance(p, Split):
        return _replicate_or_partial(p)
    src = _shape_of(ctx.arg("input"))
    dims = ctx.arg("dim")
    dims = range(len(src)) if dims is None else ([dims] if isinstance(dims, int) else dims)
    removed = [d for d in (_norm(d, len(src)) for d in dims) if src[d] == 1]
    if p.dim in removed:
        return _along_split_dim("squeeze removes the split dim")
    return replace(p, dim=p.dim - sum(d < p.dim for d in removed))


def view_as_complex(ctx: RuleContext) -> NodePlacement | Reason:
    """(..., 2) reals as complex numbers (Llama 3's RoPE): every dim but the last stays."""
    p = _input(ctx)
    if not isinstance(p, Split):
        return _replicate_or_partial(p)
    if p.dim == len(_shape_of(ctx.arg("input"))) - 1:
        return _along_split_dim("view_as_complex of a split real/imaginary dim")
    return p


def view_as_real(ctx: RuleContext) -> NodePlacement | Reason:
    p = _input(ctx)
    return p if isinstance(p, Split) else _replicate_or_partial(p)


def slice_(ctx: RuleContext) -> NodePlacement | Reason:
    """A slice of another dim, or of whole blocks of a blocked split dim (one rank's keys
    out of an all-gather): chunk ``i`` of each block it keeps is chunk ``i`` of the slice."""
    p = _input(ctx)
    if not isinstance(p, Split):
        return _replicate_or_partial(p)
    src = _shape_of(ctx.arg("input"))
    dim = _norm(ctx.arg("dim", 0), len(src))
    if dim != p.dim or _shape(ctx.out) == src:
        return p
    if p.sizes is not None:
        return _along_split_dim("slice of rows cut in uneven per-rank blocks")
    bounds = slice_bounds(ctx.arg("start"), ctx.arg("end"), src[dim])
    blocks = _whole_blocks(bounds, ctx.arg("step", 1), src[dim] // p.blocks)
    if blocks is None:
        return _along_split_dim("slice along the split dim, not of whole blocks")
    return Split(dim, blocks)


def slice_bounds(start: object, end: object, size: int) -> tuple[int, int]:
    """``aten.slice``'s start and end (None, negative or past the end) within ``size``."""
    def bound(x: object, default: int) -> int:
        x = default if x is None else int(x)
        return min(max(x + size if x < 0 else x, 0), size)

    return bound(start, 0), bound(end, size)


def _whole_blocks(bounds: tuple[int, int], step: object, block: int) -> int | None:
    """How many whole blocks of ``block`` rows ``bounds`` covers (None: it cuts one)."""
    start, end = bounds
    if step != 1 or start % block or end % block or end <= start:
        return None
    return (end - start) // block


def scatter_into(ctx: RuleContext) -> NodePlacement | Reason:
    """slice_scatter / select_scatter (backward of a slice or select): writes ``src`` into
    ``input`` along ``dim``. The output is split like ``src`` (along another dim); a
    replicated ``input`` (zeros, mostly) is sliced like it (``OpFacts.aligned_operands``)."""
    src = ctx.pl(ctx.arg("src"))
    ndim = len(_shape(ctx.out))
    dim = _norm(ctx.arg("dim", 0), ndim)
    if not isinstance(src, Split):
        return _unsupported_form("scatter of an unsplit source")
    if src.sizes is not None:
        return _unsupported_form("scatter of rows cut in uneven per-rank blocks")
    if src.dim == dim and "start" in ctx.args:
        return _scatter_blocks(ctx, src, dim)
    if src.blocks != 1:
        return _unsupported_form("scatter of a blocked source")
    lacks_dim = len(_shape_of(ctx.arg("src"))) < ndim  # select_scatter's src has no ``dim``
    out = Split(src.dim + (lacks_dim and src.dim >= dim))
    if out.dim == dim:
        return _along_split_dim("scatter along the split dim")
    base = ctx.pl(ctx.arg("input"))
    if base != out and not isinstance(base, Replicate):
        return _operands_split_apart("scatter into a value split otherwise")
    return out


FILLS = frozenset({
    aten.full.default, aten.zeros.default, aten.ones.default, aten.full_like.default,
    aten.zeros_like.default, aten.ones_like.default, aten.new_zeros.default,
    aten.new_ones.default, aten.new_full.default,
})
"""Ops that fill their output with one value: any slice of it is any nanobatch's slice."""


def _scatter_blocks(ctx: RuleContext, src: Split, dim: int) -> NodePlacement | Reason:
    """slice_scatter of whole blocks along the split dim into a constant fill (the
    gradient of one rank's keys in an all-gathered buffer): the output is blocked alike,
    and each nanobatch writes its chunks into its slice of the fill."""
    size = _shape(ctx.out)[dim]
    bounds = slice_bounds(ctx.arg("start"), ctx.arg("end"), size)
    block = (bounds[1] - bounds[0]) // src.blocks
    base = ctx.arg("input")
    if not block or size % block or _whole_blocks(bounds, ctx.arg("step", 1), block) is None:
        return _along_split_dim("scatter along the split dim, not of whole blocks")
    if not isinstance(base, torch.fx.Node) or base.target not in FILLS:
        return _unsupported_form("scatter of blocks into a value that is not a constant fill")
    return Split(dim, size // block)


def select(ctx: RuleContext) -> NodePlacement | Reason:
    p = _input(ctx)
    if not isinstance(p, Split):
        return _replicate_or_partial(p)
    dim = _norm(ctx.arg("dim"), len(_shape_of(ctx.arg("input"))))
    if dim == p.dim:
        return _along_split_dim("select along the split dim")
    return replace(p, dim=p.dim - (dim < p.dim))


def split(ctx: RuleContext) -> NodePlacement | Reason:
    p = _input(ctx)
    n = len(ctx.out)
    if not isinstance(p, Split):
        return _replicate_or_partial(p)
    src = _shape_of(ctx.arg("input"))
    dim = _norm(ctx.arg("dim", 0), len(src))
    if dim != p.dim:
        return (p,) * n
    if p.sizes is not None:
        return _along_split_dim("split of rows cut in uneven per-rank blocks")
    # Splitting a blocked dim into groups of whole blocks (an all-gather followed by
    # DTensor's re-layout, or by one chunk per rank) leaves each block chunked the same way.
    equal = all(n * _shape(o)[dim] == src[dim] for o in ctx.out)
    if p.blocks % n == 0 and equal:
        return (Split(dim, p.blocks // n),) * n
    if p.blocks == 1 and p.order is None and equal and (ctx.k % n == 0 or n % ctx.k == 0):
        # Pieces of the batch (the forward's saved values as the backward takes them):
        # each is assembled from the nanobatches' pieces, never joined and cut again.
        why = Reason(ReasonKind.ALONG_SPLIT_DIM, None, f"one of {n} pieces of the batch")
        return tuple(Piece(why, p, j, n) for j in range(n))
    return _along_split_dim("split along the split dim")


def unbind(ctx: RuleContext) -> NodePlacement | Reason:
    p = _input(ctx)
    n = len(ctx.out)
    if not isinstance(p, Split):
        return _unsplit(p, "unbind")
    dim = _norm(ctx.arg("dim", 0), len(_shape_of(ctx.arg("input"))))
    if dim == p.dim:
        return _along_split_dim("unbind along the split dim")
    return (replace(p, dim=p.dim - (dim < p.dim)),) * n


def cat(ctx: RuleContext) -> NodePlacement | Reason:
    tensors = ctx.arg("tensors")
    rows = pieces_of(ctx, tensors)
    if rows is not None:
        return rows
    ps = {ctx.pl(t) for t in tensors}
    if len(ps) != 1:
        return _operands_split_apart("concatenation of differently placed tensors")
    (p,) = ps
    if isinstance(p, Partial):
        return PARTIAL  # the concatenation of sums is the sum of the concatenations
    if not isinstance(p, Split):
        return _unsplit(p, "concatenation")
    ndim = len(_shape(ctx.out))
    dim = _norm(ctx.arg("dim", 0), ndim)
    if dim != p.dim:
        return p
    sizes = {_shape_of(t)[dim] for t in tensors}
    if len(sizes) == 1 and p.sizes is None:
        return Split(dim, len(tensors) * p.blocks)
    return _along_split_dim("concatenation along the split dim of unequal pieces")


def pieces_of(ctx: RuleContext, tensors: Sequence[object]) -> Split | None:
    """The split ``rows`` whose pieces ``tensors`` are, all of them in order along their
    dim (a concatenation of them is that split again); None if they are not."""
    pieces = [ctx.whole(t) for t in tensors]
    if not all(isinstance(q, Piece) for q in pieces):
        return None
    rows = pieces[0].rows
    dim = _norm(ctx.arg("dim", 0), len(_shape(ctx.out)))
    ordered = [(q.rows, q.index, q.count) for q in pieces] == [
        (rows, j, len(pieces)) for j in range(len(pieces))
    ]
    return rows if ordered and dim == rows.dim else None


def stack(ctx: RuleContext) -> NodePlacement | Reason:
    ps = {ctx.pl(t) for t in ctx.arg("tensors")}
    if len(ps) != 1:
        return _operands_split_apart("stack of differently placed tensors")
    (p,) = ps
    if isinstance(p, Partial):
        return PARTIAL
    if not isinstance(p, Split):
        return _unsplit(p, "stack")
    dim = _norm(ctx.arg("dim", 0), len(_shape(ctx.out)))
    return replace(p, dim=p.dim + (dim <= p.dim))


def constant_pad(ctx: RuleContext) -> NodePlacement | Reason:
    """Padding (pairs of amounts for the last dims first) keeps a split dim it leaves alone."""
    p = _input(ctx)
    if not isinstance(p, Split):
        return _unsplit(p, "padding")
    ndim = len(_shape_of(ctx.arg("input")))
    pad = list(ctx.arg("pad"))
    padded = {ndim - 1 - i // 2 for i, amount in enumerate(pad) if amount != 0}
    return _along_split_dim("padding along the split dim") if p.dim in padded else p


# -- indexing -------------------------------------------------------------------------------


def gather(ctx: RuleContext) -> NodePlacement | Reason:
    """``out[..i..] = input[..index[..i..]..]`` along ``dim``: a split elsewhere pairs rows."""
    src, index = ctx.pl(ctx.arg("input")), ctx.pl(ctx.arg("index"))
    dim = _norm(ctx.arg("dim"), len(_shape(ctx.out)))
    if not isinstance(src, Split) or src != index:
        return _operands_split_apart("gather whose input and index are not split alike")
    if src.dim == dim or src.blocks != 1:
        return _along_split_dim("gather along the split dim, or of a blocked one")
    return src


def index_select(ctx: RuleContext) -> NodePlacement | Reason:
    src, index = ctx.pl(ctx.arg("input")), ctx.pl(ctx.arg("index"))
    dim = _norm(ctx.arg("dim"), len(_shape(ctx.out)))
    if isinstance(src, Split) and isinstance(index, Replicate):
        return src if src.dim != dim else _along_split_dim("index_select along the split dim")
    if isinstance(src, Replicate) and isinstance(index, Split) and index.blocks == 1:
        return Split(dim)  # rows picked by split ids (a frequency table indexed by position)
    return _unsupported_form("index_select of this input and index")


def index(ctx: RuleContext) -> NodePlacement | Reason:
    """``input[..., idx, ...]``: replicated index tensors on dims other than the split one,
    or the rows of a whole value picked by split ids."""
    p = _input(ctx)
    indices = list(ctx.arg("indices"))
    used = [d for d, i in enumerate(indices) if i is not None]
    if used == [0] and isinstance(ids := ctx.pl(indices[0]), LocalIds):
        return _by_local_ids(p, ids)
    if isinstance(p, Replicate) and used == [0] and isinstance(ctx.pl(indices[0]), Split):
        return ctx.pl(indices[0])  # rows of a whole value picked by split ids
    if not isinstance(p, Split) or any(not isinstance(ctx.pl(indices[d]), Replicate) for d in used):
        return _unsupported_form("indexing an unsplit value, or with split indices")
    if p.dim in used:
        return _along_split_dim("indexing the split dim")
    if used != list(range(used[0], used[-1] + 1)):
        return _unsupported_form("advanced indices that are not adjacent")
    if p.dim < used[0]:
        return p
    index_ndim = max(len(_shape_of(indices[d])) for d in used)
    return replace(p, dim=p.dim - len(used) + index_ndim)


def _by_local_ids(p: NodePlacement, ids: LocalIds) -> NodePlacement | Reason:
    """A nanobatch's rows picked by its own ids: into the order of their sort (by its
    indices; of a whole value, its rows cut like the nanobatch's), or back into row order
    (by their inverse)."""
    rows, ordered = replace(ids.rows, order=None), replace(ids.rows, order=ids.order)
    if isinstance(p, Replicate) and not ids.inverse:
        # a whole value indexed by the batch's row ids pairs its rows with the batch's:
        # each nanobatch picks from its own rows of it (the rewrite cuts it in the blocks)
        return ordered
    if not isinstance(p, Split) or p.dim != 0:
        return _operands_split_apart("rows picked by a nanobatch's ids, of a value not its rows")
    if not ids.inverse and replace(p, order=None) == rows:
        return replace(p, order=ids.order)
    if ids.inverse and p == ordered:
        return rows
    return _operands_split_apart("rows picked by a nanobatch's ids in another order")


# -- matmuls, reductions, normalisations ------------------------------------------------


def mm(ctx: RuleContext) -> NodePlacement | Reason:
    return _matmul(ctx.pl(ctx.arg("input")), ctx.pl(ctx.arg("mat2")), 0, 1)


def addmm(ctx: RuleContext) -> NodePlacement | Reason:
    bias = ctx.arg("input")
    if (
        not isinstance(ctx.pl(bias), Replicate)
        or len(_shape_of(bias)) == 2
        and _shape_of(bias)[0] != 1
    ):
        return _batch_varying_operand("addmm with a bias that is split or varies over rows")
    result = _matmul(ctx.pl(ctx.arg("mat1")), ctx.pl(ctx.arg("mat2")), 0, 1)
    if isinstance(result, Partial):
        return _partial_sum("addmm adds its bias once per contribution")
    return result


def bmm(ctx: RuleContext) -> NodePlacement | Reason:
    a, b = ctx.pl(ctx.arg("input")), ctx.pl(ctx.arg("mat2"))
    if a == b == Split(0):
        return Split(0)
    return _matmul(a, b, 1, 2, batch=True)


def _matmul(
    a: NodePlacement, b: NodePlacement, row: int, col: int, batch: bool = False
) -> NodePlacement | Reason:
    """C = A @ B: split rows of A or columns of B stay split; a split contraction is a
    partial sum."""
    rep_a, rep_b = isinstance(a, Replicate), isinstance(b, Replicate)
    if isinstance(a, Split) and rep_b and a.dim == row and not batch:
        return a
    if rep_a and isinstance(b, Split) and b.dim == col and not batch:
        return b
    if (
        isinstance(a, Split)
        and isinstance(b, Split)
        and (a.dim, b.dim) == (col, row)
        and replace(a, dim=0) == replace(b, dim=0)
    ):
        return PARTIAL
    if (isinstance(a, Partial) and rep_b) or (rep_a and isinstance(b, Partial)):
        return PARTIAL
    kind = ReasonKind.PARTIAL_SUM if PARTIAL in (a, b) else ReasonKind.OPERANDS_SPLIT_APART
    return Reason(kind, None, f"matmul of {a} and {b}")


def grouped_mm(ctx: RuleContext) -> NodePlacement | Reason:
    """Rows grouped by expert times each expert's weight (``offs``: where each group ends).
    A nanobatch's rows in the order of its own sort, grouped by the counts it made of them
    (a partial sum computed from that sort), are multiplied alone."""
    weight = ctx.arg("weight", ctx.arg("mat2"))  # transformers' name, aten's
    x, w, offs = (ctx.pl(a) for a in (ctx.arg("input"), weight, ctx.arg("offs")))
    if isinstance(x, Split) and x.order and isinstance(w, Replicate) and isinstance(
        offs, Partial
    ) and isinstance(ctx.pl(ctx.arg("bias")), Replicate) and (
        x.order in {n.name for n in ancestors(ctx.arg("offs"))}
    ):
        return x
    return _operands_split_apart("grouped matmul other than of a nanobatch's sorted rows")


def ancestors(node: object) -> list[torch.fx.Node]:
    """``node`` (a node, else nothing) and every node it is computed from, each once."""
    seen, stack, found = set(), [node] if isinstance(node, torch.fx.Node) else [], []
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            found.append(n)
            stack.extend(n.all_input_nodes)
    return found


def _reduced_dims(ctx: RuleContext) -> list[int]:
    ndim = len(_shape_of(ctx.arg("input")))
    dims = ctx.arg("dim")
    if dims is None or dims == []:
        return list(range(ndim))
    return [_norm(d, ndim) for d in ([dims] if isinstance(dims, int) else dims)]


def _reduction(ctx: RuleContext, linear: bool) -> NodePlacement | Reason:
    p = _input(ctx)
    if isinstance(p, Partial):
        return PARTIAL if linear else _partial_sum("nonlinear reduction of a partial sum")
    if not isinstance(p, Split):
        return _replicate_or_partial(p)
    dims = _reduced_dims(ctx)
    if p.dim in dims:
        return PARTIAL if linear else _along_split_dim("reduction over the split dim")
    keepdim = bool(ctx.arg("keepdim", False))
    return replace(p, dim=p.dim if keepdim else p.dim - sum(d < p.dim for d in dims))


def sum_(ctx: RuleContext) -> NodePlacement | Reason:
    return _reduction(ctx, linear=True)


def reduction(ctx: RuleContext) -> NodePlacement | Reason:
    return _reduction(ctx, linear=False)


def var_mean(ctx: RuleContext) -> NodePlacement | Reason:
    result = _reduction(ctx, linear=False)
    return result if isinstance(result, Reason) else (result, result)


def along_dim(ctx: RuleContext) -> NodePlacement | Reason:
    """Ops that mix values along one ``dim`` only (softmax, cumsum, sort, topk)."""
    p = _input(ctx)
    dim = _norm(ctx.arg("dim", -1), len(_shape_of(ctx.arg("input"))))
    if not isinstance(p, Split):
        return _unsplit(p, str(ctx.node.target))
    if p.dim == dim:
        return _along_split_dim(f"{ctx.node.target} along the split dim")
    return (p,) * len(ctx.out) if isinstance(ctx.out, (tuple, list)) else p


def cumsum(ctx: RuleContext) -> NodePlacement | Reason:
    """A running sum is linear: of a partial sum (counts per expert), a partial sum."""
    return PARTIAL if isinstance(_input(ctx), Partial) else along_dim(ctx)


def histogram(ctx: RuleContext) -> NodePlacement | Reason:
    """Counts of values in given bins: of a split value, each nanobatch's counts add up to
    the batch's, in any order of its elements (an MoE counting its tokens per expert)."""
    p = _input(ctx)
    if not ctx.arg("min", 0) < ctx.arg("max", 0):
        return _unsupported_form("histogram over the range of its data (min == max)")
    return PARTIAL if isinstance(p, Split) else _unsplit(p, "histogram")


def sort(ctx: RuleContext) -> NodePlacement | Reason:
    """Sorting along the split dim mixes the batch: computed once. Its indices, for a 1-D
    value split along it (an MoE sorting its tokens' slots by expert), are row ids: where
    each sorted element came from, which lets its rows be put back in batch order."""
    result, shape, p = along_dim(ctx), _shape_of(ctx.arg("input")), _input(ctx)
    if isinstance(p, Split) and p.sizes is not None and p.order is None and len(shape) == 1:
        # Rows exchanged in per-rank blocks (an MoE's received tokens): every nanobatch
        # sorts its own, so that it runs its experts on them alone.
        name = ctx.node.name
        return replace(p, order=name), LocalIds(p, name)
    if (
        isinstance(result, Reason)
        and result.kind is ReasonKind.ALONG_SPLIT_DIM
        and _input(ctx) == Split(0)
        and len(shape) == 1
    ):
        reason = replace(result, node=ctx.node.name)
        return Whole(reason), RowIds(reason, shape[0], permutation=True)
    return result


def floor_divide(ctx: RuleContext) -> NodePlacement | Reason:
    """Row ids floor-divided by ``c``: the ids of groups of ``c`` rows (the token of a top-k
    slot), rows of a split dim too where no group spans two nanobatches."""
    ids, divisor = ctx.whole(ctx.arg("input")), ctx.arg("other")
    local = ctx.pl(ctx.arg("input"))
    if isinstance(local, LocalIds) and not local.inverse:
        # one row per group (an expert-parallel MoE's received slots): the same ids
        if divisor == 1 and ctx.arg("rounding_mode", "floor") == "floor":
            return local
        return _unsupported_form("groups of a nanobatch's own rows")
    if (
        isinstance(ids, RowIds)
        and ctx.arg("rounding_mode", "floor") == "floor"
        and isinstance(divisor, int)
        and divisor > 0
        and ids.extent % (divisor * ctx.k) == 0
    ):
        return RowIds(ids.reason, ids.extent // divisor, permutation=False)
    return pointwise(ctx)


def softmax_backward(ctx: RuleContext) -> NodePlacement | Reason:
    a, b = ctx.pl(ctx.arg("grad_output")), ctx.pl(ctx.arg("output"))
    dim = _norm(ctx.arg("dim"), len(_shape(ctx.out)))
    if not isinstance(a, Split) or a != b:
        return _operands_split_apart("softmax backward of a gradient and output not split alike")
    return _along_split_dim("softmax backward along the split dim") if a.dim == dim else a


def nll_loss(ctx: RuleContext) -> NodePlacement | Reason:
    """Rows of the logits with their targets; a summed loss is a partial sum (a mean is not)."""
    logits, target = ctx.pl(ctx.arg("input")), ctx.pl(ctx.arg("target"))
    if (
        logits != Split(0)
        or target != Split(0)
        or not isinstance(ctx.pl(ctx.arg("weight")), Replicate)
    ):
        return _operands_split_apart("nll_loss of rows and targets not split alike")
    reduction = ctx.arg("reduction")
    if reduction == 0:  # none
        return (Split(0), REPLICATE)
    if reduction == 2:  # sum
        return (PARTIAL, PARTIAL)
    return _unsupported_form("mean nll_loss: a ratio of sums over the batch")


def nll_loss_backward(ctx: RuleContext) -> NodePlacement | Reason:
    logits, target = ctx.pl(ctx.arg("input")), ctx.pl(ctx.arg("target"))
    grad = ctx.pl(ctx.arg("grad_output"))
    ok_grad = grad == Split(0) if ctx.arg("reduction") == 0 else isinstance(grad, Replicate)
    if (
        logits == target == Split(0)
        and ok_grad
        and isinstance(ctx.pl(ctx.arg("total_weight")), Replicate)
    ):
        return Split(0)
    return _operands_split_apart("nll_loss backward of rows and targets not split alike")


# -- attention ----------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionKernel:
    """Where an attention kernel's batched operands and results are, by argument name.

    Attention kernels are batched over dim 0 of their ``batched`` tensors (query, key,
    value; gradients, output and logsumexp in the backward). ``outputs`` places each
    result: "split" along the batch, or "local" (seeds, offsets, sizes: per nanobatch).
    ``mask`` names the additive mask or bias argument, which broadcasts over the batch,
    is split like the queries, or is one whole-batch value (Hugging Face's per-sample
    mask) sliced per nanobatch (``OpFacts.aligned_operands``).
    """

    batched: tuple[str, ...]
    outputs: tuple[str, ...]
    mask: str | None = None

    def __call__(self, ctx: RuleContext) -> NodePlacement | Reason:
        if ctx.arg("dropout_p", 0.0):
            return _random("attention with dropout: splitting it would change the random stream")
        if any(ctx.pl(ctx.arg(name)) != Split(0) for name in self.batched):
            return _operands_split_apart("attention inputs not split along the batch dim")
        mask = ctx.arg(self.mask) if self.mask else None
        if (
            isinstance(mask, torch.fx.Node)
            and not isinstance(ctx.pl(mask), Replicate)
            and ctx.pl(mask) != Split(0)
        ):
            return _batch_varying_operand("attention mask or bias split otherwise than the batch")
        if list(ctx.arg("grad_input_mask") or ())[3:4] == [True] and not _broadcasts(mask):
            return _unsupported_form("gradient of a batch-varying attention bias")
        return tuple({"split": Split(0), "local": LOCAL}[o] for o in self.outputs)


def _broadcasts(mask: object) -> bool:
    shape = _shape_of(mask)
    return len(shape) < 4 or shape[0] == 1


# -- embeddings and masked writes ---------------------------------------------------------


def embedding(ctx: RuleContext) -> NodePlacement | Reason:
    weight, indices = ctx.pl(ctx.arg("weight")), ctx.pl(ctx.arg("indices"))
    if not isinstance(weight, Replicate) or not isinstance(indices, Split):
        return _unsupported_form("embedding of split weights or unsplit indices")
    return indices


def embedding_backward(ctx: RuleContext) -> NodePlacement | Reason:
    grad, indices = ctx.pl(ctx.arg("grad_output")), ctx.pl(ctx.arg("indices"))
    if ctx.arg("scale_grad_by_freq", False):
        return _unsupported_form("embedding backward scaled by frequency")
    # grad is indices' shape plus the embedding dim: the same split pairs rows with ids
    ok = isinstance(grad, Split) and grad == indices and grad.blocks == 1
    if not ok:
        return _operands_split_apart("embedding backward of unsplit or misaligned gradients")
    return PARTIAL


def fill_like(ctx: RuleContext) -> NodePlacement:
    """``zeros_like`` and kin: the shape of ``input``, none of its data. A fill of a split
    value (or of a nanobatch's ids) is one of each piece; of anything else (a partial sum:
    the whole value's shape), one value for all."""
    p = _input(ctx)
    return p if isinstance(p, (Split, LocalIds)) else REPLICATE


def copy_into(ctx: RuleContext) -> NodePlacement | Reason:
    """``copy(input, src)``: ``src`` in ``input``'s dtype and layout; ``input`` gives only
    those, so a whole one is sliced like split ``src`` (``OpFacts.aligned_operands``), and a
    partial sum stays one."""
    src, base = ctx.pl(ctx.arg("src")), ctx.pl(ctx.arg("input"))
    if base == src or isinstance(base, Replicate) and not in_blocks(src):
        return src
    return _operands_split_apart("copy into a value placed otherwise than its source")


def scatter_add(ctx: RuleContext) -> NodePlacement | Reason:
    """Adding values into zeros at their indices (an MoE counting its tokens per expert):
    each nanobatch adds its own into its own zeros, and the results add up, along any dim
    as long as indices and values are split alike (a whole ``src`` is sliced like
    ``index``: ``OpFacts.aligned_operands``)."""
    index, src = ctx.arg("index"), ctx.arg("src")
    if _shape_of(index) != _shape_of(src):
        return _unsupported_form("scatter_add of fewer indices than values")
    # Whole values (a fill of ones: counting) are sliced like the indices they pair with.
    split, sliced = ctx.pl(index), isinstance(ctx.pl(src), Replicate)
    if sliced and isinstance(split, Split) and (split.blocks > 1 or split.sizes is not None):
        return _operands_split_apart("scatter_add of indices in blocks and whole values")
    paired = [index] if sliced else [index, src]
    return _accumulate_into_zeros(ctx, ctx.arg("input"), paired, split)


def masked_accumulate(ctx: RuleContext) -> NodePlacement | Reason:
    return _accumulate_into_zeros(
        ctx, ctx.arg("input"), [ctx.arg("mask"), *ctx.arg("indices"), ctx.arg("values")]
    )


def _accumulate_into_zeros(
    ctx: RuleContext, base: object, operands: list[object], split: Placement = Split(0)
) -> NodePlacement | Reason:
    """Scatter-adding the batch into zeros (an embedding's weight gradient) is a partial sum:
    each nanobatch scatters its rows into its own zeros, and the results add up."""
    if not (_zeros(base) and isinstance(ctx.pl(base), Replicate)):
        return _unsupported_form("accumulation into a tensor other than fresh zeros")
    if not isinstance(split, Split) or any(
        ctx.pl(o) != split for o in operands if isinstance(o, torch.fx.Node)
    ):
        return _operands_split_apart("accumulation of indices and values not split alike")
    return PARTIAL


_ZERO_FILLS = frozenset({aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default})


def _zeros(base: object) -> bool:
    """Whether ``base`` is a fresh tensor of zeros."""
    return isinstance(base, torch.fx.Node) and (
        base.target in _ZERO_FILLS or base.target is aten.full.default and base.args[1] == 0
    )


def _scatter_to_rows(
    ctx: RuleContext, base: object, ids: RowIds, values: object
) -> NodePlacement | Reason:
    """Values written to the rows their ids name in a fresh tensor, computed once: added
    into zeros, or each row written once (a permutation's inverse). The result is laid out
    like the rows the ids are of, so the split resumes from it. Split values (gradients
    summed over nanobatches) are joined first: one scatter, not one per nanobatch."""
    if isinstance(ctx.pl(values), Local):
        return _per_nanobatch_value("scatter of a per-nanobatch value by row ids")
    accumulate = ctx.arg("accumulate", False)
    fresh = (
        isinstance(base, torch.fx.Node)
        and isinstance(ctx.pl(base), Replicate)
        and _shape_of(base)[:1] == (ids.extent,)
        and (
            _zeros(base)
            if accumulate
            else ids.permutation and base.target in (aten.full.default, aten.empty.memory_format)
        )
    )
    if not fresh:
        return _unsupported_form(
            "scatter by row ids into a tensor other than fresh zeros (adding) or a fresh "
            "tensor each row of which a permutation writes once"
        )
    if per_nanobatch(ctx.pl(values)):
        joined = _along_split_dim("scatter by row ids, once on the joined values")
        return Aligned(replace(joined, node=ctx.node.name), Split(0))
    return Aligned(ids.reason, Split(0))


def _inverse_ids(
    ctx: RuleContext, base: object, ids: LocalIds, values: object
) -> NodePlacement | Reason:
    """``inverse[perm] = arange(n)`` in a fresh tensor: each nanobatch inverts its own
    sort's indices (``ops._resize_inverse`` cuts a whole tensor and the arange to its
    rows)."""
    fresh = isinstance(base, torch.fx.Node) and (
        ctx.pl(base) == ids
        or isinstance(ctx.pl(base), Replicate) and base.target in _ALLOCATIONS
    )
    if (
        not ids.inverse
        and fresh
        and _counts_up(values)
        and isinstance(ctx.pl(values), Replicate)
        and not ctx.arg("accumulate", False)
    ):
        return replace(ids, inverse=True)
    return _unsupported_form("index_put by a nanobatch's ids other than its sort's inverse")


_ALLOCATIONS = frozenset({aten.empty.memory_format, aten.empty_like.default})


def _counts_up(node: object) -> bool:
    """Whether ``node`` is 0, 1, 2, ... (``arange(n)``, or its decomposition ``iota``)."""
    if not isinstance(node, torch.fx.Node):
        return False
    if node.target is aten.arange.default:
        return True
    return node.target is torch.ops.prims.iota.default and (
        node.kwargs.get("start"), node.kwargs.get("step")
    ) == (0, 1)


def _scatter_of_joined(ctx: RuleContext, base: object, ids: object, values: object) -> bool:
    """Split values written once each into a fresh tensor of as many rows, at whole ids
    (the token slots an MoE's combine puts its received outputs back in): computed once,
    on the joined values, and laid out like the batch after (``Aligned``)."""
    rows = _shape_of(base)[:1]
    return (
        isinstance(base, torch.fx.Node)
        and base.target in _ALLOCATIONS
        and isinstance(ctx.pl(ids), Replicate)
        and _shape_of(ids) == rows
        and not ids.meta["val"].is_floating_point()
        and ids.meta["val"].dtype is not torch.bool
        and isinstance(ctx.pl(values), Split)
        and _shape_of(values)[:1] == rows
        and not ctx.arg("accumulate", False)
    )


def index_put(ctx: RuleContext) -> NodePlacement | Reason:
    """``x[mask] = value`` with a boolean mask split like ``x`` and a replicated value; or
    a scatter-add of the batch into zeros."""
    x, indices, values = ctx.arg("input"), ctx.arg("indices"), ctx.arg("values")
    ids = ctx.whole(indices[0]) if len(indices) == 1 else None
    if isinstance(ids, RowIds):
        return _scatter_to_rows(ctx, x, ids, values)
    if len(indices) == 1 and isinstance(local := ctx.pl(indices[0]), LocalIds):
        return _inverse_ids(ctx, x, local, values)
    if len(indices) == 1 and _scatter_of_joined(ctx, x, indices[0], values):
        joined = _along_split_dim("scatter by whole ids, once on the joined values")
        return Aligned(replace(joined, node=ctx.node.name), Split(0))
    if ctx.arg("accumulate", False):
        return _accumulate_into_zeros(ctx, x, [*indices, values])
    p = ctx.pl(x)
    if not isinstance(p, Split) or len(indices) != 1:
        return _unsupported_form("index_put other than a masked fill")
    (mask,) = indices
    mask_val = mask.meta.get("val") if isinstance(mask, torch.fx.Node) else None
    if mask_val is None or mask_val.dtype != torch.bool or p.dim >= mask_val.ndim:
        return _unsupported_form("index_put other than a masked fill of leading dims")
    if ctx.pl(mask) != p or not isinstance(ctx.pl(values), Replicate) or _shape_of(values):
        return _operands_split_apart("masked fill with a mask or value not placed like its target")
    return p


# -- collectives -----------------------------------------------------------------------


def all_reduce(ctx: RuleContext) -> NodePlacement | Reason:
    p = _input(ctx)
    if isinstance(p, Split) and p.order:
        return _along_split_dim("all-reduce of rows in a nanobatch's own order")
    if isinstance(p, Partial) and ctx.arg("reduce_op") != "sum":
        return _partial_sum("all-reduce of a partial sum with an op other than sum")
    return p if isinstance(p, Split) else _replicate_or_partial(p)


def all_gather(ctx: RuleContext) -> NodePlacement | Reason:
    p, n = _input(ctx), ctx.arg("group_size")
    if not isinstance(p, Split):
        return _unsplit(p, "all-gather")
    if p.dim != 0:
        return p
    if p.sizes is not None:
        return _along_split_dim("all-gather of rows cut in uneven per-rank blocks")
    # Each rank's blocks, laid end to end in rank order: every one chunked alike.
    return Split(0, n * p.blocks)


def reduce_scatter(ctx: RuleContext) -> NodePlacement | Reason:
    p, n = _input(ctx), ctx.arg("group_size")
    if isinstance(p, Partial) and ctx.arg("reduce_op") != "sum":
        return _partial_sum("reduce-scatter of a partial sum with an op other than sum")
    if not isinstance(p, Split):
        return _replicate_or_partial(p)
    if p.dim != 0:
        return p
    if p.sizes is not None:
        return _along_split_dim("reduce-scatter of rows cut in uneven per-rank blocks")
    if p.blocks % n:
        return _along_split_dim(
            f"reduce-scatter of rows split in {p.blocks} block(s) over {n} ranks: a rank's "
            "part cuts a block"
        )
    return Split(0, p.blocks // n)


def _permutation(sizes: Sequence[int], rows: int) -> bool:
    """Whether one rank's block is all ``rows`` and the others' are empty."""
    return sorted(sizes)[-1:] == [rows] and sum(sizes) == rows


def all_to_all(ctx: RuleContext) -> NodePlacement | Reason:
    """Rows (dim 0) leave in ``input_split_sizes`` blocks, one per rank, and arrive in
    ``output_split_sizes`` blocks. A split along another dim travels with its rows, and a
    partial sum stays one (the exchange is linear), whatever the sizes. Along dim 0 a
    nanobatch must send its share of every rank's block:

    - rows cut in uneven blocks of the sizes it sends (``Split.sizes``: an MoE's tokens
      laid out by destination) arrive cut in the blocks it receives. The sizes differ by
      rank, but each rank knows those of the blocks it sends and receives, and a block's
      sender and receiver cut it alike from its size (chunk ``j`` of ``s`` rows starts at
      ``j * s // k``), so no rank needs another's sizes (``exchanged_blocks``).
    - a split into even blocks that refine the ranks' blocks, the same on every rank; or
      all rows to one rank and from one (``funcol.permute_tensor``, a ring's shift), so a
      nanobatch's share is its own rows.

    Analysis lays out the graph's inputs by destination where that splits an all-to-all
    (``interface.cut_by_destination``)."""
    p, raw = _input(ctx), arguments(ctx.node)
    if not isinstance(p, Split):
        return _replicate_or_partial(p)
    if p.order:
        return _along_split_dim("all-to-all of rows in a nanobatch's own order")
    if p.dim != 0:
        return p
    if p.sizes is not None:
        if tuple(raw["input_split_sizes"]) != p.sizes:
            return _operands_split_apart(
                "all-to-all of rows cut in blocks other than those it sends"
            )
        return exchanged_blocks(raw["output_split_sizes"])
    sent, received = ctx.arg("input_split_sizes"), ctx.arg("output_split_sizes")
    sizes = [*sent, *received]
    if not all(isinstance(s, int) for s in sizes):
        unknown = exchanged_blocks([*raw["input_split_sizes"], *raw["output_split_sizes"]])
        return unknown if isinstance(unknown, Reason) else _data_dependent_sizes(
            "all-to-all of split rows with sizes computed in the graph (token counts), its "
            "input not laid out by destination: a nanobatch's share of each rank's rows is "
            "not its rows"
        )
    rows, n = _shape_of(ctx.arg("input"))[0], len(sent)
    if _permutation(sent, rows) and _permutation(received, _shape(ctx.out)[0]):
        return p  # each rank's rows go whole to one rank (a ring's shift): any split follows
    if any(s * n != rows for s in sizes):
        return _data_dependent_sizes(
            f"all-to-all of split rows with uneven split sizes (sent {list(sent)}, received "
            f"{list(received)}), its input not laid out by destination: a nanobatch's share "
            "of each rank's rows is not its rows"
        )
    if p.blocks % n:
        return _along_split_dim(
            f"all-to-all of rows split in {p.blocks} block(s) over {n} ranks: a nanobatch's "
            "rows are not its share of every rank's block"
        )
    return p


def exchanged_blocks(given: Sequence[object]) -> Split | Reason:
    """Rows in uneven blocks of the sizes ``given`` (an all-to-all's split sizes as the
    graph spells them: ints, or the graph's symbolic inputs), or why not: sizes the graph
    reads from tensor data itself (unbacked symbols) have no example value, and fake
    propagation of a piece cut from one guards on it."""
    for size in given:
        val = size.meta.get("val") if isinstance(size, torch.fx.Node) else size
        if not isinstance(val, (int, torch.SymInt)) or (
            isinstance(val, torch.SymInt) and free_unbacked_symbols(val)
        ):
            return _data_dependent_sizes(
                f"all-to-all of rows in blocks of sizes read from tensor data in the graph "
                f"({size}): no piece of them can be propagated without a guard"
            )
    return Split(0, len(given), tuple(given))
