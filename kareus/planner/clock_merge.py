"""Clocks a pipeline plan hardly gains by, merged into faster ones, their loss counted.

On the simulated H100 the top three clocks run Llama 3.1 70B's instructions in the same
time to the microsecond, and the six lowest save a tenth of a joule a step: options that
multiply the exact program's binaries and its plans of about equal energy, between which
HiGHS must still decide. At 4 stages x 8 microbatches it found no plan at all within 20 s
at the three points of the frontier nearest its fastest; with those clocks merged it
proved 7 of the frontier's 10 points within 20 s each (the largest gap stated 2.2%, from
3.1%).

A clock c merges into a clock c' where, for every (stage, kind) with options at c, each
of them has an option at c' no slower than it. Any plan then maps to a plan of the merged
options: each instruction at c moves to that option at c'. No instruction ends later; no
switch is added (two instructions of one clock keep one clock), nor does any cost more,
where every switch has one price whatever its clocks (the devices' today), not below
nothing; so the iteration ends no later and its energy rises by at most the loss: per
instruction, the most any of its options' price (effective energy less the blocked power
its seconds save) rises, summed over the DAG. The merged program's optimum is therefore
within the loss of the full one's, and a bound of the merged program less the loss
bounds the full one (a bound on time needs no correction: no plan is slowed).

Merges are made greedily, the least added loss first, while the loss stays within the
budget asked (``MERGE_LOSS`` of a floor of the iteration's energy, in ``pipeline``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kareus.planner.compose import FrontierPoint

MERGE_LOSS = 1e-3
"""The most a merge may lose, as a share of a floor of the iteration's energy (``pipeline``
states it in the plan's gap)."""

Key = tuple[int, str]


@dataclass(frozen=True)
class Merged:
    """Each (stage, kind)'s options with some clocks merged into others, and the most any
    plan's energy can rise by being mapped onto them (joules, over the whole DAG)."""

    options: dict[Key, tuple[FrontierPoint, ...]]
    loss_j: float


def uniform_switch(options: Mapping[Key, Sequence[FrontierPoint]], switch: Callable,
                   switch_key: Callable[[Any], Hashable], blocking_power_w: float) -> bool:
    """Whether every switch between two of the options' clocks has one (seconds, joules),
    neither it nor its price (joules less the blocked power its seconds save) below
    nothing: where a merge then removes a switch, it only saves."""
    chosen = {switch_key(o.choice): o.choice for opts in options.values() for o in opts}
    prices = {switch(a, b) for a, b in itertools.permutations(chosen.values(), 2)}
    return len(prices) <= 1 and all(seconds >= 0 and joules - blocking_power_w * seconds >= 0
                                    for seconds, joules in prices)


def merge_clocks(options: Mapping[Key, Sequence[FrontierPoint]], counts: Mapping[Key, int],
                 switch_key: Callable[[Any], Hashable], blocking_power_w: float,
                 budget_j: float) -> Merged:
    """``options`` with clocks merged (the module docstring's rule), the least added loss
    first, while the loss stays within ``budget_j``. ``counts``: each (stage, kind)'s
    instructions in the DAG. The caller must have checked ``uniform_switch``."""
    def price(o: FrontierPoint) -> float:
        return o.effective_energy_j - blocking_power_w * o.time_s

    # every original option's stand-in among the options left (itself, to begin with)
    held = {key: {o: o for o in opts} for key, opts in options.items()}
    loss = dict.fromkeys(options, 0.0)

    def moved(by_clock: Mapping[Key, Mapping[Hashable, list[FrontierPoint]]],
              clock: Hashable, into: Hashable) -> dict[Key, dict] | None:
        """Each (stage, kind)'s stand-ins with ``clock`` merged ``into`` another (of those
        with options at ``clock``); None where one of them has none at ``into`` no slower."""
        out = {}
        for key, left in by_clock.items():
            swap = {}
            for o in left.get(clock, ()):
                faster = [t for t in left.get(into, ()) if t.time_s <= o.time_s]
                if not faster:
                    return None
                swap[o] = min(faster, key=lambda t: (price(t), t.time_s))
            if swap:
                out[key] = {orig: swap.get(s, s) for orig, s in held[key].items()}
        return out

    def key_loss(stand_in: Mapping[FrontierPoint, FrontierPoint]) -> float:
        return max(0.0, *(price(s) - price(o) for o, s in stand_in.items()))

    def total() -> float:
        return sum(counts[key] * lost for key, lost in loss.items())

    while True:
        by_clock: dict[Key, dict[Hashable, list[FrontierPoint]]] = {}
        for key, stand_in in held.items():
            for s in dict.fromkeys(stand_in.values()):
                by_clock.setdefault(key, {}).setdefault(switch_key(s.choice), []).append(s)
        clocks = sorted({c for left in by_clock.values() for c in left}, key=repr)
        best = None
        for clock, into in itertools.permutations(clocks, 2):
            change = moved(by_clock, clock, into)
            if change is None:
                continue
            added = sum(counts[key] * (key_loss(stand_in) - loss[key])
                        for key, stand_in in change.items())
            if best is None or added < best[0]:
                best = (added, change)
        if best is None or total() + best[0] > budget_j:
            break
        for key, stand_in in best[1].items():
            held[key], loss[key] = stand_in, key_loss(stand_in)
    kept = {key: tuple(o for o in options[key] if o in left)
            for key, left in ((key, set(stand_in.values())) for key, stand_in in held.items())}
    return Merged(kept, total())
