"""Partition profiling: each distinct partition of a graph searched once, through the store.

For a graph split into ``k`` nanobatches, every partition whose collective can launch at
more than one slot is a search over (launch slot x the SMs its collective gets x SM clock)
(REFERENCE.md section 1). Partitions with the same structural key (the identical layers of
a model) are searched once. Each evaluation runs ``workloads.partition_workload`` on this
rank's device under the measurement protocol, on every rank of the partition's group at
once (``exchange.Team``: the lowest rank leads, the others follow, nobody meets in a
collective outside the measured variant itself), and is committed to the profile store
the moment it is complete. An evaluation already in the store is read back instead of
measured (``mode="refresh"`` measures again and replaces it), so a second compile of the
same model on the same device measures nothing, and a search cut short by a crash resumes
where it stopped.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from kareus.devices.base import Device, Measurement, Workload
from kareus.passes.analyse import GraphAnalysis
from kareus.passes.collectives import find_collectives
from kareus.passes.partition import Partition
from kareus.passes.variants import PartitionChoices
from kareus.profiler.exchange import ProfilingAborted, Team
from kareus.profiler.interrupt import check
from kareus.profiler.measure import GpuTime, Protocol, measure_variant
from kareus.profiler.search import (
    Config,
    Point,
    SearchResult,
    Space,
    exhaustive,
    pareto,
    search,
)
from kareus.profiler.store import Knobs, ProfileKey, ProfileStore, SearchRecord
from kareus.profiler.workloads import Lower, partition_workload
from kareus.runtime.communicators import Communicators

MODES = ("auto", "off", "refresh")


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
"""(partition label, evaluations so far, budget, points so far) after each evaluation."""


def profile_graph(
    analysis: GraphAnalysis,
    k: int,
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
    """Search every distinct partition of ``analysis`` at ``k`` nanobatches (none when the
    mode is "off" or ``k`` does not apply). ``prefix`` names this compile of the graph
    identically on every rank (the agreement's compile key); ``lower`` compiles the
    variants a device runs (see ``workloads.partition_workload``). A device that does not
    model communication resources measures a capped collective on a capped communicator
    from ``communicators``; without them, it searches only the library's default. Once
    ``stop`` is set (a signal, ``interrupt.DeferredSignals``) no measurement starts: the
    search in progress is given up, its team told, and ``ProfilingInterrupted`` raised.
    ``spend`` counts the GPU-seconds measuring takes; once its cap is reached a leader
    measures nothing more: the search is given up (``measure.ProfileBudgetSpent``), and its
    partition runs at its earliest slot."""
    if settings.mode == "off" or k == 1 or k not in analysis.space.nanobatches:
        return ()
    groups: dict[str, list[tuple[PartitionChoices, Partition]]] = {}
    for choices, part in zip(
        analysis.space.partitions(k), analysis.partitioning.partitions, strict=True
    ):
        if choices.launch_slots > 1:  # else its collective is not split: nothing overlaps
            groups.setdefault(choices.key, []).append((choices, part))
    def searches() -> tuple[PartitionProfile, ...]:
        return tuple(
            _Search(analysis, k, members, device, store, settings, prefix, lower,
                    communicators, stop, spend or GpuTime()).run(progress)
            for members in groups.values()
        )

    return _outside_the_compile(searches)


def _outside_the_compile(
    searches: Callable[[], tuple[PartitionProfile, ...]],
) -> tuple[PartitionProfile, ...]:
    """Run ``searches`` on a thread of its own, and wait for it.

    The compiling thread carries the compile's thread-local state (dispatch modes, the
    fake-tensor mode where one is active, tracing context). Measuring on it under
    ``unset_fake_temporarily`` blocked every rank of a gloo group in the first warm-up's
    collective (tests/test_profile_e2e.py, 60 s timeout); a fresh thread starts without
    any of that state, so variants run on real tensors whatever the compile had active.
    The searches use the caller's store: one thread uses it at a time, since the caller
    waits, and one store per graph finds a locked file (and says so) once, not per count.
    """
    result: list[tuple[PartitionProfile, ...]] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
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


class _Search:
    """One distinct partition's search on this rank (leading or following its team)."""

    def __init__(
        self,
        analysis: GraphAnalysis,
        k: int,
        members: list[tuple[PartitionChoices, Partition]],
        device: Device,
        store: ProfileStore,
        settings: Settings,
        prefix: str,
        lower: Lower | None,
        communicators: Communicators | None,
        stop: threading.Event | None,
        spend: GpuTime,
    ) -> None:
        self.choices, self.partition = members[0]
        self.stop, self.spend, self.gpu_s = stop, spend, 0.0
        self.graph = analysis.label
        self.indices = tuple(c.index for c, _ in members)
        self.placements, self.table = analysis.placements[k], analysis.table
        self.k, self.device, self.store, self.settings = k, device, store, settings
        self.lower, self.communicators = lower, communicators
        self.label = f"{analysis.label} p{self.choices.index} ({self.choices.key[:8]})"
        # A real GPU runs a capped collective on a capped communicator, made by the team's
        # ranks together when they first measure the cap (in the leader's order).
        realisable = device.models_resources or communicators is not None
        resources = self.choices.resources if realisable else (None,)
        self.space = Space(
            tuple(range(self.choices.launch_slots)), resources, device.search_clocks()
        )
        self.team = Team.of_group(
            self.choices.group_name, f"kareus/profile/{prefix}/{self.choices.key}/k{k}",
            settings.timeout_s, stop,
        )
        self.key = ProfileKey(
            self.choices.key, device.identity, device.model_version, self.space.clocks,
            self.team.group_size,
        )
        self._workloads: dict[tuple[int, int | None], tuple[Workload, str]] = {}
        self.measured: dict[Config, Measurement] = {}
        self.fresh = 0

    def run(self, progress: Progress | None) -> PartitionProfile:
        """The profile, or one with the error where the search failed on any rank (a
        device, a workload that cannot be built, the store, a rank that timed out): the
        graph then compiles without it."""
        try:
            try:
                self.device.probe_counter(self.store)
                if self.team.leads:
                    result = self._lead(progress)
            except BaseException as exc:
                self.team.abort(f"rank {self.team.rank} failed: {type(exc).__name__}: {exc}")
                raise
            if not self.team.leads:
                result, self.measured = self.team.follow(self._measure_here)
        except (ProfilingAborted, ValueError, RuntimeError, TypeError, OSError) as exc:
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            self.spend.warn(self.label, f"not profiled: {reason}")
            return self._profile(None, error=reason)
        return self._profile(result)

    def _lead(self, progress: Progress | None) -> SearchResult:
        grid = self.settings.strategy == "grid"
        search_id = json.dumps({
            "nanobatches": self.k, "slots": self.space.slots, "resources": self.space.resources,
            **({"strategy": "grid"} if grid else
               {"budget": self.settings.budget, "seed": self.settings.seed}),
        })
        if self.settings.mode == "auto" and (replayed := self._replay(search_id)) is not None:
            self.team.finish(0, replayed, self.measured)
            return replayed
        points: list[Point] = []

        def evaluate(config: Config) -> Measurement:
            check(self.stop)
            knobs = self._knobs(config)
            hit = None if self.settings.mode == "refresh" else self.store.lookup(self.key, knobs)
            if hit is not None:
                m = hit.measurement
            else:
                self.spend.check()
                m = self.team.measure(self.fresh, config, self._measure_here)
                self.fresh += 1
                self.store.record(self.key, knobs, m, replace=self.settings.mode == "refresh")
            self.measured[config] = m
            points.append(Point.of(config, m))
            if progress is not None:
                total = self.space.size if grid else min(self.settings.budget, self.space.size)
                progress(self.label, len(points), total, points)
            return m

        if grid:
            result = SearchResult(exhaustive(self.space, evaluate), "exhausted")
        else:
            result = search(self.space, evaluate, budget=self.settings.budget,
                            seed=self.settings.seed)
        self.store.record_search(self.key, search_id, SearchRecord(
            tuple(self._knobs(p.config) for p in result.points), result.stopped,
            tuple(result.hypervolumes),
        ))
        self.team.finish(self.fresh, result, self.measured)
        return result

    def _replay(self, search_id: str) -> SearchResult | None:
        """The finished search the store holds under ``search_id``, from its evaluations
        (no surrogate refitted); None where there is none or an evaluation is missing."""
        record = self.store.search(self.key, search_id)
        if record is None:
            return None
        points = []
        for knobs in record.knobs:
            hit = self.store.lookup(self.key, knobs)
            if hit is None:
                return None
            sms = knobs.resources[0][1] if knobs.resources else None
            config = Config(knobs.slot, sms, knobs.clock_mhz)
            self.measured[config] = hit.measurement
            points.append(Point.of(config, hit.measurement))
        return SearchResult(points, record.stopped, list(record.hypervolumes))

    def _measure_here(self, config: Config, agree: Callable[[int], int] | None) -> Measurement:
        modelled = self.device.models_resources and config.sms is not None
        workload, collective = self._workload(config.slot, None if modelled else config.sms)
        return measure_variant(
            self.device, replace(workload, agree=agree), config.clock_mhz,
            resources={collective: config.sms} if modelled else None,
            protocol=self.settings.protocol, stop=self.stop, spent=self._spent,
        )

    def _spent(self, seconds: float) -> None:
        self.gpu_s += seconds
        self.spend.charge(self.graph, seconds)

    def _workload(self, slot: int, cap: int | None = None) -> tuple[Workload, str]:
        """The variant at ``slot``, its collective on a communicator capped to ``cap`` CTAs
        (None: the graph's own), and that collective's name."""
        if (slot, cap) not in self._workloads:
            group = None
            if cap is not None:
                assert self.communicators is not None  # no cap is searched without them
                group = self.communicators.capped(self.choices.group_name, cap)
            workload = partition_workload(
                self.partition, self.placements, self.k, slot, group_name=group,
                world_size=self.team.group_size, lower=self.lower, table=self.table,
            )
            (collective,) = (c.name for c in find_collectives(workload.gm.graph))
            self._workloads[slot, cap] = workload, collective
        return self._workloads[slot, cap]

    def _knobs(self, config: Config) -> Knobs:
        resources = {} if config.sms is None else {self._workload(config.slot)[1]: config.sms}
        return Knobs(config.slot, resources, config.clock_mhz, self.k)

    def _profile(self, result: SearchResult | None, error: str | None = None) -> PartitionProfile:
        def records(points: list[Point]) -> tuple[ProfilePoint, ...]:
            return tuple(
                ProfilePoint(self._knobs(p.config), p.time_s, p.energy_j, p.effective_energy_j)
                for p in points
            )

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
            device=self.device.identity,
            model_version=self.device.model_version,
            error=error,
            points=records(points),
            group_size=self.team.group_size,
            gpu_s=self.gpu_s,
        )
