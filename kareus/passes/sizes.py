"""Sizes as the analysis reads them: ints, or symbolic sizes it never guards on.

A graph compiled with dynamic shapes has ``SymInt`` sizes. ``int()`` or a comparison of
one adds a guard to Dynamo's shape environment and specialises the graph (a recompile per
batch size), so the placement rules read a symbolic size as a ``SymbolicSize``: equal to
the same expression and to nothing else, multiplied by sizes (a reshape's products),
ordered by its example value only where a search needs a direction, and refusing any
other arithmetic with ``SymbolicSizeRead``, which propagation turns into a typed reason.

The rewrite cuts a symbolic split dim of ``c * R`` rows (``c`` an int, ``R`` the graph's
batch expression) into ``k`` pieces at rows ``c * (j * R // k)``: uneven where ``k`` does
not divide ``R``, the same cut for every value of the graph (``units``).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

import sympy
import torch
import torch.fx

from kareus.errors import KareusError
from kareus.passes.collectives import size_hint


class SymbolicSizeRead(KareusError, TypeError):
    """A rule computed with a symbolic size in a way that would guard on its value."""


@dataclass(frozen=True, eq=False)
class SymbolicSize:
    """A size known only as an expression of the graph's symbols (and its example value)."""

    expr: sympy.Expr
    hint: int

    def __eq__(self, other: object) -> bool:
        if isinstance(other, SymbolicSize):
            return sympy.expand(self.expr - other.expr) == 0
        return False  # never statically a number: 0/1 sizes are specialised by Dynamo

    def __hash__(self) -> int:
        return hash(sympy.expand(self.expr))

    def __mul__(self, other: object) -> SymbolicSize:
        if isinstance(other, SymbolicSize):
            return SymbolicSize(self.expr * other.expr, self.hint * other.hint)
        if isinstance(other, int):
            return SymbolicSize(self.expr * other, self.hint * other)
        return NotImplemented

    __rmul__ = __mul__

    def __lt__(self, other: object) -> bool:
        """By example value: only a search's direction, never a decision (``__eq__`` is)."""
        return self.hint < (other.hint if isinstance(other, SymbolicSize) else other)

    def __gt__(self, other: object) -> bool:
        return self.hint > (other.hint if isinstance(other, SymbolicSize) else other)

    def _refuse(self, *_: object) -> None:
        raise SymbolicSizeRead(f"a rule computes with the symbolic size {self.expr}")

    __int__ = __index__ = __add__ = __radd__ = __sub__ = __rsub__ = _refuse
    __mod__ = __rmod__ = __floordiv__ = __rfloordiv__ = __truediv__ = __rtruediv__ = _refuse
    __le__ = __ge__ = _refuse

    def __str__(self) -> str:
        return str(self.expr)


Size = int | SymbolicSize


def size(d: int | torch.SymInt) -> Size:
    """``d`` as the rules read it: an int, or a ``SymbolicSize`` (no guard either way)."""
    if isinstance(d, torch.SymInt):
        expr = d.node.expr
        if expr.is_Integer:
            return int(expr)
        return SymbolicSize(expr, size_hint(d))
    return int(d)


def shape(x: object) -> tuple[Size, ...]:
    """The shape of a tensor value (``()`` for anything else)."""
    return tuple(size(d) for d in x.shape) if isinstance(x, torch.Tensor) else ()


def symbolic(x: object) -> bool:
    return isinstance(x, (SymbolicSize, torch.SymInt)) and not (
        isinstance(x, torch.SymInt) and x.node.expr.is_Integer
    )


def units(d: SymbolicSize) -> tuple[int, sympy.Expr] | None:
    """``d`` as ``c * R``: its integer coefficient and its symbolic rest (None: not so)."""
    coeff, rest = sympy.expand(d.expr).as_coeff_Mul()
    if not coeff.is_Integer or coeff <= 0 or rest.is_Add:
        return None
    return int(coeff), rest


Emit = Callable[[Callable[..., object], tuple, str], "torch.fx.Node"]
"""Emits one step of size arithmetic into a graph: (target, args, step name)."""


def chunk_start(
    size: int | torch.fx.Node, j: int, k: int, emit: Emit | None = None, step: str = ""
) -> object:
    """Where nanobatch ``j``'s chunk of a block of ``size`` rows starts: ``j * size // k``
    (an int, or computed in the graph with ``emit`` from the node of a symbolic size)."""
    if j in (0, k):
        return 0 if j == 0 else size
    if isinstance(size, int):
        return j * size // k
    assert emit is not None, "a symbolic size's cut is computed in a graph"
    return emit(operator.floordiv, (emit(operator.mul, (size, j), f"{step}.times{j}"), k),
                f"{step}.cut{j}")


def chunk_rows(size: int | torch.fx.Node, j: int, k: int, emit: Emit, step: str) -> object:
    """The rows of nanobatch ``j``'s chunk of a block of ``size`` rows."""
    if isinstance(size, int):
        return (j + 1) * size // k - j * size // k
    end, start = chunk_start(size, j + 1, k, emit, step), chunk_start(size, j, k, emit, step)
    return end if j == 0 else emit(operator.sub, (end, start), f"{step}.rows{j}")
