"""Whole graphs measured per clock, on a device that cannot cost a graph without running it.

The planner costs a graph as variants (unrewritten, each count's default variant, each
candidate of its composed frontier) at the search clocks (``planner.graph.GraphCost``). A
model answers at once; a real GPU must run them. Here every variant the planner asks for
runs:

- at every other search clock, the first and the last always (:func:`measured_clocks`);
  the clocks between are predicted from their measured neighbours with the structure the
  partition search uses (time a + b/f through both, energy on their chord:
  ``search.between``), which bounds the cost to about half the clocks;
- on a copy of the inputs of the graph's first call: real data, so that a data-dependent
  graph (MoE routing, index ops) costs what it will cost, and the call then runs on its
  own inputs untouched;
- under the measurement protocol, on every rank of the graph's collectives at once: the
  lowest leads and posts each (variant, clock) through the store, the others measure it
  alongside (``exchange.Team``, as for partitions) and adopt the leader's measurements;
- through the profile store, keyed by graph hash, variant and clock: the next run measures
  nothing.

The leader finds what to measure by running the planner's exploration (``explore``: the
graph's frontier) with a cost that measures; every rank then plans from the same
measurements (:class:`MeasuredGraph.cost`), so all of them choose alike.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from kareus.devices.base import Device, Measurement, Workload
from kareus.passes.analyse import GraphAnalysis
from kareus.passes.decide import Choice
from kareus.passes.variants import Variant
from kareus.profiler.exchange import ProfilingAborted, Team
from kareus.profiler.measure import GpuTime, ProfileBudgetSpent, measure_variant
from kareus.profiler.profile import Progress, Settings
from kareus.profiler.search import Point, SearchResult, between
from kareus.profiler.store import Knobs, ProfileKey, ProfileStore

GraphCost = Callable[[Variant | None, Sequence[int]], dict[int, Measurement] | None]
"""What the planner costs a whole graph with (``planner.graph``): (variant, clocks) -> what
the graph costs at each clock as that variant (None: unrewritten), per GPU; None where it
cannot be told (a device that must run the graph, before it has)."""


def measured_clocks(clocks: Sequence[int]) -> tuple[int, ...]:
    """The clocks a whole graph is measured at: every other one of ``clocks`` (descending),
    and the last, so that every other clock lies between two measured ones."""
    picked = list(clocks[::2])
    if clocks and clocks[-1] not in picked:
        picked.append(clocks[-1])
    return tuple(picked)


def predicted_cost(
    measured: dict[int, Measurement], clock: int
) -> Measurement | None:
    """The graph's cost at ``clock`` from its measured neighbours (itself where measured);
    None outside the measured range."""
    if clock in measured:
        return measured[clock]
    guess = between(measured, clock)
    if guess is None:
        return None
    high = min(c for c in measured if c > clock)
    low = max(c for c in measured if c < clock)
    anchor = measured[high]
    return Measurement(
        time_s=guess[0], energy_j=guess[1], static_power_w=anchor.static_power_w,
        clock_mhz=clock, method=f"predicted between {high} and {low} MHz",
        model_version=anchor.model_version,
    )


def _choice(fields: dict) -> Choice:
    return Choice(fields["nanobatches"], fields["clock_mhz"],
                  tuple((s, r) for s, r in fields["partitions"]))


@dataclass(frozen=True)
class MeasuredGraph:
    """What measuring one graph gave: its cost for the planner (measured clocks as
    measured, the others predicted; per GPU), how many measurements were taken now and
    read from the store, and the GPU-seconds they took on this rank."""

    measurements: dict[Choice, Measurement]  # (variant, clock) -> its group's measurement
    search_clocks: tuple[int, ...]
    group_size: int
    measured: int
    reused: int
    gpu_s: float

    def cost(self, variant: Variant | None, clocks: Sequence[int]) -> dict[int, Measurement] | None:
        """``planner.graph.GraphCost`` from the measurements: None where the variant (or a
        neighbour of an asked clock) was not measured."""
        answer = _answer(self.search_clocks, variant, clocks, self._lookup)
        return None if answer is None else {
            f: replace(m, energy_j=m.energy_j / self.group_size,
                       static_power_w=m.static_power_w / self.group_size)
            for f, m in answer.items()
        }

    def _lookup(self, choice: Choice) -> Measurement | None:
        return self.measurements.get(choice)


def _answer(
    search_clocks: Sequence[int], variant: Variant | None, clocks: Sequence[int],
    lookup: Callable[[Choice], Measurement | None],
) -> dict[int, Measurement] | None:
    """The variant at each of ``clocks``: those of :func:`measured_clocks` looked up, the
    others predicted from the measured clocks either side of them."""
    grid = measured_clocks(search_clocks)
    base = Choice.of(variant)
    needed = sorted({f for clock in clocks for f in _neighbours(grid, clock)}, reverse=True)
    curve: dict[int, Measurement] = {}
    for f in needed:
        m = lookup(base.at(f))
        if m is None:
            return None
        curve[f] = m
    answer: dict[int, Measurement] = {}
    for f in clocks:
        m = predicted_cost(curve, f)
        if m is None:
            return None
        answer[f] = m
    return answer


def _neighbours(grid: Sequence[int], clock: int) -> tuple[int, ...]:
    """The measured clocks ``clock``'s cost comes from: itself, or the two either side."""
    if clock in grid:
        return (clock,)
    above = [f for f in grid if f > clock]
    below = [f for f in grid if f < clock]
    return tuple(([min(above)] if above else []) + ([max(below)] if below else []))


class GraphMeasurer:
    """Measures one graph's variants on this rank, leading or following its team.

    ``workload(choice)``: the variant of ``choice`` (its clock aside) as a workload that
    runs it once on the copied inputs, compiled as the training graph is (the caller
    compiles each variant once).
    """

    def __init__(
        self,
        analysis: GraphAnalysis,
        workload: Callable[[Choice], Workload],
        device: Device,
        store: ProfileStore,
        settings: Settings,
        spend: GpuTime,
        *,
        prefix: str,
        progress: Progress | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        self.analysis, self.workload, self.device = analysis, workload, device
        self.store, self.settings, self.spend = store, settings, spend
        self.progress, self.stop = progress, stop
        self.label = f"{analysis.label} whole graph"
        groups = sorted({c.group_name for c in analysis.collectives})
        self.team = Team.of_groups(groups, f"kareus/graph/{prefix}", settings.timeout_s, stop,
                                   decode=_choice)
        self.search_clocks = tuple(device.search_clocks())
        self.measurements: dict[Choice, Measurement] = {}
        self.fresh = self.reused = 0
        self.gpu_s = 0.0

    def run(self, explore: Callable[[GraphCost], object]) -> MeasuredGraph:
        """Every variant ``explore`` asks for, measured (or read back) on every rank of the
        team; raises what stopped it (``ProfilingAborted`` on every rank where one failed,
        ``ProfileBudgetSpent`` on the leader once the budget is spent)."""
        if self.team.leads:
            try:
                explore(self._measuring_cost)
            except BaseException as exc:
                self.team.abort(f"rank {self.team.rank} failed: {type(exc).__name__}: {exc}")
                raise
            points = [Point.of(c, m) for c, m in self.measurements.items()]
            self.team.finish(self.fresh, SearchResult(points, "measured"), self.measurements)
        else:
            _, self.measurements = self.team.follow(self._measure_here)
        return MeasuredGraph(dict(self.measurements), self.search_clocks, self.team.group_size,
                             self.fresh, self.reused, self.gpu_s)

    def _measuring_cost(
        self, variant: Variant | None, clocks: Sequence[int]
    ) -> dict[int, Measurement] | None:
        return _answer(self.search_clocks, variant, clocks, self._measured)

    def _measured(self, choice: Choice) -> Measurement:
        """``choice`` measured for the team, or read back from the store."""
        if choice in self.measurements:
            return self.measurements[choice]
        key, knobs = self._key(choice), Knobs(0, {}, choice.clock_mhz, choice.nanobatches)
        refresh = self.settings.mode == "refresh"
        hit = None if refresh else self.store.lookup(key, knobs)
        if hit is not None:
            m = hit.measurement
            self.reused += 1
        else:
            self.spend.check()
            m = self.team.measure(self.fresh, choice, self._measure_here)
            self.fresh += 1
            self.store.record(key, knobs, m, replace=refresh)
        self.measurements[choice] = m
        if self.progress is not None:
            done = len(self.measurements)
            self.progress(self.label, done, done, [Point.of(c, x)
                                                  for c, x in self.measurements.items()])
        return m

    def _key(self, choice: Choice) -> ProfileKey:
        """Where ``choice``'s variant is stored: the graph's hash, the count, the choices."""
        partitions = json.dumps([list(p) for p in choice.partitions])
        return ProfileKey(
            f"graph {self.analysis.key} k{choice.nanobatches} {partitions}",
            self.device.identity, self.device.model_version, self.search_clocks,
            self.team.group_size,
        )

    def _measure_here(self, choice: Choice, agree: Callable[[int], int] | None) -> Measurement:
        return measure_variant(
            self.device, replace(self.workload(choice), agree=agree), choice.clock_mhz,
            protocol=self.settings.protocol, stop=self.stop, spent=self._spent,
        )

    def _spent(self, seconds: float) -> None:
        self.gpu_s += seconds
        self.spend.charge(self.analysis.label, seconds)


FAILURES = (ProfilingAborted, ProfileBudgetSpent, ValueError, RuntimeError, TypeError, OSError)
"""What makes a graph's measurement fail on every rank of its team (it is then not planned)."""
