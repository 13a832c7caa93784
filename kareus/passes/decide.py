"""Stage 2 of 3 (analyse -> decide -> apply): which variant of a graph runs, at which clock.

What runs is one record, a ``Choice``: the nanobatch count, the graph's clock and each
partition's (launch slot, SMs). Decide, the planner, the plan file, the reports and the
graphs that switch to the plan's choice at run time all speak it. A ``Decision`` is a
choice plus why it runs unrewritten where more was asked.

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
class Choice:
    """What a graph runs: ``nanobatches`` (1: unrewritten), its one clock
    (``DEFAULT_CLOCK_MHZ``: the device's default clocks) and, per partition, the launch
    slot of its collective and the SMs it gets (None: the library's default)."""

    nanobatches: int = 1
    clock_mhz: int = DEFAULT_CLOCK_MHZ
    partitions: tuple[tuple[int, int | None], ...] = ()

    @classmethod
    def of(cls, variant: Variant | None, clock_mhz: int = DEFAULT_CLOCK_MHZ) -> Choice:
        """``variant`` (None: unrewritten) at ``clock_mhz``."""
        if variant is None:
            return cls(1, clock_mhz)
        return cls(variant.nanobatches, clock_mhz,
                   tuple(zip(variant.slots, variant.resources, strict=True)))

    @property
    def variant(self) -> Variant | None:
        """The point of the graph's variant space this runs (None: unrewritten)."""
        if self.nanobatches == 1:
            return None
        return Variant(self.nanobatches, tuple(s for s, _ in self.partitions),
                       tuple(r for _, r in self.partitions))

    def at(self, clock_mhz: int) -> Choice:
        return dataclasses.replace(self, clock_mhz=clock_mhz)

    def __str__(self) -> str:
        clock = "default clocks" if self.clock_mhz == DEFAULT_CLOCK_MHZ else f"{self.clock_mhz} MHz"
        return f"k={self.nanobatches} at {clock}"


@dataclass(frozen=True)
class Decision:
    requested: int  # the nanobatch count the policy asked for
    choice: Choice  # what runs
    reason: Reason | None = None  # why it runs unrewritten though more was asked

    @property
    def variant(self) -> Variant | None:
        return self.choice.variant

    @property
    def clock_mhz(self) -> int:
        return self.choice.clock_mhz

    def fallback(self, reason: Reason) -> Decision:
        """The same request, run unrewritten (at its clock) for ``reason``."""
        return dataclasses.replace(self, choice=Choice(1, self.clock_mhz), reason=reason)


def follow(choice: Choice) -> Policy:
    """The policy that decides ``choice`` (checked against the graph's space)."""
    variant = choice.variant
    return Policy(choice.nanobatches, lambda analysis, k: variant, choice.clock_mhz)


def decide(analysis: GraphAnalysis, policy: Policy) -> Decision:
    k = policy.nanobatches
    unrewritten = Choice(1, policy.clock_mhz)
    if k == 1:
        return Decision(k, unrewritten)
    if k in analysis.space.infeasible:
        return Decision(k, unrewritten, analysis.space.infeasible[k])
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
    return Decision(k, Choice.of(variant, policy.clock_mhz))
