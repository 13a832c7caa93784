"""Lowering a large DAG's plan: moves checked by the exact schedule.

The program of shared options (``planner.pipeline_large``) gives every microbatch of a
(stage, kind) one option, so near the fastest time it cannot slow what has slack (a
rank's filling and draining instructions) without slowing its steady state, which is
critical. From a plan, ``descend`` moves in three ways, keeping a move only where the
exact cost (``Timing``) says it lowers what the solve minimises within its limits:

- **relabels**: every instruction of one rank's phase (filling: before its first
  backward; draining: after its last forward; the steady state between; or the whole
  rank) to one clock. A single instruction's clock rarely moves alone: it pays two
  switches' time where there is no slack. The phases' relabels compete for the same
  slack, and the order they are tried in decides who gets it, so there are two orders:
  - *best first* (``_relabels``): every phase to every clock, in the order of what each
    saves locally; on Llama 3.1 70B at 16 stages x 64 microbatches (simulated H100, at
    the fastest time) it slows the steady state of every rank the last stage paces, which
    the stepwise order, its slack spent by the first ranks' phases, does not (1.372e5 J
    against 1.607e5 J);
  - *stepwise* (``_relabel``): phase by phase, a clock a step at a time from the phase's
    own while that lowers it; it finds plans the best-first order passes by where the
    largest saving blocks two smaller ones.
- **merges** (``_merge``), tried once the relabels have settled: each span of a rank's
  filling or draining instructions that reaches one end of its phase (``spans``) to the
  clock of the instruction next to it. A phase's instructions wait on other ranks, so their
  best clocks differ along it, and the relabels leave switches inside the filling and
  draining that stall the rank where no bubble hides them; a merge removes one or moves it.
  On the workload above, from the relabelled plans at the frontier's 10 points, the stated
  gaps went from 0.26-1.66% to 0.25-1.06%.
- **a sweep**: in an order where every instruction follows what it waits for, each takes
  its cheapest option (its effective energy less the blocked power its seconds save, and
  the switches to its rank's neighbours) that still finishes by its latest finish: the
  latest that lets everything after it, as planned, end by the time limit. No earlier
  instruction then ends later than it may, so the plan stays within the limit.

All are local: the plan's gap is still proven against the bounds, not assumed.
"""

from __future__ import annotations

import graphlib
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Literal

import numpy as np

from kareus.planner.compose import FrontierPoint

ROUNDS = 5
"""Relabel-and-sweep rounds at most (each costs about 4 exact costs per rank phase)."""

WORK = 2_000_000
"""Instructions costed (exact costs x the DAG's instructions) at most in one descent: a
DAG of 2048 instructions pays 976 costs (about a second on 2 cores), one of 8192 a quarter
as many."""

PATIENCE = 3
"""Steps in a row a stepwise relabel tries past the last it kept (a clock's step may pay a
switch the next one's saving repays)."""

_TOLERANCE = 1e-12
"""A relative improvement below this is none (floating point rounding)."""

Cost = tuple[float, float]
"""An iteration's (seconds, joules), static power's included."""


class Timing:
    """The exact cost of plans of one DAG (``pipeline._evaluate``'s model), with the DAG's
    arrays built once: a descent costs hundreds of plans. A plan is one option index per
    instruction (into ``options``)."""

    def __init__(self, dag, options: Sequence[Sequence[FrontierPoint]], model) -> None:
        n = len(options)
        self.dag, self.model = dag, model
        self.time = [[o.time_s for o in opts] for opts in options]
        self.energy = [[o.effective_energy_j for o in opts] for opts in options]
        self.key = [[model.switch_key(o.choice) for o in opts] for opts in options]
        self._index = [{o.choice: k for k, o in enumerate(opts)} for opts in options]
        self.fastest_at: list[dict[Hashable, int]] = []
        """Each instruction's fastest option at each of its clocks (of those, the least
        energy)."""
        for opts, keys in zip(options, self.key):
            fastest: dict[Hashable, int] = {}
            for k, (o, key) in enumerate(zip(opts, keys)):
                held = fastest.get(key)
                if held is None or (o.time_s, o.effective_energy_j) < (
                        opts[held].time_s, opts[held].effective_energy_j):
                    fastest[key] = k
            self.fastest_at.append(fastest)
        self.price = [[e - model.blocking_power_w * t for e, t in zip(es, ts)]
                      for es, ts in zip(self.energy, self.time)]
        chosen = {k: o.choice for opts, keys in zip(options, self.key)
                  for o, k in zip(opts, keys)}
        self.switches = {(a, b): model.switch(chosen[a], chosen[b])
                         for a in chosen for b in chosen if a != b}
        self.prev, self.next = [-1] * n, [-1] * n
        self.last = [False] * n
        for order in dag.orders:
            for a, b in zip(order, order[1:] + order[:1]):
                self.next[a] = b
                if b != order[0]:
                    self.prev[b] = a
            self.last[order[-1]] = True
        self.lasts = [order[-1] for order in dag.orders]
        self.round_from = {order[0]: order[-1] for order in dag.orders}
        """Each rank's first instruction: the last, whose switch into the next iteration
        ends at it."""
        self.cross_preds: list[list[int]] = [[] for _ in range(n)]
        self.cross_succs: list[list[int]] = [[] for _ in range(n)]
        for a, b in dag.edges:
            if self.prev[b] != a:
                self.cross_preds[b].append(a)
                self.cross_succs[a].append(b)
        preds = {i: [*self.cross_preds[i], *([self.prev[i]] if self.prev[i] >= 0 else [])]
                 for i in range(n)}
        self.topo = list(graphlib.TopologicalSorter(preds).static_order())
        # The same as arrays (options padded with each instruction's first), for ``cost``:
        # a descent's time is mostly its exact costs.
        clocks = {k: c for c, k in enumerate(dict.fromkeys(k for keys in self.key for k in keys))}
        width = max(map(len, options))
        def table(rows: Sequence[Sequence[Any]]) -> np.ndarray:
            return np.array([[*row, *[row[0]] * (width - len(row))] for row in rows])
        self._times, self._energies = table(self.time), table(self.energy)
        self._clocks = table([[clocks[k] for k in keys] for keys in self.key])
        self._switch_s = np.zeros((len(clocks), len(clocks)))
        self._switch_j = np.zeros((len(clocks), len(clocks)))
        for (a, b), (seconds, joules) in self.switches.items():
            self._switch_s[clocks[a], clocks[b]] = seconds
            self._switch_j[clocks[a], clocks[b]] = joules
        self._rows, self._next = np.arange(n), np.array(self.next)
        self._steps = [(i, self.prev[i], tuple(self.cross_preds[i])) for i in self.topo]

    def plan_of(self, choices: Sequence[Any]) -> list[int] | None:
        """The plan of ``choices`` (one per instruction); None where one is none of its
        instruction's options."""
        plan = []
        for i, choice in enumerate(choices):
            at = self._index[i].get(choice)
            if at is None:
                return None
            plan.append(at)
        return plan

    def switch(self, a: Hashable, b: Hashable) -> tuple[float, float]:
        """The switch from clock ``a`` to ``b``: (seconds, effective joules)."""
        return (0.0, 0.0) if a == b else self.switches[a, b]

    def switches_after(self, plan: Sequence[int]) -> tuple[list[float], float]:
        """The seconds of the switch after each instruction on its rank, and the joules of
        all."""
        after, joules = self._switches(np.asarray(plan))
        return after, sum(joules)

    def _switches(self, at: np.ndarray) -> tuple[list[float], list[float]]:
        """Each instruction's switch after it on its rank: (seconds, joules)."""
        clocks = self._clocks[self._rows, at]
        following = clocks[self._next]
        return (self._switch_s[clocks, following].tolist(),
                self._switch_j[clocks, following].tolist())

    def _makespan(self, durations: Sequence[float], after: Sequence[float]) -> float:
        finish = [0.0] * len(durations)
        for i, p, cross in self._steps:
            start = finish[p] + after[p] if p >= 0 else 0.0
            for a in cross:  # not max(): this loop is most of a descent's time
                if finish[a] > start:  # noqa: PLR1730
                    start = finish[a]
            finish[i] = start + durations[i]
        return max(finish[i] + after[i] for i in self.lasts)

    def cost(self, plan: Sequence[int]) -> Cost:
        """The plan's (seconds, joules)."""
        at = np.asarray(plan)
        durations = self._times[self._rows, at].tolist()
        after, switch_j = self._switches(at)
        makespan = self._makespan(durations, after)
        effective = sum(self._energies[self._rows, at].tolist()) + sum(switch_j)
        blocked = self.dag.ranks * makespan - sum(durations) - sum(after)
        effective += self.model.blocking_power_w * blocked
        return makespan, effective + self.model.static_power_w * makespan


Moves = Literal["best_first", "stepwise", "merge"]
"""A descent's moves besides the sweep: the phases' relabels best first or stepwise, or
the spans merged into their neighbours (the module docstring's)."""


def descend(timing: Timing, plan: Sequence[int], value: Callable[[Cost], float],
            limit_s: float | None, limit_j: float | None, moves: Moves = "best_first"
            ) -> list[int]:
    """A plan no worse than ``plan`` by ``value`` (of its cost) within ``limit_s`` and
    ``limit_j`` (None: none), found by ``moves`` and sweeps within ``WORK``; ``plan``
    itself where none lowers it."""
    descent = _Descent(timing, plan, value, limit_s, limit_j)
    groups = spans(timing.dag) if moves == "merge" else phases(timing.dag)
    for _ in range(ROUNDS):
        before = descent.value
        if moves == "best_first":
            _relabels(groups, descent)
        elif moves == "stepwise":
            for group in groups:
                _relabel(group, descent)
        else:
            _merge(groups, descent)
        for end in dict.fromkeys([descent.cost[0], *([limit_s] if limit_s else [])]):
            if end >= descent.cost[0]:
                descent.consider(sweep(timing, descent.best, end))
        if descent.left <= 0 or descent.value >= before - _TOLERANCE * abs(before):
            break
    return descent.best


class _Descent:
    """One descent: its best plan so far, and the exact costs it may still pay."""

    def __init__(self, timing: Timing, plan: Sequence[int], value: Callable[[Cost], float],
                 limit_s: float | None, limit_j: float | None) -> None:
        self.timing, self.objective, self.limit_s, self.limit_j = timing, value, limit_s, limit_j
        self.left = max(1, WORK // len(plan))
        self.best, self.cost = list(plan), timing.cost(plan)
        self.value = value(self.cost)

    def consider(self, candidate: list[int]) -> bool:
        """Keeps ``candidate`` where it is within the limits and lowers the value (never
        once the work is spent)."""
        if self.left <= 0:
            return False
        self.left -= 1
        cost = self.timing.cost(candidate)
        value = self.objective(cost)
        if ((self.limit_s is None or cost[0] <= self.limit_s)
                and (self.limit_j is None or cost[1] <= self.limit_j)
                and value < self.value - _TOLERANCE * abs(self.value)):
            self.best, self.cost, self.value = candidate, cost, value
            return True
        return False


def rank_phases(dag, order: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
    """A rank's filling (before its first backward), steady (the rest) and draining
    (after its last forward) instructions."""
    kinds = [dag.instructions[i].kind for i in order]
    first_b = kinds.index("backward") if "backward" in kinds else len(order)
    last_f = (len(kinds) - 1 - kinds[::-1].index("forward")) if "forward" in kinds else -1
    return (list(order[:first_b]), list(order[first_b:last_f + 1]),
            list(order[max(first_b, last_f + 1):]))


def phases(dag) -> list[list[int]]:
    """Each rank's filling, steady and draining instructions, and the whole rank (those
    not empty)."""
    groups = []
    for order in dag.orders:
        groups += [g for g in (*rank_phases(dag, order), list(order)) if g]
    return groups


def spans(dag) -> list[tuple[list[int], int]]:
    """Each rank's spans of its filling or draining instructions that reach one end of the
    phase but not the other, each with the instruction next to it outside the span (the
    steady state's first or last, or the rest of the phase's)."""
    out: list[tuple[list[int], int]] = []
    for order in dag.orders:
        fill, steady, drain = rank_phases(dag, order)
        inner = [(fill[j:], (steady or drain)[0]) for j in range(1, len(fill)) if steady or drain]
        inner += [(drain[:j], (steady or fill)[-1]) for j in range(1, len(drain))
                  if steady or fill]
        out += inner + [(fill[:j], fill[j]) for j in range(1, len(fill))]
        out += [(drain[-j:], drain[-j - 1]) for j in range(1, len(drain))]
    return out


def _relabel(group: Sequence[int], descent: _Descent) -> None:
    """Moves ``group`` to one clock: the clocks in the order of the group's time at them,
    from its most common clock a step at a time in each direction, until ``PATIENCE``
    steps in a row were not kept by the descent (clocks as fast and as costly as the last
    tried count as none)."""
    timing, plan = descent.timing, descent.best
    moves = {}
    for clock in {k for i in group for k in timing.key[i]}:
        moved = _at_clock(timing, plan, group, clock)
        moves[clock] = (sum(timing.time[i][moved[i]] for i in group),
                        sum(timing.price[i][moved[i]] for i in group))
    clocks = sorted(moves, key=lambda c: (moves[c], _ordering(c)))
    held = [timing.key[i][plan[i]] for i in group]
    at = clocks.index(max(set(held), key=lambda c: (held.count(c), _ordering(c))))
    for step in (-1, 1):
        n, misses, last = at + step, 0, moves[clocks[at]]
        while 0 <= n < len(clocks) and misses < PATIENCE and descent.left > 0:
            if moves[clocks[n]] != last:
                kept = descent.consider(_at_clock(timing, descent.best, group, clocks[n]))
                misses = 0 if kept else misses + 1
                last = moves[clocks[n]]
            n += step


def _relabels(groups: Sequence[Sequence[int]], descent: _Descent) -> None:
    """Every group to every one of its clocks, tried best first by what the move saves
    locally (``_local``: the group's prices and seconds and the switches it touches, as
    the descent values them). Tried group by group instead, the first groups would spend
    the slack that the groups with most to save need."""
    timing, value = descent.timing, descent.objective
    moves = []
    for g, group in enumerate(groups):
        held = value(_local(timing, descent.best, group))
        for clock in {k for i in group for k in timing.key[i]}:
            moved = _at_clock(timing, descent.best, group, clock)
            saved = held - value(_local(timing, moved, group))
            if moved != descent.best and saved > 0:
                moves.append((saved, g, clock))
    moves.sort(key=lambda move: (-move[0], move[1], _ordering(move[2])))
    for _, g, clock in moves:
        if descent.left <= 0:
            return
        moved = _at_clock(timing, descent.best, groups[g], clock)
        if moved != descent.best:
            descent.consider(moved)


def _merge(ends: Sequence[tuple[Sequence[int], int]], descent: _Descent) -> None:
    """Each span (``spans``) to the clock of the instruction next to it: the switch between
    them is gone, or moves to a bubble. Filling and draining instructions wait on other
    ranks, so their best clocks differ along the phase (near the fastest time, the
    draining speeds up toward its end), and a switch between two of them stalls the rank
    where a bubble may not hide it."""
    timing = descent.timing
    for span, neighbour in ends:
        if descent.left <= 0:
            return
        moved = _at_clock(timing, descent.best, span,
                          timing.key[neighbour][descent.best[neighbour]])
        if moved != descent.best:
            descent.consider(moved)


def _local(timing: Timing, plan: Sequence[int], group: Sequence[int]) -> Cost:
    """What ``group`` takes in ``plan``: its instructions' seconds, and their prices with
    the switches into and out of each (those a move of the group changes)."""
    touched = {*group, *(timing.prev[i] for i in group if timing.prev[i] >= 0),
               *(timing.round_from[i] for i in group if i in timing.round_from)}
    seconds = sum(timing.time[i][plan[i]] for i in group)
    joules = sum(timing.price[i][plan[i]] for i in group)
    for i in touched:
        j = timing.next[i]
        switch_s, switch_j = timing.switch(timing.key[i][plan[i]], timing.key[j][plan[j]])
        seconds += switch_s
        joules += switch_j - timing.model.blocking_power_w * switch_s
    return seconds, joules


def _at_clock(timing: Timing, plan: Sequence[int], group: Sequence[int], clock: Hashable
              ) -> list[int]:
    """``plan`` with each of ``group`` at its fastest option of ``clock`` (where it has
    one)."""
    moved = list(plan)
    for i in group:
        k = timing.fastest_at[i].get(clock)
        if k is not None:
            moved[i] = k
    return moved


def sweep(timing: Timing, plan: Sequence[int], end_s: float) -> list[int]:
    """Each instruction, in ``timing.topo`` order, at its cheapest option that finishes by
    its latest finish with the iteration ending by ``end_s`` (at least ``plan``'s
    makespan: ``plan``'s own options always fit, so the result ends by ``end_s``)."""
    n = len(plan)
    durations = [t[k] for t, k in zip(timing.time, plan)]
    after, _ = timing.switches_after(plan)
    latest = [0.0] * n  # latest start of each instruction, as planned
    for i in reversed(timing.topo):
        finish = end_s - after[i] if timing.last[i] else latest[timing.next[i]] - after[i]
        for j in timing.cross_succs[i]:
            finish = min(finish, latest[j])
        latest[i] = finish - durations[i]
    moved, ends = list(plan), [0.0] * n
    blocking = timing.model.blocking_power_w
    switches, none = timing.switches, (0.0, 0.0)  # no pair of one clock: no switch
    for i in timing.topo:
        ready = max((ends[a] for a in timing.cross_preds[i]), default=0.0)
        p, q = timing.prev[i], timing.next[i]
        cap = min((latest[j] for j in timing.cross_succs[i]), default=float("inf"))
        limit = end_s if timing.last[i] else latest[q]
        next_key = timing.key[q][moved[q]]
        if p >= 0:
            prev_key, held_s = timing.key[p][moved[p]], 0.0
        else:  # the switch round from the rank's last: never longer than planned
            last = timing.round_from[i]
            prev_key = timing.key[last][plan[last]]
            held_s = switches.get((prev_key, timing.key[i][plan[i]]), none)[0]
        choice, price, choice_end = plan[i], None, 0.0
        for k, (key, duration, own) in enumerate(zip(timing.key[i], timing.time[i],
                                                      timing.price[i])):
            seconds, joules = switches.get((prev_key, key), none)
            if p >= 0:
                begin = max(ready, ends[p] + seconds)
            elif seconds > held_s:
                continue
            else:
                begin = ready
            extra = joules - blocking * seconds
            finish = begin + duration
            seconds, joules = switches.get((key, next_key), none)
            if finish > min(cap, limit - seconds) * (1 + _TOLERANCE) and k != plan[i]:
                continue
            total = own + extra + joules - blocking * seconds
            if price is None or total < price - _TOLERANCE * abs(price):
                choice, price, choice_end = k, total, finish
        moved[i], ends[i] = choice, choice_end
    return moved


def _ordering(key: Any) -> tuple[int, Any]:
    """Clocks in order: numbers by value, anything else by its text."""
    return (0, key) if isinstance(key, (int, float)) else (1, repr(key))
