"""Planning while the step compiles: each graph's choice, and the step's plan once known.

AOT autograd compiles a step's backward lazily, at its first backward call, after the
forward has run once; so the plan cannot be made when the forward compiles. Each graph
starts with the best choice known when it compiles: the plan's for it (a ``plan`` option,
or the plan an earlier run with the same options stored in the cache directory), else a
provisional one from its own options under the budget. Once every forward has its
backward, the step is planned; the ranks agree on the plan through the store, it is
stored, and every graph runs its planned choice from its next call on
(``SelectableGraph``), compiling it then if it is not the one it started with. A second
run with the same options finds the stored plan, so it compiles only what runs.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kareus.devices.base import Device
from kareus.planner.budget import Budget, BudgetError
from kareus.planner.compose import GraphChoice
from kareus.planner.graph import GraphOptions
from kareus.planner.plan import Plan, PlanError, make_plan

log = logging.getLogger("kareus")

# Options that do not change what a plan chooses: a stored plan made under others serves.
_NOT_PLANNING = frozenset({"cache_dir", "plan", "profile", "verify", "explain",
                           "agreement_timeout_s", "lowering"})


@dataclass(frozen=True)
class _Graph:
    kind: str  # "forward" | "backward" | "inference"
    region: int
    options: GraphOptions
    groups: tuple[str, ...]  # the process groups of its collectives


class StepPlanner:
    """The step's graphs as they compile (one per label, the last compiled), and its plan."""

    def __init__(
        self, options: Mapping[str, Any], budget: Budget, device: Device, kareus_version: str,
        plans_dir: Path, given: Plan | None = None,
    ) -> None:
        self.options, self.budget, self.device = dict(options), budget, device
        self.kareus_version = kareus_version
        self.plan: Plan | None = given
        planning = {k: v for k, v in sorted(self.options.items()) if k not in _NOT_PLANNING}
        digest = hashlib.sha256(json.dumps(
            [planning, device.identity, device.model_version, kareus_version], default=str,
        ).encode()).hexdigest()[:16]
        self.path = plans_dir / f"{digest}.json"
        self._stored: Plan | None = None
        self._graphs: dict[str, _Graph] = {}

    def initial_choice(self, graph: GraphOptions, kind: str) -> tuple[GraphChoice, str]:
        """The choice ``graph`` starts with, and where it comes from: this step's plan, the
        one an earlier run stored (matched by graph hash), else a provisional one."""
        entry, source = None, ""
        if self.plan is not None:
            entry, source = self.plan.graph_like(graph.graph_hash, kind), "the plan"
        if entry is None and self.stored is not None:
            entry, source = self.stored.graph_like(graph.graph_hash, kind), "the stored plan"
        if entry is not None and any(o.choice == entry.choice for o in graph.options):
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

    def add(self, kind: str, region: int, graph: GraphOptions, groups: tuple[str, ...]) -> None:
        self._graphs[graph.label] = _Graph(kind, region, graph, groups)

    def complete(self) -> bool:
        """Whether the step is known: every forward has its backward."""
        kinds = [(g.kind, g.region) for g in self._graphs.values()]
        forwards = {r for k, r in kinds if k == "forward"}
        return forwards == {r for k, r in kinds if k == "backward"} and bool(kinds)

    def groups(self) -> tuple[str, ...]:
        return tuple(sorted({n for g in self._graphs.values() for n in g.groups}))

    def make(self) -> Plan:
        """The step's plan: forwards in region order, then backwards in reverse (the order
        a step runs them), under the budget (a ``BudgetError`` where none meets it)."""
        order = {"forward": 0, "inference": 0, "backward": 1}
        graphs = sorted(self._graphs.values(),
                        key=lambda g: (order[g.kind], g.region if g.kind != "backward"
                                       else -g.region))
        return make_plan([g.options for g in graphs], self.budget, self.device, self.options,
                         self.kareus_version, self.options.get("microbatches", 1))

    def adopt(self, plan: Plan, store: bool = True) -> None:
        """Run ``plan`` from now on (and store it for the next run)."""
        self.plan = plan
        if store:
            try:
                plan.save(self.path)
            except OSError as exc:
                log.warning("could not store the plan in %s: %s", self.path, exc)

    def _alone(self, budget: Budget) -> Budget:
        """What a budget asks of one graph planned alone: a fraction of its own baseline,
        a trade-off as is; an absolute amount is the step's, so the fastest for now."""
        return budget if budget.value is None or budget.kind == "tradeoff" else Budget("fastest")


Run = Callable[[list[Any]], Any]


class SelectableGraph:
    """A compiled graph that runs what the plan chooses for it, from its next call on.

    ``build(choice, args)`` compiles a choice (with the call's inputs as examples);
    ``verify(choice, args, run)``, when set, runs a newly chosen rewrite's first call
    against the unrewritten graph and returns the outputs and what runs from then on.
    A boxed callable, as Inductor's: it takes its inputs as one list and may clear it.
    """

    def __init__(
        self,
        label: str,
        graph_hash: str,
        choice: GraphChoice,
        run: Run,
        build: Callable[[GraphChoice, list[Any]], Run],
        current_plan: Callable[[], Plan | None],
        verify: Callable[[GraphChoice, list[Any], Run], tuple[Any, Run]] | None = None,
    ) -> None:
        self._boxed_call = True  # an instance attribute: wrappers copy __dict__, not the class
        self.label, self.graph_hash, self.choice = label, graph_hash, choice
        self._run, self._build, self._current_plan, self._verify = run, build, current_plan, verify
        self._plan: Plan | None = None
        self._unverified = verify is not None and choice.nanobatches > 1

    def __call__(self, args: list[Any]) -> Any:
        plan = self._current_plan()
        if plan is not None and plan is not self._plan:
            self._plan = plan
            entry = next((g for g in plan.graphs if g.label == self.label
                          and g.graph_hash == self.graph_hash), None)
            if entry is not None and entry.choice != self.choice:
                log.info("%s: switching to the plan's choice %s", self.label, entry.choice)
                self._run = self._build(entry.choice, args)
                self.choice = entry.choice
                self._unverified = self._verify is not None and entry.choice.nanobatches > 1
        if self._unverified:
            self._unverified = False
            outputs, self._run = self._verify(self.choice, args, self._run)
            return outputs
        return self._run(args)

