"""The command line refuses what it cannot run before spawning anything."""

import pytest

from kareus.cli import main


@pytest.mark.parametrize(
    "argv, message",
    [
        (["demo", "--steps", "0"], "argument --steps: must be at least 1, got 0"),
        (["demo", "--world-size", "-2"], "argument --world-size: must be at least 1, got -2"),
        (["demo", "--layers", "two"], "argument --layers: 'two' is not an integer"),
        (["demo", "--nanobatches", "3"], "argument --nanobatches: invalid choice: '3'"),
        (["demo", "--time-budget", "1.1", "--energy-budget", "0.9"],
         "argument --energy-budget: not allowed with argument --time-budget"),
    ],
)
def test_bad_demo_arguments_are_refused_with_the_reason(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_bad_budget_or_target_is_refused_before_anything_runs(capsys, tmp_path):
    assert main(["demo", "--energy-budget", "12 furlongs"]) == 2
    assert "kareus option 'energy_budget': got '12 furlongs'" in capsys.readouterr().out
    assert main(["show", str(tmp_path / "missing.json")]) == 2
    assert "missing.json: no such file or directory" in capsys.readouterr().out


@pytest.mark.slow
def test_the_demo_plans_trains_with_the_plan_and_writes_it(tmp_path, capsys):
    import json

    out = tmp_path / "plan.png"
    argv = ["demo", "--steps", "3", "--dim", "256", "--batch", "4", "--seq-len", "64",
            "--layers", "1", "--lowering", "eager", "--time-budget", "1.2", "--out", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    plan = json.loads(out.with_suffix(".json").read_text())
    assert out.read_bytes().startswith(b"\x89PNG")
    assert plan["budget"] == {"kind": "time", "value": None, "fraction": 1.2}
    assert plan["predicted"]["time_s"] <= 1.2 * plan["baseline"]["time_s"]
    assert "of the baseline" in text and "clock switches recorded on rank 0: 6" in text
