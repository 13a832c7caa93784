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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kareus.errors import KareusError
from kareus.planner.compose import StepPoint


class BudgetError(KareusError, ValueError):
    """A budget is malformed, two were given, or no plan meets it."""


_UNITS = {
    "energy": {"J": 1.0, "kJ": 1e3, "mJ": 1e-3, "Wh": 3600.0},  # SI symbols: mJ is not MJ
    "time": {"s": 1.0, "ms": 1e-3, "min": 60.0},
}
_EXAMPLE = {"energy": '"350 J"', "time": '"1.2 s"'}
_AMOUNT = re.compile(r"\s*([-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]*)\s*")


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

    def describe(self) -> str:
        """What the budget asks for, in words (the backend's log, ``kareus show``)."""
        if self.kind == "fastest":
            return "the fastest plan"
        if self.kind == "tradeoff":
            return f"the least eta x energy + (1 - eta) x P_max x time, eta {self.value:g}"
        limit = (f"{self.fraction:g} of the baseline" if self.fraction is not None
                 else f"{self.value:.4g} {'J' if self.kind == 'energy' else 's'}")
        goal = "the least energy" if self.kind == "time" else "the fastest plan"
        return f"{goal} with {self.kind} <= {limit}"

    @classmethod
    def _amount(cls, kind: str, name: str, given: float | str) -> Budget:
        units = _UNITS[kind]
        accepted = (f"a fraction of the baseline's {kind} (e.g. 0.9) or an amount per step "
                    f"with a unit ({', '.join(units)}; e.g. {_EXAMPLE[kind]})")

        def refuse(why: str = "") -> BudgetError:
            return BudgetError(f"{name}: got {given!r}; {why + '; ' if why else ''}"
                               f"accepted: {accepted}")

        if isinstance(given, bool) or not isinstance(given, (int, float, str)):
            raise refuse()
        match = _AMOUNT.fullmatch(given) if isinstance(given, str) else None
        if isinstance(given, str) and (match is None or match.group(2) not in ("", *units)):
            raise refuse()
        try:
            number = float(match.group(1) if match else given)
        except OverflowError:  # an integer too large for a float
            number = math.inf
        if not math.isfinite(number):
            raise refuse("not finite")
        if number <= 0:
            raise refuse("must be positive")
        if match is None:
            return cls(kind, fraction=number)
        if not match.group(2):
            raise refuse(f"a fraction is a number ({match.group(1)}, not a string); an amount "
                         f'needs a unit ("{match.group(1)} {next(iter(units))}")')
        return cls(kind, value=number * units[match.group(2)])


class Cost(Protocol):
    """A step's time and energy: a frontier point, or a plan's record of one."""

    @property
    def time_s(self) -> float: ...

    @property
    def energy_j(self) -> float: ...


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
    limit = limit_of(budget, baseline)
    if budget.kind == "energy":
        fits = [p for p in frontier if p.energy_j <= limit]
        if fits:
            return min(fits, key=lambda p: (p.time_s, p.energy_j))
    else:
        fits = [p for p in frontier if p.time_s <= limit]
        if fits:
            return min(fits, key=lambda p: (p.energy_j, p.time_s))
    raise BudgetError(_unmet(frontier, baseline, budget, limit))


def constrains_nothing(frontier: Sequence[Cost], baseline: Cost, budget: Budget,
                       per: str = "step") -> str | None:
    """Why an energy or time ``budget`` changes nothing, or None: every point of the
    ``per`` (step, iteration) ``frontier`` meets it (legitimate, a fraction above 1 lets a
    faster plan spend more, but a bound nothing reaches is likely a slip, such as 50 for
    0.50)."""
    if budget.kind not in ("energy", "time") or not frontier:
        return None
    measure, unit = _bounded(budget)
    limit, high = limit_of(budget, baseline), max(map(measure, frontier))
    if high > limit:
        return None
    runs = ("the fastest plan runs, as without a budget" if budget.kind == "energy"
            else "the least-energy plan runs, whatever its time")
    return (f"the {budget.kind} budget {asked(budget, baseline, limit)} per {per} constrains "
            f"nothing: every plan meets it (the most any takes is {high:.4g} {unit}); {runs}")


def _bounded(budget: Budget) -> tuple[Callable[[Cost], float], str]:
    """What an energy or time budget bounds, and its unit."""
    if budget.kind == "energy":
        return (lambda c: c.energy_j), "J"
    return (lambda c: c.time_s), "s"


def limit_of(budget: Budget, baseline: Cost) -> float:
    """What an energy (J) or time (s) budget allows per step: its value, or its fraction of
    the baseline's."""
    measure, _ = _bounded(budget)
    return budget.value if budget.value is not None else budget.fraction * measure(baseline)


def asked(budget: Budget, baseline: Cost, limit: float) -> str:
    """An energy or time budget in words ("0.9 of the baseline's 10 s = 9 s", "9 s")."""
    measure, unit = _bounded(budget)
    return (f"{budget.fraction:g} of the baseline's {measure(baseline):.4g} {unit} = "
            f"{limit:.4g} {unit}" if budget.fraction is not None else f"{limit:.4g} {unit}")


def _unmet(frontier: Sequence[StepPoint], baseline: StepPoint, budget: Budget, limit: float) -> str:
    measure, unit = _bounded(budget)
    low, high = min(map(measure, frontier)), max(map(measure, frontier))
    base = measure(baseline)
    return (
        f"no plan meets the {budget.kind} budget {asked(budget, baseline, limit)} per step: "
        f"the plans reach {low:.4g} to {high:.4g} {unit} ({low / base:.3g} to "
        f"{high / base:.3g} of the baseline)"
    )
