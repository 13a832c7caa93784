"""A lower bound on a pipeline plan's price, one rank at a time.

A rank runs its instructions in a fixed order. Each may start no earlier than its
predecessors could have finished at their fastest (``release``) and must finish by the
time limit less the fastest path after it (``deadline``): every plan that ends by the limit
meets these windows. Within them, the rank's least price (options' effective energy, and
the clock switches between consecutive instructions of different clocks: their seconds
delay the rank, their joules are priced) is a dynamic program over the order whose state is
the last instruction's clock and the time the rank has finished: ``A[c][t]``, the least
price so far with the last at clock ``c`` and all finished by cell ``t``, non-increasing
in ``t``. The sum over ranks bounds every plan from below, each rank paying only for its
own instructions; unlike the linear relaxation, it charges the switches a rank cannot
avoid, which is where the relaxation is weak (near the fastest time, where fast
instructions on the critical path sit between slower ones).

A rank may also be priced for when its instructions start and finish (``start_price``,
``finish_price``, J per second later): a Lagrangian relaxation lifts the precedences
between ranks into such prices (``pipeline_large.RankBound``), and each rank's least price
within its windows is then its share of a bound whatever prices are given.

Time is counted in cells of ``cell`` seconds, rounded in the plan's favour (durations,
switches and releases down; a start priced at its cell's start, and its finish at that
plus its seconds, less a cell of their prices where they sum below nothing), so the bound
stays a bound; each instruction's state covers only the cells between its earliest finish
and its deadline.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kareus.planner.compose import FrontierPoint


@dataclass(frozen=True)
class RankWindows:
    """One rank's instructions in its order: each one's options, its earliest start and
    latest finish (seconds); the switch's (seconds, effective joules) between two choices
    and what it depends on (``key``: their clock); the power a blocked GPU draws above
    static, which prices an option's and a switch's seconds (they are not blocked)."""

    options: Sequence[Sequence[FrontierPoint]]
    release: Sequence[float]
    deadline: Sequence[float]
    key: Callable[[Any], Hashable]
    switch: Callable[[Any, Any], tuple[float, float]]
    blocking_power_w: float
    start_price: Sequence[float] = ()
    """Each instruction's price of starting a second later (J/s; none given: 0)."""
    finish_price: Sequence[float] = ()
    """Each instruction's price of finishing a second later (J/s; none given: 0)."""


def least_price(rank: RankWindows, cell: float) -> float:
    """No plan of the rank within its windows prices below this (``math.inf``: none fits).
    The switch round to the next iteration is not charged, except a negative price."""
    keys = sorted({rank.key(o.choice) for opts in rank.options for o in opts}, key=repr)
    index = {k: n for n, k in enumerate(keys)}
    choice_of = {rank.key(o.choice): o.choice for opts in rank.options for o in opts}
    pairs = {}
    for a, ka in enumerate(keys):
        for b, kb in enumerate(keys):
            if a != b:
                seconds, joules = rank.switch(choice_of[ka], choice_of[kb])
                pairs[a, b] = (math.floor(seconds / cell),
                               joules - rank.blocking_power_w * seconds)
    lo_prev, prev = 0, None
    for k, opts in enumerate(rank.options):
        clock = np.array([index[rank.key(o.choice)] for o in opts])
        cells = np.array([math.floor(o.time_s / cell) for o in opts])
        starts, finishes = (rank.start_price[k] if rank.start_price else 0.0,
                            rank.finish_price[k] if rank.finish_price else 0.0)
        price = np.array([o.effective_energy_j - rank.blocking_power_w * o.time_s
                          + finishes * o.time_s for o in opts])
        price += min(starts + finishes, 0.0) * cell  # both priced at the start's cell
        release = math.floor(rank.release[k] / cell)
        lo, hi = release + int(cells.min()), math.ceil(rank.deadline[k] / cell)
        if hi < lo:
            return math.inf
        finish = np.arange(lo, hi + 1)
        if prev is None:
            values = np.where(finish[None] >= release + cells[:, None], price[:, None], np.inf)
        else:
            ready = _arrive(prev, pairs, max(1, hi - int(cells.min()) - lo_prev + 1))
            src = np.concatenate([np.full((len(keys), 1), np.inf), ready], axis=1)
            at = np.clip(finish[None] - cells[:, None] - lo_prev, -1, ready.shape[1] - 1) + 1
            values = src[clock[:, None], at] + price[:, None]
            values[finish[None] < release + cells[:, None]] = np.inf
        if starts or finishes:
            values += (starts + finishes) * cell * (finish[None] - cells[:, None])
        state = np.full((len(keys), finish.size), np.inf)
        if len(set(clock.tolist())) == len(clock):  # an option a clock: no two to compare
            state[clock] = values
        else:
            by_clock = np.argsort(clock, kind="stable")
            first = np.flatnonzero(np.diff(clock[by_clock], prepend=-1))
            state[clock[by_clock[first]]] = np.minimum.reduceat(values[by_clock], first, axis=0)
        lo_prev, prev = lo, np.minimum.accumulate(state, axis=1)
    cheapest = min((price for _, price in pairs.values()), default=0.0)
    return float(prev[:, -1].min()) + min(cheapest, 0.0)


def _arrive(state: np.ndarray, pairs: dict[tuple[int, int], tuple[int, float]],
            width: int) -> np.ndarray:
    """The least price to be at each clock by each of ``width`` cells (as many as the next
    instruction looks up): staying at it, or switching to it from another (its cells later,
    its price more); past ``state``'s last cell, finished by it is finished by any later."""
    if width > state.shape[1]:
        state = np.concatenate([state, np.repeat(state[:, -1:], width - state.shape[1], axis=1)],
                               axis=1)
    state = state[:, :width]
    out = state.copy()
    prices = set(pairs.values())
    if len(prices) == 1 and len(state) > 1:  # one price whatever the clocks: the best other
        ((cells, price),) = prices
        if cells >= width:
            return out
        columns = np.arange(width)
        best = state.argmin(axis=0)
        rest = state.copy()
        rest[best, columns] = np.inf
        other = np.where(np.arange(len(state))[:, None] == best[None], rest.min(axis=0),
                         state[best, columns][None])
        np.minimum(out[:, cells:], other[:, : width - cells] + price, out=out[:, cells:])
        return out
    for (a, b), (cells, price) in pairs.items():
        if cells < width:
            np.minimum(out[b, cells:], state[a, : width - cells] + price, out=out[b, cells:])
    return out
