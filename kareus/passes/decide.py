"""Stage 2 of 3 (analyse -> decide -> apply): which variant of a graph runs, at which clock.

A ``Policy`` is what the backend was asked for (a nanobatch count, a way to choose the
variant, a clock); ``decide`` turns it and a ``GraphAnalysis`` into a ``Decision`` and
checks it where it is made: a chooser that returns another count, a slot out of range or
nothing is an error here, not a report of a variant that never ran.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from kareus.errors import KareusError
from kareus.passes.analyse import GraphAnalysis
from kareus.passes.ops import DEFAULT_CLOCK_MHZ
from kareus.passes.reasons import Reason
from kareus.passes.variants import NANOBATCH_COUNTS, Variant, VariantError

VariantChooser = Callable[[GraphAnalysis, int], Variant]
"""Picks the variant of a graph for ``k`` nanobatches. It must return the same variant on
every rank (seed any randomness with ``analysis.key``), or the ranks fall back."""


class DecisionError(KareusError, ValueError):
    """A policy asked for something that is not a point of the graph's variant space."""


def earliest_slots(analysis: GraphAnalysis, k: int) -> Variant:
    """Every collective at its earliest slot, on the library's default resources."""
    return analysis.space.default(k)


@dataclass(frozen=True)
class Policy:
    nanobatches: int = 1  # 1: no rewrite
    chooser: VariantChooser = earliest_slots
    clock_mhz: int = DEFAULT_CLOCK_MHZ  # one per graph (0: the device's default clocks)

    def __post_init__(self) -> None:
        if self.nanobatches not in NANOBATCH_COUNTS:
            raise DecisionError(
                f"nanobatches must be one of {NANOBATCH_COUNTS}, got {self.nanobatches!r}"
            )
        if isinstance(self.clock_mhz, bool) or not isinstance(self.clock_mhz, int):
            raise DecisionError(f"clock_mhz must be an int (MHz), got {self.clock_mhz!r}")
        if self.clock_mhz < 0:
            raise DecisionError(f"clock_mhz must be >= 0 (0: default clocks), got {self.clock_mhz}")


@dataclass(frozen=True)
class Decision:
    requested: int  # the nanobatch count the policy asked for
    variant: Variant | None  # what runs (None: the graph unrewritten)
    clock_mhz: int
    reason: Reason | None = None  # why it runs unrewritten though more was asked

    def fallback(self, reason: Reason) -> Decision:
        """The same request, run unrewritten for ``reason``."""
        return dataclasses.replace(self, variant=None, reason=reason)


def decide(analysis: GraphAnalysis, policy: Policy) -> Decision:
    k = policy.nanobatches
    if k == 1:
        return Decision(k, None, policy.clock_mhz)
    if k in analysis.space.infeasible:
        return Decision(k, None, policy.clock_mhz, analysis.space.infeasible[k])
    variant = policy.chooser(analysis, k)
    try:
        analysis.space.check(variant)
    except VariantError as exc:
        raise DecisionError(
            f"{analysis.label} ({analysis.key}): the chooser returned a variant outside the "
            f"graph's space: {exc}"
        ) from exc
    if variant.nanobatches != k:
        raise DecisionError(
            f"{analysis.label} ({analysis.key}): {k} nanobatches were asked for, the chooser "
            f"returned a variant of {variant.nanobatches}"
        )
    return Decision(k, variant, policy.clock_mhz)
