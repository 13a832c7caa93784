"""A compiled graph that runs what the plan chooses for it, from its next call on.

AOT autograd compiles a step's backward lazily, so the step's plan is known only after its
graphs first ran; each graph starts with the choice known when it compiled, and from its
next call after the plan is adopted runs the plan's choice for it, compiling it then.
Where asked, the first call of each newly chosen rewrite is checked against the
unrewritten graph (``kareus.verify``) before it is trusted. On a device that must run a
graph to cost it, the graph's first call measures and plans it first, on its inputs
(``planner.measured``). Every call is told to the plan's source, which finds where a step
starts among them and measures the steps there (``runtime.step_meter``).

Under a pipeline's plan a graph's choice is its instruction's (``runtime.pipelining``
says which runs): each variant is compiled once, without a clock switch, and every call
first asks for its instruction's clock (the ``kareus::set_clock`` op, called eagerly: the
switch is queued at that point of the stream, as a graph's own would be).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from kareus.passes.decide import Choice, Decision
from kareus.passes.ops import SET_CLOCK
from kareus.runtime.materialise import GraphBuilder, Run
from kareus.runtime.pipelining import Instruction, InstructionTracker

log = logging.getLogger("kareus")


class PlannedGraph(Protocol):
    label: str
    graph_hash: str
    choice: Choice


class PlannedInstruction(Protocol):
    def choice_of(self, graph_hash: str) -> Choice | None: ...


class Plan(Protocol):
    graphs: Sequence[PlannedGraph]
    instructions: Sequence[PlannedInstruction]

    def instruction(self, stage: int, microbatch: int, kind: str
                    ) -> PlannedInstruction | None: ...


class PlanSource(Protocol):
    """Where the step's plan appears once made (the step planner): None until then."""

    plan: Plan | None

    def graph_called(self, label: str, graph_hash: str, calls: int) -> None:
        """The graph ``label`` of hash ``graph_hash`` is called, for the ``calls``-th time
        (a step may start here)."""


class Reports(Protocol):
    def update(self, label: str, notes_added: tuple[str, ...] = (), **changes: Any) -> None: ...


class Verifier(Protocol):
    def __call__(self, choice: Choice, args: list[Any], run: Run) -> tuple[Any, Run]:
        """The outputs of ``run``'s first call on ``args``, and what runs from then on."""


class SelectableGraph:
    """A boxed callable, as Inductor's: it takes its inputs as one list and may clear it."""

    def __init__(
        self,
        label: str,
        graph_hash: str,
        choice: Choice,
        run: Run,
        builder: GraphBuilder,
        plans: PlanSource,
        reports: Reports,
        verify: Verifier | None = None,
        instructions: InstructionTracker | None = None,
        first_call: Callable[[list[Any]], None] | None = None,
    ) -> None:
        self._boxed_call = True  # an instance attribute: wrappers copy __dict__, not the class
        self.label, self.graph_hash, self.choice = label, graph_hash, choice
        self._run, self._builder, self._plans = run, builder, plans
        self._reports, self._verify = reports, verify
        self._plan: Plan | None = None
        self._unverified = verify is not None and choice.nanobatches > 1
        self._instructions = instructions
        self._variants: dict[tuple[int, tuple], Run] = {}  # unclocked, by (k, partitions)
        self._first_call = first_call
        """Run before the first call, on its inputs: a graph that can only be costed by
        running it is measured and planned then (``planner.measured``)."""
        self.calls = 0  # in this process, its first included

    def __call__(self, args: list[Any]) -> Any:
        if self._first_call is not None:
            first, self._first_call = self._first_call, None
            first(args)
        self.calls += 1
        self._plans.graph_called(self.label, self.graph_hash, self.calls)
        now = None if self._instructions is None else self._instructions.current()
        if now is not None:
            self._instructions.called(self.label, self.graph_hash)
        plan = self._plans.plan
        if self._instructions is not None and plan is not None and plan.instructions:
            entry = None if now is None else plan.instruction(*now)
            choice = None if entry is None else entry.choice_of(self.graph_hash)
            if choice is not None:
                return self._run_instruction(now, choice, args)
            plan = self._plan  # outside its instructions a graph keeps the choice it has
        if plan is not None and plan is not self._plan:
            self._plan = plan
            entry = next((g for g in plan.graphs if g.label == self.label
                          and g.graph_hash == self.graph_hash), None)
            if entry is not None and entry.choice != self.choice:
                log.info("%s: switching to the plan's choice %s", self.label, entry.choice)
                decision, self._run = self._builder.build(entry.choice, args)
                self._ran(decision)
                self.choice = entry.choice
                self._unverified = self._verify is not None and entry.choice.nanobatches > 1
        if self._unverified:
            self._unverified = False
            outputs, self._run = self._verify(self.choice, args, self._run)
            return outputs
        return self._run(args)

    def _run_instruction(self, now: Instruction, choice: Choice, args: list[Any]) -> Any:
        """``choice``'s variant at ``choice``'s clock, for instruction ``now``."""
        key = (choice.nanobatches, choice.partitions)
        run = self._variants.get(key)
        fresh = run is None
        if fresh:
            log.info("%s: compiling %s for the pipeline's instructions", self.label, choice)
            decision, run = self._builder.build(choice, args, clocked=False)
            why = "" if decision.reason is None else f" (falls back: {decision.reason.detail})"
            ran = decision.choice
            note = (f"pipeline instructions run k={ran.nanobatches}, partitions "
                    f"{list(ran.partitions)} (each at its instruction's clock){why}")
            self._reports.update(self.label, notes_added=(note,))
            self._variants[key] = run
        stage, microbatch, kind = now
        SET_CLOCK(f"{self.label} s{stage} {kind[0]}{microbatch}", choice.clock_mhz)
        if fresh and self._verify is not None and choice.nanobatches > 1:
            outputs, self._variants[key] = self._verify(choice, args, run)
            return outputs
        return run(args)

    def _ran(self, decision: Decision) -> None:
        """The report says what runs now (and why unrewritten, where it fell back)."""
        changes: dict[str, Any] = {"choice": decision.choice}
        if decision.reason is not None:
            changes["fallback"] = decision.reason
        self._reports.update(self.label, **changes)
