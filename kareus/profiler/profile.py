"""Partition profiling: each distinct partition of a graph searched once, through the store.

For a graph split into ``k`` nanobatches, every partition whose collective can launch at
more than one slot is a search over (launch slot x the SMs its collective gets x SM clock)
(REFERENCE.md section 1), at every third search clock and the last
(:func:`partition_clocks`; the grid strategy takes every clock). Partitions with the same
structural key (the identical layers of a model) are searched once; a graph's searches run
side by side, a round per clock, what they propose at one clock measured as one batch
(``search.lockstep``). Each evaluation runs ``workloads.partition_workload`` on this rank's
device under the measurement protocol, on every rank of the partition's group at once
(``exchange.Team``: the lowest rank leads, the others follow, nobody meets in a collective
outside the measured variant itself), and is committed to the profile store the moment it
is complete. An evaluation already in the store is read back instead of measured
(``mode="refresh"`` measures again and replaces it), so a second compile of the same model
on the same device measures nothing, and a search cut short by a crash resumes where it
stopped.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kareus.devices.base import Device, Measurement, Resources, Workload
from kareus.passes.analyse import GraphAnalysis
from kareus.passes.collectives import find_collectives
from kareus.passes.partition import Partition
from kareus.passes.variants import PartitionChoices
from kareus.profiler.exchange import ProfilingAborted, Team, outcomes_json, read_outcomes
from kareus.profiler.interrupt import check
from kareus.profiler.measure import GpuTime, Protocol, measure_batch
from kareus.profiler.replicas import Pool, deal, digest
from kareus.profiler.search import (
    ClockSearch,
    Config,
    GridSearch,
    Point,
    Searcher,
    SearchResult,
    Space,
    lockstep,
    pareto,
)
from kareus.profiler.store import Knobs, ProfileKey, ProfileStore, SearchRecord
from kareus.profiler.workloads import Lower, partition_workload
from kareus.runtime.communicators import Communicators

MODES = ("auto", "off", "refresh")

CLOCK_STRIDE = 3
"""A partition's search measures every third of the device's search clocks (and the last).
A search only proposes: the planner predicts each schedule between its measured clocks
(time a + b/f, energy on the chord: ``search.complete``) and costs every candidate it
composes as a whole graph at the clocks it runs at (``planner.graph``), so the clocks
between cost the searches' rounds (a clock switch and the counter's readings each) and
add little: ``benchmarks/profiling_cost.py`` plans the same energy from them as from every
variant at every clock."""


def partition_clocks(clocks: Sequence[int]) -> Sequence[int]:
    """The clocks of ``clocks`` (descending) a partition's search measures at: every
    ``CLOCK_STRIDE``-th from the highest, and the lowest (the bottom of every curve)."""
    picked = clocks[::CLOCK_STRIDE]
    return picked if picked[-1] == clocks[-1] else (*picked, clocks[-1])


@dataclass(frozen=True)
class Settings:
    """What the profiler is asked to do (from the backend's options)."""

    mode: str = "auto"  # "auto": reuse the store | "refresh": measure again | "off"
    budget: int = 32  # evaluations per distinct partition
    seed: int = 0
    timeout_s: float = 120.0  # how long a rank waits for the others of its group
    protocol: Protocol = field(default_factory=Protocol)
    strategy: str = "bayesian"  # "bayesian": ``search`` within ``budget`` | "grid": every variant


@dataclass(frozen=True)
class ProfilePoint:
    knobs: Knobs
    time_s: float
    energy_j: float
    effective_energy_j: float


@dataclass(frozen=True)
class PartitionProfile:
    """One distinct partition's search: its frontiers in (time, energy) and (time,
    effective energy), each point with its knobs, and how they were obtained."""

    key: str  # the partition's structural key
    nanobatches: int
    collective: str  # the collective's kind
    partitions: tuple[int, ...]  # the indices of the graph's partitions with this key
    space_size: int
    evaluations: int  # configurations the search looked at
    measured: int  # of which measured now (the rest came from the store)
    stopped: str  # search.SearchResult.stopped, or "failed"
    frontier: tuple[ProfilePoint, ...]
    effective_frontier: tuple[ProfilePoint, ...]
    device: str
    model_version: str | None
    error: str | None = None
    points: tuple[ProfilePoint, ...] = ()  # every evaluation, in the order it was made
    group_size: int = 1  # the ranks whose GPUs time and energy add up (``group_measurement``)
    gpu_s: float = 0.0  # GPU-seconds its measurements took on this rank (``measure.GpuTime``)


Progress = Callable[[str, int, int, list[Point]], None]
"""(partition label, evaluations so far, budget, points so far) after each round."""


@dataclass(frozen=True)
class Tagged:
    """A configuration of one search of a schedule (its index there): what a round
    measures, several searches' configurations at one clock together."""

    search: int
    config: Config


def _decode(fields: dict[str, Any]) -> Hashable:
    """A round's ``Tagged`` configuration, or a result's ``Config``, from its fields."""
    if "search" in fields:
        return Tagged(fields["search"], Config(**fields["config"]))
    return Config(**fields)


def profile_graph(
    analysis: GraphAnalysis,
    counts: Sequence[int],
    device: Device,
    store: ProfileStore,
    settings: Settings,
    *,
    prefix: str,
    progress: Progress | None = None,
    lower: Lower | None = None,
    communicators: Communicators | None = None,
    stop: threading.Event | None = None,
    spend: GpuTime | None = None,
) -> tuple[PartitionProfile, ...]:
    """Search every distinct partition of ``analysis`` at each of ``counts`` nanobatches
    (none when the mode is "off"; counts of 1 or that do not apply are skipped), in the
    order of the counts. The searches whose collectives share a process group run side by
    side (``search.lockstep``): a round measures what each proposes at one clock, together,
    so the GPU's clock changes once a round rather than once a point. ``prefix`` names this
    compile of the graph identically on every rank (the agreement's compile key);
    ``lower`` compiles the variants a device runs (see ``workloads.partition_workload``).
    A device that does not model communication resources measures a capped collective on
    a capped communicator from ``communicators``; without them, it searches only the
    library's default. Once ``stop`` is set (a signal, ``interrupt.DeferredSignals``) no
    measurement starts: the searches in progress are given up, their team told, and
    ``ProfilingInterrupted`` raised. ``spend`` counts the GPU-seconds measuring takes;
    once its cap is reached a leader measures nothing more: the searches in progress are
    given up (``measure.ProfileBudgetSpent``), and their partitions run at their earliest
    slot."""
    (profiles,) = profile_graphs([Searched(analysis, tuple(counts), lower, communicators)],
                                 device, store, settings, prefix=prefix, progress=progress,
                                 stop=stop, spend=spend)
    return profiles


@dataclass(frozen=True)
class Searched:
    """A graph whose partitions are searched: at which counts, and how its variants are
    compiled and capped (``profile_graph``'s ``lower`` and ``communicators``)."""

    analysis: GraphAnalysis
    counts: tuple[int, ...]
    lower: Lower | None = None
    communicators: Communicators | None = None


def profile_graphs(
    graphs: Sequence[Searched],
    device: Device,
    store: ProfileStore,
    settings: Settings,
    *,
    prefix: str,
    progress: Progress | None = None,
    stop: threading.Event | None = None,
    spend: GpuTime | None = None,
) -> list[tuple[PartitionProfile, ...]]:
    """``profile_graph`` of several graphs at once, each graph's profiles in its place: the
    searches of all of them whose collectives share a process group run side by side, so a
    round at one clock measures every graph's proposals there (a step's graphs on a real
    GPU, once all had their first call: ``planner.measured``). ``prefix`` names this set of
    graphs identically on every rank that searches it."""
    if settings.mode == "off":
        return [() for _ in graphs]
    spend = spend or GpuTime()
    # a partition two graphs hold (the same key and count) is searched once: the second
    # graph's search waits for a later wave, and reads the first's from the store
    waves: list[dict[str, list[tuple[int, _Context, int, list]]]] = [{}, {}]
    first: set[tuple[str, int]] = set()
    for g, graph in enumerate(graphs):
        analysis = graph.analysis
        context = _Context(analysis, device, store, settings, graph.lower,
                           graph.communicators, stop, spend)
        for k in graph.counts:
            if k == 1 or k not in analysis.space.nanobatches:
                continue
            groups: dict[str, list[tuple[PartitionChoices, Partition]]] = {}
            for choices, part in zip(
                analysis.space.partitions(k), analysis.partitioning.partitions, strict=True
            ):
                if choices.launch_slots > 1:  # else its collective is not split: no overlap
                    groups.setdefault(choices.key, []).append((choices, part))
            for key, members in groups.items():
                wave = waves[(key, k) in first]
                first.add((key, k))
                wave.setdefault(members[0][0].group_name, []).append((g, context, k, members))

    def searches() -> list[tuple[PartitionProfile, ...]]:
        found: list[list[PartitionProfile]] = [[] for _ in graphs]
        for w, wave in enumerate(waves):
            for index, (group, members) in enumerate(wave.items()):
                schedule = _Schedule(group, f"{prefix}/w{w}g{index}",
                                     [(context, k, parts) for _, context, k, parts in members])
                for (g, *_), profile in zip(members, schedule.run(progress), strict=True):
                    found[g].append(profile)
        return [tuple(profiles) for profiles in found]

    return _outside_the_compile(searches)


def _outside_the_compile(
    searches: Callable[[], list[tuple[PartitionProfile, ...]]],
) -> list[tuple[PartitionProfile, ...]]:
    """Run ``searches`` on a thread of its own, and wait for it.

    The compiling thread carries the compile's thread-local state (dispatch modes, the
    fake-tensor mode where one is active, tracing context). Measuring on it under
    ``unset_fake_temporarily`` blocked every rank of a gloo group in the first warm-up's
    collective (tests/test_profile_e2e.py, 60 s timeout); a fresh thread starts without
    any of that state, so variants run on real tensors whatever the compile had active.
    The searches use the caller's store: one thread uses it at a time, since the caller
    waits, and one store per graph finds a locked file (and says so) once, not per count.
    The thread takes the caller's CUDA device: torch keeps the current device per thread,
    and a new one starts on device 0, where the variants' streams, CUDA events and
    synchronizes would miss the work of a rank that trains on another GPU.
    """
    result: list[list[tuple[PartitionProfile, ...]]] = []
    failure: list[BaseException] = []
    device = torch.cuda.current_device() if torch.cuda.is_initialized() else None

    def run() -> None:
        try:
            if device is not None:
                torch.cuda.set_device(device)
            result.append(searches())
        except BaseException as exc:  # noqa: BLE001 - re-raised on the compiling thread
            failure.append(exc)

    # Not a daemon: a daemon thread still running torch code at interpreter exit aborts the
    # process (pytorch/pytorch#38228); signals only stop it (``interrupt``).
    thread = threading.Thread(target=run, name="kareus-profile")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return result[0]


@dataclass(frozen=True)
class _Context:
    """What every search of one graph's profiling shares (of several graphs': all but the
    graph, its lowering and its communicators)."""

    analysis: GraphAnalysis
    device: Device
    store: ProfileStore
    settings: Settings
    lower: Lower | None
    communicators: Communicators | None
    stop: threading.Event | None
    spend: GpuTime


class _Schedule:
    """The searches (of one graph, or of several: each with its graph's context) whose
    collectives share a process group, run side by side on this rank (leading or following
    their team): one round per clock."""

    def __init__(
        self, group: str, prefix: str,
        members: list[tuple[_Context, int, list[tuple[PartitionChoices, Partition]]]],
    ) -> None:
        self.context = context = members[0][0]  # the device, store and settings: all's
        self.team = Team.of_group(group, f"kareus/profile/{prefix}", context.settings.timeout_s,
                                  context.stop, decode=_decode)
        self.searches = [_Search(c, k, parts, self.team.group_size) for c, k, parts in members]
        self.step = 0
        self._clock: int | None = None

    def run(self, progress: Progress | None) -> list[PartitionProfile]:
        """The profiles, or ones with the error where the schedule failed on any rank (a
        device, the store, a rank that timed out): the graph then compiles without them.
        A search whose variant cannot be built fails alone."""
        try:
            try:
                self.context.device.probe_counter(self.context.store)
                if self.team.leads:
                    self._lead(progress)
            except BaseException as exc:
                self.team.abort(f"rank {self.team.rank} failed: {type(exc).__name__}: {exc}")
                raise
            if not self.team.leads:
                outcomes = self.team.follow(self._measure_here, self._measure_round_here)
                for search, outcome in zip(self.searches, outcomes, strict=True):
                    search.adopt(outcome)
        except (ProfilingAborted, ValueError, RuntimeError, TypeError, OSError) as exc:
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            for search in self.searches:
                if search.error is None and search.result is None:
                    search.fail(reason)
        return [search.profile() for search in self.searches]

    def _lead(self, progress: Progress | None) -> None:
        """Every search of the schedule, this team's share searched here and the rest
        adopted from the data-parallel replicas holding the same searches
        (``replicas.Pool``: one slice claimed at first, the slices still unclaimed once
        the first pass is done); the outcomes then posted to the team."""
        for search in self.searches:
            search.replay()
        pool = Pool.of(digest([s.identity for s in self.searches]), self.team.group_size,
                       self.context.settings.timeout_s, self.context.stop)
        parts = deal([s.weight for s in self.searches], pool.slots)
        mine: list[int] = []

        def more() -> list[_Search]:
            claimed = pool.claim(len(parts), every=bool(mine))
            mine.extend(claimed)
            return [self.searches[i] for j in claimed for i in parts[j]
                    if self.searches[i].result is None]

        try:
            self._search(more, progress)
        except BaseException:
            pool.release(mine)
            raise
        done = {j: pool.post(j, parts[j], self._outcomes(parts[j])) for j in mine}
        for shared in pool.rest(parts, done, lambda part: self._slice(part, progress)):
            if not shared.here:  # another replica searched it
                for i, outcome in zip(shared.indices, read_outcomes(shared.posted, _decode),
                                      strict=True):
                    self.searches[i].adopt(outcome, store=True)
        self.team.finish(self.step, [s.outcome() for s in self.searches])

    def _slice(self, part: Sequence[int], progress: Progress | None) -> str:
        """The searches ``part`` (indices) side by side, here; their outcomes."""
        pending = [[self.searches[i] for i in part if self.searches[i].result is None]]
        self._search(lambda: pending.pop() if pending else [], progress)
        return self._outcomes(part)

    def _outcomes(self, part: Sequence[int]) -> str:
        return outcomes_json([self.searches[i].outcome() for i in part])

    def _search(self, more: Callable[[], list[_Search]], progress: Progress | None) -> None:
        """The searches ``more`` gives (at the start of each pass) side by side, a round
        per clock, each finished as it ends."""
        settings = self.context.settings
        active: list[_Search] = []

        def joining() -> list[_Search]:
            new = more()
            active.extend(new)
            return new

        def measure(clock: int, batch: list[tuple[int, Config]]) -> list[Measurement]:
            return self._round(clock, [Tagged(self.searches.index(active[i]), config)
                                       for i, config in batch])

        def after(index: int) -> None:
            search = active[index]
            if progress is not None:
                grid = settings.strategy == "grid"
                total = (search.space.size if grid
                         else min(settings.budget, search.space.size))
                progress(search.label, len(search.searcher.points), total,
                         list(search.searcher.points))

        results = lockstep([], self.searches[0].space.clocks, measure, after, joining)
        for search, result in zip(active, results, strict=True):
            search.finished(result)

    def _round(self, clock: int, batch: list[Tagged]) -> list[Measurement]:
        """One round at ``clock``: what the store holds read back, the rest measured by
        the team together; every answer committed to the store at once."""
        store, settings = self.context.store, self.context.settings
        found: list[Measurement | None] = []
        for tagged in batch:
            search = self.searches[tagged.search]
            hit = (None if settings.mode == "refresh"
                   else store.lookup(search.key, search.knobs(tagged.config)))
            found.append(hit.measurement if hit is not None else None)
        missing = [i for i, m in enumerate(found) if m is None]
        if missing:
            check(self.context.stop)
            self.context.spend.check()
            measured = self.team.measure_batch(self.step, [batch[i] for i in missing],
                                               self._measure_round_here)
            self.step += 1
            for i, m in zip(missing, measured, strict=True):
                search = self.searches[batch[i].search]
                found[i] = m
                search.fresh += 1
                store.record(search.key, search.knobs(batch[i].config), m,
                             replace=settings.mode == "refresh")
        answers = [m for m in found if m is not None]
        for tagged, m in zip(batch, answers, strict=True):
            self.searches[tagged.search].measured[tagged.config] = m
        return answers

    def _measure_here(self, tagged: Tagged, agree: Callable[[int], int] | None) -> Measurement:
        return self._measure_round_here([tagged], agree)[0]

    def _measure_round_here(
        self, batch: list[Tagged], agree: Callable[[int], int] | None
    ) -> list[Measurement]:
        """``batch`` (one clock) on this rank's GPU, together."""
        (clock,) = {tagged.config.clock_mhz for tagged in batch}
        switched, self._clock = clock != self._clock, clock
        variants = [self.searches[t.search].variant(t.config) for t in batch]

        def spent(seconds: float) -> None:
            for tagged in batch:
                self.searches[tagged.search].spent(seconds / len(batch))

        return measure_batch(
            self.context.device, [workload for workload, _ in variants], clock, agree=agree,
            resources=[resources for _, resources in variants],
            protocol=self.context.settings.protocol, switched=switched,
            stop=self.context.stop, spent=spent,
        )


class _Search:
    """One distinct partition's search at one nanobatch count, in a schedule."""

    def __init__(
        self, context: _Context, k: int, members: list[tuple[PartitionChoices, Partition]],
        group_size: int,
    ) -> None:
        analysis, settings, device = context.analysis, context.settings, context.device
        self.context, self.k, self.group_size = context, k, group_size
        self.choices, self.partition = members[0]
        self.gpu_s, self.fresh = 0.0, 0
        self.graph = analysis.label
        self.indices = tuple(c.index for c, _ in members)
        self.placements, self.table = analysis.placements[k], analysis.table
        self.label = f"{analysis.label} p{self.choices.index} ({self.choices.key[:8]})"
        # A real GPU runs a capped collective on a capped communicator, made by the team's
        # ranks together when they first measure the cap (in the leader's order).
        realisable = device.models_resources or context.communicators is not None
        resources = self.choices.resources if realisable else (None,)
        self.grid = settings.strategy == "grid"
        clocks = device.search_clocks()
        self.space = Space(tuple(range(self.choices.launch_slots)), resources,
                           clocks if self.grid else partition_clocks(clocks))
        self.key = ProfileKey(self.choices.key, device.identity, device.model_version,
                              self.space.clocks, group_size)
        self.search_id = json.dumps({
            "nanobatches": k, "slots": self.space.slots, "resources": self.space.resources,
            **({"strategy": "grid"} if self.grid else
               {"budget": settings.budget, "seed": settings.seed}),
        })
        self.searcher: Searcher = (
            GridSearch(self.space) if self.grid else
            ClockSearch(self.space, budget=settings.budget, seed=settings.seed)
        )
        self._workloads: dict[tuple[int, int | None], tuple[Workload, str]] = {}
        self.measured: dict[Config, Measurement] = {}
        self.result: SearchResult | None = None
        self.error: str | None = None

    def replay(self) -> None:
        """Take the finished search the store holds (mode "auto"; its evaluations read
        back, no surrogate refitted), where it holds one with every evaluation."""
        if self.context.settings.mode != "auto":
            return
        store = self.context.store
        record = store.search(self.key, self.search_id)
        if record is None:
            return
        measured, points = {}, []
        for knobs in record.knobs:
            hit = store.lookup(self.key, knobs)
            if hit is None:
                return
            sms = knobs.resources[0][1] if knobs.resources else None
            config = Config(knobs.slot, sms, knobs.clock_mhz)
            measured[config] = hit.measurement
            points.append(Point.of(config, hit.measurement))
        self.measured = measured
        self.result = SearchResult(points, record.stopped, list(record.hypervolumes))

    # -- the searcher, as the leader's schedule asks it (``search.Searcher``) ------------

    @property
    def done(self) -> bool:
        return self.error is not None or self.searcher.done

    def propose(self, clock: int) -> list[Config]:
        """The searcher's proposal, where each of its variants builds on this rank (the
        leader's, before it posts a round); one that does not gives this search up alone,
        with why."""
        configs = self.searcher.propose(clock)
        try:
            for config in configs:
                self._workload(config.slot)
        except (ValueError, RuntimeError, TypeError) as exc:
            self.fail(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            return []
        return configs

    def tell(self, points: Sequence[Point]) -> None:
        self.searcher.tell(points)

    def finish(self) -> SearchResult:
        return self.searcher.finish()

    def finished(self, result: SearchResult) -> None:
        """The search's end on the leader: its record stored."""
        if self.error is not None:
            return
        self.result = result
        self.context.store.record_search(self.key, self.search_id, SearchRecord(
            tuple(self.knobs(p.config) for p in result.points), result.stopped,
            tuple(result.hypervolumes),
        ))

    def outcome(self) -> tuple[SearchResult, dict[Config, Measurement]] | str:
        """What the leader posts of this search: its result, or why it failed."""
        if self.error is not None:
            return self.error
        assert self.result is not None
        return self.result, self.measured

    def adopt(self, outcome: tuple[SearchResult, dict[Any, Measurement]] | str,
              store: bool = False) -> None:
        """What a follower takes from the leader's post, or a leader from a replica's
        (``store``: kept in the profile store too, so the next run measures nothing)."""
        self.error = None  # a slice failed here may stand as another replica searched it
        if isinstance(outcome, str):
            self.fail(outcome)
            return
        self.result, self.measured = outcome
        if store:
            for config, m in self.measured.items():
                self.context.store.record(self.key, self.knobs(config), m)
            self.finished(self.result)

    @property
    def identity(self) -> str:
        """What the search is, the same on every replica holding it (``replicas.digest``)."""
        return f"{self.key.digest()} {self.search_id} {self.context.settings.mode}"

    @property
    def weight(self) -> int:
        """The most evaluations it takes, to balance replicas' slices."""
        return self.space.size if self.grid else min(self.context.settings.budget,
                                                     self.space.size)

    def fail(self, reason: str) -> None:
        self.error = reason
        self.context.spend.warn(self.label, f"not profiled: {reason}")

    def spent(self, seconds: float) -> None:
        self.gpu_s += seconds
        self.context.spend.charge(self.graph, seconds)

    def variant(self, config: Config) -> tuple[Workload, Resources | None]:
        """The workload measuring ``config`` runs and the SM caps a modelling device
        applies to it (a real GPU's cap is its collective's communicator)."""
        modelled = self.context.device.models_resources and config.sms is not None
        workload, collective = self._workload(config.slot, None if modelled else config.sms)
        return workload, {collective: config.sms} if modelled else None

    def _workload(self, slot: int, cap: int | None = None) -> tuple[Workload, str]:
        """The variant at ``slot``, its collective on a communicator capped to ``cap`` CTAs
        (None: the graph's own), and that collective's name."""
        if (slot, cap) not in self._workloads:
            group = None
            if cap is not None:
                communicators = self.context.communicators
                assert communicators is not None  # no cap is searched without them
                group = communicators.capped(self.choices.group_name, cap)
            workload = partition_workload(
                self.partition, self.placements, self.k, slot, group_name=group,
                world_size=self.group_size, lower=self.context.lower, table=self.table,
            )
            (collective,) = (c.name for c in find_collectives(workload.gm.graph))
            self._workloads[slot, cap] = workload, collective
        return self._workloads[slot, cap]

    def knobs(self, config: Config) -> Knobs:
        resources = {} if config.sms is None else {self._workload(config.slot)[1]: config.sms}
        return Knobs(config.slot, resources, config.clock_mhz, self.k)

    def profile(self) -> PartitionProfile:
        def records(points: list[Point]) -> tuple[ProfilePoint, ...]:
            return tuple(
                ProfilePoint(self.knobs(p.config), p.time_s, p.energy_j, p.effective_energy_j)
                for p in points
            )

        result = self.result if self.error is None else None
        points = result.points if result is not None else []
        return PartitionProfile(
            key=self.choices.key,
            nanobatches=self.k,
            collective=self.partition.collective.kind,
            partitions=self.indices,
            space_size=self.space.size,
            evaluations=len(points),
            measured=self.fresh,
            stopped=result.stopped if result is not None else "failed",
            frontier=records(pareto(points)),
            effective_frontier=records(pareto(points, lambda p: p.effective_energy_j)),
            device=self.context.device.identity,
            model_version=self.context.device.model_version,
            error=self.error,
            points=records(points),
            group_size=self.group_size,
            gpu_s=self.gpu_s,
        )
