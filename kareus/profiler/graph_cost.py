"""Whole graphs measured per clock, on a device that cannot cost a graph without running it.

The planner costs a graph as variants (unrewritten, each count's default variant, each
candidate of its composed frontier) at the search clocks (``planner.graph.GraphCost``). A
model answers at once; a real GPU must run them. Here every variant the planner asks for
runs:

- at about four clocks (:func:`measured_clocks`): the top two, measured directly because
  the power cap bends the curve there, one midway and the last; the clocks between are
  predicted from their measured neighbours (time a + b/f through both, power on their
  chord: :func:`predicted_cost`). The unrewritten graph is also measured at a held-back
  clock (:func:`held_back_clock`), and where the prediction misses it by more than
  ``HELD_BACK_TOLERANCE`` (the curve bends there) that clock joins the grid and the next
  widest gap is checked (:func:`grid`). What the planner asks for first (the unrewritten
  graph and each count's default) is measured at the held-back clock too, so that a clock
  joining the grid costs no batch of its own;
- one clock at a time, the graphs of a step together: the variants the planner asks for
  are gathered first (the planner's exploration asks again once they are measured, until
  it asks nothing new), every graph's of a round, and each clock's are measured as one
  batch (``Device.measure_batch``: interleaved where the GPU's counter allows; its first
  variant is the control that catches drift); so a step's graphs switch clocks a few
  times per round, not once per graph and clock, and each batch's fixed cost (the settle,
  the counter's first updates and its report) is paid once for all of them;
- on a copy of the inputs of each graph's first call: real data, so that a
  data-dependent graph (MoE routing, index ops) costs what it will cost, and the call
  then runs on its own inputs untouched;
- under the measurement protocol, on every rank of the graphs' collectives at once (the
  graphs measured together share their groups): the lowest leads and posts each batch of
  (graph, variant, clock) through the store, the others measure it alongside
  (``exchange.Team``, as for partitions) and adopt the leader's measurements;
- through the profile store, keyed by graph hash, variant and clock: the next run measures
  nothing.

The leader finds what to measure by running the planner's exploration of each graph
(``Subject.explore``: the graph's frontier) with a cost that measures; every rank then
plans from the same measurements (:class:`MeasuredGraph.cost`), so all of them choose
alike.
"""

from __future__ import annotations

import collections
import functools
import itertools
import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from kareus.devices.base import Device, Measurement, Workload
from kareus.devices.nvml.gpu import CHECK_WINDOW_S
from kareus.errors import KareusError
from kareus.passes.analyse import GraphAnalysis
from kareus.passes.decide import Choice
from kareus.passes.variants import Variant
from kareus.profiler.exchange import ProfilingAborted, Team, outcomes_json, read_outcomes
from kareus.profiler.interrupt import check
from kareus.profiler.measure import GpuTime, ProfileBudgetSpent, measure_batch
from kareus.profiler.profile import Progress, Settings
from kareus.profiler.replicas import Pool, digest
from kareus.profiler.search import Point, SearchResult
from kareus.profiler.store import Knobs, ProfileKey, ProfileStore

GraphCost = Callable[[Variant | None, Sequence[int]], dict[int, Measurement] | None]
"""What the planner costs a whole graph with (``planner.graph``): (variant, clocks) -> what
the graph costs at each clock as that variant (None: unrewritten), per GPU; None where it
cannot be told (a device that must run the graph, before it has)."""


HELD_BACK_TOLERANCE = 0.02
"""The most a prediction may miss the held-back clock by (time or energy, relative) for
the graph's sparse grid of clocks to stand: about the measurement error of a point."""


def measured_clocks(clocks: Sequence[int]) -> tuple[int, ...]:
    """The clocks a whole graph is measured at (descending): the top two, where the power
    cap bends the curve, the one midway and the last, so every other clock lies between
    two measured ones."""
    picked = [*clocks[:2], clocks[len(clocks) // 2], clocks[-1]] if clocks else []
    return tuple(dict.fromkeys(picked))


def held_back_clock(clocks: Sequence[int], grid: Sequence[int] | None = None) -> int | None:
    """The clock ``grid``'s prediction (default: :func:`measured_clocks`) is checked at:
    midway in the lower of its widest gaps; None where no gap has a clock inside."""
    grid = measured_clocks(clocks) if grid is None else grid
    index = {f: i for i, f in enumerate(clocks)}
    gaps = [(index[lo] - index[hi], index[hi], index[lo])
            for hi, lo in itertools.pairwise(grid)]
    width, hi, lo = max(gaps, key=lambda g: (g[0], g[1]), default=(0, 0, 0))
    return clocks[(hi + lo) // 2] if width > 1 else None


def grid(
    clocks: Sequence[int], unrewritten: Callable[[int], Measurement | None]
) -> tuple[int, ...]:
    """The clocks a graph's variants are measured at: :func:`measured_clocks`, and each
    held-back clock whose prediction missed the unrewritten graph's measurement there by
    more than ``HELD_BACK_TOLERANCE`` (the curve bends there: a power cap, a voltage
    floor), checked again at the next widest gap, until a check holds or one is not
    measured yet (the next clock to measure is then :func:`next_check`)."""
    current = measured_clocks(clocks)
    while (check := held_back_clock(clocks, current)) is not None:
        measured = {f: m for f in (*current, check) if (m := unrewritten(f)) is not None}
        if len(measured) < len(current) + 1:
            break
        predicted = predicted_cost({f: measured[f] for f in current}, check)
        assert predicted is not None  # the check lies between two measured clocks
        if held_back_error(predicted, measured[check]) <= HELD_BACK_TOLERANCE:
            break
        current = tuple(sorted({*current, check}, reverse=True))
    return current


def next_check(clocks: Sequence[int], unrewritten: Callable[[int], Measurement | None]
               ) -> int | None:
    """The held-back clock the unrewritten graph is measured at next (None: no gap left)."""
    return held_back_clock(clocks, grid(clocks, unrewritten))


def held_back_error(predicted: Measurement, measured: Measurement) -> float:
    """The larger relative miss of a prediction, in time or in energy."""
    return max(abs(predicted.time_s / measured.time_s - 1),
               abs(predicted.energy_j / measured.energy_j - 1))


def predicted_cost(
    measured: dict[int, Measurement], clock: int
) -> Measurement | None:
    """The graph's cost at ``clock`` from its measured neighbours (itself where measured):
    time a + b/f through both, average power on their chord (power is closer to linear in
    the clock than energy, which the a + b/f time bends); None outside the measured range."""
    if clock in measured:
        return measured[clock]
    high = min((c for c in measured if c > clock), default=None)
    low = max((c for c in measured if c < clock), default=None)
    if high is None or low is None:
        return None
    a, b = measured[high], measured[low]
    w = (1 / clock - 1 / high) / (1 / low - 1 / high)
    v = (high - clock) / (high - low)
    time_s = a.time_s + w * (b.time_s - a.time_s)
    power_w = a.average_power_w + v * (b.average_power_w - a.average_power_w)
    return Measurement(
        time_s=time_s, energy_j=power_w * time_s, static_power_w=a.static_power_w,
        clock_mhz=clock, method=f"predicted between {high} and {low} MHz",
        model_version=a.model_version,
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
    shared: int = 0
    """Measurements another data-parallel replica took (``replicas.Pool``)."""

    @property
    def grid(self) -> tuple[int, ...]:
        """The clocks its variants were measured at (:func:`grid`)."""
        return _grid_of(self.search_clocks, self.measurements)

    def point(self, choice: Choice) -> Measurement | None:
        """What the group's measurements say ``choice`` costs (at a clock of the search:
        measured, or predicted from its neighbours); None where they do not tell."""
        answer = _answer(self.grid, choice, [choice.clock_mhz], self.measurements.get)
        return None if answer is None else answer[choice.clock_mhz]

    def cost(self, variant: Variant | None, clocks: Sequence[int]) -> dict[int, Measurement] | None:
        """``planner.graph.GraphCost`` from the measurements: None where the variant (or a
        neighbour of an asked clock) was not measured."""
        answer = _answer(self.grid, Choice.of(variant), clocks, self.measurements.get)
        return None if answer is None else {
            f: replace(m, energy_j=m.energy_j / self.group_size,
                       static_power_w=m.static_power_w / self.group_size)
            for f, m in answer.items()
        }


def _grid_of(search_clocks: Sequence[int], measurements: dict[Choice, Measurement]
             ) -> tuple[int, ...]:
    return grid(search_clocks, lambda f: measurements.get(Choice(1, f, ())))


def _answer(
    clocks_measured: Sequence[int], base: Choice, clocks: Sequence[int],
    lookup: Callable[[Choice], Measurement | None],
) -> dict[int, Measurement] | None:
    """``base``'s variant at each of ``clocks``: those of ``clocks_measured`` looked up, the
    others predicted from the measured clocks either side of them."""
    curve: dict[int, Measurement] = {}
    for f in _needed(clocks_measured, clocks):
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


def _needed(clocks_measured: Sequence[int], clocks: Sequence[int]) -> list[int]:
    """The measured clocks the costs at ``clocks`` come from, descending."""
    return sorted({f for clock in clocks for f in _neighbours(clocks_measured, clock)},
                  reverse=True)


def _neighbours(grid: Sequence[int], clock: int) -> tuple[int, ...]:
    """The measured clocks ``clock``'s cost comes from: itself, or the two either side."""
    if clock in grid:
        return (clock,)
    above = [f for f in grid if f > clock]
    below = [f for f in grid if f < clock]
    return tuple(([min(above)] if above else []) + ([max(below)] if below else []))


class MixedTeamsError(KareusError, ValueError):
    """Graphs whose collectives span different groups were given to one measurer: no one
    team can run their batches."""


class UnsettledExplorationError(KareusError, RuntimeError):
    """The planner's exploration of a graph kept asking for new variants (a bug): the
    graph is not planned rather than measured without end."""


EXTRA_ROUNDS = 4
"""The most rounds of asking and measuring a graph takes beyond one per search clock: the
planner's exploration asks for the unrewritten graph with each count's default, then the
candidates composed from them, while the grid grows by at most one held-back clock a
round, up to every search clock (a noisy GPU's checks may all miss); more means it keeps
asking for new variants, which is a bug."""


@dataclass(frozen=True)
class Subject:
    """A graph to measure: its analysis; its variants (``workload(choice)``: the variant of
    ``choice``, clock aside, as a workload that runs it once on the copied inputs, compiled
    as the training graph is: the caller compiles each variant once); the key its checks
    meet under on every rank (its compile key); and how the planner explores it
    (``explore(cost)``: the graph's frontier from a ``GraphCost``)."""

    analysis: GraphAnalysis
    workload: Callable[[Choice], Workload]
    key: str
    explore: Callable[[GraphCost], object]


@dataclass(frozen=True)
class Item:
    """A variant at a clock of one of the measured graphs (its index): what a team's
    instructions name."""

    graph: int
    choice: Choice


def _item(fields: dict) -> Item:
    return Item(fields["graph"], _choice(fields["choice"]))


@dataclass
class _Graph:
    """What measuring one of the graphs has found so far."""

    subject: Subject
    measurements: dict[Choice, Measurement] = field(default_factory=dict)
    missing: dict[Choice, None] = field(default_factory=dict)  # asked for, not measured
    first_ask: bool = True  # the planner's first ask: the unrewritten graph, the defaults
    fresh: int = 0
    reused: int = 0
    shared: int = 0
    ran: int = 0  # variants this rank ran in the team's batches: alike on every rank
    gpu_s: float = 0.0

    @property
    def label(self) -> str:
        return f"{self.subject.analysis.label} whole graph"


class GraphMeasurer:
    """Measures graphs' variants on this rank, leading or following their team: several
    graphs together (a step's, once all of them had their first call), so that each round
    sets each clock once for all of them, one batch holding every graph's variants at it.

    The graphs must share their collectives' groups: one team (every rank of them) runs
    each batch. ``prefix`` names that team identically on every rank of it and differently
    for each set of graphs (``planner.measured``: from their compile keys).
    """

    def __init__(
        self,
        subjects: Sequence[Subject],
        device: Device,
        store: ProfileStore,
        settings: Settings,
        spend: GpuTime,
        *,
        prefix: str,
        progress: Progress | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        self.device, self.store, self.settings, self.spend = device, store, settings, spend
        self.progress, self.stop = progress, stop
        self.graphs = [_Graph(s) for s in subjects]
        groups = {tuple(sorted({c.group_name for c in s.analysis.collectives}))
                  for s in subjects}
        if len(groups) != 1:
            raise MixedTeamsError(f"graphs measured together must share their collectives' "
                                  f"groups, not {sorted(groups)}")
        (self.groups,) = (list(g) for g in groups)
        self.team = Team.of_groups(self.groups, f"kareus/graph/{prefix}", settings.timeout_s,
                                   stop, decode=_item)
        self.search_clocks = tuple(device.search_clocks())
        self._steps = 0
        self._clock: int | None = None  # the clock the last batch ran at

    def run(self) -> list[MeasuredGraph]:
        """Every variant each graph's exploration asks for, measured (or read back) on
        every rank of the team, a clock at a time, the graphs' rounds side by side (each
        round: every graph still asking asks, then each clock's variants of them all are
        one batch); raises what stopped it (``ProfilingAborted`` on every rank where one
        failed, ``ProfileBudgetSpent`` on the leader once the budget is spent)."""
        if self.team.leads:
            try:
                self.device.probe_counter(self.store)
                rounds = len(self.search_clocks) + EXTRA_ROUNDS
                asking = list(range(len(self.graphs)))
                for ask in range(rounds):
                    for g in asking:
                        graph = self.graphs[g]
                        graph.missing.clear()
                        graph.first_ask = ask == 0
                        graph.subject.explore(functools.partial(self._asking_cost, graph))
                    asking = [g for g in asking if self.graphs[g].missing]
                    if not asking:
                        break
                    self._measure([Item(g, c) for g in asking for c in self.graphs[g].missing])
                else:
                    raise UnsettledExplorationError(
                        f"{', '.join(self.graphs[g].label for g in asking)}: the planner "
                        f"still asks for new variants after {rounds} rounds")
            except BaseException as exc:
                self.team.abort(f"rank {self.team.rank} failed: {type(exc).__name__}: {exc}")
                raise
            self.team.finish(self._steps, [_outcome(self._items())])
        else:
            try:
                self.device.probe_counter(self.store)
            except BaseException as exc:
                self.team.abort(f"rank {self.team.rank} failed: {type(exc).__name__}: {exc}")
                raise
            ((_, measured),) = self.team.follow(self._measure_here, self._measure_batch_here)
            for item, m in measured.items():
                self.graphs[item.graph].measurements[item.choice] = m
        return [MeasuredGraph(dict(g.measurements), self.search_clocks, self.team.group_size,
                              g.fresh, g.reused, g.gpu_s, g.shared) for g in self.graphs]

    def ran(self, graph: int) -> bool:
        """Whether this rank ran any of ``graph``'s variants (alike on every rank)."""
        return self.graphs[graph].ran > 0

    def _items(self) -> dict[Item, Measurement]:
        return {Item(g, c): m for g, graph in enumerate(self.graphs)
                for c, m in graph.measurements.items()}

    def _asking_cost(
        self, graph: _Graph, variant: Variant | None, clocks: Sequence[int]
    ) -> dict[int, Measurement] | None:
        """``GraphCost`` of ``graph`` from what is measured or stored; what is neither is
        noted to be measured (at the held-back clock too: the unrewritten graph's, and
        every variant's of the first ask) and the answer is None."""
        measurements = graph.measurements
        clocks_measured = _grid_of(self.search_clocks, measurements)
        wanted = [Choice.of(variant).at(f) for f in _needed(clocks_measured, clocks)]
        check = next_check(self.search_clocks, lambda f: measurements.get(Choice(1, f, ())))
        if check is not None and (variant is None or graph.first_ask):
            wanted.append(Choice.of(variant).at(check))
        for choice in wanted:
            if choice not in measurements and not self._stored(graph, choice):
                graph.missing[choice] = None
        return _answer(clocks_measured, Choice.of(variant), clocks, measurements.get)

    def _stored(self, graph: _Graph, choice: Choice) -> bool:
        """Whether ``choice`` was read back from the store (and is now known)."""
        if self.settings.mode == "refresh":
            return False
        hit = self.store.lookup(self._key(graph, choice), _knobs(choice))
        if hit is None:
            return False
        graph.measurements[choice] = hit.measurement
        graph.reused += 1
        return True

    def _measure(self, items: list[Item]) -> None:
        """``items`` measured for the team a clock at a time, from the clock the last
        batch ran at downwards and then upwards; where data-parallel replicas ask for the
        same, each clock's batch is claimed by one of them (``replicas.Pool``: a work
        queue) and the others take its measurements."""
        by_clock: dict[int, list[Item]] = {}
        for item in items:
            by_clock.setdefault(item.choice.clock_mhz, []).append(item)
        top = self._clock if self._clock is not None else max(by_clock)
        order = sorted((f for f in by_clock if f <= top), reverse=True) + sorted(
            f for f in by_clock if f > top)
        batches = [by_clock[f] for f in order]
        pool = Pool.of(digest([self._key(self.graphs[i.graph], i.choice).digest()
                               + f" {i.choice}" for i in items]),
                       self.team.group_size, self.settings.timeout_s, self.stop)
        for shared in pool.share([[i] for i in range(len(batches))],
                                 lambda part: self._batches([batches[i] for i in part])):
            if not shared.here:  # another replica measured them
                self._adopt(_read(shared.posted))
        if self.progress is not None:
            for graph in (self.graphs[g] for g in dict.fromkeys(i.graph for i in items)):
                done = len(graph.measurements)
                self.progress(graph.label, done, done,
                              [Point.of(c, x) for c, x in graph.measurements.items()])

    def _batches(self, batches: list[list[Item]]) -> str:
        """Each batch measured by the team at its clock, in order; what a replica posts."""
        for batch in batches:
            self.spend.check()
            found = self.team.measure_batch(self._steps, batch, self._measure_batch_here)
            self._steps += 1
            for item, m in zip(batch, found, strict=True):
                graph = self.graphs[item.graph]
                graph.fresh += 1
                graph.measurements[item.choice] = m
                self.store.record(self._key(graph, item.choice), _knobs(item.choice), m,
                                  replace=self.settings.mode == "refresh")
        return _posted({i: self.graphs[i.graph].measurements[i.choice]
                        for batch in batches for i in batch})

    def _adopt(self, measurements: dict[Item, Measurement]) -> None:
        """Batches another replica measured: taken, and kept in the store."""
        for item, m in measurements.items():
            graph = self.graphs[item.graph]
            if graph.measurements.get(item.choice) != m:
                graph.shared += 1
            graph.measurements[item.choice] = m
            self.store.record(self._key(graph, item.choice), _knobs(item.choice), m)

    def check(self, index: int, choice: Choice, measured: MeasuredGraph) -> str | None:
        """Graph ``index``'s chosen ``choice`` measured once more on every rank of the
        team, apart from the batches, in one long window (``Device.check``): how far it
        moved from what the plan used, said in a note; None where the measurements do not
        cost it. Every rank of the team calls it alike (where the team measured anything
        of the graph: ``ran``)."""
        graph = self.graphs[index]
        point = choice.at(choice.clock_mhz or self.search_clocks[0])
        expected = measured.point(point)
        if expected is None:
            return None
        team = Team.of_groups(self.groups, f"kareus/graph-check/{graph.subject.key}",
                              self.settings.timeout_s, self.stop, decode=_choice)
        if team.leads:
            try:
                found, steps = self._checked_once(index, team, point)
            except BaseException as exc:
                team.abort(f"rank {team.rank} failed: {type(exc).__name__}: {exc}")
                raise
            team.finish(steps, [(SearchResult([Point.of(point, found)], "checked"),
                                 {point: found})])
        else:
            ((_, checked),) = team.follow(functools.partial(self._check_here, graph))
            found = checked[point]
        return (f"the chosen point ({point}) checked in one {CHECK_WINDOW_S:g} s window: "
                f"time {found.time_s / expected.time_s - 1:+.1%}, energy "
                f"{found.energy_j / expected.energy_j - 1:+.1%} from what the plan used")

    def _checked_once(self, index: int, team: Team, point: Choice) -> tuple[Measurement, int]:
        """``point`` checked by the team, or by the first data-parallel replica to claim
        the check of the same point (``replicas.Pool``), whose measurement the others take;
        and the team's instructions it took (0 where adopted)."""
        graph = self.graphs[index]
        pool = Pool.of(digest([self._key(graph, point).digest(), f"check {point}"]),
                       team.group_size, self.settings.timeout_s, self.stop)
        here: list[Measurement] = []

        def measure(part: Sequence[int]) -> str:
            here.append(team.measure(0, point, functools.partial(self._check_here, graph)))
            return _posted({Item(index, point): here[0]})

        (shared,) = pool.share([[0]], measure)
        return _read(shared.posted)[Item(index, point)], len(here)

    def _check_here(self, graph: _Graph, choice: Choice, agree: Callable[[int], int] | None
                    ) -> Measurement:
        check(self.stop)
        started = time.perf_counter()
        m = self.device.check(replace(graph.subject.workload(choice), agree=agree),
                              choice.clock_mhz)
        self._spent(graph, self.settings.protocol.seconds_per_check(m.time_s)
                    if self.device.deterministic else time.perf_counter() - started)
        return m

    def _key(self, graph: _Graph, choice: Choice) -> ProfileKey:
        """Where ``choice``'s variant is stored: the graph's hash, the count, the choices."""
        partitions = json.dumps([list(p) for p in choice.partitions])
        return ProfileKey(
            f"graph {graph.subject.analysis.key} k{choice.nanobatches} {partitions}",
            self.device.identity, self.device.model_version, self.search_clocks,
            self.team.group_size,
        )

    def _measure_here(self, item: Item, agree: Callable[[int], int] | None) -> Measurement:
        return self._measure_batch_here([item], agree)[0]

    def _measure_batch_here(
        self, items: list[Item], agree: Callable[[int], int] | None
    ) -> list[Measurement]:
        (clock,) = {i.choice.clock_mhz for i in items}
        switched, self._clock = clock != self._clock, clock
        shares = collections.Counter(i.graph for i in items)
        for g, count in shares.items():
            self.graphs[g].ran += count

        def spent(seconds: float) -> None:  # the batch's, each graph its share of variants
            for g, count in shares.items():
                self._spent(self.graphs[g], seconds * count / len(items))

        return measure_batch(
            self.device, [self.graphs[i.graph].subject.workload(i.choice) for i in items],
            clock, agree=agree, protocol=self.settings.protocol, switched=switched,
            stop=self.stop, spent=spent,
        )

    def _spent(self, graph: _Graph, seconds: float) -> None:
        graph.gpu_s += seconds
        self.spend.charge(graph.subject.analysis.label, seconds)


def _outcome(measurements: dict[Item, Measurement]) -> tuple[SearchResult, dict[Item, Measurement]]:
    """Measurements as one outcome a team or replica posts (``exchange.outcomes_json``)."""
    points = [Point.of(item, m) for item, m in measurements.items()]
    return SearchResult(points, "measured"), measurements


def _posted(measurements: dict[Item, Measurement]) -> str:
    """Measurements as a replica posts them."""
    return outcomes_json([_outcome(measurements)])


def _read(posted: str) -> dict[Item, Measurement]:
    ((_, measurements),) = read_outcomes(posted, _item)
    return measurements


def _knobs(choice: Choice) -> Knobs:
    return Knobs(0, {}, choice.clock_mhz, choice.nanobatches)


FAILURES = (ProfilingAborted, ProfileBudgetSpent, ValueError, RuntimeError, TypeError, OSError)
"""What makes a graph's measurement fail on every rank of its team (it is then not planned)."""
