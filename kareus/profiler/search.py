"""Search one partition's knobs for its time-energy frontier with few measurements.

A partition variant is a launch slot for the other nanobatch's collective, the SMs that
collective gets, and an SM clock (REFERENCE.md section 1); measuring one on a real GPU
takes seconds, so the search spends an evaluation budget where the frontier can still
move. It is multi-pass multi-objective Bayesian optimisation (DESIGN.md section 5): each
proposal comes from one of several scalarisations of (time, energy) and (time, effective
energy), in turn, and every pass is told every measurement. Clock is an ordinal dimension
(time falls and power rises monotonically with it, which the surrogate can use); the start
is seeded and always holds the default variant at the highest and lowest clocks. The search
stops at the budget, when the grid is exhausted, or when the hypervolume of the frontier
has not improved for ``patience`` evaluations.

Everything here is deterministic for a seed: every rank that runs it on the same
measurements proposes the same points in the same order.
"""

from __future__ import annotations

import itertools
import math
import operator
import random
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kareus.profiler.devices.base import Measurement


@dataclass(frozen=True, order=True)
class Config:
    """One variant of a partition: where its collective launches, on how many SMs (None:
    the library's default), at which SM clock."""

    slot: int
    sms: int | None
    clock_mhz: int


@dataclass(frozen=True)
class Space:
    """The grid a partition is searched over; ``clocks`` descending from the default.
    ``default_sms``: what None (the library's default) amounts to, so the surrogate sees the
    SM choices in the order of what they give the collective."""

    slots: tuple[int, ...]
    resources: tuple[int | None, ...]
    clocks: tuple[int, ...]
    default_sms: int | None = None

    def __post_init__(self) -> None:
        for name in ("slots", "resources", "clocks"):
            if not getattr(self, name):
                raise ValueError(f"search space: {name} is empty")
        if tuple(sorted(self.clocks, reverse=True)) != self.clocks:
            raise ValueError(f"search space: clocks must descend, got {self.clocks}")

    @property
    def ordered_resources(self) -> tuple[int | None, ...]:
        """The SM choices by the SMs they give (None at ``default_sms``, else first)."""

        def sms(choice: int | None) -> int:
            if choice is not None:
                return choice
            return -1 if self.default_sms is None else self.default_sms

        return tuple(sorted(self.resources, key=sms))

    @property
    def size(self) -> int:
        return len(self.slots) * len(self.resources) * len(self.clocks)

    def __iter__(self):
        for slot, sms, clock in itertools.product(self.slots, self.resources, self.clocks):
            yield Config(slot, sms, clock)

    @property
    def default(self) -> Config:
        """Earliest slot, the library's SMs (or the first choice), the default clock."""
        sms = None if None in self.resources else self.resources[0]
        return Config(self.slots[0], sms, self.clocks[0])


@dataclass(frozen=True)
class Point:
    """A measured configuration."""

    config: Config
    time_s: float
    energy_j: float
    effective_energy_j: float

    @classmethod
    def of(cls, config: Config, m: Measurement) -> Point:
        return cls(config, m.time_s, m.energy_j, m.effective_energy_j)


Objective = Callable[[Point], float]
ENERGY: Objective = operator.attrgetter("energy_j")
EFFECTIVE: Objective = operator.attrgetter("effective_energy_j")


def pareto(points: Iterable[Point], energy: Objective = ENERGY) -> list[Point]:
    """The non-dominated points of (time, ``energy``), fastest first; of equal points the
    first measured is kept."""
    front: list[Point] = []
    for p in sorted(points, key=lambda p: (p.time_s, energy(p))):
        if not front or energy(p) < energy(front[-1]):
            front.append(p)
    return front


def hypervolume(
    points: Iterable[Point], reference: tuple[float, float], energy: Objective = ENERGY
) -> float:
    """Area dominated by ``points`` in (time, ``energy``) and bounded by ``reference``
    (both minimised); points beyond the reference add nothing."""
    ref_t, ref_e = reference
    front = [p for p in pareto(points, energy) if p.time_s < ref_t and energy(p) < ref_e]
    rights = [p.time_s for p in front[1:]] + [ref_t]
    return sum((right - p.time_s) * (ref_e - energy(p)) for p, right in zip(front, rights))


def reference_point(points: Sequence[Point], energy: Objective = ENERGY) -> tuple[float, float]:
    """10% beyond the worst time and energy seen: every measured point counts."""
    return (1.1 * max(p.time_s for p in points), 1.1 * max(energy(p) for p in points))


@dataclass
class SearchResult:
    points: list[Point]  # in measurement order
    stopped: str  # "budget", "exhausted" or "converged"
    hypervolumes: list[float] = field(default_factory=list)  # after each evaluation

    @property
    def frontier(self) -> list[Point]:
        """(time, energy)."""
        return pareto(self.points)

    @property
    def effective_frontier(self) -> list[Point]:
        """(time, effective energy): what the step planner composes (REFERENCE.md s1)."""
        return pareto(self.points, EFFECTIVE)


# Scalarisations the passes take in turn: weight on normalised time (the rest on energy),
# each for total and for effective energy (DESIGN.md s5: several, sharing measurements).
WEIGHTS = (0.5, 0.1, 0.9, 0.3, 0.7)


def search(
    space: Space,
    evaluate: Callable[[Config], Measurement],
    *,
    budget: int = 32,
    seed: int = 0,
    initial: int = 6,
    patience: int = 8,
    tolerance: float = 1e-3,
) -> SearchResult:
    """Measure up to ``budget`` configurations of ``space`` through ``evaluate`` and return
    them with their frontiers; no configuration is measured twice."""
    if budget < 1:
        raise ValueError(f"search budget must be at least 1, got {budget}")
    rng = random.Random(seed)
    points: list[Point] = []
    seen: set[Config] = set()
    result = SearchResult(points, "exhausted")

    def measure(config: Config) -> None:
        seen.add(config)
        points.append(Point.of(config, evaluate(config)))

    for config in _start(space, rng, min(initial, budget)):
        measure(config)
    reference = reference_point(points)
    best, stale = hypervolume(points, reference), 0
    result.hypervolumes = [best] * len(points)
    passes = itertools.cycle(itertools.product(WEIGHTS, (ENERGY, EFFECTIVE)))
    while len(points) < min(budget, space.size):
        weight, energy = next(passes)
        measure(_propose(space, points, seen, weight, energy, rng, seed + len(points)))
        volume = hypervolume(points, reference)
        result.hypervolumes.append(volume)
        if volume > best * (1 + tolerance):
            best, stale = volume, 0
        else:
            stale += 1
            if stale >= patience:
                result.stopped = "converged"
                return result
    result.stopped = "exhausted" if len(points) == space.size else "budget"
    return result


def exhaustive(space: Space, evaluate: Callable[[Config], Measurement]) -> list[Point]:
    """Every configuration of ``space``: the ground truth the search is judged against."""
    return [Point.of(config, evaluate(config)) for config in space]


def _start(space: Space, rng: random.Random, n: int) -> list[Config]:
    """The default variant at the highest and lowest clocks, then seeded random picks."""
    default = space.default
    start = list(dict.fromkeys([default, Config(default.slot, default.sms, space.clocks[-1])]))
    rest = [c for c in space if c not in start]
    rng.shuffle(rest)
    return (start + rest)[:n]


def _encode(space: Space, config: Config) -> list[int]:
    """Indices into the space's choices (clock as an ordinal)."""
    return [
        space.slots.index(config.slot),
        space.ordered_resources.index(config.sms),
        space.clocks.index(config.clock_mhz),
    ]


def _propose(
    space: Space,
    points: list[Point],
    seen: set[Config],
    weight: float,
    energy: Objective,
    rng: random.Random,
    seed: int,
) -> Config:
    """The next configuration by a Gaussian-process surrogate of one scalarisation, told
    every measurement; a random unmeasured one where the surrogate repeats itself."""
    from skopt import Optimizer
    from skopt.space import Integer

    times = [p.time_s for p in points]
    energies = [energy(p) for p in points]

    def scale(x: float, xs: list[float]) -> float:
        low, high = min(xs), max(xs)
        return 0.0 if math.isclose(low, high) else (x - low) / (high - low)

    ys = [weight * scale(t, times) + (1 - weight) * scale(e, energies)
          for t, e in zip(times, energies, strict=True)]
    dims = [Integer(0, len(choices) - 1) for choices in
            (space.slots, space.resources, space.clocks)]
    optimizer = Optimizer(
        dims, base_estimator="GP", n_initial_points=0, random_state=seed,
        acq_optimizer="sampling", acq_optimizer_kwargs={"n_points": min(space.size, 1000)},
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sklearn convergence chatter on tiny data
        optimizer.tell([_encode(space, p.config) for p in points], ys)
        slot, sms, clock = optimizer.ask()
    config = Config(space.slots[slot], space.ordered_resources[sms], space.clocks[clock])
    if config not in seen:
        return config
    unmeasured = [c for c in space if c not in seen]
    return unmeasured[rng.randrange(len(unmeasured))]
