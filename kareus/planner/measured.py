"""A graph planned at its first call, where the device must run it to cost it (a real GPU).

Such a graph has no frontier when it compiles, so it starts with the choice its options
give. Its first call has its real inputs: its variants are measured then, on a copy of
them (``profiler.graph_cost``), its frontier is made from the measurements and handed to
the step planner like any other graph's, and the planner plans the step once its last
graph is measured. Every graph runs the plan's choice from its next call on
(``runtime.selectable``). Random inputs would mis-cost a data-dependent graph (MoE
routing, index ops); the first call's do not. The copy costs the memory of the graph's
inputs once, while it is measured.
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
from kareus.planner.step import StepPlanner
from kareus.profiler.graph_cost import FAILURES, GraphMeasurer, MeasuredGraph
from kareus.profiler.interrupt import DeferredSignals
from kareus.profiler.measure import GpuTime
from kareus.profiler.profile import PartitionProfile, Settings
from kareus.profiler.progress import ProfilingProgress, make_console
from kareus.profiler.store import ProfileStore

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
    """What a graph's first call does before it runs: measure the graph's variants on its
    inputs, and plan it (and the step, where it is the last). Where measuring fails (on any
    rank of its team: they fail together) the graph is not planned and says why."""

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

    def __call__(self, args: Sequence[Any]) -> None:
        label = self.analysis.label
        shows = not dist.is_initialized() or dist.get_rank() == 0
        copies: list[Any] = []  # made when a variant first runs: none where all is stored
        compiled: dict[tuple[int, tuple], Workload] = {}

        def workload(choice: Choice) -> Workload:
            key = (choice.nanobatches, choice.partitions)
            if not copies:
                copies.extend(_copy(a) for a in args)
            if key not in compiled:
                _, graph = self.builder.graph(choice.at(DEFAULT_CLOCK_MHZ), clocked=False)
                run = self.builder.lowered(graph, copies)
                name = f"{label} k={choice.nanobatches} {list(choice.partitions)}"
                compiled[key] = Workload(name, gm=graph, run=lambda: run(list(copies)),
                                         world_size=self.world_size)
            return compiled[key]

        with DeferredSignals() as signals:
            try:
                with ProfileStore(cache_dir=self.cache_dir) as store, \
                        ProfilingProgress(shows) as progress:
                    measurer = GraphMeasurer(
                        self.analysis, workload, self.device, store, self.settings, self.spend,
                        prefix=self.compile_key, progress=progress, stop=signals.stop,
                    )
                    measured = measurer.run(
                        lambda cost: self.planner.explore(self.analysis, self.profiles, cost))
            except FAILURES as exc:
                why = f"not planned: measuring the whole graph failed: {type(exc).__name__}: {exc}"
                self.spend.warn(label, why)
                self.reports.update(label, notes_added=(why,),
                                    profile_gpu_s=self.spend.by_graph.get(label, 0.0))
                return
            finally:
                if self.device.controls_clocks:
                    self.device.clock_controller().reset()
        replicas = (f", {measured.shared} taken by another data-parallel replica"
                    if measured.shared else "")
        summary = (f"whole graph measured at its first call: {measured.measured} "
                   f"measurements taken ({measured.gpu_s:.1f} GPU-s){replicas}, "
                   f"{measured.reused} read from the store; {self.spend.describe(label)}")
        if shows:
            make_console().print(f"kareus {label}: {summary}")
        choice, note = self.planner.choose(self.analysis, self.profiles, measured.cost,
                                           region=self.region, compile_key=self.compile_key)
        checked = (None if choice is None or not measurer.ran  # once: where it was measured
                   else _checked(measurer, choice, measured, self.device))
        if checked is not None and shows:
            make_console().print(f"kareus {label}: {checked}")
        self.reports.update(label, notes_added=tuple(n for n in (summary, note, checked) if n),
                            profile_gpu_s=self.spend.by_graph.get(label, 0.0))
        log.info("%s: measured at its first call; %s", label, note)


def _checked(measurer: GraphMeasurer, choice: Choice, measured: MeasuredGraph,
             device: Device) -> str | None:
    """``measurer.check``, under deferred signals, clocks reset after; a check that fails
    leaves the plan as it is and says why."""
    with DeferredSignals() as signals:
        measurer.stop = signals.stop
        try:
            return measurer.check(choice, measured)
        except FAILURES as exc:
            why = f"the chosen point's check failed: {type(exc).__name__}: {exc}"
            log.warning("%s: %s", measurer.analysis.label, why)
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
