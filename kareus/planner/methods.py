"""What one pipeline instruction may cost under each method the benchmark compares.

An instruction (one microbatch's forward or backward on one stage) runs a sequence of
graphs, each some number of times: per-block compilation makes every layer of a stage the
same graph (forward of stage 0: the embedding once, then the block once per layer). Every
graph of an instruction runs at the instruction's clock, as Perseus plans a clock per
instruction, so no switch happens inside one; the pipeline planner prices those between
instructions. Per method, an instruction's options at a clock are:

- ``baseline`` (Megatron-LM): every graph unrewritten at the default clock, the only option;
- ``perseus``: every graph unrewritten, at each search clock;
- ``nanobatch_perseus``: every graph at two nanobatches with its default variant (each
  collective at its earliest slot, the library's SMs) where it has one, else unrewritten,
  at each search clock: nanobatching without a search, then Perseus's clocks;
- ``kareus``: at each clock, the frontier of the sums of the graphs' own frontier points
  at that clock (k, slots, SMs searched; unrewritten is always among them).

Each option's choice is ``InstructionChoice``: the clock and every graph's ``Choice``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kareus.errors import KareusError
from kareus.passes.decide import Choice
from kareus.passes.ops import DEFAULT_CLOCK_MHZ
from kareus.planner.compose import FrontierPoint, combine, front
from kareus.planner.graph import GraphFrontier

METHODS = ("baseline", "perseus", "nanobatch_perseus", "kareus")
NANOBATCHES = 2  # the method's "Nanobatching + Perseus" baseline splits in two


class UnknownMethodError(KareusError, ValueError):
    """A method the benchmark does not know."""


@dataclass(frozen=True)
class InstructionChoice:
    """What an instruction runs: its clock (``DEFAULT_CLOCK_MHZ``: the default clocks) and
    each of its graphs' choices, in the order it runs them."""

    clock_mhz: int
    graphs: tuple[Choice, ...]


def instruction_clock(choice: InstructionChoice) -> int:
    """The switch key of an instruction's option (a switch costs the same whatever else)."""
    return choice.clock_mhz


Graphs = Sequence[tuple[GraphFrontier, int]]
"""An instruction's graphs in the order it runs them, each with how many times it runs."""


def instruction_options(graphs: Graphs, method: str) -> list[FrontierPoint]:
    """The options of an instruction running ``graphs`` under ``method`` (``METHODS``), per
    clock the Pareto set, clocks in the order the graphs' frontiers list them; an empty
    list where some graph has no point at any clock they share."""
    if method not in METHODS:
        raise UnknownMethodError(f"unknown method {method!r}: expected one of {', '.join(METHODS)}")
    if method == "baseline":
        return [_sum([(g.baseline, n) for g, n in graphs], DEFAULT_CLOCK_MHZ)]
    per_graph = [_by_clock(_points(g, method)) for g, _ in graphs]
    shared = [f for f in per_graph[0] if all(f in clocks for clocks in per_graph[1:])]
    options: list[FrontierPoint] = []
    for f in shared:
        parts = [[_times(o, n) for o in clocks[f]] for clocks, (_, n) in zip(per_graph, graphs)]
        options += [FrontierPoint(o.time_s, o.effective_energy_j, InstructionChoice(f, o.choice))
                    for o in combine(parts)]
    return options


def _points(graph: GraphFrontier, method: str) -> Sequence[FrontierPoint]:
    if method == "perseus":
        return graph.frequency_only
    if method == "nanobatch_perseus":
        split = [o for o in graph.nanobatched if o.choice.nanobatches == NANOBATCHES]
        return split or graph.frequency_only
    return graph.points


def _by_clock(points: Sequence[FrontierPoint]) -> dict[int, list[FrontierPoint]]:
    clocks: dict[int, list[FrontierPoint]] = {}
    for o in points:
        clocks.setdefault(o.choice.clock_mhz, []).append(o)
    return {f: front(opts) for f, opts in clocks.items()}


def _times(point: FrontierPoint, n: int) -> FrontierPoint:
    return FrontierPoint(n * point.time_s, n * point.effective_energy_j, point.choice)


def _sum(points: Sequence[tuple[FrontierPoint, int]], clock_mhz: int) -> FrontierPoint:
    return FrontierPoint(
        sum(n * o.time_s for o, n in points), sum(n * o.effective_energy_j for o, n in points),
        InstructionChoice(clock_mhz, tuple(o.choice for o, _ in points)),
    )
