"""Profiling one graph as it compiles: the one call the backend makes.

The ranks of the graph's collectives first agree that they all profile and plan it alike,
then every distinct partition is searched at each nanobatch count the plan may choose,
side by side a clock at a time (``profile.profile_graph``), through the profile store,
with progress and a summary on rank 0. A graph planned at its first call (a device that
must run it to cost it) is searched then instead, with the step's other graphs, side by
side (:func:`search_partitions`).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from kareus.devices.base import Device
from kareus.passes.analyse import GraphAnalysis
from kareus.profiler.interrupt import DeferredSignals
from kareus.profiler.measure import GpuTime
from kareus.profiler.profile import PartitionProfile, Searched, Settings, profile_graphs
from kareus.profiler.progress import ProfilingProgress, make_console, summary_table
from kareus.profiler.store import ProfileStore
from kareus.profiler.workloads import Lower
from kareus.runtime.agreement import agree
from kareus.runtime.communicators import Communicators


@dataclass(frozen=True)
class GraphProfiles:
    """What profiling one graph gave: its distinct partitions' profiles at every count
    searched, whether it is planned (every rank of its collectives plans it alike), and
    why not where the ranks do not all profile and plan it alike."""

    profiles: tuple[PartitionProfile, ...] = ()
    planned: bool = False
    note: str | None = None
    later: tuple[int, ...] = ()
    """The counts its partitions are to be searched at, at its first call (``search``
    False), with the step's other graphs (:func:`search_partitions`)."""


def profile(
    analysis: GraphAnalysis,
    counts: Sequence[int],
    device: Device,
    cache_dir: Path | None,
    settings: Settings,
    *,
    plans: Hashable | None,
    compile_key: str,
    lower: Lower | None = None,
    communicators: Communicators | None = None,
    spend: GpuTime | None = None,
    search: bool = True,
) -> GraphProfiles:
    """The frontiers of ``analysis``'s distinct partitions at each of ``counts`` (those of
    them above 1 that apply; none with ``settings.mode == "off"``), from the profile store
    in ``cache_dir`` or measured now, and whether the graph is planned.

    ``plans``: what this rank plans the graph under (its budget), None where it does not.
    Every rank of the graph's collectives first confirms (through the store, as decisions
    are) that all of them will search the same graph with the same settings, so that a
    leader never waits out the timeout for a rank that will not follow, and that all plan
    it alike, so that no rank waits for another's plan. Rank 0 shows progress and a
    summary; the device's clocks are back at default afterwards, also after SIGINT or
    SIGTERM: the measuring stops, the clocks are reset, and only then does the signal act
    (``interrupt.DeferredSignals``). ``spend`` counts (and may cap) the GPU-seconds taken.
    ``search`` False: the ranks agree now, and the searches are left for the graph's first
    call (``GraphProfiles.later``).
    """
    spend = spend if spend is not None else GpuTime()
    searched = tuple(k for k in counts if k > 1 and k in analysis.space.nanobatches)
    wants = settings.mode != "off" and bool(searched)
    planned = plans is not None
    if not analysis.collectives:
        return GraphProfiles((), planned)
    intent = {"graph": analysis.key, "counts searched": searched if wants else (),
              "settings": settings, "budget": plans}
    verdict = agree(
        f"{compile_key}/profile", intent if wants or planned else None,
        (c.group_name for c in analysis.collectives), timeout_s=settings.timeout_s,
        falls_back=not (wants or planned),
    )
    if not (wants or planned):
        return GraphProfiles()
    if not verdict:
        return GraphProfiles(note=(
            "not profiled or planned: the ranks do not all profile and plan this graph "
            f"alike ({verdict.reason})"
        ))
    if not wants:
        return GraphProfiles((), planned)
    if not search:
        return GraphProfiles((), planned, later=searched)
    (profiles,) = search_partitions([Searched(analysis, searched, lower, communicators)],
                                    device, cache_dir, settings, prefix=compile_key, spend=spend)
    return GraphProfiles(profiles, planned)


def search_partitions(
    graphs: Sequence[Searched], device: Device, cache_dir: Path | None, settings: Settings, *,
    prefix: str, spend: GpuTime,
) -> list[tuple[PartitionProfile, ...]]:
    """The graphs' partitions searched side by side (``profile.profile_graphs``), through
    the store, with progress and each graph's summary on rank 0; the clocks back at
    default afterwards, also after SIGINT or SIGTERM (then the signal acts)."""
    shows = not dist.is_initialized() or dist.get_rank() == 0
    found: list[tuple[PartitionProfile, ...]] = [() for _ in graphs]
    with DeferredSignals() as signals:
        try:
            with ProfileStore(cache_dir=cache_dir) as store, ProfilingProgress(shows) as progress:
                found = profile_graphs(graphs, device, store, settings, prefix=prefix,
                                       progress=progress, stop=signals.stop, spend=spend)
        finally:
            if device.controls_clocks:
                device.clock_controller().reset()
    for graph, profiles in zip(graphs, found, strict=True):
        if shows and profiles:
            label = graph.analysis.label
            make_console().print(summary_table(
                f"kareus {label}: partition frontiers on {device.identity} "
                f"({spend.describe(label)})", profiles
            ))
    return found


