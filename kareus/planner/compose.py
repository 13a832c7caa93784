"""Compose frontiers: partitions into a graph's, graphs into a training step's.

Everything is summed in (time, effective energy): the partitions of a graph run one after
another, as do the graphs of a step, so times and effective energies add. Static energy
is added once for the whole step (E = E_eff + P_static x T, REFERENCE.md section 1); a
plan dominated in (time, effective energy) is dominated in (time, total energy) too, so
composing effective frontiers loses no plan.

The frontier of a sum is the frontier of the sum of the parts' frontiers, so parts are
merged one at a time and pruned after each merge (``combine``): the work stays the product
of two frontiers, never of all the parts' grids.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kareus.interrupts import raise_if_interrupted
from kareus.passes.decide import Choice


@dataclass(frozen=True)
class FrontierPoint:
    """One way to run something (a partition, a graph, a step so far): its time, its
    effective energy and what was chosen (a graph's: its ``Choice``)."""

    time_s: float
    effective_energy_j: float
    choice: Any = ()


def front(points: Iterable[FrontierPoint]) -> list[FrontierPoint]:
    """The points no other is at least as fast and as frugal as, fastest first (of equal
    ones, the first given)."""
    kept: list[FrontierPoint] = []
    for o in sorted(points, key=lambda o: (o.time_s, o.effective_energy_j)):
        if not kept or o.effective_energy_j < kept[-1].effective_energy_j:
            kept.append(o)
    return kept


def fronts_by(
    points: Iterable[FrontierPoint], key: Callable[[Any], Hashable]
) -> list[FrontierPoint]:
    """The frontier of each group of ``points`` with the same ``key`` of their choice,
    together, fastest first. A graph's points are pruned per clock, never across clocks:
    a point dominated by one at another clock may still be in the best step, where its
    clock saves a switch that the other would cost (the step prunes across clocks, once
    switches are counted)."""
    groups: dict[Hashable, list[FrontierPoint]] = {}
    for o in points:
        groups.setdefault(key(o.choice), []).append(o)
    kept = [o for group in groups.values() for o in front(group)]
    return sorted(kept, key=lambda o: (o.time_s, o.effective_energy_j))


def clock_of(choice: Choice) -> int:
    """What a clock switch depends on: a graph's clock."""
    return choice.clock_mhz


def combine(parts: Sequence[Sequence[FrontierPoint]]) -> list[FrontierPoint]:
    """The frontier of running every part once, each with one of its points; a
    combination's ``choice`` is the tuple of its parts' choices, in order. A part without
    points makes the whole infeasible (no point)."""
    combined = [FrontierPoint(0.0, 0.0, ())]
    for part in parts:
        part_front = front(part)
        combined = front(
            FrontierPoint(a.time_s + b.time_s, a.effective_energy_j + b.effective_energy_j,
                   (*a.choice, b.choice))
            for a in combined
            for b in part_front
        )
    return combined


def variants_frontier(
    variants: Mapping[tuple[int, int], tuple[FrontierPoint, Sequence[Sequence[FrontierPoint]]]],
) -> list[FrontierPoint]:
    """The frontier of a graph over its (nanobatch count, clock) variants, at each clock
    (``fronts_by``). Each maps to the compute outside its partitions at that clock and, per
    partition occurrence, the points measured at that clock; occurrences of one key are
    separate parts, so repeated layers may take different points. A variant with an
    unmeasured partition is left out."""
    points = []
    for (k, clock), (outside, partitions) in variants.items():
        for o in combine(partitions):
            points.append(FrontierPoint(
                outside.time_s + o.time_s, outside.effective_energy_j + o.effective_energy_j,
                Choice(k, clock, o.choice),
            ))
    return fronts_by(points, clock_of)


@dataclass(frozen=True)
class StepPoint:
    """A training step's plan: one choice per graph, and what the step costs with them."""

    time_s: float
    energy_j: float
    effective_energy_j: float
    graphs: tuple[Any, ...]


Switch = Callable[[Hashable, Hashable], tuple[float, float]]
"""(seconds, effective joules) of going from one graph's choice to the next's (a clock
switch: what the device says it costs)."""


def step_frontier(
    graphs: Sequence[Sequence[FrontierPoint]],
    *,
    repeats: int = 1,
    static_power_w: float,
    switch: Switch = lambda a, b: (0.0, 0.0),
    switch_key: Callable[[Any], Hashable] = lambda choice: choice,
) -> list[StepPoint]:
    """The frontier of a step that runs ``graphs`` in order ``repeats`` times (the forward
    and backward of each of ``repeats`` accumulated micro-batches), every repetition the
    same plan: each graph's frontier points, the switches between consecutive graphs
    (wrapping around to the next step's first), static power over the whole step.

    ``switch`` must depend on its choices only through ``switch_key`` (a graph's clock):
    partial plans are then merged graph by graph and pruned among those with the same
    first and last key, which is exact (what follows costs the same for all of them) and
    keeps the work linear in the number of graphs. For the same reason a graph's points
    are pruned only among those of one key (``fronts_by``)."""
    fronts = [fronts_by(g, switch_key) for g in graphs]
    if not fronts or not all(fronts):
        return []
    partial: dict[tuple[Hashable, Hashable], list[FrontierPoint]] = {}
    for o in fronts[0]:
        key = switch_key(o.choice)
        partial.setdefault((key, key), []).append(
            FrontierPoint(o.time_s, o.effective_energy_j, (o.choice,))
        )
    for graph_points in fronts[1:]:
        raise_if_interrupted()  # a graph's merge can take a second: a pending Ctrl-C ends it
        merged: dict[tuple[Hashable, Hashable], list[FrontierPoint]] = {}
        for (first, _), plans in partial.items():
            for o in graph_points:
                for p in plans:
                    seconds, joules = switch(p.choice[-1], o.choice)
                    merged.setdefault((first, switch_key(o.choice)), []).append(FrontierPoint(
                        p.time_s + seconds + o.time_s,
                        p.effective_energy_j + joules + o.effective_energy_j,
                        (*p.choice, o.choice),
                    ))
        partial = {key: front(plans) for key, plans in merged.items()}
    points = []
    for plans in partial.values():
        for p in plans:
            seconds, joules = switch(p.choice[-1], p.choice[0])  # into the next step
            time_s = repeats * (p.time_s + seconds)
            effective = repeats * (p.effective_energy_j + joules)
            points.append(StepPoint(time_s, effective + static_power_w * time_s, effective,
                                    p.choice))
    kept: list[StepPoint] = []
    for p in sorted(points, key=lambda p: (p.time_s, p.energy_j)):
        if not kept or p.energy_j < kept[-1].energy_j:
            kept.append(p)
    return kept
