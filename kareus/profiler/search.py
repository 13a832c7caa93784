"""Search one partition's knobs for its time-energy frontier with few measurements.

A partition variant is a launch slot for the other nanobatch's collective, the SMs that
collective gets, and an SM clock (REFERENCE.md section 1); measuring one on a real GPU
takes a fraction of a second at a clock already set and a settle more where the clock
changes, so the search spends an evaluation budget where the frontier can still move, and
it is asked one clock at a time: what it proposes at a clock is measured with what the
graph's other searches propose there, in one round (``lockstep``, through the clocks
coarse to fine, ``sweep``). At a clock, two kinds of step share every measurement:

- a clock step uses the structure of the clock: for one schedule (slot, SMs) time falls
  with the clock as a + b/f and energy is convex in it, so a few measured clocks predict
  the rest (interpolated between measured clocks, elsewhere scaled like the schedule with
  the most measured clocks), and no clock below one that costs more energy than a higher
  one can be on the frontier. The frontier is mostly "the best schedules x their clocks",
  so the measured schedules whose predicted points at this clock would add most
  hypervolume (total plus effective energy) are measured there, while that gain exceeds
  ``tolerance``;
- otherwise, multi-pass multi-objective Bayesian optimisation (DESIGN.md section 5) looks
  for better schedules at this clock: each proposal comes from one of several
  scalarisations of (time, energy) and (time, effective energy), in turn, its surrogate
  over all three knobs with clock as an ordinal dimension.

Only measured points are returned: predictions choose what to measure, never what is
reported. The start is seeded and always holds the default variant at the highest and
lowest clocks (they give the first clock curve). The search stops at the budget, when
the grid is exhausted, or when the hypervolume of the frontier has not improved for
``patience`` evaluations at the end of a round.

Everything here is deterministic for a seed: every rank that runs it on the same
measurements proposes the same points in the same order, alone or beside others.
"""

from __future__ import annotations

import itertools
import math
import operator
import random
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kareus.devices.base import Measurement
from kareus.errors import KareusError


class SearchSpaceError(KareusError, ValueError):
    """A search space has an empty axis, clocks not descending from the default, or more
    clocks or configurations than a search or an exhaustive run takes."""


class SearchBudgetError(KareusError, ValueError):
    """A search was given no evaluation to spend."""


@dataclass(frozen=True, order=True)
class Config:
    """One variant of a partition: where its collective launches, on how many SMs (None:
    the library's default), at which SM clock."""

    slot: int
    sms: int | None
    clock_mhz: int


MAX_SEARCH_CLOCKS = 1000
"""The most clocks a search takes: each clock step scores every unmeasured clock of every
measured schedule (a device has about 100; GPU specs are held to the same bound)."""

MAX_EXHAUSTIVE = 100_000
"""The most configurations ``exhaustive`` measures: each is a measurement (seconds on a
real GPU), and more than this is no ground truth anyone waits for."""


@dataclass(frozen=True)
class Space:
    """The grid a partition is searched over; ``clocks`` strictly descending from the
    default (a tuple, or a ``range`` with a negative step: nothing here lists the clocks or
    the grid, so neither needs to fit in memory). ``default_sms``: what None (the library's
    default) amounts to, so the surrogate sees the SM choices in the order of what they
    give the collective."""

    slots: tuple[int, ...]
    resources: tuple[int | None, ...]
    clocks: Sequence[int]
    default_sms: int | None = None

    def __post_init__(self) -> None:
        for name in ("slots", "resources", "clocks"):
            if not getattr(self, name):
                raise SearchSpaceError(f"search space: {name} is empty")
        clocks = self.clocks
        descending = (clocks.step < 0 or len(clocks) == 1 if isinstance(clocks, range)
                      else all(a > b for a, b in itertools.pairwise(clocks)))
        if not descending:
            raise SearchSpaceError(f"search space: clocks must strictly descend, got {clocks}")

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

    def config(self, index: int) -> Config:
        """The configuration at ``index`` in iteration order, computed, not looked up."""
        rest, clock = divmod(index, len(self.clocks))
        slot, sms = divmod(rest, len(self.resources))
        return Config(self.slots[slot], self.resources[sms], self.clocks[clock])

    def index(self, config: Config) -> int:
        """Where ``config`` comes in iteration order (``config``'s inverse)."""
        return ((self.slots.index(config.slot) * len(self.resources)
                 + self.resources.index(config.sms)) * len(self.clocks)
                + self.clocks.index(config.clock_mhz))

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
    rounds: list[int] = field(default_factory=list)
    """How many points each round measured together (one clock each), in order."""

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

WIDTH = 4
"""The most measured schedules a clock step adds at one clock: a round measures its clock's
most promising unmeasured points together (one clock setting, one multiplexed batch)."""

MAX_CANDIDATES = 1000
"""The most unmeasured schedules the surrogate scores at one clock (drawn where more)."""

LCB_KAPPA = 1.96
"""Weight of the surrogate's uncertainty in its score (skopt's default lower bound)."""


def sweep(clocks: Sequence[int]) -> list[int]:
    """``clocks`` coarse to fine: the highest, the lowest, then the middle of each gap,
    widest first (breadth-first bisection), so every curve is bracketed early and the
    clocks a pass reaches last are those its neighbours predict best."""
    n = len(clocks)
    order = [0, n - 1] if n > 1 else [0]
    gaps = [(0, n - 1)]
    while gaps:
        low, high = gaps.pop(0)
        if high - low > 1:
            middle = (low + high) // 2
            order.append(middle)
            gaps += [(low, middle), (middle, high)]
    return [clocks[i] for i in order]


class Searcher(Protocol):
    """A search asked, one clock at a time, what it would measure at that clock: what a
    schedule of many searches (``lockstep``) measures together, one clock setting each."""

    @property
    def done(self) -> bool: ...

    def propose(self, clock: int) -> list[Config]:
        """What to measure at ``clock`` now (all at that clock; none: nothing there)."""

    def tell(self, points: Sequence[Point]) -> None:
        """The measurements of the last proposal, in its order."""

    def finish(self) -> SearchResult:
        """The result (once nothing more is proposed at any clock)."""


MeasureRound = Callable[[int, list[tuple[int, Config]]], list[Measurement]]
"""Measures, at one clock, configurations of several searches (their index in the
schedule, the configuration) together, one measurement each in their order."""


def lockstep(searches: Sequence[Searcher], clocks: Sequence[int], measure: MeasureRound,
             after: Callable[[int], None] = lambda index: None,
             more: Callable[[], Sequence[Searcher]] = lambda: ()) -> list[SearchResult]:
    """Run ``searches`` side by side through passes of ``sweep(clocks)``: at each clock,
    what every search proposes is measured in one round, until no search proposes anything
    in a whole pass. A search's proposals depend on its own measurements only, so each
    measures what it would alone, while the GPU changes its clock once a round rather than
    once a point. ``after`` is told each search (its index) that took part in a round;
    ``more`` gives searches that join at the start of a pass (from its first clock, as
    alone); the results are in the order the searches joined."""
    order = sweep(clocks)
    searches = list(searches)
    while True:
        searches += more()
        if all(s.done for s in searches):
            break
        proposed = False
        for clock in order:
            batch = [(i, config) for i, s in enumerate(searches) if not s.done
                     for config in s.propose(clock)]
            if not batch:
                continue
            proposed = True
            measured = measure(clock, batch)
            for i in dict.fromkeys(i for i, _ in batch):
                searches[i].tell([Point.of(config, m) for (j, config), m
                                  in zip(batch, measured, strict=True) if j == i])
                after(i)
        if not proposed and not (joined := more()):
            break
        if not proposed:
            searches += joined
    return [s.finish() for s in searches]


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
    them with their frontiers; no configuration is measured twice. One ``ClockSearch``
    alone: what it measures in a schedule of many."""
    alone = ClockSearch(space, budget=budget, seed=seed, initial=initial, patience=patience,
                        tolerance=tolerance)
    (result,) = lockstep([alone], space.clocks,
                         lambda clock, batch: [evaluate(config) for _, config in batch])
    return result


class ClockSearch:
    """One partition's search, a clock at a time (see the module docstring).

    The start is the default schedule and ``initial - 2`` drawn ones at the highest clock,
    and the default schedule at the lowest. At every later clock it proposes the measured
    schedules whose predicted point there adds the most hypervolume (a clock step, up to
    ``WIDTH``), or, where no clock step is worth it, the schedule the surrogate of the
    next scalarisation scores best there (exploration, the ``WIDTH`` best: a round costs
    the counter's readings and a clock switch whatever it holds, so each is filled). It
    stops at ``budget`` (the last round cut short: a shorter budget measures a prefix),
    when the grid is exhausted, or when the hypervolume has not improved for ``patience``
    evaluations at the end of a round."""

    def __init__(
        self, space: Space, *, budget: int = 32, seed: int = 0, initial: int = 6,
        patience: int = 8, tolerance: float = 1e-3,
    ) -> None:
        if budget < 1:
            raise SearchBudgetError(f"search budget must be at least 1, got {budget}")
        if len(space.clocks) > MAX_SEARCH_CLOCKS:
            raise SearchSpaceError(
                f"search space: {len(space.clocks):,} clocks; a search takes at most "
                f"{MAX_SEARCH_CLOCKS:,} (search fewer, or in coarser steps)"
            )
        self.space, self.budget, self.seed = space, budget, seed
        self.patience, self.tolerance = patience, tolerance
        self.rng = random.Random(seed)
        self.points: list[Point] = []
        self.seen: set[Config] = set()
        self.hypervolumes: list[float] = []
        self.stopped: str | None = None
        self.rounds: list[int] = []
        self.start = _start(space, self.rng, initial)
        self.references: dict[Objective, tuple[float, float]] = {}
        self.best, self.stale = 0.0, 0
        self.passes = itertools.cycle(itertools.product(WEIGHTS, (ENERGY, EFFECTIVE)))

    @property
    def done(self) -> bool:
        return self.stopped is not None

    def propose(self, clock: int) -> list[Config]:
        room = min(self.budget, self.space.size) - len(self.points)
        if self.done or room <= 0:
            return []
        if not self.references:
            return [c for c in self.start if c.clock_mhz == clock][:room]
        picks = _clock_picks(self.points, self.seen, self.references, self.tolerance, clock)
        if picks:
            return picks[:room]
        weight, energy = next(self.passes)
        return _explore(self.space, self.points, self.seen, weight, energy, clock, self.rng,
                        self.seed + len(self.points), WIDTH)[:room]

    def tell(self, points: Sequence[Point]) -> None:
        for p in points:
            self.seen.add(p.config)
            self.points.append(p)
        self.rounds.append(len(points))
        if not self.references:
            if self.seen.issuperset(self.start):  # the start measured: scores begin
                self.references = {e: reference_point(self.points, e) for e in (ENERGY, EFFECTIVE)}
                self.best = hypervolume(self.points, self.references[ENERGY])
                self.hypervolumes = [self.best] * len(self.points)
        else:
            for n in range(len(self.points) - len(points), len(self.points)):
                volume = hypervolume(self.points[: n + 1], self.references[ENERGY])
                self.hypervolumes.append(volume)
                if volume > self.best * (1 + self.tolerance):
                    self.best, self.stale = volume, 0
                else:
                    self.stale += 1
            if self.stale >= self.patience:
                self.stopped = "converged"
        if len(self.points) == self.space.size:
            self.stopped = "exhausted"
        elif len(self.points) >= self.budget:
            self.stopped = "budget"

    def finish(self) -> SearchResult:
        if self.stopped is None:  # a pass proposed nothing more
            self.stopped = "converged"
        if len(self.hypervolumes) < len(self.points):  # the start never completed
            self.hypervolumes = [0.0] * len(self.points)
        return SearchResult(self.points, self.stopped, self.hypervolumes, self.rounds)


class GridSearch:
    """Every configuration, a clock at a time: the exhaustive ground truth in a schedule
    (a ``SearchSpaceError`` beyond ``MAX_EXHAUSTIVE`` of them)."""

    def __init__(self, space: Space) -> None:
        self.space = _exhaustible(space)
        self.points: list[Point] = []
        self.rounds: list[int] = []

    @property
    def done(self) -> bool:
        return len(self.points) == self.space.size

    def propose(self, clock: int) -> list[Config]:
        measured = {p.config for p in self.points}
        return [Config(slot, sms, clock)
                for slot, sms in itertools.product(self.space.slots, self.space.resources)
                if Config(slot, sms, clock) not in measured]

    def tell(self, points: Sequence[Point]) -> None:
        self.points += points
        self.rounds.append(len(points))

    def finish(self) -> SearchResult:
        return SearchResult(self.points, "exhausted", rounds=self.rounds)


def exhaustive(space: Space, evaluate: Callable[[Config], Measurement]) -> list[Point]:
    """Every configuration of ``space``: the ground truth the search is judged against (a
    ``SearchSpaceError`` beyond ``MAX_EXHAUSTIVE`` of them)."""
    return [Point.of(config, evaluate(config)) for config in _exhaustible(space)]


def _exhaustible(space: Space) -> Space:
    if space.size > MAX_EXHAUSTIVE:
        raise SearchSpaceError(
            f"search space: {space.size:,} configurations; an exhaustive run measures at "
            f"most {MAX_EXHAUSTIVE:,} (search it instead)"
        )
    return space


def _start(space: Space, rng: random.Random, n: int) -> list[Config]:
    """The default schedule at the highest clock, then ``n - 2`` seeded drawn schedules
    there, then the default schedule at the lowest clock (the first clock curve): schedule
    indices drawn from their count, so the grid is never listed."""
    default = space.default
    schedules = len(space.slots) * len(space.resources)
    first = space.index(default) // len(space.clocks)
    drawn = [i for i in rng.sample(range(schedules), min(max(n - 1, 0), schedules))
             if i != first][: max(n - 2, 0)]
    top = [space.config(i * len(space.clocks)) for i in drawn]
    bottom = Config(default.slot, default.sms, space.clocks[-1])
    return list(dict.fromkeys([default, *top, bottom]))[:max(n, 1)]


Curve = dict[int, Point]  # one schedule's measured points by clock


def _curves(points: Iterable[Point]) -> dict[tuple[int, int | None], Curve]:
    """The measured points of each schedule (slot, SMs), by clock."""
    curves: dict[tuple[int, int | None], Curve] = {}
    for p in points:
        curves.setdefault((p.config.slot, p.config.sms), {})[p.config.clock_mhz] = p
    return curves


def between(curve: Mapping[int, Point | Measurement], clock: int) -> tuple[float, float] | None:
    """(time, energy) at ``clock`` from the measured clocks either side of it: time as
    a + b/f through both, energy along their chord (above a convex curve, so a cautious
    guess); None outside the measured range."""
    if clock in curve:
        return curve[clock].time_s, curve[clock].energy_j
    high = min((c for c in curve if c > clock), default=None)
    low = max((c for c in curve if c < clock), default=None)
    if high is None or low is None:
        return None
    a, b = curve[high], curve[low]
    w = (1 / clock - 1 / high) / (1 / low - 1 / high)
    v = (high - clock) / (high - low)
    return a.time_s + w * (b.time_s - a.time_s), a.energy_j + v * (b.energy_j - a.energy_j)


def _predict(curves: dict[tuple[int, int | None], Curve], config: Config) -> Point | None:
    """A guess at an unmeasured clock of a measured schedule: interpolated where measured
    clocks bracket it, else its nearest measured point scaled by how the schedule with the
    most measured clocks bracketing both changes between them (clock responses of one
    partition's schedules differ mostly in scale). Effective energy at the anchor's static
    power."""
    curve = curves[(config.slot, config.sms)]
    guess = between(curve, config.clock_mhz)
    anchor = curve[min(curve, key=lambda c: (abs(c - config.clock_mhz), -c))]
    if guess is None:
        shapes = [
            (len(other), at, base) for other in curves.values()
            if (at := between(other, config.clock_mhz)) is not None
            and (base := between(other, anchor.config.clock_mhz)) is not None
        ]
        if not shapes:
            return None
        _, at, base = max(shapes, key=operator.itemgetter(0))
        guess = anchor.time_s * at[0] / base[0], anchor.energy_j * at[1] / base[1]
    time_s, energy_j = guess
    static_w = (anchor.energy_j - anchor.effective_energy_j) / anchor.time_s
    return Point(config, time_s, energy_j, energy_j - static_w * time_s)


def complete(points: Iterable[Point], clocks: Iterable[int]) -> list[Point]:
    """The measured points and, for every measured schedule, a prediction at each clock of
    ``clocks`` it was not measured at (``_predict``; none where no measured schedule spans
    that clock): what a planner composes one clock at a time. The search measures a
    schedule at a few clocks only, so clocks common to every partition are rare."""
    measured = list(points)
    curves = _curves(measured)
    predicted = [
        guess
        for (slot, sms), curve in curves.items()
        for clock in clocks
        if clock not in curve and (guess := _predict(curves, Config(slot, sms, clock)))
    ]
    return measured + predicted


def _floor(curve: Curve) -> int:
    """The highest measured clock that costs at least as much energy as a higher measured
    one: with time falling and energy convex in the clock, every clock below it is
    dominated by it (0: none known)."""
    clocks = sorted(curve, reverse=True)
    return max(
        (low for i, low in enumerate(clocks)
         if any(curve[low].energy_j >= curve[high].energy_j for high in clocks[:i])),
        default=0,
    )


def _clock_picks(
    points: list[Point],
    seen: set[Config],
    references: dict[Objective, tuple[float, float]],
    tolerance: float,
    clock: int,
) -> list[Config]:
    """Up to ``WIDTH`` measured schedules unmeasured at ``clock`` whose predicted points
    there add the most hypervolume, relative and summed over total and effective energy,
    each scored with the picks before it on the fronts; only gains above ``tolerance``
    (else a new schedule is worth more), and a pick must beat the best so far by
    ``tolerance`` too: near-ties go to the earliest measured schedule."""
    curves = _curves(points)
    fronts = {energy: pareto(points, energy) for energy in references}
    picks: list[Config] = []
    while len(picks) < WIDTH:
        volumes = {energy: hypervolume(fronts[energy], ref, energy)
                   for energy, ref in references.items()}
        best: tuple[Config, Point] | None = None
        best_gain = 0.0
        for (slot, sms), curve in curves.items():
            config = Config(slot, sms, clock)
            if config in seen or config in picks or clock < _floor(curve):
                continue
            guess = _predict(curves, config)
            if guess is None:
                continue
            gain = sum(
                hypervolume([*fronts[e], guess], ref, e) / volumes[e] - 1
                for e, ref in references.items() if volumes[e] > 0
            )
            if gain > best_gain + tolerance:
                best, best_gain = (config, guess), gain
        if best is None:
            break
        picks.append(best[0])
        fronts = {e: pareto([*front, best[1]], e) for e, front in fronts.items()}
    return picks


def _encode(space: Space, config: Config) -> list[int]:
    """Indices into the space's choices (clock as an ordinal)."""
    return [
        space.slots.index(config.slot),
        space.ordered_resources.index(config.sms),
        space.clocks.index(config.clock_mhz),
    ]


def _explore(
    space: Space,
    points: list[Point],
    seen: set[Config],
    weight: float,
    energy: Objective,
    clock: int,
    rng: random.Random,
    seed: int,
    count: int = 1,
) -> list[Config]:
    """The ``count`` unmeasured configurations at ``clock`` that a Gaussian-process
    surrogate of one scalarisation, told every measurement, scores best (lower confidence
    bound), best first; fewer where fewer schedules are unmeasured there."""
    from skopt import Optimizer
    from skopt.space import Categorical, Integer

    schedules = len(space.slots) * len(space.resources)
    drawn = (range(schedules) if schedules <= MAX_CANDIDATES
             else sorted(rng.sample(range(schedules), MAX_CANDIDATES)))
    candidates = [
        c for i in drawn
        if (c := Config(space.slots[i // len(space.resources)],
                        space.resources[i % len(space.resources)], clock)) not in seen
    ]
    if not candidates:
        return []
    times = [p.time_s for p in points]
    energies = [energy(p) for p in points]

    def scale(x: float, xs: list[float]) -> float:
        low, high = min(xs), max(xs)
        return 0.0 if math.isclose(low, high) else (x - low) / (high - low)

    ys = [weight * scale(t, times) + (1 - weight) * scale(e, energies)
          for t, e in zip(times, energies, strict=True)]
    dims = [  # skopt's Integer needs two values at least; a fixed knob is one category
        Integer(0, len(choices) - 1) if len(choices) > 1 else Categorical([0])
        for choices in (space.slots, space.resources, space.clocks)
    ]
    optimizer = Optimizer(dims, base_estimator="GP", n_initial_points=0, random_state=seed,
                          acq_optimizer="sampling", acq_optimizer_kwargs={"n_points": 1})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sklearn convergence chatter on tiny data
        optimizer.tell([_encode(space, p.config) for p in points], ys)
        model = optimizer.models[-1]
        mean, std = model.predict(
            optimizer.space.transform([_encode(space, c) for c in candidates]), return_std=True
        )
    scores = mean - LCB_KAPPA * std
    best = sorted(range(len(candidates)), key=lambda i: (scores[i], i))[:count]
    return [candidates[i] for i in best]
