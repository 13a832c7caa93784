"""A graph's time-energy options, from its profiled partitions and the device's cost of the rest.

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

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kareus.devices.base import Measurement
from kareus.passes.analyse import GraphAnalysis
from kareus.passes.variants import PartitionChoices, Variant
from kareus.planner.compose import GraphChoice, Option, front, graph_frontier
from kareus.profiler.profile import PartitionProfile
from kareus.profiler.search import Config, Point, complete

GraphCost = Callable[[Variant | None, Sequence[int]], dict[int, Measurement] | None]
"""(variant, clocks) -> what the graph costs at each clock as that variant (None:
unrewritten); None where the device cannot tell without running it."""

_FIXED = Option(0.0, 0.0, (0, None))  # a partition nothing is chosen for: earliest slot


@dataclass(frozen=True)
class GraphOptions:
    """What one graph can cost: its frontier over (k, clock, partition choices), the
    unrewritten graph per clock (frequency only) and at the default clock (the baseline)."""

    label: str
    graph_hash: str
    options: tuple[Option, ...]  # choice: GraphChoice; fastest first
    frequency_only: tuple[Option, ...]
    baseline: Option


def graph_options(
    analysis: GraphAnalysis,
    profiles: Sequence[PartitionProfile],
    counts: Sequence[int],
    clocks: Sequence[int],
    cost: GraphCost,
) -> GraphOptions | None:
    """The options of ``analysis``'s graph at ``counts`` and ``clocks`` (the first is the
    default); None where ``cost`` cannot cost it. The unrewritten graph gives the
    frequency-only options and the baseline whatever the counts."""
    unrewritten = cost(None, clocks)
    if unrewritten is None:
        return None
    single = [Option(m.time_s, m.effective_energy_j, GraphChoice(1, f, ()))
              for f, m in unrewritten.items()]
    variants: dict[tuple[int, int], tuple[Option, list[list[Option]]]] = {
        (1, f): (Option(m.time_s, m.effective_energy_j), [])
        for f, m in unrewritten.items() if 1 in counts
    }
    known = {(1, ()): unrewritten}
    for k in counts:
        if k == 1 or k not in analysis.space.nanobatches:
            continue
        default = analysis.space.default(k)
        whole = cost(default, clocks)
        if whole is None:
            continue
        known[(k, tuple(zip(default.slots, default.resources, strict=True)))] = whole
        per_clock = [_partition_options(p, profiles, k, clocks)
                     for p in analysis.space.partitions(k)]
        for f, m in whole.items():
            parts = [options.get(f) for options in per_clock]
            if any(options is None for options in parts):
                continue  # a partition with no measurement or prediction at f
            share = [next(o for o in options if o.choice == (0, _default_sms(p)))
                     for options, p in zip(parts, analysis.space.partitions(k))]
            outside = Option(m.time_s - sum(o.time_s for o in share),
                             m.effective_energy_j - sum(o.effective_energy_j for o in share))
            variants[(k, f)] = (outside, parts)
    return GraphOptions(
        analysis.label, analysis.key, tuple(_costed(graph_frontier(variants), cost, known)),
        tuple(front(single)),
        Option(unrewritten[clocks[0]].time_s, unrewritten[clocks[0]].effective_energy_j,
               GraphChoice(1, clocks[0], ())),
    )


def _costed(
    options: Sequence[Option], cost: GraphCost, known: dict[tuple, dict[int, Measurement]]
) -> list[Option]:
    """The composed frontier, each point replaced by what the device says its whole graph
    costs (one call per distinct variant, at its clocks). Composition finds the candidates;
    its error (clocks a partition was not measured at are predicted, and the rest is a
    difference) would otherwise bias the choice towards points predicted too low: up to
    20% of effective energy on a TP2 Llama layer. ``known``: variants costed at every
    clock already, by (k, partition choices)."""
    clocks: dict[tuple, list[int]] = {}
    for o in options:
        clocks.setdefault((o.choice.nanobatches, o.choice.partitions), []).append(
            o.choice.clock_mhz)
    costs = {key: known.get(key) or cost(variant_of(GraphChoice(key[0], 0, key[1])), at)
             for key, at in clocks.items()}
    costed = []
    for o in options:
        c = o.choice
        m = costs[(c.nanobatches, c.partitions)]
        costed.append(o if m is None else
                      Option(m[c.clock_mhz].time_s, m[c.clock_mhz].effective_energy_j, c))
    return front(costed)


def variant_of(choice: GraphChoice) -> Variant | None:
    """The rewrite a graph choice runs (None: unrewritten)."""
    if choice.nanobatches == 1:
        return None
    return Variant(choice.nanobatches, tuple(s for s, _ in choice.partitions),
                   tuple(r for _, r in choice.partitions))


def _default_sms(p: PartitionChoices) -> int | None:
    return None if None in p.resources else p.resources[0]


def _partition_options(
    p: PartitionChoices, profiles: Sequence[PartitionProfile], k: int, clocks: Sequence[int]
) -> dict[int, list[Option]]:
    """Clock -> the options of partition ``p`` run ``k`` times, per GPU; one fixed option
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
    options: dict[int, list[Option]] = {}
    for point in complete(measured, clocks):
        c = point.config
        options.setdefault(c.clock_mhz, []).append(Option(
            k * point.time_s, k * point.effective_energy_j / profile.group_size,
            (c.slot, c.sms),
        ))
    default = (0, _default_sms(p))
    return {f: opts for f, opts in options.items() if any(o.choice == default for o in opts)}
