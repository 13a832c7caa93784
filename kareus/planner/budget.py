"""Budgets: which point of a step's frontier runs.

``energy_budget`` picks the fastest plan whose step energy fits, ``time_budget`` the
least-energy plan whose step time fits; each is relative to the baseline (default clocks,
no rewrite: ``0.9`` is 90% of its energy or time) or absolute with a unit (``"350 J"``,
``"1.2 s"``, per step). ``energy_time_tradeoff`` is Zeus's eta: the plan of least
eta x E + (1 - eta) x P_max x T (REFERENCE.md section 2). Without any, the fastest plan
(and of the fastest, the least energy). A budget no plan meets is an error that states the
range the frontier reaches.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from kareus.errors import KareusError
from kareus.planner.compose import StepPoint


class BudgetError(KareusError, ValueError):
    """A budget is malformed, two were given, or no plan meets it."""


_UNITS = {
    "energy": {"J": 1.0, "kJ": 1e3, "mJ": 1e-3, "Wh": 3600.0},  # SI symbols: mJ is not MJ
    "time": {"s": 1.0, "ms": 1e-3, "min": 60.0},
}
_EXAMPLE = {"energy": '"350 J"', "time": '"1.2 s"'}
_AMOUNT = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]+)\s*")


@dataclass(frozen=True)
class Budget:
    """What the user asked for: ``kind`` "energy" | "time" | "tradeoff" | "fastest"; an
    absolute ``value`` (J, s, or eta), or a ``fraction`` of the baseline's."""

    kind: str
    value: float | None = None
    fraction: float | None = None

    @classmethod
    def parse(
        cls,
        energy_budget: float | str | None = None,
        time_budget: float | str | None = None,
        energy_time_tradeoff: float | None = None,
    ) -> Budget:
        given = {name: v for name, v in (("energy_budget", energy_budget),
                                         ("time_budget", time_budget),
                                         ("energy_time_tradeoff", energy_time_tradeoff))
                 if v is not None}
        if len(given) > 1:
            raise BudgetError(
                f"give one budget, not {' and '.join(given)}: energy_budget picks the fastest "
                "plan within an energy, time_budget the least energy within a time"
            )
        if energy_budget is not None:
            return cls._amount("energy", "energy_budget", energy_budget)
        if time_budget is not None:
            return cls._amount("time", "time_budget", time_budget)
        if energy_time_tradeoff is not None:
            eta = energy_time_tradeoff
            if isinstance(eta, bool) or not isinstance(eta, (int, float)) or not 0 <= eta <= 1:
                raise BudgetError(
                    f"energy_time_tradeoff: got {eta!r}; accepted: a number in [0, 1] (0: "
                    "time only, 1: energy only)"
                )
            return cls("tradeoff", value=float(eta))
        return cls("fastest")

    @classmethod
    def _amount(cls, kind: str, name: str, given: float | str) -> Budget:
        units = _UNITS[kind]
        accepted = (f"a fraction of the baseline's {kind} (e.g. 0.9) or an amount per step "
                    f"with a unit ({', '.join(units)}; e.g. {_EXAMPLE[kind]})")
        if isinstance(given, bool):
            raise BudgetError(f"{name}: got {given!r}; accepted: {accepted}")
        if isinstance(given, (int, float)):
            if not (math.isfinite(given) and given > 0):
                raise BudgetError(f"{name}: got {given!r}; must be > 0; accepted: {accepted}")
            return cls(kind, fraction=float(given))
        match = _AMOUNT.fullmatch(str(given))
        unit = match.group(2) if match else None
        if match is None or unit not in units or float(match.group(1)) <= 0:
            raise BudgetError(f"{name}: got {given!r}; accepted: {accepted}")
        return cls(kind, value=float(match.group(1)) * units[unit])


def choose(
    frontier: Sequence[StepPoint], baseline: StepPoint, budget: Budget, max_power_w: float = 0.0
) -> StepPoint:
    """The frontier point ``budget`` asks for (``max_power_w``: P_max of the trade-off,
    the group's power limit). ``frontier`` is fastest first, as ``step_frontier`` makes it."""
    if not frontier:
        raise BudgetError("no plan to choose from: the step's frontier is empty")
    if budget.kind == "fastest":
        return frontier[0]
    if budget.kind == "tradeoff":
        eta = budget.value
        return min(frontier, key=lambda p: eta * p.energy_j + (1 - eta) * max_power_w * p.time_s)
    if budget.kind == "energy":
        limit = budget.value if budget.value is not None else budget.fraction * baseline.energy_j
        fits = [p for p in frontier if p.energy_j <= limit]
        if fits:
            return min(fits, key=lambda p: (p.time_s, p.energy_j))
    else:
        limit = budget.value if budget.value is not None else budget.fraction * baseline.time_s
        fits = [p for p in frontier if p.time_s <= limit]
        if fits:
            return min(fits, key=lambda p: (p.energy_j, p.time_s))
    raise BudgetError(_unmet(frontier, baseline, budget, limit))


def _unmet(frontier: Sequence[StepPoint], baseline: StepPoint, budget: Budget, limit: float) -> str:
    if budget.kind == "energy":
        low, high = min(p.energy_j for p in frontier), max(p.energy_j for p in frontier)
        base, unit = baseline.energy_j, "J"
    else:
        low, high = min(p.time_s for p in frontier), max(p.time_s for p in frontier)
        base, unit = baseline.time_s, "s"
    asked = (f"{budget.fraction:g} of the baseline's {base:.4g} {unit} = {limit:.4g} {unit}"
             if budget.fraction is not None else f"{limit:.4g} {unit}")
    return (
        f"no plan meets the {budget.kind} budget {asked} per step: the plans reach "
        f"{low:.4g} to {high:.4g} {unit} ({low / base:.3g} to {high / base:.3g} of the "
        "baseline)"
    )
