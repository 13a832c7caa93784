"""Graphs planned at their first call, where the device must run a graph to cost it (a
real GPU).

Such a graph has no frontier when it compiles, so it starts with the choice its options
give, and its partitions are not searched yet. Its first call has its real inputs: they
are copied, and once every graph of the step had its first call (every forward has its
backward: ``step.complete``) the step's graphs are measured together: their partitions
searched side by side (``profiler.graph.search_partitions``: a round at one clock holds
every graph's proposals there), then their whole graphs on those copies
(``profiler.graph_cost``: each round sets each clock once for all of them, one batch
holding every graph's variants at it). Each graph's frontier is made from its
measurements and handed to the step planner like any other graph's, and the planner
plans the step. Every graph runs the plan's choice from its next call on
(``runtime.selectable``). Random inputs would mis-cost a data-dependent graph (MoE
routing, index ops); the first call's do not. The copies cost the memory of the step's
graphs' inputs once (a layer's activations and weights per graph, not the model's),
until the step is measured. Graphs first called later (an extra compile) are measured
likewise, once every forward among them has its backward.

Graphs are measured together where they share their collectives' groups (one team runs
each batch; graphs without collectives are a team of their own, which the node's ranks
split as data-parallel replicas do: ``replicas.Pool``), and every rank of the team must
have the same graphs: the ranks agree on the set through the store
(``runtime.agreement``) first; where they do not (one rank compiled another graph), each
graph is measured alone, as its own team.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.fx

from kareus.devices.base import Device, Workload
from kareus.passes.analyse import GraphAnalysis
from kareus.passes.decide import Choice, Decision
from kareus.passes.ops import DEFAULT_CLOCK_MHZ
from kareus.planner.step import StepPlanner, complete
from kareus.profiler.exchange import ProfilingAborted
from kareus.profiler.graph import search_partitions
from kareus.profiler.graph_cost import FAILURES, GraphMeasurer, MeasuredGraph, Subject
from kareus.profiler.interrupt import DeferredSignals
from kareus.profiler.measure import GpuTime
from kareus.profiler.profile import PartitionProfile, Searched, Settings
from kareus.profiler.progress import ProfilingProgress, make_console
from kareus.profiler.replicas import digest
from kareus.profiler.store import ProfileStore
from kareus.runtime.agreement import agree

log = logging.getLogger("kareus")

Run = Callable[[list[Any]], Any]


class Builder(Protocol):
    """Materialises and compiles a graph's choices (``runtime.materialise.GraphBuilder``)."""

    def graph(self, choice: Choice, clocked: bool = True
              ) -> tuple[Decision, torch.fx.GraphModule]: ...

    def lowered(self, graph: torch.fx.GraphModule, args: Sequence[Any]) -> Run: ...


class Reports(Protocol):
    def update(self, label: str, notes_added: tuple[str, ...] = (), **changes: Any) -> None: ...


@dataclass
class FirstCallPlanning:
    """What a graph's first call does before it runs: hand its inputs to the step's first
    calls (``calls``), which measure the step's graphs' variants together and plan them
    once the step is known. Where measuring fails (on any rank of its team: they fail
    together) the graph is not planned and says why."""

    analysis: GraphAnalysis
    profiles: tuple[PartitionProfile, ...]
    planner: StepPlanner
    builder: Builder
    device: Device
    cache_dir: Path
    settings: Settings
    spend: GpuTime
    reports: Reports
    region: int
    compile_key: str
    world_size: int
    calls: FirstCalls
    searched: Searched
    """Its partitions, to be searched once the step is known (``searched.counts``; none
    where they were searched as it compiled, or are not)."""

    def __call__(self, args: Sequence[Any]) -> None:
        self.calls.arrived(self, args)

    @property
    def groups(self) -> tuple[str, ...]:
        """Its collectives' process groups: the graphs of one team share them."""
        return tuple(sorted({c.group_name for c in self.analysis.collectives}))

    def subject(self, copies: list[Any]) -> Subject:
        """The graph to measure, its variants run on ``copies`` of its first call's inputs
        (each compiled once, when it first runs: none where every one is stored)."""
        compiled: dict[tuple[int, tuple], Workload] = {}
        label = self.analysis.label

        def workload(choice: Choice) -> Workload:
            key = (choice.nanobatches, choice.partitions)
            if key not in compiled:
                _, graph = self.builder.graph(choice.at(DEFAULT_CLOCK_MHZ), clocked=False)
                run = self.builder.lowered(graph, copies)
                name = f"{label} k={choice.nanobatches} {list(choice.partitions)}"
                compiled[key] = Workload(name, gm=graph, run=lambda: run(list(copies)),
                                         world_size=self.world_size)
            return compiled[key]

        return Subject(self.analysis, workload, self.compile_key,
                       lambda cost: self.planner.explore(self.analysis, self.profiles, cost))

    def failed(self, exc: BaseException) -> None:
        """Measuring failed: the graph is not planned, and its report says why."""
        why = f"not planned: measuring the whole graph failed: {type(exc).__name__}: {exc}"
        self.spend.warn(self.analysis.label, why)
        self.reports.update(self.analysis.label, notes_added=(why,),
                            profile_gpu_s=self.spend.by_graph.get(self.analysis.label, 0.0))

    def plan(self, measured: MeasuredGraph, together: int) -> Choice | None:
        """Plan the graph from its measurements (the step too, where it completes it): its
        choice (None: not planned)."""
        label = self.analysis.label
        replicas = (f", {measured.shared} taken by another data-parallel replica"
                    if measured.shared else "")
        n = together - 1
        others = f" with {n} other graph{'s' * (n > 1)} of the step" if n else ""
        summary = (f"whole graph measured on its first call's inputs{others}: "
                   f"{measured.measured} measurements taken ({measured.gpu_s:.1f} GPU-s)"
                   f"{replicas}, {measured.reused} read from the store; "
                   f"{self.spend.describe(label)}")
        if _shows():
            make_console().print(f"kareus {label}: {summary}")
        choice, note = self.planner.choose(self.analysis, self.profiles, measured.cost,
                                           region=self.region, compile_key=self.compile_key)
        self.reports.update(label, notes_added=tuple(n for n in (summary, note) if n),
                            profile_gpu_s=self.spend.by_graph.get(label, 0.0))
        log.info("%s: measured on its first call's inputs; %s", label, note)
        return choice


class FirstCalls:
    """The step's graphs at their first calls, measured together once the step is known
    (the module docstring)."""

    def __init__(self, key: Callable[[str], str]) -> None:
        """``key``: the agreement key of the n-th use of a name in this process, alike on
        every rank (``agreement.CompileCounter.key``)."""
        self.key = key
        self.pending: list[tuple[FirstCallPlanning, list[Any]]] = []
        self.seen: list[tuple[str, int]] = []  # every graph's (kind, region) that came

    def arrived(self, first: FirstCallPlanning, args: Sequence[Any]) -> None:
        """``first``'s graph is called for the first time on ``args``: copied, and the
        step's graphs measured and planned where it completes the step (or, once it was
        complete, at once)."""
        self.pending.append((first, [_copy(a) for a in args]))
        self.seen.append((first.analysis.kind, first.region))
        if not complete(self.seen):
            return
        pending, self.pending = self.pending, []
        teams: dict[tuple[str, ...], list[tuple[FirstCallPlanning, list[Any]]]] = {}
        for f, copies in pending:  # teams in the order of their first graph: alike on ranks
            teams.setdefault(f.groups, []).append((f, copies))
        for groups, team in teams.items():
            if len(team) == 1:
                _measure(team)
                continue
            firsts = [f for f, _ in team]
            keys = sorted(f.compile_key for f in firsts)
            verdict = agree(self.key(f"graphs/{','.join(groups)}"), keys, groups,
                            timeout_s=firsts[0].settings.timeout_s)
            if verdict:
                _measure(team)
            elif verdict.timed_out:  # alone, each would wait for it again
                for f in firsts:
                    f.failed(ProfilingAborted(f"the step's graphs: {verdict.reason}"))
            else:
                log.warning("%s: measured one at a time: the ranks have different graphs to "
                            "measure (%s)", ", ".join(f.analysis.label for f in firsts),
                            verdict.reason)
                for one in team:
                    _measure([one])


def _measure(team: Sequence[tuple[FirstCallPlanning, list[Any]]]) -> None:
    """The team's graphs measured together (ordered by compile key, alike on every rank),
    then each planned and its chosen point checked."""
    team = sorted(team, key=lambda t: t[0].compile_key)
    firsts = [f for f, _ in team]
    first = firsts[0]
    prefix = digest([f.compile_key for f in firsts])
    searching = [f for f in firsts if f.searched.counts]
    if searching:  # side by side: a round at one clock measures every graph's proposals
        found = search_partitions([f.searched for f in searching], first.device,
                                  first.cache_dir, first.settings, prefix=prefix,
                                  spend=first.spend)
        for f, profiles in zip(searching, found, strict=True):
            f.profiles = profiles
            f.reports.update(f.analysis.label, profiles=profiles,
                             profile_gpu_s=f.spend.by_graph.get(f.analysis.label, 0.0))
    with DeferredSignals() as signals:
        try:
            with ProfileStore(cache_dir=first.cache_dir) as store, \
                    ProfilingProgress(_shows()) as progress:
                measurer = GraphMeasurer(
                    [f.subject(copies) for f, copies in team], first.device, store,
                    first.settings, first.spend, prefix=prefix, progress=progress,
                    stop=signals.stop,
                )
                measured = measurer.run()
        except FAILURES as exc:
            for f in firsts:
                f.failed(exc)
            return
        finally:
            if first.device.controls_clocks:
                first.device.clock_controller().reset()
    chosen = [f.plan(m, len(team)) for f, m in zip(firsts, measured, strict=True)]
    # checked once every graph chose: the step's plan, where they completed it
    for index, (f, m, choice) in enumerate(zip(firsts, measured, chosen, strict=True)):
        planned = f.planner.planned(f.analysis.label) or choice
        checked = (None if planned is None or not measurer.ran(index)  # where measured
                   else _checked(measurer, index, planned, m, f.device))
        if checked is not None:
            if _shows():
                make_console().print(f"kareus {f.analysis.label}: {checked}")
            f.reports.update(f.analysis.label, notes_added=(checked,),
                             profile_gpu_s=f.spend.by_graph.get(f.analysis.label, 0.0))


def _shows() -> bool:
    """Whether this rank prints (rank 0, or one process)."""
    return not dist.is_initialized() or dist.get_rank() == 0


def _checked(measurer: GraphMeasurer, index: int, choice: Choice, measured: MeasuredGraph,
             device: Device) -> str | None:
    """``measurer.check`` of graph ``index``, under deferred signals, clocks reset after; a
    check that fails leaves the plan as it is and says why."""
    with DeferredSignals() as signals:
        measurer.stop = signals.stop
        try:
            return measurer.check(index, choice, measured)
        except FAILURES as exc:
            why = f"the chosen point's check failed: {type(exc).__name__}: {exc}"
            log.warning("%s: %s", measurer.graphs[index].subject.analysis.label, why)
            return why
        finally:
            if device.controls_clocks:
                device.clock_controller().reset()


def _copy(value: Any) -> Any:
    """A tensor's copy with its layout (compiled graphs assert strides); others as they are."""
    if not isinstance(value, torch.Tensor):
        return value
    with torch.no_grad():
        copy = torch.empty_strided(value.size(), value.stride(), dtype=value.dtype,
                                   device=value.device)
        return copy.copy_(value)
