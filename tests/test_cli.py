"""The command line refuses what it cannot run before spawning anything."""

import pytest

from kareus.cli import main


@pytest.mark.parametrize(
    "argv, message",
    [
        (["demo", "--steps", "0"], "argument --steps: must be at least 1, got 0"),
        (["demo", "--world-size", "-2"], "argument --world-size: must be at least 1, got -2"),
        (["demo", "--layers", "two"], "argument --layers: 'two' is not an integer"),
        (["demo", "--nanobatches", "3"], "argument --nanobatches: invalid choice: 3"),
    ],
)
def test_bad_demo_arguments_are_refused_with_the_reason(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err
