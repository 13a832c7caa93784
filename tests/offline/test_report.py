"""The frontier table says how far from optimal a plan is proven, to the hundredth of a
percent: a merged-clock plan's 0.04% is not "0.0%"."""

from __future__ import annotations

from rich.console import Console

from kareus.offline.report import frontier_table


def _result(gaps: list[float]) -> dict:
    points = [{"time_s": 1.0 + k, "energy_j": 100.0 - k, "gap": g} for k, g in enumerate(gaps)]
    return {"workload": {"model": "m", "tp": 1, "pp": 2, "sp": False, "microbatches": 8,
                         "microbatch_size": 1, "seq": 16, "schedule": "1f1b",
                         "recompute": "none", "gpus": 2},
            "device": "sim:h100-sxm", "frontiers": {"baseline": [points[0]], "kareus": points},
            "chosen": {"method": "kareus", **points[0]}}


def test_small_gaps_show_to_the_hundredth_and_proven_points_as_optimal():
    console = Console(record=True, width=200)
    console.print(frontier_table(_result([0.0, 0.00039, 0.0187])))
    text = console.export_text()
    assert "optimal" in text and "0.04%" in text and "1.87%" in text
    assert "0.0%" not in text
