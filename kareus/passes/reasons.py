"""Why a split region ends, why a nanobatch count does not apply, why a graph runs
unrewritten: one record with an enumerated kind, so that reports serialise it and search,
planner and tests group by kind instead of matching message text.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class ReasonKind(str, Enum):
    # A split region ends at an op (placement rules).
    NO_RULE = "no-rule"  # no placement rule for the op
    ALONG_SPLIT_DIM = "along-split-dim"  # the op reads or reshapes across the split dim
    OPERANDS_SPLIT_APART = "operands-split-apart"  # operands not split alike
    BATCH_VARYING_OPERAND = "batch-varying-operand"  # an operand varies over the batch unsplit
    PARTIAL_SUM = "partial-sum"  # a non-linear use of a per-nanobatch partial sum
    RANDOM = "random"  # splitting would change the random stream
    PER_NANOBATCH_VALUE = "per-nanobatch-value"  # a per-nanobatch value cannot be joined
    UNSUPPORTED_FORM = "unsupported-form"  # a form of the op the rule does not split
    DATA_DEPENDENT_SIZES = "data-dependent-sizes"  # sizes that vary by rank (token counts)
    # A nanobatch count does not apply to a graph.
    NO_SPLIT_INPUT = "no-split-input"
    NOT_DIVISIBLE = "not-divisible"
    NO_SPLIT_COLLECTIVE = "no-split-collective"
    SYMBOLIC_SHAPES = "symbolic-shapes"
    # A graph runs unrewritten.
    CANNOT_REWRITE = "cannot-rewrite"
    RANKS_DISAGREED = "ranks-disagreed"
    VERIFY_FAILED = "verify-failed"  # its rewrite computed other values than the graph


@dataclass(frozen=True)
class Reason:
    kind: ReasonKind
    node: str | None  # the node it is about (None: the whole graph)
    detail: str

    def __str__(self) -> str:
        return f"{self.node}: {self.detail}" if self.node else self.detail
