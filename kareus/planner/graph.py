"""A graph's time-energy frontier, from its profiled partitions and the device's cost of the rest.

For each nanobatch count ``k`` and clock ``f`` the graph is its partitions, each running
``k`` times (a nanobatch's compute with another's collective behind it: what a partition
variant measures), plus everything else: barriers, the segment after the last collective,
the nanobatches' joins. That rest is what the device says the graph of ``k`` nanobatches
with every collective at its earliest slot costs at ``f``, less its partitions' share at
their earliest slot, so the composition is exact at that variant and every other choice
moves the graph by what it moves its partitions. Partition frontiers are per clock: each
measured schedule also gets a prediction at the clocks it was not measured at
(``search.complete``), since a search measures each schedule at a few clocks only. The
points of the composed frontier are then costed as whole graphs by the device, which is
what they are planned with.

Everything here is per GPU: a partition measured for its group (energies summed over its
ranks, ``measure.group_measurement``) is divided by the group's size.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch.fx

from kareus.codegen.apply import apply
from kareus.devices.base import Device, Measurement
from kareus.passes.analyse import GraphAnalysis
from kareus.passes.decide import Choice
from kareus.passes.ops import DEFAULT_CLOCK_MHZ
from kareus.passes.variants import PartitionChoices, Variant
from kareus.planner.compose import FrontierPoint, clock_of, fronts_by, variants_frontier
from kareus.profiler.graph_cost import GraphCost
from kareus.profiler.profile import PartitionProfile
from kareus.profiler.search import Config, Point, complete


def device_cost(
    gm: torch.fx.GraphModule, analysis: GraphAnalysis, device: Device, world_size: int
) -> GraphCost:
    """What ``device`` says the graph costs as each variant at each asked clock (its clock
    switch asks for the default clocks: the clock the device costs it at)."""

    def cost(variant: Variant | None, clocks: Sequence[int]) -> dict[int, Measurement] | None:
        return device.estimate_at(apply(gm, analysis, Choice.of(variant)), clocks, world_size)

    return cost


_FIXED = FrontierPoint(0.0, 0.0, (0, None))  # a partition nothing is chosen for: earliest slot


@dataclass(frozen=True)
class GraphFrontier:
    """What one graph can cost: its frontier over (k, clock, partition choices), the
    unrewritten graph per clock (frequency only) and at the default clock (the baseline),
    and each count's default variant (every collective at its earliest slot, the library's
    SMs) per clock: nanobatching without a search, the method's "Nanobatching + Perseus"."""

    label: str
    graph_hash: str
    points: tuple[FrontierPoint, ...]  # choice: Choice; the front at each clock, fastest first
    frequency_only: tuple[FrontierPoint, ...]
    baseline: FrontierPoint
    nanobatched: tuple[FrontierPoint, ...] = ()  # k > 1 at its default variant, every clock


def graph_frontier(
    analysis: GraphAnalysis,
    profiles: Sequence[PartitionProfile],
    counts: Sequence[int],
    clocks: Sequence[int],
    cost: GraphCost,
) -> GraphFrontier | None:
    """The frontier of ``analysis``'s graph at ``counts`` and ``clocks`` (the first is the
    default), per clock; None where ``cost`` cannot cost it. The unrewritten graph at every
    clock is a point whatever the counts, so the baseline (unrewritten at the default
    clock) is always one a plan can take: a plan is never worse than doing nothing."""
    unrewritten = cost(None, clocks)
    # Each count's default is asked for before the answer is looked at: a device that must
    # measure whole graphs measures them with the unrewritten one, clock by clock.
    defaults = {k: (analysis.space.default(k), cost(analysis.space.default(k), clocks))
                for k in counts if k != 1 and k in analysis.space.nanobatches}
    if unrewritten is None:
        return None
    single = [FrontierPoint(m.time_s, m.effective_energy_j, Choice(1, f, ()))
              for f, m in unrewritten.items()]
    variants: dict[tuple[int, int], tuple[FrontierPoint, list[list[FrontierPoint]]]] = {
        (1, f): (FrontierPoint(m.time_s, m.effective_energy_j), [])
        for f, m in unrewritten.items()
    }
    known = {(1, ()): unrewritten}
    nanobatched: list[FrontierPoint] = []
    for k, (default, whole) in defaults.items():
        if whole is None:
            continue
        known[(k, tuple(zip(default.slots, default.resources, strict=True)))] = whole
        nanobatched += [FrontierPoint(m.time_s, m.effective_energy_j, Choice.of(default, f))
                        for f, m in whole.items()]
        per_clock = [_partition_points(p, profiles, k, clocks)
                     for p in analysis.space.partitions(k)]
        for f, m in whole.items():
            parts = [points.get(f) for points in per_clock]
            if any(points is None for points in parts):
                continue  # a partition with no measurement or prediction at f
            share = [next(o for o in points if o.choice == (0, _default_sms(p)))
                     for points, p in zip(parts, analysis.space.partitions(k))]
            outside = FrontierPoint(
                m.time_s - sum(o.time_s for o in share),
                m.effective_energy_j - sum(o.effective_energy_j for o in share),
            )
            variants[(k, f)] = (outside, parts)
    spelled = functools.partial(_default_spelled, default_mhz=clocks[0])
    baseline = unrewritten[clocks[0]]
    return GraphFrontier(
        analysis.label, analysis.key,
        tuple(map(spelled, _costed(variants_frontier(variants), cost, known))),
        tuple(map(spelled, fronts_by(single, clock_of))),
        FrontierPoint(baseline.time_s, baseline.effective_energy_j, Choice(1)),
        tuple(map(spelled, nanobatched)),
    )


def _default_spelled(point: FrontierPoint, default_mhz: int) -> FrontierPoint:
    """``point`` with its choice's clock spelled ``DEFAULT_CLOCK_MHZ`` where it is the
    device's default (the first search clock): the device's costs are keyed by clocks, a
    choice asks for the default clocks as every graph's clock switch does."""
    choice = point.choice
    if choice.clock_mhz != default_mhz:
        return point
    return dataclasses.replace(point, choice=choice.at(DEFAULT_CLOCK_MHZ))


def _costed(
    points: Sequence[FrontierPoint], cost: GraphCost, known: dict[tuple, dict[int, Measurement]]
) -> list[FrontierPoint]:
    """The composed frontier, each point replaced by what the device says its whole graph
    costs (one call per distinct variant, at its clocks). Composition finds the candidates;
    its error (clocks a partition was not measured at are predicted, and the rest is a
    difference) would otherwise bias the choice towards points predicted too low: up to
    20% of effective energy on a TP2 Llama layer. ``known``: variants costed at every
    clock already, by (k, partition choices)."""
    clocks: dict[tuple, list[int]] = {}
    for o in points:
        clocks.setdefault((o.choice.nanobatches, o.choice.partitions), []).append(
            o.choice.clock_mhz)
    costs = {key: known.get(key) or cost(Choice(key[0], 0, key[1]).variant, at)
             for key, at in clocks.items()}
    costed = []
    for o in points:
        c = o.choice
        m = costs[(c.nanobatches, c.partitions)]
        costed.append(o if m is None else
                      FrontierPoint(m[c.clock_mhz].time_s, m[c.clock_mhz].effective_energy_j, c))
    return fronts_by(costed, clock_of)


def _default_sms(p: PartitionChoices) -> int | None:
    return None if None in p.resources else p.resources[0]


def _partition_points(
    p: PartitionChoices, profiles: Sequence[PartitionProfile], k: int, clocks: Sequence[int]
) -> dict[int, list[FrontierPoint]]:
    """Clock -> the points of partition ``p`` run ``k`` times, per GPU; one fixed point
    at every clock where nothing was chosen for it (its collective is not split, or its
    profile failed: it stays at its earliest slot, costed as part of the rest)."""
    profile = next((q for q in profiles if q.key == p.key and q.nanobatches == k
                    and q.error is None and q.points), None)
    if p.launch_slots == 1 or profile is None:
        return {f: [_FIXED] for f in clocks}
    # Predicted in effective energy: a total's chord carries static energy, which is most
    # of a short partition's, and a small error in it is a large one in what is left.
    measured = []
    for q in profile.points:
        sms = dict(q.knobs.resources)
        config = Config(q.knobs.slot, next(iter(sms.values()), None), q.knobs.clock_mhz)
        measured.append(Point(config, q.time_s, q.effective_energy_j, q.effective_energy_j))
    points: dict[int, list[FrontierPoint]] = {}
    for point in complete(measured, clocks):
        c = point.config
        points.setdefault(c.clock_mhz, []).append(FrontierPoint(
            k * point.time_s, k * point.effective_energy_j / profile.group_size,
            (c.slot, c.sms),
        ))
    default = (0, _default_sms(p))
    return {f: opts for f, opts in points.items() if any(o.choice == default for o in opts)}
