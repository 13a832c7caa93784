"""The method's metrics, read off frontiers of whole iterations without interpolating.

Against Perseus, at each point of its frontier: the energy kareus saves at no more time
(iso-time: its least-energy plan no slower than that point) and the time it saves at no
more energy (iso-energy: its fastest plan within that point's energy). Against the baseline
(Megatron-LM: default clocks, no rewrite): the time and energy saved by the fastest plan
(maximum throughput). A reduction is a fraction of the reference's (0.1: 10% less); None
where no plan is no slower (or within the energy) at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class Cost(Protocol):
    @property
    def time_s(self) -> float: ...

    @property
    def energy_j(self) -> float: ...


@dataclass(frozen=True)
class Reduction:
    """At one reference point: its cost, and what the compared frontier saves there."""

    time_s: float
    energy_j: float
    energy_at_iso_time: float | None
    time_at_iso_energy: float | None


def reductions(compared: Sequence[Cost], reference: Sequence[Cost]) -> list[Reduction]:
    """At each point of ``reference``: the energy ``compared`` saves at no more time, and the
    time it saves at no more energy."""
    out = []
    for r in reference:
        in_time = [c.energy_j for c in compared if c.time_s <= r.time_s]
        in_energy = [c.time_s for c in compared if c.energy_j <= r.energy_j]
        out.append(Reduction(
            r.time_s, r.energy_j,
            1 - min(in_time) / r.energy_j if in_time else None,
            1 - min(in_energy) / r.time_s if in_energy else None,
        ))
    return out


@dataclass(frozen=True)
class Throughput:
    """The fastest plan against the baseline: the time and energy it saves."""

    time_s: float
    energy_j: float
    time_reduction: float
    energy_reduction: float


def max_throughput(frontier: Sequence[Cost], baseline: Cost) -> Throughput:
    """``frontier``'s fastest point (least energy among equally fast ones) against
    ``baseline``."""
    fastest = min(frontier, key=lambda c: (c.time_s, c.energy_j))
    return Throughput(fastest.time_s, fastest.energy_j, 1 - fastest.time_s / baseline.time_s,
                      1 - fastest.energy_j / baseline.energy_j)


def summary(values: Sequence[float | None]) -> dict[str, float | None]:
    """The largest and the mean of the reductions that exist, and how many do."""
    present = [v for v in values if v is not None]
    return {
        "max": max(present) if present else None,
        "mean": sum(present) / len(present) if present else None,
        "points": float(len(present)),
    }
