"""Planning while the step compiles: each graph's choice, and the step's plan once known.

AOT autograd compiles a step's backward lazily, at its first backward call, after the
forward has run once; so the plan cannot be made when the forward compiles. Each graph
starts with the best choice known when it compiles: the plan's for it (a ``plan`` option,
or the plan an earlier run with the same options stored in the cache directory), else a
provisional one from its own options under the budget. Once every forward has its
backward, the step is planned; the ranks agree on the plan through the store, it is
stored, and every graph runs its planned choice from its next call on
(``runtime.selectable``), compiling it then if it is not the one it started with. A second
run with the same options finds the stored plan, so it compiles only what runs.

Once a plan runs, every call of a planned graph is told to the planner
(``graph_called``): at the plan's first graph, at the first of a step's microbatches, a step
starts, and the step meter measures the steps there (``runtime.step_meter``, on a device
that reads energy); each window it measures is published with the plan
(``Plan.measured``: what ``kareus.current_plan()`` names) and stored with it by rank 0.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kareus.devices.base import Device, StepMeasurement
from kareus.passes.analyse import GraphAnalysis
from kareus.passes.decide import Choice
from kareus.planner.budget import Budget, BudgetError, constrains_nothing
from kareus.planner.graph import GraphCost, GraphFrontier, graph_frontier
from kareus.planner.plan import Plan, PlanError, make_plan
from kareus.profiler.profile import PartitionProfile
from kareus.runtime.agreement import agree, group_size
from kareus.runtime.step_meter import StepMeter

log = logging.getLogger("kareus")


@dataclass(frozen=True)
class _Graph:
    kind: str  # "forward" | "backward" | "inference"
    region: int
    frontier: GraphFrontier
    groups: tuple[str, ...]  # the process groups of its collectives


def complete(kinds: Sequence[tuple[str, int]]) -> bool:
    """Whether graphs of these (kind, region) are a whole step: every forward has its
    backward (an inference graph has none)."""
    forwards = {r for k, r in kinds if k == "forward"}
    return bool(kinds) and forwards == {r for k, r in kinds if k == "backward"}


class StepPlanner:
    """The step's graphs as they compile (one per label, the last compiled), and its plan.

    ``options``: all the backend's options (recorded in the plan); ``planning``: those that
    change what a plan chooses, which name the plan stored for the next run; ``counts``:
    the nanobatch counts a graph may be planned at (None: each graph's own).
    ``option_sources``: where each option given came from, recorded in the plans this
    run makes. ``budget_defaulted``: nobody asked for ``budget`` (kareus's default): where no plan
    meets it (measurements of the plans and of the baseline that disagree), the fastest
    plan runs with a warning instead of failing the job the user never gave a budget.
    """

    def __init__(
        self,
        options: Mapping[str, Any],
        planning: Mapping[str, Any],
        budget: Budget,
        device: Device,
        kareus_version: str,
        plans_dir: Path,
        *,
        counts: tuple[int, ...] | None,
        microbatches: int = 1,
        timeout_s: float,
        given: Plan | None = None,
        publish: Callable[[Plan], None] = lambda plan: None,
        budget_defaulted: bool = False,
        option_sources: Mapping[str, str] | None = None,
    ) -> None:
        self.options, self.budget, self.device = dict(options), budget, device
        self.budget_defaulted = budget_defaulted
        self.option_sources = dict(option_sources or {})
        self.kareus_version, self.counts = kareus_version, counts
        self.microbatches, self.timeout_s, self.publish = microbatches, timeout_s, publish
        self.plan: Plan | None = None
        self._meter: StepMeter | None = None
        self._first: tuple[str, str] | None = None  # (label, hash) of the plan's first graph
        self._stores_measured = self._told = False
        digest = hashlib.sha256(json.dumps(
            [dict(sorted(planning.items())), device.identity, device.model_version,
             kareus_version], default=str,
        ).encode()).hexdigest()[:16]
        self.path = plans_dir / f"{digest}.json"
        self._stored: Plan | None = None
        self._graphs: dict[str, _Graph] = {}
        self.pipelined = False
        """True: the graphs are a pipeline's stages, planned once an iteration ran
        (``planner.pipeline_step``), not when the step's graphs compiled."""
        if given is not None:
            given.check_device(device, self._given_source)
            self._run(given)

    def graph_counts(self, analysis: GraphAnalysis) -> tuple[int, ...]:
        """The nanobatch counts the plan may choose for ``analysis``'s graph."""
        return analysis.space.nanobatches if self.counts is None else self.counts

    def choose(
        self,
        analysis: GraphAnalysis,
        profiles: Sequence[PartitionProfile],
        cost: GraphCost,
        *,
        region: int,
        compile_key: str,
    ) -> tuple[Choice | None, str | None]:
        """The plan's choice for this graph from its frontier (its profiles composed with
        ``cost``, the device's cost of the whole graph), planning the step when this graph
        completes it, and a note on where the choice comes from; (None, why) where the
        graph cannot be planned (it runs as the options say)."""
        frontier, why_not = self._frontier(analysis, profiles, cost)
        if frontier is None:
            return None, why_not
        groups = tuple(sorted({c.group_name for c in analysis.collectives}))
        self._graphs[frontier.label] = _Graph(analysis.kind, region, frontier, groups)
        if self.complete() and not self.pipelined:
            self._plan_step(compile_key)
        choice, source = self.initial_choice(frontier, analysis.kind)
        return choice, f"planned: {choice} ({source})"

    @property
    def _given_source(self) -> str:
        """What names the given plan in messages: its path."""
        return str(self.options.get("plan"))

    def given_choice(self, analysis: GraphAnalysis) -> tuple[Choice | None, str]:
        """The given plan's choice for this graph (a ``PlanError`` where it was made for
        another graph of its kind, or is no variant of it at a clock of the device)."""
        assert self.plan is not None
        source = self._given_source
        try:
            entry = self.plan.match(analysis.label, analysis.key, analysis.kind)
        except PlanError as exc:  # it names the graphs; the file too
            raise PlanError(f"{source}: {exc}") from exc
        if entry is None:
            return None, f"not in the plan {source}: runs as the options say"
        self.plan.check_choice(entry, analysis.space, self.device, source)
        return entry.choice, f"choice from the plan {source}"

    def explore(
        self, analysis: GraphAnalysis, profiles: Sequence[PartitionProfile], cost: GraphCost
    ) -> GraphFrontier | None:
        """The graph's frontier from ``cost``: what asks a device that measures whole graphs
        for the variants to measure (``planner.measured``)."""
        return graph_frontier(analysis, profiles, self.graph_counts(analysis),
                              self.device.search_clocks(), cost)

    def _frontier(
        self, analysis: GraphAnalysis, profiles: Sequence[PartitionProfile], cost: GraphCost
    ) -> tuple[GraphFrontier | None, str | None]:
        device = self.device
        try:
            frontier = self.explore(analysis, profiles, cost)
        except Exception as exc:  # noqa: BLE001 - a graph that cannot be planned still runs
            log.warning("%s: not planned: %s: %s", analysis.label, type(exc).__name__, exc)
            return None, f"not planned: {type(exc).__name__}: {exc}"
        if frontier is None:
            why = (f"not planned: {device.name} cannot cost a whole graph without running it; "
                   "runs as the options say at the default clock")
            log.warning("%s: %s", analysis.label, why)  # the budget asked for goes unmet
            return None, why
        if not frontier.points:
            return None, "not planned: no variant of the graph could be costed at any clock"
        return frontier, None

    def _plan_step(self, compile_key: str) -> None:
        """Plan the step (a ``BudgetError`` where no plan meets the budget, saying where the
        device limits the plans, as one that cannot set clocks does) and run it once every
        rank of the step's collectives made the same plan."""
        try:
            plan = self.make()
        except BudgetError as exc:
            limitation = self.device.clock_limitation
            if self.budget_defaulted:
                log.warning("%s%s; no budget was given (the default is time_budget=1.0), so "
                            "the fastest plan runs", exc, f"; {limitation}" if limitation else "")
                plan = self.make(Budget("fastest"))
            elif limitation is None:
                raise
            else:
                raise BudgetError(f"{exc}; {limitation}") from exc
        verdict = agree(f"{compile_key}/plan", plan.digest, self.groups(),
                        timeout_s=self.timeout_s)
        if not verdict:
            log.warning("the ranks made different plans (%s); each graph keeps its choice",
                        verdict.reason)
            return
        self.adopt(plan)
        idle = constrains_nothing(plan.frontier, plan.baseline, plan.budget)
        if idle:  # news to whoever gave the budget; the default's is no surprise
            log.log(logging.INFO if self.budget_defaulted else logging.WARNING, "%s", idle)
        log.info(
            "kareus plan: %.4g s, %.4g J per step and GPU (baseline %.4g s, %.4g J); %s",
            plan.predicted.time_s, plan.predicted.energy_j, plan.baseline.time_s,
            plan.baseline.energy_j,
            ", ".join(f"{g.label} {g.choice}" for g in plan.graphs),
        )

    def initial_choice(self, graph: GraphFrontier, kind: str) -> tuple[Choice, str]:
        """The choice ``graph`` starts with, and where it comes from: this step's plan, the
        one an earlier run stored (matched by graph hash), else a provisional one."""
        entry, source = None, ""
        if self.plan is not None:
            entry, source = self.plan.graph_like(graph.graph_hash, kind), "the plan"
        if entry is None and self.stored is not None:
            entry, source = self.stored.graph_like(graph.graph_hash, kind), "the stored plan"
        if entry is not None and any(o.choice == entry.choice for o in graph.points):
            return entry.choice, source
        try:
            chosen = make_plan([graph], self._alone(self.budget), self.device, self.options,
                               self.kareus_version)
        except BudgetError:  # the step may still meet it; the graph alone does not
            chosen = make_plan([graph], Budget("fastest"), self.device, self.options,
                               self.kareus_version)
        return chosen.graphs[0].choice, "provisional, until the step is planned"

    @property
    def stored(self) -> Plan | None:
        """The plan an earlier run stored for these options, if any and readable."""
        if self._stored is None and self.path.is_file():
            try:
                self._stored = Plan.load(self.path)
            except PlanError as exc:
                log.warning("ignoring the stored plan: %s", exc)
        return self._stored

    def complete(self) -> bool:
        """Whether the step is known: every forward has its backward."""
        return complete([(g.kind, g.region) for g in self._graphs.values()])

    def planned(self, label: str) -> Choice | None:
        """The step plan's choice for the graph ``label`` (None: no plan yet, or none for
        it there)."""
        if self.plan is None:
            return None
        return next((g.choice for g in self.plan.graphs if g.label == label), None)

    def graph_frontiers(self) -> dict[str, GraphFrontier]:
        """Every planned graph's frontier, by label."""
        return {label: g.frontier for label, g in self._graphs.items()}

    def gpus(self, labels: Sequence[str]) -> int:
        """How many GPUs run these graphs alike: their largest collective group (1: none)."""
        names = {n for label in labels if label in self._graphs
                 for n in self._graphs[label].groups}
        return max((group_size(n) for n in names), default=1)

    def groups(self) -> tuple[str, ...]:
        return tuple(sorted({n for g in self._graphs.values() for n in g.groups}))

    def frontiers(self) -> tuple[tuple[str, int, GraphFrontier], ...]:
        """Each planned graph compiled so far as (kind, region, frontier), in the order a
        step runs them: forwards (and inference graphs) in region order, then backwards in
        reverse. A graph that could not be planned has none and is not listed."""
        order = {"forward": 0, "inference": 0, "backward": 1}
        graphs = sorted(self._graphs.values(),
                        key=lambda g: (order[g.kind], g.region if g.kind != "backward"
                                       else -g.region))
        return tuple((g.kind, g.region, g.frontier) for g in graphs)

    def make(self, budget: Budget | None = None) -> Plan:
        """The step's plan: its graphs in step order (``frontiers``), under ``budget``
        (default: the planner's; a ``BudgetError`` where none meets it)."""
        return make_plan([f for _, _, f in self.frontiers()], budget or self.budget,
                         self.device, self.options, self.kareus_version, self.microbatches)

    def adopt(self, plan: Plan, store: bool = True) -> None:
        """Run ``plan`` from now on (and store it for the next run, with where this run's
        options came from)."""
        if store:
            plan = dataclasses.replace(plan, option_sources=self.option_sources)
        self._run(plan, store)
        if store:
            self._save(self.plan)

    def _save(self, plan: Plan) -> None:
        try:
            plan.save(self.path)
        except OSError as exc:
            log.warning("could not store the plan in %s: %s", self.path, exc)

    def _run(self, plan: Plan, stores: bool = False) -> None:
        """Run ``plan`` (without the measurement of the run that stored it) and measure
        its steps from its first graph's next call (a pipeline's iterations: not yet);
        ``stores``: this run stores it, with its measurements."""
        if plan.measured is not None:
            plan = dataclasses.replace(plan, measured=None)
        self.plan = plan
        self.publish(plan)
        self._first, self._meter, self._stores_measured = None, None, stores
        self._told = False
        if plan.pipeline is None and plan.graphs:
            self._first = (plan.graphs[0].label, plan.graphs[0].graph_hash)
            self._meter = StepMeter.of(self.device, f"kareus/measured/{plan.digest}")

    def graph_called(self, label: str, graph_hash: str, calls: int) -> None:
        """A planned graph is called, for the ``calls``-th time in this process: where it
        is the plan's first graph at the first of a step's microbatches, a step starts and
        the step meter reads there (it costs a comparison at every other call)."""
        if (label, graph_hash) != self._first or (calls - 1) % self.microbatches:
            return
        assert self._meter is not None and self.plan is not None
        measured = self._meter.step_started((calls - 1) // self.microbatches)
        if measured is not None:
            self._measured(self.plan, measured)

    def _measured(self, plan: Plan, measured: StepMeasurement) -> None:
        """Publish ``plan`` with ``measured`` (rank 0 stores it where this run stores the
        plan), and say so: at INFO for the plan's first window, later at DEBUG."""
        first, self._told = not self._told, True
        now = dataclasses.replace(plan, measured=measured)
        self.publish(now)
        if self._stores_measured and measured.rank == 0:
            self._save(now)
        total = measured.total_energy_j
        (log.info if first else log.debug)(
            "kareus measured: %.4g s, %.4g J per step on this GPU (rank %d; steps %d-%d), "
            "predicted %.4g s, %.4g J; %s", measured.time_s, measured.energy_j,
            measured.rank, measured.first_step, measured.first_step + measured.steps - 1,
            plan.predicted.time_s, plan.predicted.energy_j,
            f"{total:.4g} J per step on all {measured.world_size} GPUs" if total is not None
            else f"the total waits for all {measured.world_size} ranks' measurements")

    def _alone(self, budget: Budget) -> Budget:
        """What a budget asks of one graph planned alone: a fraction of its own baseline,
        a trade-off as is; an absolute amount is the step's, so the fastest for now."""
        return budget if budget.value is None or budget.kind == "tradeoff" else Budget("fastest")
