"""Pipelines too large to solve exactly: the plan of a smaller program, and the bounds
that state how far from optimal it can be.

The exact program (``planner.pipeline``) weighs every instruction's option; HiGHS proves
small DAGs (some of 128 instructions take it over a minute), but Llama 3.1 70B at 16
stages x 64 microbatches has 2048, and the full program's relaxation alone takes a minute
there (its switch rows). A
large DAG is planned in steps whose cost grows gently with it:

1. **The plan: shared options.** The program with each rank's steady state's (stage, kind)
   instructions sharing one option in each of two runs of microbatches, and its filling
   and draining instructions one each (``by_phase``, up to ``PHASE_STAGES`` stages; one
   option a (stage, kind) beyond, ``by_kind``): its binaries grow with the stages, not the
   microbatches, every switch priced, solved by HiGHS within ``shared_solve_s``: a stage
   off the critical path runs slower throughout, and a rank's filling and draining take
   the clocks its bubbles allow (Llama 3.1 70B at 4 stages x 8 microbatches, at 4 points
   from the fastest time: the large plan 0-1.75% above the exact solve's, 60 s a solve,
   where with one option a (stage, kind) it was 0.76-3.10%). The plan of every instruction
   at its fastest is a candidate too, so a plan is found wherever one is fast enough. The
   best candidate is then lowered by ``pipeline_descent`` (a rank's phases relabelled to
   one clock, each instruction moved into its slack), every move checked by the exact
   cost, with its relabels tried in two orders; every instruction at its fastest is
   lowered too, best first (where the program's plan has slowed whole stages, it is often
   the better start). The best of those descents then merges spans of filling and draining
   instructions into their neighbours' clocks.
2. **The bound: the relaxation without switches.** The full program's linear relaxation
   with every clock switch free and only each (stage, kind)'s lower convex hull of
   options (``hull``: the only ones a relaxation mixes): about a second for 2048
   instructions. No plan undercuts it (a switch only adds time, and its price is
   floored by ``switch_floor``).
3. **A second bound near the fastest time.** Where the relaxation leaves a gap above
   ``GAP``, each rank's least price within the windows every plan meets
   (``planner.rank_dp``), summed: it charges the switches a rank cannot avoid, which the
   relaxation does not, but lets every rank take all the slack the others leave. Where
   that too leaves more than ``GAP``, the same with the precedences between ranks lifted
   into prices (a Lagrangian relaxation, ``Prices``) at the relaxation's duals: each rank
   then pays for the slack it takes, as in the relaxation, and for its switches.

Each plan states ``(its value - the best bound) / its value`` as its proven gap. Where the
gap is large, it is near the fastest time: there the optimum runs a stage's filling and
draining instructions on other clocks than its steady state, which the program of shared
options reaches within its time only on small DAGs and the descent in part, and the bounds
are loose (the relaxation lets a draining rank speed up a clock step an instruction, where
a plan pays a stall a step; the rank bound at prices still lets it, for a fraction of a
stall); the plan's time is still proven shortest. Llama 3.1 70B on a simulated H100,
before the merges: at 4 stages x 16 microbatches, 0.6% above the exact optimum at the
fastest time (the program of shared options alone: 7.8%) and 0.5% at 1.005 times it (the
stepwise descent from the program's plan alone: 2.6%), stated 1.7% and 2.1%; at 16 x 64,
stated 0.3-1.7% over the frontier (the stepwise descent alone: up to 15.7%), 0.25-1.06%
with the merges, and 0.25-0.96% with the priced rank bound.
"""

from __future__ import annotations

import graphlib
import itertools
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kareus.planner.compose import FrontierPoint
from kareus.planner.pipeline_descent import Timing, rank_phases
from kareus.planner.rank_dp import RankWindows, least_price

EXACT_INSTRUCTIONS = 256
"""The largest DAG (instructions) the exact program is given. 4 stages x 16 microbatches
of Llama 3.1 70B options on a simulated H100 (128 instructions) already take HiGHS a
minute to prove, near the fastest time."""

GAP = 0.01
"""The gap above which the rank bound is computed too."""

SHARED_SOLVE_S = 2.0
"""The most seconds HiGHS spends on one program of shared options per 2048 instructions
(its starts and precedence rows grow with the DAG; never less than this)."""


STEADY_RUNS = 2
"""The runs of microbatches a rank's steady state is cut into in the program of shared
options, each run's (stage, kind) sharing one option (``by_phase``)."""


PHASE_STAGES = 4
"""The most stages whose program of shared options gives the filling and draining their
own options (``by_phase``): deeper ones share
one option a (stage, kind) (``by_kind``). On Llama 3.1 70B (simulated H100) the larger
program lowered the largest stated gap at 2 x 128 from 3.2% to 2.1% and 4 x 8's from 5.2%
to 3.1%, but at 8 x 32, 8 x 128, 16 x 16, 16 x 64 and 32 x 32 HiGHS found no better plan
in its time, and ``kareus plan`` at 16 x 64 planned in 108-112 s against 103 s."""


def shared_solve_s(instructions: int) -> float:
    """The time limit of one solve of the program of shared options (``SHARED_SOLVE_S``)."""
    return SHARED_SOLVE_S * max(1.0, instructions / 2048)

CELLS = 40_000
"""Time cells over the limit in the rank bound (rounding loosens it by under a cell an
instruction: 0.06 ms in a 2.5 s iteration)."""

PRICED_CELLS = 1_250
"""Time cells over the limit in the rank bound at prices, per instruction of the longest
rank: the slack rounding gives a rank (under a cell an instruction) is priced there, so
cells must be finer as ranks grow longer (Llama 3.1 70B at 16 x 64 near the fastest time,
128 instructions a rank: 132264 J at 40,000 cells, 132336 J at 160,000, 132360 J at
240,000; 4 s a bound at 160,000 on 2 cores)."""


@dataclass(frozen=True)
class Weights:
    """What a solve minimises: ``energy`` x the iteration's energy + ``time`` x its
    seconds (the fastest plan: time only)."""

    energy: float
    time: float

    def of(self, time_s: float, energy_j: float) -> float:
        return self.energy * energy_j + self.time * time_s


@dataclass(frozen=True)
class Sharing:
    """A smaller program: each instruction's class (a class's instructions take one
    option) and the options it may take."""

    classes: tuple[Hashable, ...]
    options: tuple[tuple[FrontierPoint, ...], ...]


@dataclass(frozen=True)
class LargeParts:
    """What a large DAG is planned with: the program without switches whose relaxation
    bounds it, the program of shared options, the plan of every instruction at its
    fastest, the rank bound, the least the switches can take off (``switch_floor``), and
    the exact cost its plans are lowered by (``pipeline_descent``)."""

    relaxation: Any
    shared: Any
    quickest: Any
    rank_bound: RankBound
    floor: float
    timing: Timing


def shared_program(dag, options: Sequence[Sequence[FrontierPoint]]) -> Sharing:
    """The program of shared options of ``dag``: ``by_phase`` up to ``PHASE_STAGES``
    stages, ``by_kind`` beyond."""
    return (by_phase if dag.stages <= PHASE_STAGES else by_kind)(dag, options)


def by_kind(dag, options: Sequence[Sequence[FrontierPoint]]) -> Sharing:
    """Each (stage, kind)'s instructions share one option, any of theirs."""
    return Sharing(tuple((i.stage, i.kind) for i in dag.instructions),
                   tuple(tuple(opts) for opts in options))


def by_phase(dag, options: Sequence[Sequence[FrontierPoint]]) -> Sharing:
    """Each rank's filling and draining instructions take their own options (they wait on
    other ranks, so their best clocks differ along the phase); its steady state's (stage,
    kind) instructions share one in each of ``STEADY_RUNS`` runs of microbatches (where the
    limit falls between two clocks, a run at each, one switch between them)."""
    classes: list[Hashable] = [(i.stage, i.kind) for i in dag.instructions]
    for order in dag.orders:
        fill, steady, drain = rank_phases(dag, order)
        for i in (*fill, *drain):
            classes[i] = i
        for n, i in enumerate(steady):
            classes[i] = (*classes[i], n * STEADY_RUNS // len(steady))
    return Sharing(tuple(classes), tuple(tuple(opts) for opts in options))


def hull(options: Sequence[FrontierPoint], blocking_power_w: float) -> list[FrontierPoint]:
    """The options on the lower convex hull of (time, price): the only ones a linear
    relaxation mixes (price: effective energy less the blocked power the time saves)."""
    def price(o: FrontierPoint) -> float:
        return o.effective_energy_j - blocking_power_w * o.time_s

    kept: list[FrontierPoint] = []
    for o in sorted(options, key=lambda o: (o.time_s, price(o))):
        if kept and price(o) >= price(kept[-1]):
            continue
        while len(kept) > 1 and ((price(kept[-1]) - price(kept[-2])) * (o.time_s - kept[-2].time_s)
                                 >= (price(o) - price(kept[-2])) * (kept[-1].time_s
                                                                    - kept[-2].time_s)):
            kept.pop()
        kept.append(o)
    return kept


def quickest(options: Sequence[FrontierPoint]) -> FrontierPoint:
    """The fastest option, and of those the least energy."""
    return min(options, key=lambda o: (o.time_s, o.effective_energy_j))


@dataclass(frozen=True)
class Prices:
    """A Lagrangian's prices (J per second, none negative) of the precedences the rank
    bound lifts: each edge's between instructions not consecutive on a rank (``(i, j)``:
    ``j`` starts after ``i`` finishes), and each rank's of finishing by the iteration's
    end (``dag.orders``'s order); the linear relaxation's duals are good ones."""

    edges: Mapping[tuple[int, int], float]
    ends: Sequence[float]


class RankBound:
    """The rank bound of one DAG (module docstring, step 3): each instruction's longest
    path before and after it at its fastest, computed once."""

    def __init__(self, dag, options: Sequence[Sequence[FrontierPoint]], model) -> None:
        self.dag, self.options, self.model = dag, options, model
        n = len(options)
        preds: list[list[int]] = [[] for _ in range(n)]
        succs: list[list[int]] = [[] for _ in range(n)]
        for a, b in dag.edges:
            preds[b].append(a)
            succs[a].append(b)
        topo = list(graphlib.TopologicalSorter(dict(enumerate(preds))).static_order())
        fastest = [min(o.time_s for o in opts) for opts in options]
        self.head, self.tail = [0.0] * n, [0.0] * n
        for i in topo:
            self.head[i] = max((self.head[a] + fastest[a] for a in preds[i]), default=0.0)
        for i in reversed(topo):
            self.tail[i] = max((fastest[b] + self.tail[b] for b in succs[i]), default=0.0)
        self.shortest = max(h + f for h, f in zip(self.head, fastest))
        """No plan's iteration is shorter: every instruction at its fastest, no switch."""

    def energy(self, limit_s: float, prices: Prices | None = None) -> float:
        """No plan ending by ``limit_s`` takes less energy (``math.inf``: none ends by
        then): each rank's least price within its windows, summed, and the makespan's
        price at the shortest any plan takes; with ``prices``, each rank priced too for
        when its instructions start and finish, and the makespan for what the ends' prices
        leave of it (a Lagrangian relaxation: a bound whatever the prices)."""
        n = len(self.options)
        starts, finishes = [0.0] * n, [0.0] * n
        if prices is not None:
            for (i, j), price in prices.edges.items():
                finishes[i] += price
                starts[j] -= price
            for order, price in zip(self.dag.orders, prices.ends):
                finishes[order[-1]] += price
        cell = limit_s / (CELLS if prices is None
                          else PRICED_CELLS * max(map(len, self.dag.orders)))
        total = 0.0
        for order in self.dag.orders:
            total += least_price(RankWindows(
                [self.options[i] for i in order], [self.head[i] for i in order],
                [limit_s - self.tail[i] for i in order], self.model.switch_key,
                self.model.switch, self.model.blocking_power_w,
                [starts[i] for i in order], [finishes[i] for i in order]), cell)
        makespan = (self.dag.ranks * self.model.blocking_power_w + self.model.static_power_w
                    - (sum(prices.ends) if prices is not None else 0.0))
        return total + min(makespan * self.shortest, makespan * limit_s)


def switch_floor(dag, options: Sequence[Sequence[FrontierPoint]], model) -> float:
    """The least the switches can add to an iteration's effective energy: 0 unless a
    switch is priced below nothing (its seconds, not blocked, at more than its joules),
    then that price at every pair of consecutive instructions (the relaxation without
    switches stays a bound)."""
    keys = {model.switch_key(o.choice): o.choice for opts in options for o in opts}
    cheapest = min((joules - model.blocking_power_w * seconds
                    for (a, ca), (b, cb) in itertools.permutations(keys.items(), 2)
                    for seconds, joules in [model.switch(ca, cb)]), default=0.0)
    return min(cheapest, 0.0) * len(options)


def gap(value: float, bound: float) -> float:
    """The proven relative gap of a plan of ``value`` (a share of it, 0 at best)."""
    return max(0.0, (value - bound) / value) if value > 0 else 0.0
