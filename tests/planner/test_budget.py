"""Every budget form, and every error."""

import pytest

from kareus.errors import KareusError
from kareus.planner.budget import Budget, BudgetError, choose
from kareus.planner.compose import StepPoint

FRONTIER = [StepPoint(1.0, 400.0, 300.0, ("a",)), StepPoint(1.2, 340.0, 220.0, ("b",)),
            StepPoint(1.5, 300.0, 150.0, ("c",))]
BASELINE = StepPoint(1.1, 420.0, 310.0, ("baseline",))


def pick(**budget):
    return choose(FRONTIER, BASELINE, Budget.parse(**budget), max_power_w=400.0).graphs[0]


@pytest.mark.parametrize(
    "budget, chosen",
    [
        ({}, "a"),
        ({"energy_budget": 0.85}, "b"),  # 357 J: the fastest within it
        ({"energy_budget": 0.72}, "c"),
        ({"energy_budget": "340 J"}, "b"),
        ({"energy_budget": "0.4 kJ"}, "a"),
        ({"time_budget": 1.0}, "a"),  # 1.1 s: the least energy within it
        ({"time_budget": "1.25 s"}, "b"),
        ({"time_budget": "1500 ms"}, "c"),
        ({"energy_time_tradeoff": 1.0}, "c"),
        ({"energy_time_tradeoff": 0.0}, "a"),
        ({"energy_time_tradeoff": 0.5}, "a"),  # 0.5 x (400 + 400 x 1.0) = 400 is least
    ],
)
def test_every_budget_form(budget, chosen):
    assert pick(**budget) == chosen


@pytest.mark.parametrize(
    "budget, message",
    [
        ({"energy_budget": 0.5, "time_budget": 1.0}, ("give one budget, not energy_budget and "
         "time_budget")),
        ({"energy_budget": "350"}, ("energy_budget: got '350'; accepted: a fraction of the "
         "baseline's energy (e.g. 0.9) or an amount per step with a unit (J, kJ, mJ, Wh")),
        ({"energy_budget": "350 W"}, "energy_budget: got '350 W'"),
        ({"energy_budget": "350 MJ"}, "energy_budget: got '350 MJ'"),
        ({"time_budget": -1.0}, "time_budget: got -1.0; must be > 0"),
        ({"time_budget": True}, "time_budget: got True"),
        ({"time_budget": "1.2 J"}, ("time_budget: got '1.2 J'; accepted: a fraction of the "
         "baseline's time (e.g. 0.9) or an amount per step with a unit (s, ms, min; e.g. "
         '"1.2 s")')),
        ({"energy_time_tradeoff": 1.5}, ("energy_time_tradeoff: got 1.5; accepted: a number "
         "in [0, 1]")),
    ],
)
def test_malformed_budgets(budget, message):
    with pytest.raises(BudgetError) as info:
        Budget.parse(**budget)
    assert message in str(info.value) and isinstance(info.value, KareusError)


def test_a_budget_no_plan_meets_states_the_range():
    with pytest.raises(BudgetError) as info:
        pick(energy_budget=0.5)
    assert str(info.value) == (
        "no plan meets the energy budget 0.5 of the baseline's 420 J = 210 J per step: the "
        "plans reach 300 to 400 J (0.714 to 0.952 of the baseline)"
    )
    with pytest.raises(BudgetError, match=r"time budget 0\.9 s per step: the plans reach 1 to "
                                          r"1\.5 s \(0\.909 to 1\.36 of the baseline\)"):
        pick(time_budget="900 ms")
    with pytest.raises(BudgetError, match="the step's frontier is empty"):
        choose([], BASELINE, Budget.parse())
