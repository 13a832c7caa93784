"""The pipeline-parallel iteration as a DAG of instructions, planned exactly.

With S stages on R ranks (GPUs) and M microbatches an iteration is a DAG of instructions
(stage, microbatch, forward | backward). Each rank runs the instructions of its stages one
after another in its order: one stage per rank in ``one_f_one_b`` and ``gpipe``; V = S / R
stages per rank ("virtual stages", stage s on rank s mod R) in ``interleaved_one_f_one_b``;
any orders in ``from_orders``, such as torch's own schedule's (``torch_orders``). Across
stages, a microbatch's forward on stage s feeds its forward on s + 1, its backward on s + 1
feeds its backward on s, and the last stage turns a microbatch's forward into its backward.
An instruction starts once its predecessors (its rank's previous instruction, and what
feeds it) have finished, so the iteration's time T is the DAG's longest path
(``schedule``); orders in which instructions would wait on each other in a cycle (a
deadlock) are refused.

Each instruction picks one of its options (frontier points of its graph: a time, an
effective energy and a choice holding a clock). The iteration's energy is Perseus's model
(Chung et al., SOSP '24):

    E = sum_i e(o_i) + sum of switch joules + P_blocking x sum_r (T - busy_r) + P_static x T

``e``: an option's effective energy (above static); a clock switch, between consecutive
instructions of a rank whose clocks differ and from a rank's last instruction round to its
first (the next iteration's), costs what the device says (seconds, effective joules) and
its seconds delay what follows on that rank (the round-trip one ends the rank later).
``busy_r``: the time rank r computes or switches; the rest of T it is blocked on another
rank, drawing ``P_blocking`` above static (per GPU; 0 on the simulated GPU, where a blocked
GPU draws exactly its static power). ``P_static``: of all the replica's GPUs together, over
the whole iteration. A switch's time is not blocked time: its joules price it whole.

Up to ``pipeline_large.EXACT_INSTRUCTIONS`` instructions the planner is exact: a
mixed-integer linear program solved by HiGHS (``scipy.optimize.milp``) to a zero gap.
Larger DAGs (a 70B model at 16 stages x 64 microbatches has 2048 instructions, where the
program's relaxation alone takes a minute) are planned by ``planner.pipeline_large``: a
program of shared options and the plans found before, lowered by a descent
(``planner.pipeline_descent``), every plan's gap proven against bounds and stated
(``PipelinePoint.gap``). Binaries x[i, o] pick one option per
instruction; start times s_i and T are continuous; between consecutive instructions i -> j
of a rank the switch is a transport w[a, b] >= 0 from i's clock a to j's clock b
(sum_b w[a, b] = i's indicator of clock a, sum_a w[a, b] = j's of b: with integral
indicators w is their product, whatever the switch costs); precedence s_j >= s_i + d_i
(+ the switch's seconds along a rank), T >= every rank's end. Everything is linear:
sum_r busy_r = sum_i d_i + the switch seconds, so E = sum (e - P_blocking d) x
+ sum (q - P_blocking seconds) w + (R P_blocking + P_static) T. Times are scaled to a
mean instruction of 1, and energies (and, minimising time, T) to about 1e5 so that
HiGHS's absolute gap of 1e-6 is about 1e-11 of the optimum; each solution's cost is then
recomputed exactly from its choices. A solve HiGHS stops before proving optimality (its
time limit) raises ``PipelineSolveError`` unless the best plan found is asked for
(``best_found``, its proven gap stated): a plan is never returned with its gap unsaid.
Where that gap is above ``pipeline_large.GAP`` the solve is also planned the large way
(``planner.pipeline_large``: its descents and bounds), HiGHS's plan among its candidates:
the better plan is kept, against the higher bound.

Every budget is one program (``solve_budget``): the fastest plan minimises T (then, of
those, E); least energy within a time bounds T; the fastest within an energy adds E, being
linear, as one row (E <= the limit); Zeus's trade-off minimises eta x E + (1 - eta) x
P_max x T. A limit HiGHS meets, it meets within its feasibility tolerance (1e-7 of the
scaled row: about 1e-12 of the limit).

Options are pruned first, exactly: among options of one clock, one that is no faster and
costs no less e - P_blocking x time than another is never needed (the other shortens no
path less, changes no switch, and saves at least as much: no budget prefers more time or
more energy). Where a plan states its gap anyway (``best_found``: ``kareus plan``'s), a DAG
planned exactly also has clocks a plan hardly gains by merged into faster ones
(``planner.clock_merge``): at most ``MERGE_LOSS`` of the iteration's energy lost, which
every plan's gap states; with them HiGHS proves far more of a frontier within its time
(Llama 3.1 70B at 2 stages x 8 microbatches: every point, stated 0.04-0.05%, where the
full options left one at 1.9% after 20 s).

We write our own solver rather than use ``lowtime`` (the Perseus authors'), which solves
a continuous relaxation and ships wheels for few Python versions and platforms.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import graphlib
import itertools
import math
import sys
import threading
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, linprog, milp
from scipy.sparse import csr_array, vstack

from kareus.errors import KareusError
from kareus.interrupts import raise_if_interrupted
from kareus.planner.budget import Budget, BudgetError, asked, limit_of
from kareus.planner.clock_merge import MERGE_LOSS, Merged, merge_clocks, uniform_switch
from kareus.planner.compose import FrontierPoint, Switch, clock_of, fronts_by
from kareus.planner.pipeline_descent import Moves, Timing, descend
from kareus.planner.pipeline_large import (
    EXACT_INSTRUCTIONS,
    GAP,
    LargeParts,
    Prices,
    RankBound,
    Sharing,
    Weights,
    gap,
    hull,
    quickest,
    shared_program,
    shared_solve_s,
    switch_floor,
)

KINDS = ("forward", "backward")
_T = TypeVar("_T")

TIME, ENERGY = Weights(0.0, 1.0), Weights(1.0, 0.0)
"""What the fastest plan and the least-energy plan minimise."""

Options = Mapping[tuple[int, str], Sequence[FrontierPoint]]
"""The options of every (stage, kind): each microbatch's instruction of that stage and kind
picks one of them, on its own."""

Order = Sequence[tuple[int, int, str]]
"""A rank's instructions as (stage, microbatch, kind), in the order it runs them."""

_TORCH_KINDS = {"F": "forward", "B": "backward"}
"""torch's computation types (``_ComputationType`` values) the DAG has an instruction for."""


class PipelineShapeError(KareusError, ValueError):
    """A pipeline the schedule cannot be built for (too few stages or microbatches)."""


class PipelineOrderError(KareusError, ValueError):
    """Per-rank orders no DAG can be built from: an instruction missing, repeated or out
    of range, a stage on two ranks, or instructions waiting on each other in a cycle."""


class PipelineActionError(PipelineOrderError):
    """A torch schedule action the DAG has no instruction for (a split backward, an
    overlapped forward and backward, a communication or gradient reduction)."""


class PipelineInputError(KareusError, ValueError):
    """What was given to plan a pipeline is malformed: a (stage, kind) without options, a
    baseline not among them, durations of another length than the instructions."""


class PipelineTimeLimitError(BudgetError):
    """No plan of the pipeline finishes an iteration within the time limit (a time budget
    no plan meets)."""


class PipelineEnergyLimitError(BudgetError):
    """No plan of the pipeline takes at most the energy limit an iteration (an energy
    budget no plan meets)."""


class PipelineSolveError(KareusError, RuntimeError):
    """HiGHS stopped before proving its plan optimal (its time limit, or numerical
    trouble)."""


@dataclass(frozen=True)
class Instruction:
    stage: int
    microbatch: int
    kind: str  # "forward" | "backward"


@dataclass(frozen=True)
class PipelineDag:
    """An iteration's instructions, each rank's execution order (``orders[r]``: indices into
    ``instructions``, in the order GPU r runs them, its stages' interleaved) and the
    dependency edges (predecessor, successor), the rank orders' consecutive pairs
    included."""

    stages: int
    ranks: int
    microbatches: int
    instructions: tuple[Instruction, ...]
    orders: tuple[tuple[int, ...], ...]
    edges: tuple[tuple[int, int], ...]


def one_f_one_b(stages: int, microbatches: int) -> PipelineDag:
    """1F1B, one stage per rank: stage s warms up with S - s - 1 forwards, then alternates
    one forward and one backward, then cools down with the remaining backwards; it keeps at
    most S - s microbatches' activations. Needs at least as many microbatches as stages.
    torch's ``Schedule1F1B`` runs this order."""
    _check_counts(stages=stages, microbatches=microbatches)
    if microbatches < stages:
        raise PipelineShapeError(
            f"1F1B needs at least as many microbatches as stages: got {microbatches} for "
            f"{stages} stages (use gpipe, or more microbatches)"
        )
    orders = []
    for s in range(stages):
        warm = stages - s - 1
        steady = [(s, m, kind) for k in range(microbatches - warm)
                  for m, kind in ((warm + k, "forward"), (k, "backward"))]
        orders.append([(s, m, "forward") for m in range(warm)] + steady
                      + [(s, m, "backward") for m in range(microbatches - warm, microbatches)])
    return from_orders(stages, microbatches, orders)


def gpipe(stages: int, microbatches: int) -> PipelineDag:
    """GPipe, one stage per rank: every stage runs all its forwards, then all its
    backwards (torch's ``ScheduleGPipe``)."""
    _check_counts(stages=stages, microbatches=microbatches)
    return from_orders(stages, microbatches, [
        [(s, m, kind) for kind in KINDS for m in range(microbatches)] for s in range(stages)
    ])


def interleaved_one_f_one_b(ranks: int, virtual: int, microbatches: int) -> PipelineDag:
    """Interleaved 1F1B (Narayanan et al., SC '21) exactly as torch 2.13's
    ``ScheduleInterleaved1F1B`` orders it: ``virtual`` stages per rank, stage s on rank
    s mod R. Microbatches go in rounds of M / max(1, M // R) (M must be a multiple of the
    rounds); a rank runs each of its stages' forwards for a round in turn, depth first,
    and its backwards from its last stage back. Rank r warms up with (V - 1) x round + 2 x
    (R - 1 - r) forwards (at most all V x M), then alternates a forward and a backward,
    then runs the backwards left."""
    _check_counts(ranks=ranks, virtual=virtual, microbatches=microbatches)
    rounds = max(1, microbatches // ranks)
    if microbatches % rounds:
        raise PipelineShapeError(
            f"interleaved 1F1B runs microbatches in {rounds} rounds of equal size "
            f"(max(1, microbatches // ranks)): got {microbatches} microbatches for {ranks} "
            f"ranks; accepted: a multiple of {rounds}"
        )
    size = microbatches // rounds
    chunks = virtual * microbatches  # forwards (and backwards) a rank runs

    def rank_order(rank: int) -> list[tuple[int, int, str]]:
        def nth(k: int, kind: str) -> tuple[int, int, str]:
            """The rank's k-th forward or backward: its round k // (V x size), its virtual
            stage (k // size) mod V (backwards from the last), the round's (k mod size)-th
            microbatch."""
            local = (k // size) % virtual
            local = virtual - 1 - local if kind == "backward" else local
            return local * ranks + rank, (k // (size * virtual)) * size + k % size, kind

        warm = min((virtual - 1) * size + 2 * (ranks - 1 - rank), chunks)
        forwards = [nth(k, "forward") for k in range(chunks)]
        backwards = [nth(k, "backward") for k in range(chunks)]
        steady = [op for pair in zip(forwards[warm:], backwards) for op in pair]
        return forwards[:warm] + steady + backwards[chunks - warm:]

    return from_orders(ranks * virtual, microbatches, [rank_order(r) for r in range(ranks)])


def torch_orders(pipeline_order: Mapping[int, Sequence[Any]]) -> list[list[tuple[int, int, str]]]:
    """Each rank's order, as ``from_orders`` takes it, from a torch schedule's
    ``pipeline_order`` (rank -> its actions, None an idle step, skipped). Only forward and
    full-backward actions have instructions: any other (zero bubble's split backward I and
    W, an overlapped F and B, a gradient reduction) raises ``PipelineActionError``."""
    ranks = sorted(pipeline_order)
    if ranks != list(range(len(ranks))):
        raise PipelineOrderError(
            f"pipeline_order: ranks {ranks}; accepted: ranks 0 to n - 1, each once"
        )
    return [[_torch_instruction(action, f"pipeline_order[{r}][{k}]")
             for k, action in enumerate(pipeline_order[r]) if action is not None]
            for r in ranks]


def _torch_instruction(action: Any, where: str) -> tuple[int, int, str]:
    """A torch ``_Action``'s (stage, microbatch, kind); ``where``: its place, for errors."""
    computation = action.computation_type
    kind = _TORCH_KINDS.get(getattr(computation, "value", computation))
    if kind is None:
        raise PipelineActionError(
            f"{where}: got {action!r} ({getattr(computation, 'name', computation)}); "
            "accepted: FORWARD (F) and FULL_BACKWARD (B) actions, or None: the DAG has no "
            "instruction for a split backward (zero bubble's I and W), an overlapped F and B, "
            "a communication or a gradient reduction"
        )
    return action.stage_index, action.microbatch_index, kind


def from_orders(stages: int, microbatches: int, orders: Sequence[Order]) -> PipelineDag:
    """The DAG of ranks running ``orders``: one per rank (GPU), its instructions (stage,
    microbatch, kind) in the order it runs them. Every stage's forward and backward of
    every microbatch runs once, each stage's on one rank; orders that deadlock (instructions
    waiting on each other in a cycle) raise ``PipelineOrderError``, naming the cycle."""
    _check_counts(stages=stages, microbatches=microbatches)
    instructions, rank_orders = _read_orders(stages, microbatches, orders)
    index = {i: n for n, i in enumerate(instructions)}

    def at(s: int, m: int, kind: str) -> int:
        return index[Instruction(s, m, kind)]

    edges = {(a, b): None for order in rank_orders for a, b in itertools.pairwise(order)}
    last = stages - 1
    for m in range(microbatches):
        for s in range(last):
            edges[at(s, m, "forward"), at(s + 1, m, "forward")] = None
            edges[at(s + 1, m, "backward"), at(s, m, "backward")] = None
        edges[at(last, m, "forward"), at(last, m, "backward")] = None
    dag = PipelineDag(stages, len(rank_orders), microbatches, instructions, rank_orders,
                      tuple(edges))
    try:
        graphlib.TopologicalSorter(_predecessors(dag)).prepare()
    except graphlib.CycleError as cycle:
        path = " -> ".join(_label(instructions[i]) for i in cycle.args[1])
        raise PipelineOrderError(
            f"orders deadlock: in {path} (stage, F|B, microbatch) each instruction waits for "
            "the one before it (its rank runs it later, or it needs its output); accepted: "
            "orders without such a cycle"
        ) from None
    return dag


def _read_orders(
    stages: int, microbatches: int, orders: Sequence[Order]
) -> tuple[tuple[Instruction, ...], tuple[tuple[int, ...], ...]]:
    """The instructions of ``orders``, rank by rank, and each rank's order as indices into
    them; a ``PipelineOrderError`` where one is missing, repeated or out of range, a stage
    is on two ranks or a rank runs nothing."""
    if not orders:
        raise PipelineOrderError("orders: none given; accepted: one order per rank (>= 1)")
    where: dict[Instruction, str] = {}  # each instruction, and where in orders it is
    rank_of: dict[int, tuple[int, str]] = {}  # each stage's rank, and where it first runs
    for r, order in enumerate(orders):
        if not order:
            raise PipelineOrderError(
                f"orders[{r}]: empty; accepted: every rank runs at least one instruction"
            )
        for k, item in enumerate(order):
            here = f"orders[{r}][{k}]"
            i = _instruction(item, stages, microbatches, here)
            if i in where:
                raise PipelineOrderError(
                    f"{here}: {_label(i)} runs a second time (first at {where[i]}); accepted: "
                    "each instruction once"
                )
            first_rank, first = rank_of.setdefault(i.stage, (r, here))
            if first_rank != r:
                raise PipelineOrderError(
                    f"{here}: stage {i.stage} runs on rank {r} and on rank {first_rank} (at "
                    f"{first}); accepted: each stage's instructions on one rank"
                )
            where[i] = here
    missing = [i for s in range(stages) for m in range(microbatches) for kind in KINDS
               if (i := Instruction(s, m, kind)) not in where]
    if missing:
        raise PipelineOrderError(
            f"orders: {len(missing)} instruction{'s' * (len(missing) > 1)} never run ("
            f"{', '.join(map(_label, missing[:6]))}{', ...' if len(missing) > 6 else ''}: "
            "stage, F|B, microbatch); accepted: each stage's forward and backward of each "
            f"microbatch, {stages} x {microbatches} x 2 in all"
        )
    ends = list(itertools.accumulate(map(len, orders)))
    return tuple(where), tuple(tuple(range(end - len(order), end))
                               for order, end in zip(orders, ends))


def _instruction(item: Any, stages: int, microbatches: int, where: str) -> Instruction:
    """``item`` of an order as an instruction; a ``PipelineOrderError`` where it is none of
    the pipeline's."""
    match item:
        case (int() as s, int() as m, str() as kind) if (
            not isinstance(s, bool) and not isinstance(m, bool) and 0 <= s < stages
            and 0 <= m < microbatches and kind in KINDS
        ):
            return Instruction(s, m, kind)
    raise PipelineOrderError(
        f"{where}: got {item!r}; accepted: (stage, microbatch, kind) with stage 0 to "
        f"{stages - 1}, microbatch 0 to {microbatches - 1}, kind 'forward' or 'backward'"
    )


def _label(i: Instruction) -> str:
    """torch's notation: stage, F | B, microbatch ("1B0")."""
    return f"{i.stage}{i.kind[0].upper()}{i.microbatch}"


def _predecessors(dag: PipelineDag) -> dict[int, list[int]]:
    preds: dict[int, list[int]] = {i: [] for i in range(len(dag.instructions))}
    for a, b in dag.edges:
        preds[b].append(a)
    return preds


def _check_counts(**counts: int) -> None:
    for name, n in counts.items():
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise PipelineShapeError(f"{name}: got {n!r}; accepted: an integer >= 1")


def schedule(
    dag: PipelineDag, durations: Sequence[float], switch_s: Sequence[float] | None = None
) -> tuple[tuple[float, ...], float]:
    """Each instruction's earliest start and the makespan, given each one's duration and
    the seconds of the clock switch after it on its rank (``switch_s``; a rank's last:
    into the next iteration, ending the rank later)."""
    n = len(dag.instructions)
    switch_s = [0.0] * n if switch_s is None else switch_s
    if len(durations) != n or len(switch_s) != n:
        raise PipelineInputError(
            f"durations and switch_s: got {len(durations)} and {len(switch_s)}; accepted: one "
            f"per instruction ({n})"
        )
    follows, preds, topo = _topology(dag)
    start = [0.0] * n
    for i in topo:
        start[i] = max((start[a] + durations[a] + (switch_s[a] if follows.get(i) == a else 0.0)
                        for a in preds[i]), default=0.0)
    makespan = max(start[order[-1]] + durations[order[-1]] + switch_s[order[-1]]
                   for order in dag.orders)
    return tuple(start), makespan


@functools.lru_cache(maxsize=8)
def _topology(dag: PipelineDag) -> tuple[dict[int, int], dict[int, list[int]], list[int]]:
    """Each instruction's predecessor on its rank, its predecessors, and an order in
    which every instruction follows them (a large DAG is scheduled many times over)."""
    preds = _predecessors(dag)
    return ({b: a for order in dag.orders for a, b in itertools.pairwise(order)}, preds,
            list(graphlib.TopologicalSorter(preds).static_order()))


def _free_switch(a: Hashable, b: Hashable) -> tuple[float, float]:
    return 0.0, 0.0


@dataclass(frozen=True)
class EnergyModel:
    """How an iteration's energy is priced (the module docstring's model): the static
    power of all the replica's GPUs, summed; the power above static a GPU draws blocked on
    another rank; a clock switch's (seconds, effective joules), which must depend on its
    choices only through ``switch_key`` (their clock)."""

    static_power_w: float
    blocking_power_w: float = 0.0
    switch: Switch = _free_switch
    switch_key: Callable[[Any], Hashable] = clock_of


@dataclass(frozen=True)
class PipelinePoint:
    """A plan of the iteration: one option's choice per instruction (in
    ``dag.instructions`` order), and the iteration's time, energy and energy above static."""

    time_s: float
    energy_j: float
    effective_energy_j: float
    choices: tuple[Any, ...]
    gap: float = 0.0
    """0: proven optimal; else the relative gap proven when ``max_solve_s`` ran out and the
    best plan found was kept (``best_found``; a large DAG's always)."""


def least_energy(
    dag: PipelineDag,
    options: Options,
    *,
    time_limit_s: float | None,
    model: EnergyModel,
    max_solve_s: float | None = None,
    best_found: bool = False,
    exact_up_to: int = EXACT_INSTRUCTIONS,
    known: Sequence[PipelinePoint] = (),
    merge_loss: float | None = None,
) -> PipelinePoint:
    """The plan of least energy whose iteration takes at most ``time_limit_s`` (None: any
    time); a ``PipelineTimeLimitError`` stating the range plans reach where none is fast
    enough. ``max_solve_s`` bounds HiGHS's time: past it a ``PipelineSolveError``, or with
    ``best_found`` the best plan found, its proven gap in ``PipelinePoint.gap``. A DAG of
    more than ``exact_up_to`` instructions is planned by ``planner.pipeline_large``, its
    gap always stated; ``known`` and ``merge_loss``: as for ``pipeline_frontier``."""
    if time_limit_s is not None and math.isnan(time_limit_s):
        raise PipelineInputError("time_limit_s: got nan; accepted: seconds, or None")
    return _Solver(dag, options, model, max_solve_s, best_found, known=known,
                   exact_up_to=exact_up_to, merge_loss=_merge_loss(best_found, merge_loss)
                   ).least_energy(time_limit_s)


def fastest(
    dag: PipelineDag, options: Options, *, model: EnergyModel, max_solve_s: float | None = None,
    exact_up_to: int = EXACT_INSTRUCTIONS,
) -> PipelinePoint:
    """The plan of the shortest iteration and, of those, the least energy (``exact_up_to``:
    as for ``least_energy``)."""
    return _Solver(dag, options, model, max_solve_s, exact_up_to=exact_up_to).fastest()


def fastest_within(
    dag: PipelineDag,
    options: Options,
    *,
    energy_limit_j: float,
    model: EnergyModel,
    max_solve_s: float | None = None,
    best_found: bool = False,
) -> PipelinePoint:
    """The plan of the shortest iteration whose energy (``PipelinePoint.energy_j``, static
    power's included) is at most ``energy_limit_j`` and, of those, the least energy; a
    ``PipelineEnergyLimitError`` stating the range plans reach where none is frugal enough.
    ``max_solve_s`` and ``best_found``: as for ``least_energy``."""
    if math.isnan(energy_limit_j):
        raise PipelineInputError("energy_limit_j: got nan; accepted: joules")
    solver = _Solver(dag, options, model, max_solve_s, best_found)
    return solver.fastest(energy_limit_j, f"{energy_limit_j:.4g} J")


def least_tradeoff(
    dag: PipelineDag,
    options: Options,
    *,
    eta: float,
    max_power_w: float,
    model: EnergyModel,
    max_solve_s: float | None = None,
    best_found: bool = False,
) -> PipelinePoint:
    """The plan of least eta x E + (1 - eta) x ``max_power_w`` x T: Zeus's trade-off, a
    second priced at P_max (the replica's power limit); eta 1 weighs energy only, eta 0 time
    only (the fastest plan, and of those the least energy). ``max_solve_s`` and
    ``best_found``: as for ``least_energy``."""
    _check_tradeoff(eta, max_power_w)
    return _Solver(dag, options, model, max_solve_s, best_found,
                   merge_loss=_merge_loss(best_found)).least_tradeoff(eta, max_power_w)


def stoppable(solve: Callable[[], _T], poll_s: float = 0.1) -> _T:
    """``solve()`` on a thread this one waits for in short joins. HiGHS releases the GIL
    but does not return to Python until it ends (up to ``max_solve_s``, or an hour
    unbounded), so a Ctrl-C on the thread that called it would wait for the whole solve;
    here the wait ends at its next poll with the ``KeyboardInterrupt`` (a pending one:
    ``interrupts.raise_if_interrupted``), and the abandoned solve, on a daemon thread,
    ends with the process (``interrupts.end_process``)."""
    return side_by_side([solve], poll_s)[0]


def side_by_side(solves: Sequence[Callable[[], _T]], poll_s: float = 0.1) -> list[_T]:
    """Each of ``solves`` on a thread of its own, all at once (HiGHS releases the GIL:
    independent solves share the cores), waited for as ``stoppable`` waits; their
    results in order, or the first one's exception."""
    found: dict[int, _T] = {}
    failed: list[BaseException] = []

    def run(n: int, solve: Callable[[], _T]) -> None:
        try:
            found[n] = solve()
        except BaseException as exc:  # noqa: BLE001 - raised again on the caller's thread
            failed.append(exc)

    workers = [threading.Thread(target=run, args=(n, solve), name="kareus-highs", daemon=True)
               for n, solve in enumerate(solves)]
    for worker in workers:
        worker.start()
    for worker in workers:
        while worker.is_alive() and not failed:
            worker.join(poll_s)
            raise_if_interrupted()
    if failed:
        raise failed[0]
    return [found[n] for n in range(len(solves))]


def solve_budget(
    dag: PipelineDag,
    options: Options,
    budget: Budget,
    *,
    model: EnergyModel,
    max_power_w: float,
    baseline_point: PipelinePoint,
    max_solve_s: float | None = None,
    best_found: bool = False,
    known: Sequence[PipelinePoint] = (),
) -> PipelinePoint:
    """The plan ``budget`` asks for, solved exactly: the fastest; the least energy within a
    time; the fastest within an energy; the least trade-off (``least_tradeoff``, P_max
    ``max_power_w``). A time or energy budget is absolute (seconds or joules an iteration of
    the replica, as ``PipelinePoint`` counts them) or a fraction of ``baseline_point``'s; one
    no plan meets raises ``PipelineTimeLimitError`` or ``PipelineEnergyLimitError`` (both
    ``BudgetError``s), stating the range plans reach. ``max_solve_s`` and ``best_found``: as
    for ``least_energy``; ``known``: as for ``pipeline_frontier``."""
    if budget.kind not in ("fastest", "time", "energy", "tradeoff"):
        raise BudgetError(
            f"budget.kind: got {budget.kind!r}; accepted: 'fastest', 'time', 'energy', "
            "'tradeoff'"
        )
    if budget.kind == "tradeoff":
        _check_tradeoff(budget.value, max_power_w)
    elif budget.kind != "fastest" and (budget.value is None) == (budget.fraction is None):
        raise BudgetError(
            f"budget: got {budget!r}; accepted: a {budget.kind} budget with a value (absolute) "
            "or a fraction (of the baseline's), one of them"
        )
    solver = _Solver(dag, options, model, max_solve_s, best_found, known=known,
                     merge_loss=_merge_loss(best_found and budget.kind != "energy"))
    if budget.kind == "fastest":
        return solver.fastest()
    if budget.kind == "tradeoff":
        return solver.least_tradeoff(budget.value, max_power_w)
    limit = limit_of(budget, baseline_point)
    what = f"the {budget.kind} budget {asked(budget, baseline_point, limit)}"
    if budget.kind == "time":
        return solver.least_energy(limit, what)
    return solver.fastest(limit, what)


def _merge_loss(best_found: bool, asked: float | None = None) -> float:
    """The share of the energy a solve may lose to merged clocks (``planner.clock_merge``):
    ``asked``, or by default ``MERGE_LOSS`` where its plan states a gap anyway
    (``best_found``; none with an energy limit), else none, so that a plan asked to be
    proven optimal is."""
    if asked is not None:
        return asked
    return MERGE_LOSS if best_found else 0.0


def _check_tradeoff(eta: Any, max_power_w: Any) -> None:
    if isinstance(eta, bool) or not isinstance(eta, (int, float)) or not 0 <= eta <= 1:
        raise PipelineInputError(
            f"eta: got {eta!r}; accepted: a number in [0, 1] (1: energy only, 0: time only)"
        )
    if (isinstance(max_power_w, bool) or not isinstance(max_power_w, (int, float))
            or not 0 < max_power_w < math.inf):
        raise PipelineInputError(
            f"max_power_w: got {max_power_w!r}; accepted: watts > 0, finite (P_max, the "
            "replica's power limit, prices the trade-off's seconds)"
        )


def pipeline_frontier(
    dag: PipelineDag,
    options: Options,
    *,
    model: EnergyModel,
    points: int = 10,
    max_solve_s: float | None = None,
    best_found: bool = False,
    known: Sequence[PipelinePoint] = (),
    exact_up_to: int = EXACT_INSTRUCTIONS,
    merge_loss: float | None = None,
) -> list[PipelinePoint]:
    """The fastest plan, the least-energy plan, and the least-energy plans within time
    limits evenly spaced between theirs: ``points`` limits in all, fewer plans where two
    limits find the same or one dominates another; fastest first. ``max_solve_s`` and
    ``best_found``: per solve, as for ``least_energy``; ``known``: plans found already (of
    options these dominate, e.g. another method's), which a large DAG's solve weighs as
    candidates; ``exact_up_to``: the most instructions planned exactly (larger DAGs:
    ``planner.pipeline_large``); ``merge_loss``: the share of the energy a DAG planned
    exactly may lose to merged clocks (``planner.clock_merge``), stated in the gaps (None:
    ``MERGE_LOSS`` with ``best_found``, else 0, every plan then proven optimal)."""
    if isinstance(points, bool) or not isinstance(points, int) or points < 2:
        raise PipelineInputError(
            f"points: got {points!r}; accepted: an integer >= 2 (the fastest and the "
            "least-energy plan, and plans between)"
        )
    solver = _Solver(dag, options, model, max_solve_s, best_found, known=known,
                     exact_up_to=exact_up_to, merge_loss=_merge_loss(best_found, merge_loss))
    quick, frugal = solver.fastest(), solver.least_energy(None)
    found = [quick, frugal]
    if frugal.time_s > quick.time_s:
        step = (frugal.time_s - quick.time_s) / (points - 1)
        found += [solver.least_energy(quick.time_s + k * step) for k in range(1, points - 1)]
    return pareto(found)


def pareto(points: Sequence[PipelinePoint]) -> list[PipelinePoint]:
    """Fastest first, without a plan another is no slower and no costlier than."""
    kept: list[PipelinePoint] = []
    for p in sorted(points, key=lambda p: (p.time_s, p.energy_j)):
        if not kept or p.energy_j < kept[-1].energy_j:
            kept.append(p)
    return kept


def baseline(
    dag: PipelineDag,
    options: Options,
    baseline_of: Mapping[tuple[int, str], FrontierPoint],
    *,
    model: EnergyModel,
) -> PipelinePoint:
    """The iteration with every instruction at its (stage, kind)'s baseline option (one of
    its options: the baseline is then a plan the planner weighs)."""
    _check_options(dag, options)
    for key in _kinds(dag):
        if baseline_of.get(key) not in options[key]:
            raise PipelineInputError(
                f"baseline_of[{key!r}]: got {baseline_of.get(key)!r}; accepted: one of the "
                f"{len(options[key])} options of stage {key[0]}'s {key[1]}"
            )
    return _evaluate(dag, model, [baseline_of[i.stage, i.kind] for i in dag.instructions])


def _kinds(dag: PipelineDag) -> list[tuple[int, str]]:
    return [(s, kind) for s in range(dag.stages) for kind in KINDS]


def _check_options(dag: PipelineDag, options: Options) -> None:
    for s, kind in _kinds(dag):
        if not options.get((s, kind)):
            raise PipelineInputError(
                f"options[({s}, {kind!r})]: none given; accepted: at least one "
                "FrontierPoint for every (stage, kind) of the pipeline"
            )


def _evaluate(
    dag: PipelineDag, model: EnergyModel, picks: Sequence[FrontierPoint]
) -> PipelinePoint:
    """What the iteration costs with ``picks`` (one option per instruction), exactly."""
    switch_s = [0.0] * len(picks)
    switch_j = 0.0
    for order in dag.orders:
        for i, j in zip(order, order[1:] + order[:1]):
            a, b = picks[i].choice, picks[j].choice
            if model.switch_key(a) != model.switch_key(b):
                switch_s[i], joules = model.switch(a, b)
                switch_j += joules
    durations = [p.time_s for p in picks]
    _, makespan = schedule(dag, durations, switch_s)
    blocked = dag.ranks * makespan - sum(durations) - sum(switch_s)
    effective = (sum(p.effective_energy_j for p in picks) + switch_j
                 + model.blocking_power_w * blocked)
    return PipelinePoint(makespan, effective + model.static_power_w * makespan, effective,
                         tuple(p.choice for p in picks))


class _Program:
    """A sparse linear program, built a column and a row at a time."""

    def __init__(self) -> None:
        self.cost: list[float] = []
        self.upper: list[float] = []
        self.entries: list[tuple[int, int, float]] = []
        self.bounds: list[tuple[float, float]] = []

    def column(self, cost: float, upper: float) -> int:
        self.cost.append(cost)
        self.upper.append(upper)
        return len(self.cost) - 1

    def row(self, terms: Sequence[tuple[int, float]], low: float, high: float) -> None:
        self.entries.extend((len(self.bounds), col, v) for col, v in terms)
        self.bounds.append((low, high))

    def constraints(self) -> LinearConstraint:
        r, c, v = zip(*self.entries)
        low, high = zip(*self.bounds)
        return LinearConstraint(csr_array((v, (r, c)), shape=(len(low), len(self.cost))),
                                low, high)


class _Solver:
    """The mixed-integer program of one DAG, options and energy model (the module
    docstring's), built once and solved for any budget."""

    def __init__(self, dag: PipelineDag, options: Options, model: EnergyModel,
                 max_solve_s: float | None, best_found: bool = False, *,
                 sharing: Sharing | None = None, known: Sequence[PipelinePoint] = (),
                 exact_up_to: int = EXACT_INSTRUCTIONS, merge_loss: float = 0.0) -> None:
        """``sharing``: a smaller program (``pipeline_large.Sharing``), which returns None
        where it finds no plan in its time; ``known``: plans a large DAG's solves weigh as
        candidates, with every plan they find; ``exact_up_to``: the most instructions of a
        DAG planned exactly; ``merge_loss``: the share of the iteration's energy a DAG
        planned exactly may lose to clocks merged (``planner.clock_merge``), stated in
        every plan's gap (never with an energy limit: a merge may raise a plan's energy)."""
        _check_options(dag, options)
        self.dag, self.model, self.max_solve_s = dag, model, max_solve_s
        self.best_found, self.shared, self.given = best_found, sharing is not None, options
        self.known = list(known)
        pruned = {key: _prune(options[key], model) for key in _kinds(dag)}
        merged = (_merged(dag, pruned, model, merge_loss)
                  if sharing is None and len(dag.instructions) <= exact_up_to
                  else Merged(pruned, 0.0))
        self.loss_j = merged.loss_j
        """The most a plan of the full options loses mapped onto ``self.options``: bounds
        of the program less this bound the full one's."""
        self.options = ([merged.options[i.stage, i.kind] for i in dag.instructions]
                        if sharing is None else list(sharing.options))
        self.classes = tuple(range(len(self.options))) if sharing is None else sharing.classes
        times = [o.time_s for opts in self.options for o in opts]
        self.time_unit = (sum(times) / len(times)) or 1.0
        block = dag.ranks * model.blocking_power_w
        reference = sum(max(abs(o.effective_energy_j) + (model.static_power_w + block)
                            * o.time_s for o in opts) for opts in self.options)
        self.energy_unit = (reference or 1.0) / 1e5
        self.large = sharing is None and len(self.options) > exact_up_to
        self.pruned = pruned
        if not self.large:  # a large DAG is planned by ``pipeline_large``: never built
            self._build()

    @functools.cached_property
    def parts(self) -> LargeParts:
        """What a large DAG is planned with (``_solve_large``); built where first needed
        (a small DAG's too, where HiGHS finds no plan within its time)."""
        model = self.model
        free = dataclasses.replace(model, switch=_free_switch)
        # every instruction's program however large (only its relaxation is solved: a
        # linear program, never time-limited)
        relaxation = _Solver(self.dag, {key: hull(opts, model.blocking_power_w)
                                        for key, opts in self.pruned.items()},
                             free, None, exact_up_to=sys.maxsize)
        shared = _Solver(self.dag, self.given, model,
                         min(shared_solve_s(len(self.options)), self.max_solve_s or math.inf),
                         True,
                         sharing=shared_program(self.dag, self.options))
        return LargeParts(relaxation, shared,
                          _evaluate(self.dag, model, list(map(quickest, self.options))),
                          RankBound(self.dag, self.options, model),
                          switch_floor(self.dag, self.options, model),
                          Timing(self.dag, self.options, model))

    def _build(self) -> None:
        dag, model, tau = self.dag, self.model, self.time_unit
        program = _Program()
        block = model.blocking_power_w
        members = collections.Counter(self.classes)
        by_class: dict[Hashable, list[int]] = {}
        for i, c in enumerate(self.classes):
            if c not in by_class:
                by_class[c] = [program.column(members[c] * (o.effective_energy_j
                                                            - block * o.time_s)
                                              / self.energy_unit, 1.0)
                               for o in self.options[i]]
        self.columns = [by_class[c] for c in self.classes]
        starts = [program.column(0.0, math.inf) for _ in self.options]
        self.t_col = program.column((dag.ranks * block + model.static_power_w) * tau
                                    / self.energy_unit, math.inf)
        for cols in by_class.values():
            program.row([(c, 1.0) for c in cols], 1.0, 1.0)
        follows = {}
        self.lifted: list[tuple[int, int, int]] = []
        """The rows of the precedences between instructions not consecutive on a rank:
        (row, i, j)."""
        self.ends: list[int] = []
        """Each rank's row of finishing by the iteration's end (``dag.orders``'s order)."""
        pairs = [(i, j) for order in dag.orders for i, j in zip(order, order[1:] + order[:1])]
        times = collections.Counter((self.classes[i], self.classes[j]) for i, j in pairs)
        delays: dict[tuple[Hashable, Hashable], list[tuple[int, float]]] = {}
        for order in dag.orders:
            for i, j in zip(order, order[1:] + order[:1]):
                key = self.classes[i], self.classes[j]
                if key not in delays:
                    delays[key] = [] if key[0] == key[1] else self._switch(program, i, j,
                                                                           times[key])
                end = (self.t_col if j == order[0] else starts[j], 1.0)
                if j == order[0]:
                    self.ends.append(len(program.bounds))
                program.row([end, (starts[i], -1.0), *self._duration(i), *delays[key]], 0.0,
                            math.inf)
                follows[i] = j
        for i, j in dag.edges:
            if follows[i] != j:
                self.lifted.append((len(program.bounds), i, j))
                program.row([(starts[j], 1.0), (starts[i], -1.0), *self._duration(i)], 0.0,
                            math.inf)
        self.constraints = program.constraints()
        self.upper = np.array(program.upper)
        self.energy = np.array(program.cost)
        # T in sums of mean instructions (above any makespan), times 1e5: the gap is then
        # as small a share of it as of energies
        self.makespan = np.zeros(len(program.cost))
        self.makespan[self.t_col] = 1e5 / len(self.options)
        self.integrality = np.zeros(len(program.cost))
        self.integrality[: sum(map(len, by_class.values()))] = 1

    def _duration(self, i: int) -> list[tuple[int, float]]:
        """Minus instruction ``i``'s duration, as terms of a row."""
        return [(c, -o.time_s / self.time_unit) for c, o in zip(self.columns[i], self.options[i])]

    def _switch(self, program: _Program, i: int, j: int, times: int) -> list[tuple[int, float]]:
        """The switch from instruction ``i`` to ``j``, the next on their rank: a transport
        between their clock indicators, each (clock, clock) pair priced; minus its seconds
        as terms of a row (none where no pair of their clocks costs anything to switch).
        ``times``: how often the program has such a switch (from ``i``'s class to
        ``j``'s), its columns priced for all of them."""
        model, block = self.model, self.model.blocking_power_w
        clocks_i, clocks_j = self._clocks(i), self._clocks(j)
        priced = {(a, b): model.switch(ca, cb) for a, ca in clocks_i.items()
                  for b, cb in clocks_j.items() if a != b}
        if not any(s or q for s, q in priced.values()):
            return []
        ((seconds, joules), *others) = set(priced.values())
        if not others and seconds >= 0 and joules - block * seconds >= 0:
            # One price whatever the clocks (every device's today), no gain from paying it:
            # one indicator w >= z_i(a) - z_j(a) for every clock a, 1 exactly where the
            # clocks differ (more only costs), instead of a transport of |clocks|^2 columns.
            w = program.column(times * (joules - block * seconds) / self.energy_unit, 1.0)
            for clock in {*clocks_i, *clocks_j}:
                program.row([(w, 1.0), *self._indicator(i, clock, -1.0),
                             *self._indicator(j, clock, 1.0)], 0.0, math.inf)
            return [(w, -seconds / self.time_unit)] if seconds else []
        flow: dict[tuple[int, Hashable], list[tuple[int, float]]] = {}
        delay = []
        for a, b in itertools.product(clocks_i, clocks_j):
            seconds, joules = priced.get((a, b), (0.0, 0.0))
            w = program.column(times * (joules - block * seconds) / self.energy_unit, 1.0)
            flow.setdefault((i, a), []).append((w, 1.0))
            flow.setdefault((j, b), []).append((w, 1.0))
            if seconds:
                delay.append((w, -seconds / self.time_unit))
        for (k, clock), terms in flow.items():
            chosen = [(c, -1.0) for c, o in zip(self.columns[k], self.options[k])
                      if model.switch_key(o.choice) == clock]
            program.row(terms + chosen, 0.0, 0.0)
        return delay

    def _indicator(self, i: int, clock: Hashable, sign: float) -> list[tuple[int, float]]:
        """``sign`` times instruction ``i``'s indicator of ``clock``, as terms of a row."""
        return [(c, sign) for c, o in zip(self.columns[i], self.options[i])
                if self.model.switch_key(o.choice) == clock]

    def _clocks(self, i: int) -> dict[Hashable, Any]:
        """Instruction ``i``'s clocks (switch keys), each with a choice of it."""
        clocks: dict[Hashable, Any] = {}
        for o in self.options[i]:
            clocks.setdefault(self.model.switch_key(o.choice), o.choice)
        return clocks

    def _objective(self, weights: Weights) -> tuple[np.ndarray, float]:
        """``weights`` as this program's objective, scaled for HiGHS, and what one unit of
        it is in seconds and joules."""
        if weights.energy == 0:
            return weights.time * self.makespan, self.time_unit * len(self.options) / 1e5
        objective = weights.energy * self.energy
        objective[self.t_col] += weights.time * self.time_unit / self.energy_unit
        return objective, self.energy_unit

    def _problem(self, weights: Weights, limit_s: float | None, limit_j: float | None
                 ) -> tuple[np.ndarray, list[LinearConstraint], np.ndarray, float]:
        """The program for ``weights`` within ``limit_s`` and ``limit_j`` (the energy: one
        row more): its objective, rows and columns' upper bounds, and the objective's unit."""
        objective, unit = self._objective(weights)
        constraints = [self.constraints]
        if limit_j is not None:
            constraints.append(LinearConstraint(self.energy[np.newaxis], -math.inf,
                                                limit_j / self.energy_unit))
        upper = self.upper.copy()
        upper[self.t_col] = math.inf if limit_s is None else limit_s / self.time_unit
        return objective, constraints, upper, unit

    def _run(self, weights: Weights, limit_s: float | None, limit_j: float | None
             ) -> tuple[Any, float]:
        """HiGHS's result for ``weights`` within ``limit_s`` and ``limit_j``, and the
        objective's unit."""
        objective, constraints, upper, unit = self._problem(weights, limit_s, limit_j)
        options: dict[str, float] = {"mip_rel_gap": 0.0}
        if self.max_solve_s is not None:
            options["time_limit"] = self.max_solve_s
        return stoppable(functools.partial(
            milp, objective, integrality=self.integrality,
            bounds=Bounds(np.zeros(len(upper)), upper), constraints=constraints,
            options=options)), unit

    def _relax(self, weights: Weights, limit_s: float | None, limit_j: float | None
               ) -> tuple[Any, float, Prices | None]:
        """HiGHS's result for the linear relaxation, the objective's unit, and the
        relaxation's duals as the prices of the precedences the rank bound lifts
        (``pipeline_large.Prices``, in the objective's unit a second; None: unsolved)."""
        objective, constraints, upper, unit = self._problem(weights, limit_s, limit_j)
        rows = vstack([c.A for c in constraints], format="csr")
        low = np.concatenate([np.broadcast_to(c.lb, c.A.shape[:1]) for c in constraints])
        high = np.concatenate([np.broadcast_to(c.ub, c.A.shape[:1]) for c in constraints])
        equal = low == high
        least, most = ~equal & np.isfinite(low), ~equal & np.isfinite(high)
        result = stoppable(functools.partial(
            linprog, objective, A_ub=vstack([-rows[least], rows[most]]),
            b_ub=np.concatenate([-low[least], high[most]]), A_eq=rows[equal],
            b_eq=low[equal], bounds=np.column_stack([np.zeros(len(upper)), upper]),
            method="highs"))
        if result.status != 0:
            return result, unit, None
        duals = np.zeros(len(low))
        duals[least] = np.maximum(-result.ineqlin.marginals[: int(least.sum())], 0.0)
        duals *= unit / self.time_unit
        return result, unit, Prices({(i, j): float(duals[row]) for row, i, j in self.lifted
                                     if duals[row] > 0}, [float(duals[row]) for row in self.ends])

    def _solve(self, weights: Weights, limit_s: float | None, limit_j: float | None = None
               ) -> PipelinePoint | None:
        """The optimum of ``weights`` within ``limit_s`` and ``limit_j``, costed exactly;
        None where no plan meets them."""
        if self.large:
            return self._solve_large(weights, limit_s, limit_j)
        result, unit = self._run(weights, limit_s, limit_j)
        if result.status == 2:
            return None
        gap_found = result.get("mip_gap")
        found = result.status == 1 and result.x is not None
        if result.status != 0 and not (found and (self.best_found or self.shared)):
            if self.shared:
                return None
            if self.best_found and result.status == 1:  # out of time without a plan
                return self._solve_large(weights, limit_s, limit_j)
            raise PipelineSolveError(
                f"HiGHS did not prove a plan of the {self.dag.stages}-stage pipeline on "
                f"{self.dag.ranks} ranks optimal: {result.message}"
                + (f" (gap {gap_found:.3g})" if gap_found is not None else "")
                + "; allow it more time (max_solve_s) or give fewer options"
            )
        picks = [opts[int(np.argmax(result.x[cols]))]
                 for opts, cols in zip(self.options, self.columns)]
        point = _evaluate(self.dag, self.model, picks)
        merged = weights.energy * self.loss_j  # what the full options may save beyond
        if result.status == 0:
            if not merged:
                return point
            value = weights.of(point.time_s, point.energy_j)
            return dataclasses.replace(point, gap=gap(value, value - merged))
        if self.shared:
            return dataclasses.replace(
                point, gap=float(gap_found if gap_found is not None else math.inf))
        dual = result.get("mip_dual_bound")
        bound = dual * unit - merged if dual is not None and math.isfinite(dual) else -math.inf
        return self._tightened(point, weights, limit_s, limit_j, bound)

    def _tightened(self, plan: PipelinePoint, weights: Weights, limit_s: float | None,
                   limit_j: float | None, bound: float) -> PipelinePoint:
        """A plan HiGHS found but did not prove, with ``bound`` (its dual bound): where
        their gap is above ``GAP``, also planned the large way, which weighs this plan
        among its candidates and often proves what HiGHS has not in its time; the better
        plan, against the higher bound."""
        value = weights.of(plan.time_s, plan.energy_j)
        if gap(value, bound) > GAP:
            self.known.append(plan)
            try:
                large = self._solve_large(weights, limit_s, limit_j)
            except PipelineSolveError:  # none of its own in its time: HiGHS's stands
                large = None
            if large is not None:
                large_value = weights.of(large.time_s, large.energy_j)
                bound = max(bound, large_value * (1 - large.gap))
                if large_value < value:
                    plan, value = large, large_value
        return dataclasses.replace(plan, gap=gap(value, bound))

    def _solve_large(self, weights: Weights, limit_s: float | None, limit_j: float | None
                     ) -> PipelinePoint | None:
        """A large DAG's plan (``planner.pipeline_large``), and a small one's where HiGHS
        found none in its time: of the program of shared options, every instruction at
        its fastest and the plans found before, the best; its gap proven against the
        relaxation without switches and, where that leaves more than ``GAP``, the rank
        bound, then the rank bound at the relaxation's prices."""
        parts = self.parts
        if weights.energy == 0 and limit_j is None and (
                parts.quickest.time_s <= parts.rank_bound.shortest * (1 + 1e-12)):
            return parts.quickest  # no plan is faster
        result, unit, prices = parts.relaxation._relax(weights, limit_s, limit_j)
        if result.status == 2:
            return None
        if result.status != 0:
            raise PipelineSolveError(
                f"HiGHS did not solve the relaxation of the {self.dag.stages}-stage "
                f"pipeline on {self.dag.ranks} ranks: {result.message}; allow it more time "
                "(max_solve_s)"
            )
        bound = result.fun * unit + weights.energy * parts.floor
        found = [p for p in [parts.quickest, *self.known]
                 if (limit_s is None or p.time_s <= limit_s)
                 and (limit_j is None or p.energy_j <= limit_j)]
        found += [p for p in [parts.shared._solve(weights, limit_s, limit_j)]
                  if p is not None]
        if not found and limit_j is None:  # a limit only a plan with fewer switches meets
            found = [p for p in [self.fastest()] if p.time_s <= limit_s]
        if not found:
            raise PipelineSolveError(
                f"HiGHS found no plan of the {self.dag.stages}-stage pipeline on "
                f"{self.dag.ranks} ranks within its time, although the relaxation has one; "
                "allow it more time (max_solve_s) or give a looser limit"
            )
        # the best found lowered in both orders of relabels, and every instruction at its
        # fastest best first: each reaches plans the others do not; the best of them then
        # merged (``pipeline_descent``)
        def order(p: PipelinePoint) -> tuple[float, float]:
            return weights.of(p.time_s, p.energy_j), p.time_s

        start = min(found, key=order)
        descents: list[tuple[PipelinePoint, Moves]] = [(start, "stepwise"),
                                                        (start, "best_first")]
        descents += [(p, "best_first") for p in found if p is parts.quickest and p is not start]
        best = min((self._lower(p, weights, limit_s, limit_j, moves) for p, moves in descents),
                   key=order)
        best = self._lower(best, weights, limit_s, limit_j, "merge")
        value = weights.of(best.time_s, best.energy_j)
        if gap(value, bound) > GAP and weights == ENERGY and limit_s is not None and (
                limit_j is None):  # the rank bound weighs this program's options
            bound = max(bound, parts.rank_bound.energy(limit_s) - self.loss_j)
            if gap(value, bound) > GAP and prices is not None:
                bound = max(bound, parts.rank_bound.energy(limit_s, prices) - self.loss_j)
        self.known.append(best)  # a plan within these limits is within any looser
        return dataclasses.replace(best, gap=gap(value, bound))

    def _lower(self, plan: PipelinePoint, weights: Weights, limit_s: float | None,
               limit_j: float | None, moves: Moves) -> PipelinePoint:
        """``plan`` lowered by ``pipeline_descent``'s ``moves`` within the limits (``plan``
        itself where it holds a choice that is none of this program's options: another
        method's)."""
        timing = self.parts.timing
        start = timing.plan_of(plan.choices)
        if start is None:
            return plan
        lowered = descend(timing, start, lambda cost: weights.of(*cost), limit_s, limit_j,
                          moves)
        if lowered == start:
            return plan
        point = _evaluate(self.dag, self.model,
                          [opts[k] for opts, k in zip(self.options, lowered)])
        within = ((limit_s is None or point.time_s <= limit_s)
                  and (limit_j is None or point.energy_j <= limit_j))
        better = weights.of(point.time_s, point.energy_j) < weights.of(plan.time_s, plan.energy_j)
        return point if within and better else plan

    def fastest(self, limit_j: float | None = None, what: str = "") -> PipelinePoint:
        """The fastest plan within ``limit_j`` (``what``: the limit, in words)."""
        quick = self._solve(TIME, None, limit_j)
        if quick is None:
            fast, frugal = self.fastest(), self._solve(ENERGY, None)
            raise PipelineEnergyLimitError(
                f"no plan of the pipeline takes at most {what} an iteration: the least-energy "
                f"plan takes {frugal.energy_j:.4g} J ({frugal.time_s:.4g} s), the fastest "
                f"{fast.energy_j:.4g} J ({fast.time_s:.4g} s)"
            )
        frugal = self._solve(ENERGY, quick.time_s, limit_j) or quick
        # of the two, the faster (rounding may let the second be slower by a hair); its
        # gap: in time and, of plans that fast, in energy
        found = min((quick, frugal), key=lambda p: (p.time_s, p.energy_j))
        return dataclasses.replace(found, gap=max(quick.gap, frugal.gap))

    def least_energy(self, limit_s: float | None, what: str = "") -> PipelinePoint:
        """The least-energy plan within ``limit_s`` (``what``: the limit, in words; by
        default its seconds)."""
        found = self._solve(ENERGY, limit_s)
        if found is None:
            quick, frugal = self.fastest(), self._solve(ENERGY, None)
            raise PipelineTimeLimitError(
                f"no plan of the pipeline finishes an iteration within "
                f"{what or f'{limit_s:.4g} s'}: the fastest takes {quick.time_s:.4g} s "
                f"({quick.energy_j:.4g} J), the least-energy plan {frugal.time_s:.4g} s "
                f"({frugal.energy_j:.4g} J)"
            )
        return found

    def least_tradeoff(self, eta: float, max_power_w: float) -> PipelinePoint:
        """The plan of least eta x E + (1 - eta) x ``max_power_w`` x T."""
        if eta == 0:  # time only: of the fastest plans, the least energy
            return self.fastest()
        return self._solve(Weights(eta, (1 - eta) * max_power_w), None)


def _merged(dag: PipelineDag, options: Mapping[tuple[int, str], Sequence[FrontierPoint]],
            model: EnergyModel, share: float) -> Merged:
    """``options`` with clocks merged within ``share`` of a floor of the iteration's energy
    (every instruction at its least price, every rank's busiest at its fastest): none
    where ``share`` is 0 or a switch's price depends on its clocks."""
    block = model.blocking_power_w
    if share <= 0 or not uniform_switch(options, model.switch, model.switch_key, block):
        return Merged(dict(options), 0.0)
    fastest = max(sum(min(o.time_s for o in options[i.stage, i.kind])
                      for i in map(dag.instructions.__getitem__, order)) for order in dag.orders)
    floor = (sum(min(o.effective_energy_j - block * o.time_s for o in options[i.stage, i.kind])
                 for i in dag.instructions)
             + (dag.ranks * block + model.static_power_w) * fastest)
    return merge_clocks(options, dict.fromkeys(options, dag.microbatches), model.switch_key,
                        block, share * floor)


def _prune(points: Sequence[FrontierPoint], model: EnergyModel) -> tuple[FrontierPoint, ...]:
    """The options worth weighing, of each clock: those no other of that clock is as fast
    as and saves as much as (e - P_blocking x time)."""
    weighed = [FrontierPoint(o.time_s, o.effective_energy_j - model.blocking_power_w * o.time_s,
                             o) for o in points]
    return tuple(o.choice for o in fronts_by(weighed, lambda o: model.switch_key(o.choice)))
