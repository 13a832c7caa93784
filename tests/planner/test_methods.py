"""An instruction's options under each method, from its graphs' frontiers."""

import pytest

from kareus.passes.decide import Choice
from kareus.passes.ops import DEFAULT_CLOCK_MHZ as DEFAULT
from kareus.planner.compose import FrontierPoint as P
from kareus.planner.graph import GraphFrontier
from kareus.planner.methods import (
    InstructionChoice,
    UnknownMethodError,
    instruction_options,
)


def graph(label, unrewritten, rewritten=(), nanobatched=()):
    """``unrewritten``: clock -> (time, energy); ``rewritten``/``nanobatched``: (k, clock,
    time, energy)."""
    single = tuple(P(t, e, Choice(1, f)) for f, (t, e) in unrewritten.items())
    split = tuple(P(t, e, Choice(k, f, ((0, None),))) for k, f, t, e in rewritten)
    default = tuple(P(t, e, Choice(k, f, ((0, None),))) for k, f, t, e in nanobatched)
    return GraphFrontier(label, label, single + split, single, P(*unrewritten[DEFAULT],
                         Choice(1)), default)


EMBED = graph("embed", {DEFAULT: (1.0, 10.0), 900: (1.5, 8.0)})
BLOCK = graph("block", {DEFAULT: (2.0, 20.0), 900: (3.0, 15.0)},
              rewritten=[(2, DEFAULT, 1.8, 21.0), (4, DEFAULT, 1.7, 25.0), (2, 900, 2.9, 16.0),
                         (4, 900, 3.5, 17.0)],  # the last is dominated at its clock
              nanobatched=[(2, DEFAULT, 1.9, 20.5), (2, 900, 2.95, 15.5)])


def costs(options):
    return [(o.choice.clock_mhz, round(o.time_s, 9), round(o.effective_energy_j, 9))
            for o in options]


def test_the_baseline_runs_every_graph_unrewritten_at_the_default_clock():
    (only,) = instruction_options([(EMBED, 1), (BLOCK, 3)], "baseline")
    assert (only.time_s, only.effective_energy_j) == (7.0, 70.0)
    assert only.choice == InstructionChoice(DEFAULT, (Choice(1), Choice(1)))


def test_perseus_is_every_graph_unrewritten_at_one_clock_per_instruction():
    assert costs(instruction_options([(EMBED, 1), (BLOCK, 3)], "perseus")) == [
        (DEFAULT, 7.0, 70.0), (900, 10.5, 53.0)]


def test_nanobatch_perseus_splits_where_it_can_at_the_default_variant():
    options = instruction_options([(EMBED, 1), (BLOCK, 3)], "nanobatch_perseus")
    assert costs(options) == [(DEFAULT, 6.7, 71.5), (900, 10.35, 54.5)]
    assert options[0].choice.graphs == (Choice(1), Choice(2, DEFAULT, ((0, None),)))


def test_kareus_keeps_per_clock_the_front_of_the_sums():
    options = instruction_options([(EMBED, 1), (BLOCK, 2)], "kareus")
    # at the default clock: block k=1 (2, 20), k=2 (1.8, 21), k=4 (1.7, 25), each twice
    # after the embedding (1, 10); at 900: k=1 (3, 15), k=2 (2.9, 16) (k=4 dominated)
    assert costs(options) == [
        (DEFAULT, 4.4, 60.0), (DEFAULT, 4.6, 52.0), (DEFAULT, 5.0, 50.0),
        (900, 7.3, 40.0), (900, 7.5, 38.0)]


def test_an_unknown_method_is_refused():
    with pytest.raises(UnknownMethodError, match="perseus"):
        instruction_options([(EMBED, 1)], "zeus")
