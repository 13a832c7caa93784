"""Every budget form, and every error."""

import pytest

from kareus.errors import KareusError
from kareus.planner.budget import Budget, BudgetError, choose, constrains_nothing
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
        ({"energy_budget": "350"}, ("energy_budget: got '350'; a fraction is a number (350, "
         'not a string); an amount needs a unit ("350 J"); accepted: a fraction of the '
         "baseline's energy (e.g. 0.9) or an amount per step with a unit (J, kJ, mJ, Wh")),
        ({"time_budget": "1.1"}, ("time_budget: got '1.1'; a fraction is a number (1.1, not a "
         'string); an amount needs a unit ("1.1 s"); accepted:')),
        ({"energy_budget": "-5 J"}, "energy_budget: got '-5 J'; must be positive; accepted:"),
        ({"energy_budget": "0 J"}, "energy_budget: got '0 J'; must be positive; accepted:"),
        ({"energy_budget": "1e400 J"}, "energy_budget: got '1e400 J'; not finite; accepted:"),
        ({"energy_budget": float("inf")}, "energy_budget: got inf; not finite; accepted:"),
        ({"energy_budget": 10**400}, "; not finite; accepted:"),  # too large for a float
        ({"energy_budget": 0}, "energy_budget: got 0; must be positive; accepted:"),
        ({"energy_budget": [1]}, "energy_budget: got [1]; accepted:"),
        ({"energy_budget": "350 W"}, "energy_budget: got '350 W'"),
        ({"energy_budget": "350 MJ"}, "energy_budget: got '350 MJ'"),
        ({"time_budget": -1.0}, "time_budget: got -1.0; must be positive"),
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


@pytest.mark.parametrize("budget, says", [
    ({"energy_budget": 50}, ("the energy budget 50 of the baseline's 420 J = 2.1e+04 J per step "
     "constrains nothing: every plan meets it (the most any takes is 400 J); the fastest plan "
     "runs, as without a budget")),
    ({"energy_budget": "400 J"}, "the energy budget 400 J per step constrains nothing"),
    ({"time_budget": 1.4}, ("the time budget 1.4 of the baseline's 1.1 s = 1.54 s per step "
     "constrains nothing: every plan meets it (the most any takes is 1.5 s); the least-energy "
     "plan runs, whatever its time")),
    ({"energy_budget": 0.96}, "the energy budget 0.96 of the baseline's 420 J = 403.2 J"),
    ({"energy_budget": 0.9}, None),  # 378 J: the fastest plan's 400 J is over it
    ({"time_budget": "1.25 s"}, None),
    ({"energy_time_tradeoff": 1.0}, None),
    ({}, None),
])
def test_a_budget_every_plan_meets_is_said_to_change_nothing(budget, says):
    """Accepted (a fraction above 1 is legitimate: a faster plan may spend more than the
    baseline), but a bound no plan reaches is likely a slip; the planner logs it."""
    note = constrains_nothing(FRONTIER, BASELINE, Budget.parse(**budget))
    assert note is None if says is None else note.startswith(says)
