import io

from rich.console import Console

from kareus.profiler.profile import PartitionProfile, ProfilePoint
from kareus.profiler.progress import ProfilingProgress, summary_table
from kareus.profiler.search import Config, Point
from kareus.profiler.store import Knobs


def _point(t, e, clock):
    return ProfilePoint(Knobs(1, {}, clock, 2), t, e, e - 85 * t)


def _profile(frontier, error=None):
    return PartitionProfile(
        "ab12cd34ef56aa", 2, "all_reduce", (0, 3), 36, 14, 9, "converged", frontier, frontier,
        "sim:a100-sxm4-40gb", "sim-gpu-3 sim:a100-sxm4-40gb", error,
    )


def test_the_summary_shows_every_partitions_frontier_ends():
    console = Console(file=io.StringIO(), width=200)
    console.print(summary_table("frontiers", [
        _profile((_point(1e-3, 0.3, 1410), _point(1.4e-3, 0.2, 990))),
        _profile((), error="ProfilingAborted: rank 1 waited 120 s"),
    ]))
    text = console.file.getvalue()
    assert "ab12cd34ef56" in text and "p0, p3" in text and "14/36" in text
    assert "1.000, 300.00 @ 1410 MHz" in text and "1.400, 200.00 @ 990 MHz" in text
    assert "ProfilingAborted: rank 1 waited 120 s" in text


def test_the_bar_shows_evaluations_and_the_best_so_far_on_a_terminal_only():
    points = [Point(Config(0, None, 1410), 1e-3, 0.3, 0.2), Point(Config(0, None, 900), 2e-3,
                                                                   0.25, 0.1)]
    shown = Console(file=io.StringIO(), force_terminal=True, width=200)
    with ProfilingProgress(True, shown) as progress:
        progress("forward p0", 2, 32, points)
    text = shown.file.getvalue()
    assert "forward p0" in text and "2/32" in text
    assert "fastest 1.000 ms, least 250.00 mJ (2 on the frontier)" in text
    for enabled, terminal in ((False, True), (True, False)):
        hidden = Console(file=io.StringIO(), force_terminal=terminal)
        with ProfilingProgress(enabled, hidden) as progress:
            progress("forward p0", 2, 32, points)
        assert hidden.file.getvalue() == ""
