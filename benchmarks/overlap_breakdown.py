"""Where a plan's time goes: overlap won against what the rewrite costs, a breakdown anyone
can rerun.

A workload (the arguments of ``kareus plan``) is traced and planned offline as ``kareus
plan --fastest`` plans it (``plan_offline``, solves bounded at 20 s), with a backend that
keeps every AOT graph it compiles. On the *critical stage* (the one whose forward plus
backward instruction of one microbatch takes longest under the plan) and a steady-state
microbatch (the middle one: in 1F1B's steady phase on every stage where the microbatches
are at least 2 pp - 1), each graph of the two instructions is materialised twice, as the
baseline runs it (unrewritten, default clock) and as the plan chose it, and costed on the
simulated GPU (``devices/sim/model.py``), each graph alone as the planner costs it. Per
graph, in seconds of one run (the microbatch sums them, times their counts):

    plan = baseline - hidden + joins + cuts + efficiency + clock + contention + residual

- hidden: the baseline's exposed communication (time the compute stream waits on
  collectives) less the plan's;
- joins / cuts: the isolated time (each kernel alone, no collective running:
  ``SimulatedGPU.isolated_kernel_s``) of the kernels the rewrite emits to join nanobatch
  pieces (``JOIN_ROLES``) or to cut inputs and whole values into them (``CUT_ROLES``), as
  each emitted node's ``kareus_role`` says;
- efficiency, per kernel class: the isolated time of the rewritten graph's compute kernels
  (roles "once" and "piece") less the baseline graph's at the same clock: GEMM waves,
  attention tiles, memory-bound kernels, and apart from them the launch overheads of the
  kernels added (kernel count difference times the device's launch overhead);
- clock: the baseline's kernels at the plan's clock less at the default (0 when the plan
  runs the default clock, as the fastest plan usually does);
- contention: the plan's compute-stream busy time under the timeline less its kernels'
  isolated times (compute slowed by concurrent collectives: SMs and HBM they take);
- residual: what is left. The baseline's own contention (its compute beside a collective,
  where an unrewritten graph issues one early) and clock-switch stalls land here; it is
  printed beside it.

A fused run of memory-bound kernels (``Kernel.name`` "first..last") is attributed by its
members, the kernel-launching nodes from first to last in graph order. A run mixing the
rewrite's joins or cuts with compute is split so: its compute members first, up to their
own (unfused) isolated times, then the rest between its join and cut members by their own
isolated times, so that a join Inductor writes in place (a concatenation fused with the
op producing its last piece) costs the join only what the run costs beyond that op.
Grouped-query attention's dk/dv sums ("node.sum_dk") are their attention's.

    python benchmarks/overlap_breakdown.py llama3.2-3b --tp 8 --pp 2 --microbatches 8 \\
        --microbatch-size 8 --seq-len 4096 --recompute full --device sim:a100-sxm4-40gb \\
        --regions block

Prints a table per microbatch and graph, and adds the run (keyed by its workload) to
``benchmarks/results/overlap_breakdown.json``. Every figure is the simulator's.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import operator
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.fx
from rich.console import Console
from rich.table import Table

from kareus.backend import KareusBackend
from kareus.cli import add_workload_arguments
from kareus.codegen.apply import apply
from kareus.codegen.nanobatch import ROLE
from kareus.devices.resolve import resolve_device
from kareus.devices.sim.model import GraphCost, KernelClass, SimulatedGPU, graph_cost
from kareus.errors import KareusError
from kareus.offline.cli import traced_words, workload_of
from kareus.offline.plan import OfflinePlan, plan_offline
from kareus.offline.trace import StageGraphs, fake_group, trace_stages, tracing_options
from kareus.offline.workload import Workload
from kareus.passes.analyse import ForwardInterfaces, GraphAnalysis, analyse
from kareus.passes.decide import Choice
from kareus.passes.ops import DEFAULT_CLOCK_MHZ, OP_TABLE
from kareus.passes.partition import graph_hash
from kareus.passes.unwrap import unwrap_collectives
from kareus.planner.budget import Budget
from kareus.planner.compose import FrontierPoint
from kareus.planner.graph import GraphFrontier
from kareus.runtime.communicators import graph_backend
from kareus.version import __version__

RESULTS = Path(__file__).parent / "results" / "overlap_breakdown.json"
MAX_SOLVE_S = 20.0

COMPUTE_ROLES = frozenset({"once", "piece"})
"""The graph's own compute: on the whole batch, or a nanobatch's."""
JOIN_ROLES = frozenset({
    "cat", "sum", "unsort", "places", "sorted", "ids", "invert", "inverse", "place",
    "batch ids", "permute", "unpermute", "blocks", "block", "chunk", "chunks", "rows", "bound",
})
"""What the rewrite emits to join nanobatch pieces into a whole value (``_Emitter._join``
and what it calls: concatenations and their layout permutes, partial sums added, rows a
nanobatch sorted put back in the batch's order with the places that takes, pieces split
into blocks or chunks to be laid out block by block; the last are views, launching
nothing)."""
CUT_ROLES = frozenset({"input", "dense", "slice", "cut", "assembled", "from pieces"})
"""What the rewrite emits to cut values into nanobatch pieces: the inputs' slices (a dense
copy first where the input is not), whole values sliced or cut in blocks per nanobatch,
saved pieces assembled into another count."""

CLASS_WORDS = {
    KernelClass.GEMM: "GEMM waves",
    KernelClass.FP32_GEMM: "fp32 GEMM waves",
    KernelClass.ATTENTION_FWD: "attention forward tiles",
    KernelClass.ATTENTION_BWD: "attention backward tiles",
    KernelClass.MEMORY: "memory-bound kernels",
}


class BreakdownError(KareusError, RuntimeError):
    """A breakdown cannot be made as asked (the message says which graph or node)."""


# ---------------------------------------------------------------------------------------
# Keeping the graphs and materialising choices of them


@dataclass(frozen=True)
class Kept:
    """One AOT graph as the backend's ``_compile`` received it."""

    gm: torch.fx.GraphModule
    inputs: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    region: int

    @property
    def kind(self) -> str:
        """As ``KareusBackend._compile`` names it."""
        if self.kwargs.get("is_backward"):
            return "backward"
        return "inference" if self.kwargs.get("is_inference") else "forward"


class KeepingBackend(KareusBackend):
    """The tracing backend (``tracing_options``), keeping every graph it compiles so that
    any choice of it can be materialised after the plan is made."""

    def __init__(self, options: Mapping[str, Any]) -> None:
        super().__init__(options)
        self.kept: list[Kept] = []

    def _compile(
        self, gm: torch.fx.GraphModule, inputs: Sequence[Any], region: int,
        kwargs: Mapping[str, Any],
    ) -> Any:
        self.kept.append(Kept(gm, tuple(inputs), dict(kwargs), region))
        return super()._compile(gm, inputs, region, kwargs)


class Materialiser:
    """The kept graphs by structural hash (``GraphFrontier.graph_hash``), each analysed
    again exactly as ``KareusBackend._compile`` analyses it (its collectives already
    opened there, in place), and any choice of one as the GraphModule that runs."""

    def __init__(self, kept: Sequence[Kept]) -> None:
        self.kept = tuple(kept)
        self._hashes: list[str] | None = None
        self._analyses: dict[int, GraphAnalysis] = {}

    def graph(self, key: str, choice: Choice) -> torch.fx.GraphModule:
        """``choice`` of the graph ``key``, its clock switch asking for the measured clock
        (the planner costs each choice so: ``planner.graph.device_cost``)."""
        i = self._index(key)
        return apply(self.kept[i].gm, self.analysis(key), choice.at(DEFAULT_CLOCK_MHZ))

    def analysis(self, key: str) -> GraphAnalysis:
        return self._analysis(self._index(key))

    def _index(self, key: str) -> int:
        if self._hashes is None:
            self._hashes = [graph_hash(k.gm.graph, OP_TABLE) for k in self.kept]
        if key not in self._hashes:
            raise BreakdownError(f"graph {key} was not compiled by the tracing backend")
        return self._hashes.index(key)

    def _analysis(self, i: int) -> GraphAnalysis:
        if i in self._analyses:
            return self._analyses[i]
        kept = self.kept[i]
        forward: ForwardInterfaces | None = None
        if kept.kind == "backward":  # its region's forward, the last compiled before it
            f = max(j for j in range(i)
                    if self.kept[j].region == kept.region and self.kept[j].kind == "forward")
            forward = self._analysis(f).interfaces
        unwrap_collectives(kept.gm)  # opened by the backend already: nothing left to open
        result = analyse(
            kept.gm, kept.inputs, kept.kind, forward, backend=graph_backend(kept.gm.graph),
            static_input_idxs=kept.kwargs.get("static_input_idxs") or (),
            label=f"r{kept.region}/{kept.kind}",
        )
        self._analyses[i] = result
        return result


# ---------------------------------------------------------------------------------------
# Costing one graph and attributing its kernels


@dataclass(frozen=True)
class Timed:
    """One materialised graph on the simulated GPU at one clock: its timeline, and each
    kernel alone at the clock it ran (the power limit's, where that throttled it)."""

    cost: GraphCost
    time_s: float
    compute_s: float
    exposed_s: float
    ran_mhz: int
    isolated_s: tuple[float, ...]

    @property
    def contention_s(self) -> float:
        return self.compute_s - sum(self.isolated_s)


def timed(gpu: SimulatedGPU, gm: torch.fx.GraphModule, clock_mhz: int, world_size: int,
          cost: GraphCost | None = None) -> Timed:
    cost = cost or graph_cost(gm, world_size, table=gpu.table)
    m = gpu.sweep(cost, (clock_mhz,))[clock_mhz]
    ran = int(m.details["power_limited_mhz"]) or clock_mhz
    return Timed(cost, m.time_s, m.details["compute_s"], m.details["exposed_comm_s"], ran,
                 gpu.isolated_kernel_s(cost, ran))


@dataclass(frozen=True)
class Share:
    """Part of one kernel's isolated time: its source ("compute", "joins" or "cuts"),
    its class, and whether it counts as a compute kernel launched (``launches``)."""

    source: str
    kind: KernelClass
    seconds: float
    launches: int = 0
    split: bool = False  # a share of a fused run mixing sources (the module docstring)


def source_of(node: torch.fx.Node, rewritten: bool) -> str:
    """"compute", "joins" or "cuts", by the role the rewrite gave ``node``."""
    if not rewritten:
        return "compute"
    role = node.meta.get(ROLE)
    if role in COMPUTE_ROLES:
        return "compute"
    if role in JOIN_ROLES:
        return "joins"
    if role in CUT_ROLES:
        return "cuts"
    raise BreakdownError(
        f"{node.name} ({node.target}) launches a kernel with the rewrite's role {role!r}, "
        "which the breakdown does not know: add it to JOIN_ROLES or CUT_ROLES")


class Members:
    """The nodes each kernel of a graph runs: a fused run "first..last" its
    kernel-launching nodes from first to last in graph order, "node.sum_dk" its
    attention's (``launching``: the names of the nodes that launch a kernel)."""

    def __init__(self, gm: torch.fx.GraphModule, launching: set[str]) -> None:
        self.order = list(gm.graph.nodes)
        self.position = {n.name: i for i, n in enumerate(self.order)}
        self.launching = launching

    def __call__(self, kernel_name: str) -> list[torch.fx.Node]:
        at = self.position
        if kernel_name in at:
            return [self.order[at[kernel_name]]]
        if ".." in kernel_name:
            first, last = kernel_name.split("..")
            run = self.order[at[first]:at[last] + 1]
            return [n for n in run if n.name in self.launching]
        owner = kernel_name.rsplit(".", 1)[0]
        if owner in at:
            return [self.order[at[owner]]]
        raise BreakdownError(f"kernel {kernel_name!r} names no node of the graph")


def shares(gpu: SimulatedGPU, gm: torch.fx.GraphModule, run: Timed, world_size: int,
           rewritten: bool) -> list[Share]:
    """Each kernel's isolated time by source (a mixed fused run split as the module
    docstring says, by its members' unfused isolated times)."""
    unfused = graph_cost(gm, world_size, fuse=False, table=gpu.table)
    alone = dict(zip((k.name for k in unfused.kernels),
                     gpu.isolated_kernel_s(unfused, run.ran_mhz), strict=True))
    members = Members(gm, set(alone))
    out: list[Share] = []
    for kernel, seconds in zip(run.cost.kernels, run.isolated_s, strict=True):
        nodes = members(kernel.name)
        if not nodes:
            raise BreakdownError(f"kernel {kernel.name!r} runs no kernel-launching node")
        by_source: dict[str, float] = {}
        for node in nodes:
            source = source_of(node, rewritten)
            by_source[source] = by_source.get(source, 0.0) + alone.get(node.name, 0.0)
        if len(by_source) == 1:
            (source,) = by_source
            out.append(Share(source, kernel.kind, seconds, int(source == "compute")))
            continue
        compute = min(by_source.pop("compute", 0.0), seconds)
        if compute > 0:
            out.append(Share("compute", kernel.kind, compute, 1, split=True))
        rest, weight = seconds - compute, sum(by_source.values())
        for source, own in by_source.items():
            part = rest * own / weight if weight else rest / len(by_source)
            out.append(Share(source, kernel.kind, part, split=True))
    return out


# ---------------------------------------------------------------------------------------
# The breakdown


@dataclass(frozen=True)
class Breakdown:
    """A graph's (or a microbatch's) time under the plan against the baseline, by source,
    in seconds (the module docstring defines each)."""

    baseline_s: float
    plan_s: float
    baseline_exposed_s: float
    plan_exposed_s: float
    joins_s: float
    cuts_s: float
    efficiency_s: Mapping[str, float]  # by KernelClass value, launch overheads apart
    launches_s: float
    clock_s: float
    contention_s: float
    baseline_contention_s: float
    split_s: float  # of the plan's kernel time: fused runs split between sources

    @property
    def hidden_s(self) -> float:
        return self.baseline_exposed_s - self.plan_exposed_s

    @property
    def overheads_s(self) -> float:
        return (self.joins_s + self.cuts_s + sum(self.efficiency_s.values())
                + self.launches_s + self.clock_s)

    @property
    def accounted_s(self) -> float:
        """baseline - hidden + overheads + contention."""
        return self.baseline_s - self.hidden_s + self.overheads_s + self.contention_s

    @property
    def residual_s(self) -> float:
        return self.plan_s - self.accounted_s

    def scaled(self, n: int) -> Breakdown:
        return Breakdown(**{
            f.name: ({k: n * v for k, v in value.items()} if isinstance(value, Mapping)
                     else n * value)
            for f in dataclasses.fields(self) for value in (getattr(self, f.name),)
        })

    def __add__(self, other: Breakdown) -> Breakdown:
        return Breakdown(**{
            f.name: ({k: a[k] + b[k] for k in a} if isinstance(a, Mapping) else a + b)
            for f in dataclasses.fields(self)
            for a, b in ((getattr(self, f.name), getattr(other, f.name)),)
        })

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "efficiency_s": dict(self.efficiency_s),
                "hidden_s": self.hidden_s, "overheads_s": self.overheads_s,
                "accounted_s": self.accounted_s, "residual_s": self.residual_s}


@dataclass(frozen=True)
class Entry:
    """One graph of an instruction of the microbatch: what the plan runs, how often."""

    instruction: str  # "forward" or "backward"
    graph: GraphFrontier
    count: int
    choice: Choice


@dataclass(frozen=True)
class GraphResult:
    """One graph of the microbatch broken down (one run of it), and the clocks its
    kernels ran at (the power limit's where it throttled the one asked for)."""

    entry: Entry
    breakdown: Breakdown
    baseline_mhz: int
    plan_mhz: int

    @property
    def per_microbatch(self) -> Breakdown:
        return self.breakdown.scaled(self.entry.count)


def graph_breakdown(
    gpu: SimulatedGPU, graphs: Materialiser, entry: Entry, world_size: int
) -> GraphResult:
    """``entry``'s graph as its choice runs it against its baseline (unrewritten, default
    clock), each costed alone as the planner costs a graph."""
    key, choice = entry.graph.graph_hash, entry.choice
    default = gpu.search_clocks()[0]
    clock = choice.clock_mhz or default
    base_gm = graphs.graph(key, Choice(1))
    base = timed(gpu, base_gm, default, world_size)
    plan_gm = base_gm if choice.nanobatches == 1 else graphs.graph(key, choice)
    plan = timed(gpu, plan_gm, clock, world_size, base.cost if plan_gm is base_gm else None)
    base_there = gpu.isolated_kernel_s(base.cost, plan.ran_mhz)
    launch = gpu.spec.launch_overhead_s
    efficiency = dict.fromkeys((c.value for c in KernelClass), 0.0)
    launches = 0.0
    split = joins = cuts = 0.0
    for share in shares(gpu, plan_gm, plan, world_size, choice.nanobatches > 1):
        split += share.seconds if share.split else 0.0
        if share.source == "joins":
            joins += share.seconds
        elif share.source == "cuts":
            cuts += share.seconds
        else:
            efficiency[share.kind.value] += share.seconds - share.launches * launch
            launches += share.launches * launch
    for kernel, seconds in zip(base.cost.kernels, base_there, strict=True):
        efficiency[kernel.kind.value] -= seconds - launch
        launches -= launch
    return GraphResult(entry, Breakdown(
        baseline_s=base.time_s, plan_s=plan.time_s, baseline_exposed_s=base.exposed_s,
        plan_exposed_s=plan.exposed_s, joins_s=joins, cuts_s=cuts, efficiency_s=efficiency,
        launches_s=launches, clock_s=sum(base_there) - sum(base.isolated_s),
        contention_s=plan.contention_s, baseline_contention_s=base.contention_s,
        split_s=split,
    ), base.ran_mhz, plan.ran_mhz)


@dataclass(frozen=True)
class StageTimes:
    """One microbatch's instruction times on a stage under the plan, seconds."""

    stage: int
    forward_s: float
    backward_s: float

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s


def point_of(graph: GraphFrontier, choice: Choice) -> FrontierPoint:
    """The point of ``graph`` the plan chose (on its frontier, or a baseline one)."""
    for point in (*graph.points, *graph.frequency_only, graph.baseline, *graph.nanobatched):
        if point.choice == choice:
            return point
    raise BreakdownError(f"{graph.label}: {choice} is no point of its frontier")


def entries(plan: OfflinePlan, stage: StageGraphs, microbatch: int) -> list[Entry]:
    """The graphs ``stage`` runs for ``microbatch``, forward then backward, as chosen."""
    out = []
    for kind in ("forward", "backward"):
        (choice,) = (c for i, c in zip(plan.dag.instructions, plan.chosen.choices, strict=True)
                     if (i.stage, i.microbatch, i.kind) == (stage.stage, microbatch, kind))
        out += [Entry(kind, g, n, c)
                for (g, n), c in zip(getattr(stage, kind), choice.graphs, strict=True)]
    return out


def stage_times(plan: OfflinePlan, microbatch: int) -> list[StageTimes]:
    times = []
    for stage in plan.stages:
        by_kind = {"forward": 0.0, "backward": 0.0}
        for e in entries(plan, stage, microbatch):
            by_kind[e.instruction] += e.count * point_of(e.graph, e.choice).time_s
        times.append(StageTimes(stage.stage, by_kind["forward"], by_kind["backward"]))
    return times


def steady_microbatch(workload: Workload) -> int:
    """The middle microbatch: in 1F1B's steady phase on every stage (a forward after a
    backward on the first) where there are at least 2 pp - 1 microbatches."""
    return workload.microbatches // 2


def same_choices(plan: OfflinePlan, stage: int, microbatch: int) -> list[int]:
    """The microbatches whose instructions on ``stage`` choose as ``microbatch``'s do."""
    chosen: dict[int, list[object]] = {}
    for i, c in zip(plan.dag.instructions, plan.chosen.choices, strict=True):
        if i.stage == stage:
            chosen.setdefault(i.microbatch, []).append((i.kind, c))
    return sorted(m for m, c in chosen.items() if sorted(c, key=str) ==
                  sorted(chosen[microbatch], key=str))


@dataclass(frozen=True)
class Result:
    """A breakdown run: the plan, the stage and microbatch broken down, per graph and in
    all."""

    workload: Workload
    plan: OfflinePlan
    stages: tuple[StageTimes, ...]
    critical: int
    microbatch: int
    same: tuple[int, ...]
    graphs: tuple[GraphResult, ...]

    def disagreements(self, rel: float = 1e-6) -> list[str]:
        """Graphs whose materialised costs differ from the planner's (its frontier point
        and baseline): the breakdown would then explain another time than the plan's."""
        out = []
        for g in self.graphs:
            e, b = g.entry, g.breakdown
            planned = point_of(e.graph, e.choice).time_s
            for what, mine, theirs in (("plan", b.plan_s, planned),
                                       ("baseline", b.baseline_s, e.graph.baseline.time_s)):
                if abs(mine - theirs) > rel * theirs:
                    out.append(f"{e.instruction} {e.graph.label} {what}: {mine * 1e3:.4f} ms "
                               f"here, {theirs * 1e3:.4f} ms planned")
        return out

    @property
    def total(self) -> Breakdown:
        """The microbatch's: every graph's breakdown times its count, summed."""
        return functools.reduce(operator.add, (g.per_microbatch for g in self.graphs))


def break_down(
    workload: Workload, plan: OfflinePlan, graphs: Materialiser, gpu: SimulatedGPU,
    microbatch: int | None = None, choices: Mapping[tuple[str, str], Choice] | None = None,
) -> Result:
    """The critical stage's graphs of ``microbatch`` (default: ``steady_microbatch``)
    broken down. ``choices``: what to run instead of the plan's, by (instruction, label)."""
    m = steady_microbatch(workload) if microbatch is None else microbatch
    times = stage_times(plan, m)
    critical = max(times, key=lambda t: t.total_s).stage
    chosen = entries(plan, plan.stages[critical], m)
    if choices:
        chosen = [dataclasses.replace(e, choice=choices.get((e.instruction, e.graph.label),
                                                            e.choice)) for e in chosen]
    broken = tuple(graph_breakdown(gpu, graphs, e, workload.tp) for e in chosen)
    return Result(workload, plan, tuple(times), critical, m,
                  tuple(same_choices(plan, critical, m)), broken)


def traced_and_planned(
    workload: Workload, device: str, cache_dir: str | Path | None = None,
    max_solve_s: float = MAX_SOLVE_S,
) -> tuple[OfflinePlan, Materialiser]:
    """``workload`` traced with a graph-keeping backend and planned for the fastest
    iteration, as ``kareus plan --fastest`` plans it (under a fake group: ``fake_group``)."""
    backend = KeepingBackend(tracing_options(device, cache_dir))
    stages = trace_stages(workload, device, cache_dir=cache_dir, backend=backend)
    plan = plan_offline(workload, device, Budget("fastest"), stages=stages,
                        max_solve_s=max_solve_s)
    return plan, Materialiser(backend.kept)


# ---------------------------------------------------------------------------------------
# Output


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def _choice_words(choice: Choice, default_mhz: int) -> str:
    clock = choice.clock_mhz or default_mhz
    return f"k={choice.nanobatches} @ {clock} MHz"


def rows(b: Breakdown, classes: Sequence[str]) -> list[tuple[str, float]]:
    """The table's rows of ``b``, in the order of the identity."""
    return [
        ("baseline time", b.baseline_s),
        ("baseline exposed comm", b.baseline_exposed_s),
        ("plan exposed comm", b.plan_exposed_s),
        ("- hidden", -b.hidden_s),
        ("+ joins", b.joins_s),
        ("+ cuts", b.cuts_s),
        *((f"+ efficiency: {CLASS_WORDS[KernelClass(c)]}", b.efficiency_s[c]) for c in classes),
        ("+ efficiency: launch overheads", b.launches_s),
        ("+ clock (asked, or the power limit's)", b.clock_s),
        ("+ contention", b.contention_s),
        ("= accounted", b.accounted_s),
        ("plan time", b.plan_s),
        ("residual (plan - accounted)", b.residual_s),
        ("  of which baseline's own contention", -b.baseline_contention_s),
        ("  fused runs split between sources", b.split_s),
    ]


def table(result: Result, default_mhz: int) -> Table:
    w = result.workload
    times = result.stages[result.critical]
    title = (f"{w.name} TP{w.tp} PP{w.pp}, {w.microbatches} x {w.microbatch_size} x {w.seq}, "
             f"recompute {w.recompute}, regions {w.regions} on {result.plan.device}: stage "
             f"{result.critical}, microbatch {result.microbatch} (ms, modelled)")
    t = Table(title=title, title_justify="left")
    t.add_column("")
    for g in result.graphs:
        t.add_column(f"{g.entry.graph.label} x{g.entry.count}", justify="right")
    t.add_column(f"microbatch\n(fwd {_ms(times.forward_s)} + bwd {_ms(times.backward_s)})",
                 justify="right")
    total = result.total
    per_graph = [g.per_microbatch for g in result.graphs]
    classes = [c.value for c in CLASS_WORDS if c is not KernelClass.FP32_GEMM
               or any(b.efficiency_s[c.value] for b in (*per_graph, total))]
    t.add_row("plan's choice", *(_choice_words(g.entry.choice, default_mhz)
                                 for g in result.graphs), "")
    t.add_row("kernels ran at (MHz)", *(f"{g.baseline_mhz} / {g.plan_mhz}"
                                        for g in result.graphs), "baseline / plan")
    for i, (name, value) in enumerate(rows(total, classes)):
        t.add_row(name, *(_ms(rows(b, classes)[i][1]) for b in per_graph), _ms(value),
                  end_section=name in ("- hidden", "+ contention", "residual (plan - accounted)"))
    return t


def result_json(result: Result, device_model: str) -> dict[str, Any]:
    w, plan = result.workload, result.plan
    return {
        "workload": {
            "model": w.name, "tp": w.tp, "pp": w.pp, "microbatches": w.microbatches,
            "microbatch_size": w.microbatch_size, "seq": w.seq, "sp": w.sp,
            "recompute": w.recompute, "schedule": plan.schedule, **w.describe(),
        },
        "device": plan.device,
        "model_version": device_model,
        "kareus_version": __version__,
        "modelled": "every figure is the simulated GPU's, in seconds",
        "plan": {"budget": "fastest", "time_s": plan.chosen.time_s,
                 "energy_j": plan.chosen.energy_j, "gap": plan.chosen.gap,
                 "baseline_time_s": plan.baseline.time_s},
        "stages": [dataclasses.asdict(s) | {"total_s": s.total_s} for s in result.stages],
        "critical_stage": result.critical,
        "microbatch": result.microbatch,
        "microbatches_choosing_alike": list(result.same),
        "graphs": [
            {"instruction": e.instruction, "label": e.graph.label,
             "graph_hash": e.graph.graph_hash, "count": e.count,
             "choice": dataclasses.asdict(e.choice),
             "kernels_ran_at_mhz": {"baseline": g.baseline_mhz, "plan": g.plan_mhz},
             "per_run": g.breakdown.to_json(),
             "planned_s": {"plan": point_of(e.graph, e.choice).time_s,
                           "baseline": e.graph.baseline.time_s}}
            for g in result.graphs for e in (g.entry,)
        ],
        "per_microbatch": result.total.to_json(),
        "disagreements_with_the_planner": result.disagreements(),
        "attribution": {
            "joins": sorted(JOIN_ROLES), "cuts": sorted(CUT_ROLES),
            "compute": sorted(COMPUTE_ROLES),
            "mixed fused runs": "compute members first, up to their own isolated times; the "
                                "rest between joins and cuts by their own isolated times",
        },
    }


def run_key(w: Workload, device: str) -> str:
    return (f"{w.name} tp{w.tp} pp{w.pp} mb{w.microbatches}x{w.microbatch_size} seq{w.seq}"
            f"{' sp' if w.sp else ''} recompute-{w.recompute} {w.layout} "
            f"regions-{w.regions} {device}")


def write(path: Path, key: str, record: dict[str, Any]) -> None:
    """Add ``record`` under ``key`` to the runs ``path`` holds (replacing one of that key)."""
    runs: dict[str, Any] = {}
    if path.exists():
        runs = json.loads(path.read_text()).get("runs", {})
    runs[key] = record
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"runs": runs}, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_arguments(parser)
    parser.add_argument("--device", default="sim:a100-sxm4-40gb")
    parser.add_argument("--microbatch", type=int, default=None,
                        help="which microbatch's choices (default: the middle one)")
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--json", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    workload = workload_of(args)
    gpu = resolve_device(args.device)
    if not isinstance(gpu, SimulatedGPU):
        parser.error(f"--device {args.device!r}: the breakdown needs a simulated GPU")
    console = Console(width=200)
    start = time.perf_counter()
    with fake_group(workload.tp), contextlib.redirect_stdout(sys.stderr):  # progress aside
        plan, graphs = traced_and_planned(workload, args.device, args.cache_dir)
        result = break_down(workload, plan, graphs, gpu, args.microbatch)
    elapsed = time.perf_counter() - start
    default = gpu.search_clocks()[0]
    console.print(traced_words(workload), markup=False)
    console.print(
        f"fastest plan {plan.chosen.time_s * 1e3:.2f} ms per iteration (solver gap "
        f"{plan.chosen.gap:.3g}), baseline {plan.baseline.time_s * 1e3:.2f} ms; default clock "
        f"{default} MHz", markup=False)
    for s in result.stages:
        console.print(f"stage {s.stage}, microbatch {result.microbatch}: forward "
                      f"{_ms(s.forward_s)} ms + backward {_ms(s.backward_s)} ms = "
                      f"{_ms(s.total_s)} ms", markup=False)
    console.print(f"critical stage {result.critical}; microbatches choosing as microbatch "
                  f"{result.microbatch} there: {list(result.same)}", markup=False)
    console.print(table(result, default))
    for line in result.disagreements():
        console.print(f"warning: costed apart from the planner: {line}", markup=False)
    total = result.total
    console.print(f"residual {total.residual_s * 1e3:+.4f} ms per microbatch "
                  f"({total.residual_s / total.plan_s:+.2e} of the plan's time); "
                  f"built in {elapsed:.0f} s", markup=False)
    write(args.json, run_key(workload, plan.device),
          result_json(result, gpu.model_version) | {"seconds": elapsed})
    console.print(f"wrote {args.json}", markup=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
