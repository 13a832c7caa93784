"""What kareus's profiling costs on a real GPU, counted from the measurements it takes.

A real GPU costs nothing analytically, so kareus measures two things on it, through the
profile store (graphs and partitions with the same structural hash, e.g. the identical
blocks of a model, are measured once):

- partitions: each distinct partition of a graph whose collective can launch at more than
  one slot, searched per nanobatch count k of the graph's space (``profile.profile_graph``:
  a Bayesian search of at most ``search_budget`` evaluations at every third search clock,
  the graph's searches side by side, a round per clock);
- whole graphs, on their first calls' inputs once the step's graphs all had theirs
  (``planner.measured``, ``graph_cost.GraphMeasurer``): every variant the planner's
  frontier asks for (``planner.graph.graph_frontier``: the unrewritten graph, each k's
  default variant, each candidate of the composed frontier), at about four clocks and a
  held-back one (``graph_cost.measured_clocks``, ``grid``), the step's graphs whose
  collectives share their groups together (a team).

Each batch costs what the default protocol takes on a GPU whose energy counter integrates
and whose noise and lag the probe measured (``Protocol().seconds_per_batch``: the NVML
device's 0.1 s settle where the clock changes, then a warm-up run per variant, blocks
spanning the counter updates the batch's errors need, and the waits for the counter's
report, counted as if the lag were a whole update: an upper bound;
energies recovered by least squares over the counter's readings:
``devices.nvml.multiplex``), exactly what ``measure_batch`` charges ``GpuTime`` for a
simulated, deterministic device, with the simulated GPU's time of each variant as
``run_s``. A graph's partition points are measured a round at a time (one clock and one
batch each, the searches side by side); a team's whole-graph variants a clock at a time,
each round's at one clock in one batch for all its graphs (the clock switches between
batches only; a batch's GPU-seconds are split among its graphs by their variants in it,
as kareus charges them), and each graph's chosen point is checked once in a 2 s window
(``Protocol.seconds_per_check``). Where the counter samples part of
the time the device falls back to windows long enough for the stated error
(``SAMPLED_WINDOW_S``, 3 repeats each): that figure is printed beside it.

How: the workload's graphs are traced as ``kareus plan`` traces them (``offline.trace``:
per block, one rank, fake tensors under a fake process group of ``tp`` ranks), compiled
with the kareus backend (``nanobatches="auto"``, the default Bayesian search) on the
simulated GPU made to cost a graph only by measuring it, as a real GPU must
(``MeasuringGPU``), so the backend plans every graph at its first call. That first call
cannot run inside the trace: it materialises variants of a graph whose tensors belong to
Dynamo's fake mode while the model's own fake mode is active, which torch refuses
("fake mode ... doesn't match mode"). So the backend's first-call planners are kept
(``FirstCallPlanning`` replaced for the trace by a subclass that records itself) and
called after it, in the same order and under the same process group, as a first call
calls them, but on no inputs: the simulated GPU costs a variant from its graph and never
runs it. A graph whose measuring fails there fails as on a real GPU (it is not planned;
its report says why).

What that profiling plans is set beside what profiling that costs nothing plans
(``reference``: the simulated GPU costing graphs analytically and every partition variant
measured at every clock, as ``kareus bench`` plans): each point of each graph's planned
frontier is costed again by the simulated GPU as a whole graph, and the two are compared
per step (each block graph times the layers) at the default budget (the least energy no
slower than the baseline, per graph) and at the fastest, and per graph by hypervolume.

Every measurement the device takes is logged; the counts and GPU-seconds here are the
log's, checked against kareus's own (each profile's ``measured`` and ``gpu_s``,
``GpuTime.by_graph``: tests/test_profiling_cost.py). Per rank is per node: under TP the
node's ranks measure every variant together, except a team of graphs without
collectives, which each rank runs alone and the node's ranks split as replicas do
(``replicas.Pool``: its batches and its checks claimed one at a time). Not counted:
compiling each variant (Inductor, on a real GPU), the search's proposals on the host (the
seconds this script spends tracing are an upper bound for them), repeats past 3 where a
real GPU's readings spread by more than 5%.

    python benchmarks/profiling_cost.py --model llama3.1-8b --tp 8
"""

from __future__ import annotations

import argparse
import bisect
import collections
import dataclasses
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import torch.distributed as dist
from rich.console import Console
from rich.table import Table
from torch.testing._internal.distributed.fake_pg import FakeStore

import kareus
from kareus.devices import SimulatedGPU
from kareus.devices.base import Measurement, Workload
from kareus.devices.nvml.multiplex import DEFAULT_POLICY
from kareus.offline.trace import compile_microbatch
from kareus.offline.workload import Workload as Training
from kareus.passes.decide import Choice
from kareus.passes.ops import DEFAULT_CLOCK_MHZ
from kareus.planner.measured import FirstCallPlanning
from kareus.profiler.graph_cost import GraphMeasurer, measured_clocks
from kareus.profiler.measure import COUNTER_PERIOD_S, Protocol
from kareus.profiler.replicas import deal
from kareus.profiler.search import Config, Point, hypervolume
from kareus.reports import GraphReport
from kareus.version import __version__

DEVICE = "sim:h200"
TARGET_GPU_MINUTES_PER_NODE = 15.0
SAMPLED_WINDOW_S = COUNTER_PERIOD_S / DEFAULT_POLICY.max_error
"""The window the NVML device falls back to where the counter samples part of each update
(``NvmlGPU.fallback_window_s``: the update period over the stated error, 6.7 s at 100 ms;
Yang, Adamek, Armour, SC'24 likewise needed windows of at least 5 s)."""
REPLICAS = 8
# The workload ``kareus bench`` plans Llama 3.1 8B at (offline.suite.MATRIX): 8 x 4096 tokens
# per microbatch, no pipeline, no recomputation; only one microbatch's graphs are measured.
MICROBATCH_SIZE, SEQ = 8, 4096


@dataclass(frozen=True)
class Logged:
    """One measurement the device took: the workload's name, its clock, its time."""

    name: str
    clock_mhz: int
    run_s: float
    batch: int | None = None  # the batch it was measured in (None: alone)
    check: bool = False  # a chosen point's check (``Device.check``)


class MeasuringGPU(SimulatedGPU):
    """A simulated GPU used as a real one is: it costs a graph only by measuring it (so
    the backend measures whole graphs at their first call), and logs every measurement."""

    costs_graphs = False

    def __init__(self, spec: str = DEVICE) -> None:
        super().__init__(spec)
        self.log: list[Logged] = []

    def estimate(self, gm, world_size=1):
        return None

    def estimate_at(self, gm, clocks, world_size=1):
        return None

    def measure(self, workload: Workload, clock_mhz: int, *, resources=None) -> Measurement:
        m = super().measure(workload, clock_mhz, resources=resources)
        self.log.append(Logged(workload.name, clock_mhz, m.time_s, self._batch, self._check))
        return m

    _check = False

    def check(self, workload, clock_mhz):
        self._check = True
        try:
            return super().check(workload, clock_mhz)
        finally:
            self._check = False

    _batch: int | None = None
    _batches = 0

    def measure_batch(self, workloads, clock_mhz, agree=None, resources=None):
        self._batch, self._batches = self._batches, self._batches + 1
        try:
            return super().measure_batch(workloads, clock_mhz, agree, resources)
        finally:
            self._batch = None


def _recording(into: list[FirstCallPlanning]) -> type[FirstCallPlanning]:
    """A ``FirstCallPlanning`` whose call only records it, to be replayed after the trace."""

    class Deferred(FirstCallPlanning):
        def __call__(self, args: Sequence[Any]) -> None:
            into.append(self)

    return Deferred


@dataclass
class GraphCount:
    """One distinct graph's measurements: partitions per k and whole-graph variants."""

    label: str
    role: str  # "embed/forward", "block/backward", ... (``offline.trace``'s labels)
    graph_hash: str
    kind: str
    partitions: list[dict[str, Any]] = field(default_factory=list)
    whole: dict[str, Any] = field(default_factory=dict)

    team: tuple[str, ...] = ()
    """The process groups of its collectives: the graphs of one team (a step's, sharing
    them) are measured together, a batch per clock and round for all of them (their
    partition searches side by side, then their whole graphs); a team of graphs without
    collectives runs on each tensor-parallel rank alone, and those ranks (its replicas on
    the node) claim its batches and its checks one at a time (``replicas.Pool``)."""

    rounds: list[tuple[int, int, float, int]] = field(default_factory=list)
    """The partition searches' measurements (batch, clock, run time, the search's index in
    ``partitions``) in the order taken."""

    def partition_run_s(self) -> list[float]:
        return [r for _, _, r, _ in self.rounds]

    def entries(self) -> list[tuple[float, int, int, str]]:
        """Every measurement it took in a batch: (run time, clock, batch, "partition" or
        "whole")."""
        w = self.whole
        return ([(r, f, b, "partition") for b, f, r, _ in self.rounds]
                + [(r, f, b, "whole") for r, f, b in zip(
                    w.get("run_s", []), w.get("clock_mhz", []), w.get("batch", []),
                    strict=True)])

    def whole_entries(self) -> list[tuple[float, int, int, int]]:
        """Its whole-graph measurements: (run time, clock, batch, round), as taken."""
        w = self.whole
        return list(zip(w.get("run_s", []), w.get("clock_mhz", []), w.get("batch", []),
                        w.get("round", []), strict=True))

    def to_json(self, protocol: Protocol, shares: dict[str, float]) -> dict[str, Any]:
        """Its counts; ``shares``: its GPU-seconds of its team's batches ("partition",
        "whole": each batch's split by the variants each graph has in it, as kareus
        charges them; "whole" with its checks)."""
        per_k: dict[str, dict[str, float]] = {}
        for p in self.partitions:
            k = per_k.setdefault(str(p["k"]), {"distinct": 0, "evaluations": 0,
                                               "measured": 0, "gpu_s": 0.0})
            k["distinct"] += 1
            k["evaluations"] += p["evaluations"]
            k["measured"] += p["measured"]
            k["gpu_s"] += p["kareus_gpu_s"]
        checks = self.whole.get("check_run_s", [])
        every = [*self.partition_run_s(), *self.whole.get("run_s", []), *checks]
        return {
            "label": self.label, "role": self.role, "graph_hash": self.graph_hash,
            "kind": self.kind, "team": list(self.team),
            "partitions_by_k": per_k, "partitions": self.partitions,
            "partition_measurements": len(self.partition_run_s()),
            "whole_graph": self.whole,
            "whole_graph_measurements": len(self.whole.get("run_s", [])),
            "partition_gpu_s": shares["partition"], "whole_graph_gpu_s": shares["whole"],
            "gpu_s": shares["partition"] + shares["whole"],
            "partition_rounds": len({b for b, _, _, _ in self.rounds}),
            "partition_batches": [list(entry) for entry in self.rounds],
            "sampled_counter_gpu_s": sum(
                protocol.seconds_per_evaluation(r, min_window_s=SAMPLED_WINDOW_S) for r in every),
        }


def _teams(graphs: Sequence[GraphCount]) -> list[list[GraphCount]]:
    """The graphs measured together (by their team's groups)."""
    teams: dict[tuple[str, ...], list[GraphCount]] = {}
    for g in graphs:
        teams.setdefault(g.team, []).append(g)
    return list(teams.values())


def _team_entries(team: Sequence[GraphCount]) -> list[tuple[float, int, int, str]]:
    """A team's measurements in batches (run time, clock, batch, kind), as taken."""
    return sorted((e for g in team for e in g.entries()), key=lambda e: e[2])


def _checks_s(team: Sequence[GraphCount], protocol: Protocol) -> float:
    return sum(protocol.seconds_per_check(r) for g in team
               for r in g.whole.get("check_run_s", []))


def team_s(team: Sequence[GraphCount], protocol: Protocol) -> float:
    """A team's GPU-seconds on one rank: its batches in the order taken (a clock switch
    where the clock changed) and its checks."""
    return (_batches_s([(r, f, b) for r, f, b, _ in _team_entries(team)], protocol)
            + _checks_s(team, protocol))


def shares(team: Sequence[GraphCount], protocol: Protocol) -> dict[str, dict[str, float]]:
    """Each graph's share of :func:`team_s`, its partitions' and its whole graph's (with
    its checks): each batch split by its variants."""
    entries = _team_entries(team)
    cost = _batch_costs([(r, f, b) for r, f, b, _ in entries], protocol)
    size = collections.Counter(b for _, _, b, _ in entries)
    return {g.label: {
        kind: sum(cost[b] / size[b] for _, _, b, k in g.entries() if k == kind)
        + (sum(protocol.seconds_per_check(r) for r in g.whole.get("check_run_s", []))
           if kind == "whole" else 0.0)
        for kind in ("partition", "whole")} for g in team}


def replica_s(team: Sequence[GraphCount], protocol: Protocol, replicas: int) -> float:
    """A team's node time with ``replicas`` replicas starting together:

    - its partition searches dealt into a slice per replica (``replicas.deal`` over the
      searches' most evaluations, as ``profile`` deals them), each searched in rounds of
      that slice's searches alone (a search proposes what it would alone, so its rounds
      are the full rounds' share), the node waiting for the longest slice;
    - then each round of its whole graphs' batches (a clock each) claimed one at a time, as
      ``graph_cost.GraphMeasurer`` claims them (a work queue: the next batch to the
      replica free first), the node waiting for the last of each round (a replica's first
      batch of a round counted with a clock switch: an upper bound);
    - and each chosen point checked once, by one replica."""
    searches = [(g, i, p["weight"]) for g in team for i, p in enumerate(g.partitions)]
    slices = deal([w for _, _, w in searches], replicas) if searches else []
    total = max((_batches_s(sorted(((r, f, b) for j in part
                                   for b, f, r, i in searches[j][0].rounds
                                   if i == searches[j][1]), key=lambda e: e[2]), protocol)
                 for part in slices), default=0.0)
    total += _checks_s(team, protocol)
    entries = sorted((e for g in team for e in g.whole_entries()), key=lambda e: e[2])
    for r in sorted({entry[3] for entry in entries}):
        batches: dict[int, tuple[int, list[float]]] = {}
        for run_s, clock, batch, in_round in entries:
            if in_round == r:
                batches.setdefault(batch, (clock, []))[1].append(run_s)
        free = [0.0] * replicas
        for _clock, runs in batches.values():
            first = min(range(replicas), key=lambda i: (free[i], i))
            free[first] += protocol.seconds_per_batch(runs)
        total += max(free)
    return total


def _points_s(run_s: Sequence[float], protocol: Protocol) -> float:
    """Points measured one at a time: a clock switch each."""
    return sum(protocol.seconds_per_batch([r]) for r in run_s)


def _batch_costs(entries: Sequence[tuple[float, int, int]], protocol: Protocol
                 ) -> dict[int, float]:
    """Each batch's GPU-seconds, of measurements (run time, clock, batch) in the order
    taken: each batch as one (its variants share the counter's readings), a clock switch
    where the clock changed, as ``profile.profile_graph``'s rounds and
    ``graph_cost.GraphMeasurer`` charge them."""
    batches: dict[int, tuple[int, list[float]]] = {}
    for run_s, clock, batch in entries:
        batches.setdefault(batch, (clock, []))[1].append(run_s)
    clocks = [None, *(f for f, _ in batches.values())]
    return {b: protocol.seconds_per_batch(runs, switched=f != before)
            for (b, (f, runs)), before in zip(batches.items(), clocks, strict=False)}


def _batches_s(entries: Sequence[tuple[float, int, int]], protocol: Protocol) -> float:
    """The GPU-seconds of measurements (run time, clock, batch) in the order taken."""
    return sum(_batch_costs(entries, protocol).values())


def _switches(clocks: Sequence[int]) -> int:
    return sum(1 for i, f in enumerate(clocks) if i == 0 or f != clocks[i - 1])


def count(
    workload: Training, device: str = DEVICE, *, search_budget: int = 32, seed: int = 0,
    cache_dir: str | Path | None = None,
) -> dict[str, Any]:
    """Profile ``workload``'s distinct graphs on ``device`` as a real GPU would be profiled
    (the module docstring says how), and count what it measured and what that costs."""
    gpu = MeasuringGPU(device)
    store = Path(cache_dir) if cache_dir else Path(tempfile.mkdtemp(prefix="kareus-cost-"))
    backend = kareus.KareusBackend({
        "nanobatches": "auto", "lowering": "eager", "cache_dir": str(store),
        "search": "bayesian", "search_budget": search_budget, "seed": seed,
    }, device=gpu)
    deferred: list[FirstCallPlanning] = []
    started = time.perf_counter()
    with _fake_group(workload.tp):
        with mock.patch("kareus.backend.FirstCallPlanning", _recording(deferred)):
            compile_microbatch(workload, backend)
        traced_s = time.perf_counter() - started
        roles = _roles(backend.reports())
        graphs = {r.label: GraphCount(r.label, roles[r.label], r.key, r.kind)
                  for r in backend.reports()}
        _whole_graphs(deferred, gpu, graphs)  # the partitions searched there too
        _partition_counts(backend.reports(), gpu.log, search_budget, graphs)
        for first in deferred:  # measured together: the graphs whose collectives' groups
            graphs[first.analysis.label].team = first.groups  # are alike (FirstCalls)
        planned = _true_frontiers(deferred, gpu)
    protocol = backend.protocol
    teams = _teams(list(graphs.values()))
    split = {label: s for team in teams for label, s in shares(team, protocol).items()}
    rows = [g.to_json(protocol, split[g.label]) for g in graphs.values()]
    quality = _quality(planned, reference(workload, device, seed=seed),
                       {g.label: g.role for g in graphs.values()}, workload.model.n_layers)
    return {
        "model": workload.name, "tp": workload.tp, "microbatch_size": workload.microbatch_size,
        "seq": workload.seq, "device": gpu.identity, "model_version": gpu.model_version,
        "kareus_version": __version__, "search": "bayesian", "search_budget": search_budget,
        "seed": seed, "protocol": dataclasses.asdict(protocol),
        "search_clocks": list(gpu.search_clocks()),
        "whole_graph_clocks": list(measured_clocks(gpu.search_clocks())),
        "layers": workload.model.n_layers,
        "graphs": rows,
        "teams": [_team_json(team, protocol, workload.tp) for team in teams],
        "totals": _totals(rows, teams, len(gpu.log), protocol, workload.tp),
        "quality": quality,
        "kareus_gpu_s": dict(backend.spend.by_graph),  # GpuTime's own, to check against
        "host_seconds": {"trace_and_partition_search": traced_s,
                         "total": time.perf_counter() - started},
    }


def _team_json(team: Sequence[GraphCount], protocol: Protocol, tp: int) -> dict[str, Any]:
    """A team's measuring: its graphs, batches, clock switches and GPU-seconds; its node
    time (a team without collectives split among the node's ranks) and with ``REPLICAS``
    data-parallel replicas."""
    entries = _team_entries(team)
    alone = tp if not team[0].team else 1  # the node's ranks that split it
    batches = dict.fromkeys((b, f, kind) for _, f, b, kind in entries)
    return {
        "graphs": [g.label for g in team], "groups": list(team[0].team),
        "partition_batches": sum(kind == "partition" for _, _, kind in batches),
        "whole_graph_batches": sum(kind == "whole" for _, _, kind in batches),
        "clock_switches": _switches([f for _, f, _ in batches]),
        "gpu_s": team_s(team, protocol),
        "node_s": team_s(team, protocol) if alone == 1 else replica_s(team, protocol, alone),
        "replicas_node_s": replica_s(team, protocol, REPLICAS * alone),
    }


def _totals(rows: list[dict[str, Any]], teams: Sequence[Sequence[GraphCount]],
            measurements: int, protocol: Protocol, tp: int) -> dict[str, float]:
    """Per rank (the node's ranks measure together: its wall time) and per node."""
    per_rank = sum(r["gpu_s"] for r in rows)
    team_rows = [_team_json(team, protocol, tp) for team in teams]
    node_s = sum(t["node_s"] for t in team_rows)
    sampled = sum(r["sampled_counter_gpu_s"] for r in rows)
    floor_s = protocol.seconds_per_batch([0.0])
    return {
        "partition_evaluations": sum(r["partition_measurements"] for r in rows),
        "whole_graph_measurements": sum(r["whole_graph_measurements"] for r in rows),
        "measurements": measurements,
        "checks": sum(len(r["whole_graph"].get("check_run_s", [])) for r in rows),
        "gpu_s_per_rank": per_rank,
        # the node's time: its ranks measure together, a team of graphs without
        # collectives split among them (``GraphCount.team``)
        "node_s": node_s,
        "node_wall_minutes": node_s / 60,
        "gpu_minutes_per_node": node_s * tp / 60,
        "target_gpu_minutes_per_node": TARGET_GPU_MINUTES_PER_NODE,
        # Replicas share each team's partition searches and whole-graph clocks, a slice
        # each (``replica_s``).
        "replicas": REPLICAS,
        "gpu_minutes_per_node_with_replicas": sum(t["replicas_node_s"] for t in team_rows)
        * tp / 60,
        "sampled_counter_gpu_s_per_rank": sampled,
        "sampled_counter_gpu_minutes_per_node": sampled * tp / 60,
        "sampled_window_s": SAMPLED_WINDOW_S,
        "partition_rounds": sum(t["partition_batches"] for t in team_rows),
        "whole_graph_batches": sum(t["whole_graph_batches"] for t in team_rows),
        "clock_switches": sum(t["clock_switches"] for t in team_rows),
        # What a variant measured alone costs before it runs at all: the settle and the
        # blocks the counter's readings need (a partition's point).
        "floor_s_per_lone_measurement": floor_s,
        # Graphs whose whole-graph measurement failed (not planned): what measuring them
        # unrewritten would add, not in the totals above.
        "not_measured_gpu_s": sum(
            _points_s(r["whole_graph"].get("unrewritten_if_measured_s", []), protocol)
            for r in rows),
    }


def _partition_counts(reports: Sequence[GraphReport], log: list[Logged], search_budget: int,
                      graphs: dict[str, GraphCount]) -> None:
    """Each graph's partition searches, with the measurements each took: the log's
    partition entries, each given to the profile of its partition and count (a team's
    searches measure side by side, a round at a time; a partition and count two graphs
    hold is measured by the first and read back by the second), each profile taking as
    many as it measured."""
    entries = [e for e in log if e.name.startswith("partition ")]
    if any(e.batch is None for e in entries):
        raise RuntimeError("a partition measured outside a round")
    taken: set[int] = set()
    for report in reports:
        g = graphs[report.label]
        searches = {}
        for index, p in enumerate(report.profiles):
            mine = ([e for e in entries if id(e) not in taken and f"({p.key})" in e.name
                     and f" k={p.nanobatches} " in e.name] if p.measured else [])
            searches.update({id(e): index for e in mine})
            taken.update(id(e) for e in mine)
            if len(mine) != p.measured:
                raise RuntimeError(f"{report.label}: {len(mine)} measurements of {p.key} at "
                                   f"k={p.nanobatches}, which measured {p.measured}")
            g.partitions.append({
                "key": p.key, "k": p.nanobatches, "collective": p.collective,
                "used_by": len(p.partitions), "space_size": p.space_size,
                "evaluations": p.evaluations, "measured": p.measured, "stopped": p.stopped,
                "error": p.error, "kareus_gpu_s": p.gpu_s,
                "run_s": [e.run_s for e in mine],
                "weight": min(search_budget, p.space_size),
            })
        g.rounds = [(e.batch, e.clock_mhz, e.run_s, searches[id(e)]) for e in entries
                    if id(e) in searches]
    if len(taken) != len(entries):
        raise RuntimeError("partition measurements that no profile took")


Curve = tuple[tuple[float, float], list[tuple[float, float]]]
"""A graph's baseline (time, effective energy: unrewritten at the default clock) and its
planned frontier's points, each as the simulated GPU costs it analytically."""


def _true_frontiers(deferred: Sequence[FirstCallPlanning], gpu: MeasuringGPU) -> dict[str, Curve]:
    """Each measured graph's frontier as planned from the measurements, every point (a
    choice at a clock, measured or predicted between measured clocks) costed again by the
    simulated GPU as a whole graph: what the plan would really get."""
    frontiers = deferred[0].planner.graph_frontiers() if deferred else {}
    default_mhz = gpu.search_clocks()[0]
    curves = {}
    for first in deferred:
        frontier = frontiers.get(first.analysis.label)
        if frontier is None:
            continue
        costs: dict[tuple, dict[int, Measurement]] = {}
        points = []
        for point in (frontier.baseline, *frontier.points):
            choice = point.choice
            clock = choice.clock_mhz if choice.clock_mhz != DEFAULT_CLOCK_MHZ else default_mhz
            key = (choice.nanobatches, choice.partitions)
            if key not in costs:
                _, graph = first.builder.graph(choice.at(DEFAULT_CLOCK_MHZ), clocked=False)
                costs[key] = SimulatedGPU.estimate_at(gpu, graph, gpu.search_clocks(),
                                                      first.world_size)
            m = costs[key][clock]
            points.append((m.time_s, m.effective_energy_j))
        curves[first.analysis.label] = (points[0], points[1:])
    return curves


def reference(workload: Training, device: str = DEVICE, *, seed: int = 0) -> dict[str, Curve]:
    """The frontiers kareus plans with profiling that costs nothing: the simulated GPU
    costing every graph analytically and every partition variant measured (``search``
    "grid"), as ``kareus bench`` plans; its points are the model's own costs. By role."""
    gpu = SimulatedGPU(device)
    with tempfile.TemporaryDirectory(prefix="kareus-cost-reference-") as store:
        backend = kareus.KareusBackend({
            "nanobatches": "auto", "lowering": "eager", "cache_dir": store, "search": "grid",
            "seed": seed,
        }, device=gpu)
        with _fake_group(workload.tp):
            compile_microbatch(workload, backend)
        frontiers = backend.planner.graph_frontiers()
        roles = _roles(backend.reports())
    return {roles[label]: ((f.baseline.time_s, f.baseline.effective_energy_j),
                    [(p.time_s, p.effective_energy_j) for p in f.points])
            for label, f in frontiers.items()}


def _least_energy(curve: Curve) -> tuple[float, float]:
    """(time, effective energy) of the point with the least energy no slower than the
    baseline (the default budget, per graph), the baseline where none is."""
    baseline, points = curve
    return min((p for p in [baseline, *points] if p[0] <= baseline[0] * (1 + 1e-9)),
               key=lambda p: (p[1], p[0]))


def _quality(planned: dict[str, Curve], reference: dict[str, Curve], roles: dict[str, str],
             layers: int) -> dict[str, Any]:
    """What profiling cheaply costs the plan: per graph and per step (each block graph
    x ``layers``), the least energy no slower than the baseline and the fastest time, the
    planned frontier's (really costed) against the reference's, and the energy saved
    against the baseline by each."""
    graphs, step = {}, {k: 0.0 for k in ("baseline_j", "planned_j", "reference_j",
                                         "planned_fastest_s", "reference_fastest_s")}
    for label, curve in planned.items():
        role = roles[label]
        if role not in reference:
            continue
        runs = layers if role.startswith("block/") else 1
        (_, base_j), ours, theirs = curve[0], _least_energy(curve), _least_energy(reference[role])
        fastest = min(t for t, _ in [curve[0], *curve[1]])
        fastest_ref = min(t for t, _ in [reference[role][0], *reference[role][1]])
        graphs[label] = {"role": role, "runs": runs, "baseline_j": base_j,
                         "planned_j": ours[1], "reference_j": theirs[1],
                         "planned_fastest_s": fastest, "reference_fastest_s": fastest_ref,
                         "hypervolume_vs_reference": _volume_ratio(curve, reference[role])}
        for key in step:
            step[key] += runs * graphs[label][key]
    return {
        "graphs": graphs, "step": step,
        "planned_saving": 1 - step["planned_j"] / step["baseline_j"],
        "reference_saving": 1 - step["reference_j"] / step["baseline_j"],
        "energy_vs_reference": step["planned_j"] / step["reference_j"] - 1,
        "fastest_vs_reference": step["planned_fastest_s"] / step["reference_fastest_s"] - 1,
        "worst_hypervolume_vs_reference": min(
            (g["hypervolume_vs_reference"] for g in graphs.values()), default=1.0),
    }


def _volume_ratio(planned: Curve, reference: Curve) -> float:
    """The planned frontier's hypervolume in (time, effective energy) over the reference's,
    both against 10% beyond the worst time and energy of either."""
    both = [*planned[1], *reference[1], planned[0], reference[0]]
    box = (1.1 * max(t for t, _ in both), 1.1 * max(e for _, e in both))

    def volume(points: list[tuple[float, float]]) -> float:
        return hypervolume([Point(Config(0, None, 0), t, e, e) for t, e in points], box)

    return volume([planned[0], *planned[1]]) / volume([reference[0], *reference[1]])


def _roles(reports: Sequence[GraphReport]) -> dict[str, str]:
    """Each graph's label as ``kareus plan`` names it: the trace compiles the embedding,
    one block (every layer's) and the tail, in that order, each a region of its own."""
    regions = sorted({r.label.split("/")[0] for r in reports}, key=lambda r: int(r[1:]))
    if len(regions) != 3:
        raise RuntimeError(f"the trace compiled regions {regions}, not embed, block, tail")
    role = dict(zip(regions, ("embed", "block", "tail"), strict=True))
    return {r.label: f"{role[r.label.split('/')[0]]}/{r.kind}" for r in reports}


def _whole_graphs(deferred: Sequence[FirstCallPlanning], gpu: MeasuringGPU,
                  graphs: dict[str, GraphCount]) -> None:
    """``deferred`` called as the graphs' first calls call them, in order, on no inputs
    (the simulated GPU costs a variant from its graph, never runs it): the last completes
    the step, and the step's graphs are measured then, a team's together; the log's
    entries they added, by graph (a variant's name starts with its graph's label) and
    variant. Where a graph's measuring failed (it is then not planned, and its report says
    why), what measuring it unrewritten would have taken."""
    start = len(gpu.log)
    rounds: list[int] = []  # the first batch of each round of measuring (``_measure``)
    measure = GraphMeasurer._measure

    def measuring(self: GraphMeasurer, items: list) -> None:
        rounds.append(gpu._batches)
        measure(self, items)

    with mock.patch.object(GraphMeasurer, "_measure", measuring):
        for first in deferred:
            FirstCallPlanning.__call__(first, ())
    for first in deferred:
        label = first.analysis.label
        into = graphs[label]
        mine = [e for e in gpu.log[start:] if e.name.startswith(f"{label} ")]
        checks = [e.run_s for e in mine if e.check]
        taken = [e for e in mine if not e.check]
        (report,) = (r for r in first.reports.all() if r.label == label)
        failed = [n for n in report.notes if "measuring the whole graph failed" in n]
        if failed:
            into.whole = {"error": failed[0], "run_s": [e.run_s for e in taken],
                          "clock_mhz": [e.clock_mhz for e in taken],
                          "batch": [e.batch for e in taken],
                          "round": [bisect.bisect_right(rounds, e.batch) - 1 for e in taken],
                          "unrewritten_if_measured_s": _unrewritten_s(first, gpu)}
            continue
        space = first.analysis.space
        defaults = {f"k={k} {list(Choice.of(space.default(k)).partitions)}"
                    for k in space.nanobatches if k > 1}
        kinds = {"unrewritten": 0, "default": 0, "candidate": 0}
        for variant in {e.name.removeprefix(f"{label} ") for e in taken}:
            kinds["unrewritten" if variant.startswith("k=1 ") else
                  "default" if variant in defaults else "candidate"] += 1
        into.whole = {"variants": kinds, "measured": len(taken),
                      "run_s": [e.run_s for e in taken],
                      "clock_mhz": [e.clock_mhz for e in taken],
                      "batch": [e.batch for e in taken],
                      "round": [bisect.bisect_right(rounds, e.batch) - 1 for e in taken],
                      "check_run_s": checks}


def _unrewritten_s(first: FirstCallPlanning, gpu: MeasuringGPU) -> list[float]:
    """The run times a graph whose measuring failed would have been measured with at the
    least: unrewritten, at the whole-graph clocks (not logged: nothing measured them)."""
    _, graph = first.builder.graph(Choice(), clocked=False)
    clocks = measured_clocks(gpu.search_clocks())
    swept = SimulatedGPU.sweep(gpu, Workload("unrewritten", gm=graph,
                                             world_size=first.world_size), clocks)
    return [m.time_s for m in swept.values()]


class _fake_group:
    """A fake default process group of ``tp`` ranks for the trace and the replay."""

    def __init__(self, tp: int) -> None:
        self.tp = tp

    def __enter__(self) -> None:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=self.tp)

    def __exit__(self, *exc: object) -> None:
        dist.destroy_process_group()


def table(result: dict[str, Any]) -> Table:
    t = result["totals"]
    out = Table(title=(
        f"profiling cost: {result['model']} TP{result['tp']}, {result['microbatch_size']} x "
        f"{result['seq']} tokens, {result['device']}, bayesian budget "
        f"{result['search_budget']}; GPU-s per rank"), title_justify="left")
    for column in ("graph", "runs/step", "partition evals (k: distinct, evals)",
                   "whole-graph variants", "whole-graph meas.", "partition GPU-s",
                   "whole-graph GPU-s", "GPU-s"):
        out.add_column(column, justify="left" if column == "graph" else "right")
    for g in result["graphs"]:
        by_k = ", ".join(f"k={k}: {v['distinct']}, {v['measured']}"
                         for k, v in g["partitions_by_k"].items()) or "-"
        whole = g["whole_graph"]
        variants = "failed" if "error" in whole else " + ".join(
            str(whole["variants"][k]) for k in ("unrewritten", "default", "candidate"))
        runs = result["layers"] if g["role"].startswith("block/") else 1
        out.add_row(f"{g['role']} ({g['label']})", f"x{runs}",
                    f"{g['partition_measurements']} ({by_k})", variants,
                    str(g["whole_graph_measurements"]), f"{g['partition_gpu_s']:.0f}",
                    f"{g['whole_graph_gpu_s']:.0f}", f"{g['gpu_s']:.0f}")
    out.add_section()
    partition_s = sum(g["partition_gpu_s"] for g in result["graphs"])
    out.add_row("total (distinct graphs)", "", str(t["partition_evaluations"]), "",
                str(t["whole_graph_measurements"]), f"{partition_s:.0f}",
                f"{t['gpu_s_per_rank'] - partition_s:.0f}", f"{t['gpu_s_per_rank']:.0f}")
    failed = [f"{g['role']}: {g['whole_graph']['error']}" for g in result["graphs"]
              if "error" in g["whole_graph"]]
    out.caption = "\n".join([
        (f"{t['gpu_s_per_rank']:.0f} GPU-s per rank; {t['node_s']:.0f} s = "
         f"{t['node_wall_minutes']:.1f} min of node time (a graph without collectives split "
         f"among its ranks); {t['gpu_minutes_per_node']:.1f} GPU-minutes per node of "
         f"{result['tp']} GPUs "
         f"(target <= {t['target_gpu_minutes_per_node']:g})."),
        ("Partitions searched at every third search clock, the step's side by side "
         f"({t['partition_rounds']} rounds). Whole-graph variants: "
         f"unrewritten + each k's default (at {len(result['whole_graph_clocks'])} of "
         f"{len(result['search_clocks'])} clocks and a held-back one) + composed candidates "
         "(at the measured clocks around theirs), a clock at a time, the step's graphs "
         f"together ({t['whole_graph_batches']} batches); {t['clock_switches']} clock "
         "switches; each graph's chosen point checked once in a long window "
         f"({t['checks']} checks)."),
        (f"With {t['replicas']} data-parallel replicas: "
         f"{t['gpu_minutes_per_node_with_replicas']:.1f} GPU-minutes per node (the "
         "step's partition searches dealt into a slice per replica, each round's whole-graph "
         "clocks claimed one at a time; each chosen point checked by one). If the counter "
         "samples part of the time (windows of "
         f"{t['sampled_window_s']:g} s, 3 repeats): "
         f"{t['sampled_counter_gpu_minutes_per_node']:.0f} GPU-minutes per node."),
        _quality_line(result["quality"]),
        *(f"Whole graph of {f}" for f in failed),
    ])
    return out


def _quality_line(quality: dict[str, Any]) -> str:
    return (
        "What it plans, each point costed again by the simulated GPU, beside the plan from "
        "profiling that costs nothing (every partition variant, graphs costed analytically): "
        f"per step, least energy no slower than the baseline {quality['planned_saving']:.1%} "
        f"below the baseline against {quality['reference_saving']:.1%} "
        f"({quality['energy_vs_reference']:+.2%} energy); fastest time "
        f"{quality['fastest_vs_reference']:+.2%}; the worst graph's frontier holds "
        f"{quality['worst_hypervolume_vs_reference']:.1%} of the reference's hypervolume.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3.1-8b", help="a preset or a config.json")
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--microbatch-size", type=int, default=MICROBATCH_SIZE)
    parser.add_argument("--seq", type=int, default=SEQ)
    parser.add_argument("--device", default=DEVICE)
    parser.add_argument("--search-budget", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="the profile store's directory (default: a fresh one)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/profiling_cost.json"))
    args = parser.parse_args(argv)
    workload = Training.of(args.model, tp=args.tp, microbatch_size=args.microbatch_size,
                           seq=args.seq)
    console = Console(width=140)
    result = count(workload, args.device, search_budget=args.search_budget, seed=args.seed,
                   cache_dir=args.cache_dir)
    console.print(table(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    console.print(f"wrote {args.out}", markup=False)
    console.print(f"{result['totals']['gpu_minutes_per_node']:.1f} GPU-minutes per node",
                  markup=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
