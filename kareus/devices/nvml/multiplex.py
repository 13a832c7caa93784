"""Energy of several variants at one clock from one stretch of runs, by multiplexing.

Measuring each variant in windows of its own (``nvml.energy``) costs ~1.75 s a point while
the variants run for milliseconds: the energy counter updates only every 20-100 ms, so a
window must span many updates. Here the variants of one clock instead run back to back in
shuffled *blocks* (a variant run repeatedly for ~``block_s``), while a background thread
polls the counter every ~1 ms and records each time its value changes (a *tick*). Between
two ticks the GPU used a known energy, and each block overlaps that interval for a known
time (block ends and ticks are read on the same timer), so with the powers as unknowns

    E_k = sum_v P_v * overlap(k, v) + P_gap * gap(k)

(``gap``: time in no block: the lead-in, the tail, the host between blocks) is a linear
system over all intervals, solved by non-negative least squares. A counter reports energy
a little late, so the system is solved at each lag of a small grid (0 to one update
period) and the lag with the least residual is kept, unless the counter's probe told the
lag (``counter.CounterBehaviour.lag_s``). Each power carries its relative
standard error from the residuals (covariance ``s^2 (A^T A)^-1``); a variant whose error is
above ``max_error`` gets more blocks in another round, and the whole batch is solved
again over every reading. This holds only where the counter integrates power
continuously: one that samples part of each period (``nvml.counter``) needs long windows.

A *control* variant runs in every round, so that drift between rounds (the GPU warming)
shows: its power per round is fitted on that round's readings alone.

Ranks that measure together (a variant holding a collective) must run the same variants
the same number of times in the same order: the block order comes from a
``random.Random(seed)`` with a seed every rank shares, and every count that changes what
runs (runs per block, blocks added per variant) goes through ``agree``, which returns the
largest of the ranks' proposals, in the same order on every rank.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
from scipy.optimize import nnls

from kareus.devices.errors import EnergyCounterSilentError
from kareus.errors import KareusError

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11

logger = logging.getLogger("kareus")

Agree = Callable[[int], int]


class MultiplexPolicyError(KareusError, ValueError):
    """A multiplexing policy's setting is out of range."""


class CounterCache(Protocol):
    """Where a GPU's probed counter behaviour is kept between processes (the profile
    store): its JSON (``CounterBehaviour.to_json``) by GPU model and driver version."""

    def counter(self, gpu: str, driver: str) -> str | None:
        """The JSON stored for ``gpu`` under ``driver``; None where none is."""

    def record_counter(self, gpu: str, driver: str, behaviour: str) -> None:
        """Store ``behaviour`` (JSON) for ``gpu`` under ``driver``."""


@dataclass(frozen=True)
class MultiplexPolicy:
    """How long blocks are and when an estimate is good enough."""

    block_s: float = 0.15
    """A block's target length: a few counter updates, short enough to interleave."""
    max_block_s: float = 0.2
    """The longest a first round's blocks are stretched to, so that the round spans just
    the counter updates its errors need rather than a whole block more of each variant."""
    min_blocks: int = 1
    """Blocks of each variant in the first round."""
    max_error: float = 0.015
    """Relative standard error of a power above which its variant gets more blocks."""
    max_rounds: int = 3
    max_blocks: int = 8
    """A variant's blocks over all rounds, at most."""
    max_drift: float = 0.02
    """Relative change of the control's power between rounds above which a warning says
    that the GPU drifted (thermally) while measuring."""
    poll_s: float = 0.001
    """How often the counter is read: the uncertainty of a tick's time."""
    max_spread_s: float = 0.0025
    """A tick whose time is known less well (a read delayed: the host was busy) is left
    out, its energy going to the next interval; at least twice the median spread."""
    lag_step_s: float = 0.005
    """Step of the coarse lag grid (refined to a fifth of it around the best)."""
    silent_s: float = 2.0
    """The longest wait for the counter's next tick before it counts as stalled."""

    def __post_init__(self) -> None:
        for name in ("block_s", "max_error", "poll_s", "max_spread_s", "lag_step_s", "silent_s"):
            if not getattr(self, name) > 0:
                raise MultiplexPolicyError(f"{name} must be positive, not {getattr(self, name)}")
        if not self.max_block_s >= self.block_s:
            raise MultiplexPolicyError(
                f"max_block_s must be at least block_s ({self.block_s}), not {self.max_block_s}")
        for name in ("min_blocks", "max_rounds", "max_blocks"):
            if getattr(self, name) < 1:
                raise MultiplexPolicyError(f"{name} must be at least 1, not {getattr(self, name)}")


DEFAULT_POLICY = MultiplexPolicy()

MIN_FREEDOM = 8
"""Fewest intervals beyond the unknowns for an error to be stated from the residuals alone:
their variance s^2 is uncertain by sqrt(2 / freedom), half of it at 8 (fewer, and a lucky
small residual would pass a poor fit as a precise one)."""

WAIT_BEFORE_UPDATES = 0.5
"""Counter updates a round waits for a tick before its first block, on average, where no
settle ran while the counter was watched (``multiplex(lead_in=...)``: a settle of an update
or more holds a tick)."""

WAIT_AFTER_UPDATES = 1.5
"""Counter updates a round waits after its last block, on average: until a tick a whole
update after it shows that the counter has reported the round (``_reported``). Where the
probe told the lag, a tick the lag after it does, so this is an upper bound: the lag is
one of the grid's, at most an update."""

POOLED_FREEDOM = 2
"""Fewest intervals beyond the unknowns for an error to be stated where the counter's noise
per update is known (``CounterBehaviour.update_noise_mj``, probed over many updates): the
variance is then the larger of that noise's and the residuals', so a fit that explains its
readings worse than the counter's noise does still says so, and a batch needs only a few
readings beyond its unknowns rather than ``MIN_FREEDOM``."""


@dataclass(frozen=True)
class Tick:
    """The counter changed to ``mj`` (millijoules) within ``spread_s`` around ``time_s``
    on the timer: between the start of the read that saw the old value and the end of the
    one that saw the new value."""

    time_s: float
    mj: float
    spread_s: float = 0.0


@dataclass(frozen=True)
class Block:
    """``runs`` back-to-back runs of variant ``variant`` between ``start_s`` and ``end_s``
    (wall, on the counter's timer); ``busy_s``: their CUDA-event time (wall without CUDA)."""

    variant: int
    start_s: float
    end_s: float
    runs: int
    busy_s: float
    round: int = 0

    @property
    def wall_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True)
class Fit:
    """The powers that best explain the counter's readings at one lag."""

    power_w: tuple[float, ...]
    """Per variant; NaN for one no reading covers."""
    error: tuple[float, ...]
    """Relative standard error of each power; inf where it cannot be told."""
    gap_power_w: float
    lag_s: float
    rss_j2: float
    """Sum of the squared residuals of the intervals' energies (J^2)."""
    intervals: int


@dataclass(frozen=True)
class Estimate:
    """One variant's time and energy per run, recovered from the batch's readings."""

    time_s: float
    """Per run: CUDA-event time where there is CUDA, else wall time."""
    power_w: float
    energy_j: float
    """Per run: the power over the blocks' wall time, divided by the runs."""
    error: float
    """Relative standard error of ``power_w`` (and of ``energy_j``)."""
    runs: int
    blocks: int


@dataclass(frozen=True)
class Multiplexed:
    """A batch's estimates (in the order of its runs) and what the batch saw."""

    estimates: tuple[Estimate, ...]
    control: int
    control_power_w: tuple[float, ...]
    """The control variant's power in each round (``by_round``)."""
    control_error: tuple[float, ...]
    """The relative error of each of ``control_power_w``."""
    lag_s: float
    gap_power_w: float

    @property
    def rounds(self) -> int:
        return len(self.control_power_w)

    @property
    def control_drift(self) -> float:
        """The largest change of the control's power from the first round, relative."""
        first = self.control_power_w[0]
        change = max(abs(power - first) for power in self.control_power_w)
        return change / first if first > 0 else math.inf

    def drifted(self, max_drift: float) -> bool:
        """Whether the control's power changed from the first round by more than
        ``max_drift`` (relative) and by more than twice the change's standard error."""
        first, first_error = self.control_power_w[0], self.control_error[0]
        return any(
            abs(power - first) > max(max_drift * first,
                                     2 * math.hypot(error * power, first_error * first))
            for power, error in zip(self.control_power_w, self.control_error)
        )


class TickRecorder:
    """Polls an energy counter from a background thread and records when it changes.

    A context manager: the thread starts on entry and stops on exit, where an exception
    it met (a failing NVML read) is raised in the caller. While it runs, Python's thread
    switch interval is lowered to the poll period: a caller busy in Python (launching
    kernels) would otherwise hold the GIL for 5 ms at a time and blur the ticks' times.
    """

    def __init__(
        self, read_mj: Callable[[], float], timer: Callable[[], float], poll_s: float
    ) -> None:
        self._read_mj = read_mj
        self._timer = timer
        self._poll_s = poll_s
        self._stop = threading.Event()
        self._changed = threading.Condition()
        self._ticks: list[Tick] = []
        self._error: BaseException | None = None
        self._switch_interval = sys.getswitchinterval()
        self._thread = threading.Thread(target=self._poll, name="kareus-ticks", daemon=True)

    def __enter__(self) -> Self:
        sys.setswitchinterval(min(self._switch_interval, self._poll_s))
        self._thread.start()
        return self

    def __exit__(self, exc_type: object, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()
        sys.setswitchinterval(self._switch_interval)
        if self._error is not None and exc_type is None:
            raise self._error

    @property
    def ticks(self) -> tuple[Tick, ...]:
        with self._changed:
            return tuple(self._ticks)

    def wait(self, done: Callable[[tuple[Tick, ...]], bool], timeout_s: float) -> tuple[Tick, ...]:
        """The ticks once ``done`` holds for them; each tick must come within
        ``timeout_s`` of the previous check, or ``EnergyCounterSilentError``."""
        with self._changed:
            while not done(tuple(self._ticks)):
                self._next_tick(timeout_s)
            return tuple(self._ticks)

    def _next_tick(self, timeout_s: float) -> None:
        """Wait (holding ``_changed``) for one more tick, re-raising the thread's error."""
        seen = len(self._ticks)
        self._changed.wait_for(lambda: len(self._ticks) > seen or self._error is not None,
                               timeout_s)
        if self._error is not None:
            raise self._error
        if len(self._ticks) == seen:
            raise EnergyCounterSilentError(timeout_s, seen)

    def _poll(self) -> None:
        try:
            before, value = self._timer(), self._read_mj()
            while not self._stop.wait(self._poll_s):
                start, reading, end = self._timer(), self._read_mj(), self._timer()
                if reading != value:
                    tick = Tick((before + end) / 2, float(reading), end - before)
                    with self._changed:
                        self._ticks.append(tick)
                        self._changed.notify_all()
                before, value = start, reading
        except BaseException as exc:  # noqa: BLE001 - raised in the caller (wait, exit)
            with self._changed:
                self._error = exc
                self._changed.notify_all()


def sharp(ticks: Sequence[Tick], max_spread_s: float) -> list[Tick]:
    """``ticks`` without those whose time is uncertain by more than ``max_spread_s`` or
    twice the median spread, whichever is larger: dropping a tick merges the intervals
    either side of it, whose energy stays exact."""
    limit = max(max_spread_s, 2 * statistics.median(tick.spread_s for tick in ticks))
    return [tick for tick in ticks if tick.spread_s <= limit]


def regular(ticks: Sequence[Tick], period_s: float, slack_s: float) -> list[Tick] | None:
    """``ticks`` moved onto the evenly spaced updates that explain them, where there are
    such: a counter updating every ``period_s`` of its own clock is seen through polls
    that place each update only within its spread, but a line through all of them places
    every one within a fraction of that. None where some tick lies further from the line
    than its spread allows (with ``slack_s``): the counter's updates are not regular."""
    times = np.array([tick.time_s for tick in ticks])
    updates = np.round((times - times[0]) / period_s)
    if len(ticks) < 3 or np.any(np.diff(updates) < 1):
        return None
    slope, origin = np.polyfit(updates, times, 1)
    placed = origin + slope * updates
    spreads = np.array([tick.spread_s for tick in ticks])
    if np.any(np.abs(times - placed) > spreads / 2 + slack_s):
        worst = np.argmax(np.abs(times - placed) - spreads / 2)
        logger.debug(
            "energy counter updates not regular: one seen %.2f ms off the line through "
            "%d updates, with a spread of %.2f ms",
            1e3 * (times - placed)[worst], len(ticks), 1e3 * spreads[worst],
        )
        return None
    return [replace(tick, time_s=float(at), spread_s=0.0) for tick, at in zip(ticks, placed)]


def update_period_s(ticks: Sequence[Tick]) -> float | None:
    """The counter's update period: the median time between ticks (None below two)."""
    if len(ticks) < 2:
        return None
    return statistics.median(b.time_s - a.time_s for a, b in itertools.pairwise(ticks))


def fit_at(
    ticks: Sequence[Tick], blocks: Sequence[Block], variants: int, lag_s: float,
    noise_mj: float | None = None, *, lag_fitted: bool = True,
) -> Fit:
    """The non-negative least-squares powers of ``variants`` variants (and of the gaps)
    explaining the energy between consecutive ``ticks`` read ``lag_s`` late; ``noise_mj``:
    the counter's noise per update where known (see ``POOLED_FREEDOM``); ``lag_fitted``:
    whether ``lag_s`` is one of the readings' unknowns (not where the probe told it)."""
    times = np.array([tick.time_s for tick in ticks]) - lag_s
    energy_j = np.diff([tick.mj for tick in ticks]) / 1000.0
    low, high = times[:-1, None], times[1:, None]
    starts = np.array([block.start_s for block in blocks])
    ends = np.array([block.end_s for block in blocks])
    overlap = np.clip(np.minimum(ends, high) - np.maximum(starts, low), 0.0, None)
    membership = np.zeros((len(blocks), variants))
    membership[np.arange(len(blocks)), [block.variant for block in blocks]] = 1.0
    in_blocks = overlap @ membership
    gap = np.clip((high - low)[:, 0] - in_blocks.sum(axis=1), 0.0, None)
    design = np.column_stack([in_blocks, gap])
    present = design.sum(axis=0) > 0
    power = np.full(variants + 1, math.nan)
    power[present], _ = nnls(design[:, present], energy_j)
    residual = energy_j - design[:, present] @ power[present]
    rss = float(residual @ residual)
    error = np.full(variants + 1, math.inf)
    error[present] = _relative_errors(design[:, present], power[present], rss, noise_mj,
                                      lag_fitted)
    return Fit(
        tuple(float(p) for p in power[:variants]),
        tuple(float(e) for e in error[:variants]),
        float(power[variants]),
        float(lag_s),
        rss,
        len(energy_j),
    )


def _relative_errors(
    design: np.ndarray, power: np.ndarray, rss: float, noise_mj: float | None,
    lag_fitted: bool = True,
) -> np.ndarray:
    """Standard error of each power (covariance ``s^2 (A^T A)^-1``) over the power; inf
    where the readings are too few to tell it (``MIN_FREEDOM``, or ``POOLED_FREEDOM``
    where the counter's ``noise_mj`` per update is known: ``s^2`` is then at least its
    square), or the power is zero."""
    rows, columns = design.shape
    freedom = rows - columns - lag_fitted
    if freedom < (MIN_FREEDOM if noise_mj is None else POOLED_FREEDOM):
        return np.full(columns, math.inf)
    variance = rss / freedom
    if noise_mj is not None:
        variance = max(variance, (noise_mj / 1000.0) ** 2)
    covariance = variance * np.linalg.pinv(design.T @ design)
    spread = np.sqrt(np.clip(np.diag(covariance), 0.0, None))
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(power > 0, spread / power, math.inf)


def solve(
    ticks: Sequence[Tick],
    blocks: Sequence[Block],
    variants: int,
    *,
    period_s: float,
    lag_step_s: float = MultiplexPolicy.lag_step_s,
    noise_mj: float | None = None,
) -> Fit:
    """:func:`fit_at` at the lag with the least residual: a grid of ``lag_step_s`` from 0
    to ``period_s``, then a fifth of the step around the best of it."""
    coarse = np.arange(0.0, period_s + lag_step_s / 2, lag_step_s)
    best = min((fit_at(ticks, blocks, variants, lag, noise_mj) for lag in coarse), key=_rss)
    fine = best.lag_s + np.linspace(-lag_step_s, lag_step_s, 11)
    refined = (fit_at(ticks, blocks, variants, lag, noise_mj) for lag in fine[fine >= 0])
    return min([best, *refined], key=_rss)


def _rss(fit: Fit) -> float:
    return fit.rss_j2


def schedule(counts: Sequence[int], rng: random.Random) -> list[int]:
    """A shuffled order of blocks: variant ``v`` ``counts[v]`` times."""
    order = [variant for variant, count in enumerate(counts) for _ in range(count)]
    rng.shuffle(order)
    return order


def run_timed(
    run: Callable[[], object], runs: int, timer: Callable[[], float], cuda: bool
) -> tuple[float, float, float | None]:
    """Run ``runs`` times back to back: (start, end) on ``timer`` and, with ``cuda``, the
    CUDA-event time of the runs (the end read once the stream is idle)."""
    events = (
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        if cuda
        else None
    )
    start = timer()
    if events is not None:
        events[0].record()
    for _ in range(runs):
        run()
    if events is not None:
        events[1].record()
        torch.cuda.synchronize()
    end = timer()
    stream_s = events[0].elapsed_time(events[1]) / 1000.0 if events is not None else None
    return start, end, stream_s


def runs_to_fill(per_run_s: float, seconds: float) -> int:
    """Runs expected to fill ``seconds`` with a 10% margin, from the time of one run."""
    return max(1, math.ceil(1.1 * seconds / max(per_run_s, 1e-6)))


def more_blocks(error: float, blocks: int, policy: MultiplexPolicy) -> int:
    """Blocks a variant needs besides its ``blocks`` for its error to reach ``max_error``
    (an error falls as one over the root of the blocks; an unknown one: as many again), up
    to ``max_blocks`` in all; 0 where it is there already."""
    if error <= policy.max_error:
        return 0
    needed = math.ceil(blocks * (error / policy.max_error) ** 2) if math.isfinite(error) else 0
    return max(0, min(policy.max_blocks, max(needed, 2 * blocks)) - blocks)


def first_round(
    variants: int, period_s: float | None, policy: MultiplexPolicy, *, noise_known: bool = False,
    lag_known: bool = False,
) -> tuple[int, float]:
    """Blocks of each variant in the first round, and how long each is: ``min_blocks`` of
    ``block_s``, or, where the counter's period is known and they would not span enough
    updates for an error to be stated (``MIN_FREEDOM`` beyond the unknowns: the powers,
    the gap's and the lag unless ``lag_known``; ``POOLED_FREEDOM`` where the counter's
    noise is ``noise_known``), as few as span them in blocks of at most ``max_block_s``,
    stretched to span just them."""
    if period_s is None:
        return policy.min_blocks, policy.block_s
    freedom = POOLED_FREEDOM if noise_known else MIN_FREEDOM
    needed_s = (variants + 1 + (not lag_known) + freedom) * period_s
    blocks = max(policy.min_blocks, math.ceil(needed_s / (variants * policy.max_block_s)))
    return blocks, max(policy.block_s, needed_s / (variants * blocks))


@dataclass
class _Batch:
    """What one multiplexed measurement has run so far."""

    runs: Sequence[Callable[[], object]]
    timer: Callable[[], float]
    cuda: bool
    blocks: list[Block] = field(default_factory=list)

    def run_block(self, variant: int, runs: int, round_: int) -> None:
        start, end, stream_s = run_timed(self.runs[variant], runs, self.timer, self.cuda)
        busy_s = stream_s if stream_s is not None else end - start
        self.blocks.append(Block(variant, start, end, runs, busy_s, round_))

    def of(self, variant: int) -> list[Block]:
        return [block for block in self.blocks if block.variant == variant]

    def per_run_s(self, variant: int) -> float:
        """Wall time of one run, over the variant's blocks so far."""
        blocks = self.of(variant)
        return sum(b.wall_s for b in blocks) / sum(b.runs for b in blocks)

    def estimate(self, variant: int, fit: Fit) -> Estimate:
        blocks = self.of(variant)
        runs = sum(block.runs for block in blocks)
        power_w = fit.power_w[variant]
        return Estimate(
            time_s=sum(block.busy_s for block in blocks) / runs,
            power_w=power_w,
            energy_j=power_w * self.per_run_s(variant),
            error=fit.error[variant],
            runs=runs,
            blocks=len(blocks),
        )


def by_round(blocks: Sequence[Block], control: int, variants: int) -> list[Block]:
    """``blocks`` with those of variant ``control`` in round ``r`` made variant
    ``variants + r``: fitted so, the control's power shows per round."""
    return [
        replace(block, variant=variants + block.round) if block.variant == control else block
        for block in blocks
    ]


def multiplex(
    runs: Sequence[Callable[[], object]],
    *,
    read_mj: Callable[[], float],
    timer: Callable[[], float] = time.perf_counter,
    policy: MultiplexPolicy = DEFAULT_POLICY,
    control: int = 0,
    seed: int = 0,
    agree: Agree | None = None,
    cuda: bool = False,
    period_s: float | None = None,
    noise_mj: float | None = None,
    lag_s: float | None = None,
    lead_in: Callable[[], object] | None = None,
) -> Multiplexed:
    """Time and energy per run of each of ``runs``, run interleaved in blocks while
    ``read_mj`` (the energy counter, mJ) is polled; ``period_s`` is the counter's update
    period where known (else the median time between its ticks), ``noise_mj`` its noise
    per update where known (fewer readings then state an error), ``lag_s`` its lag where
    probed (``counter.CounterBehaviour.lag_s``: then not fitted, a batch spans one update
    fewer, and waits for its report only that long after its last block). ``control``
    runs in every round; ``seed`` (the same on every rank) draws the block order; ``agree`` (see the
    module docstring) is called in the same order on every rank. ``lead_in`` runs once the
    counter is watched, before the first block (a clock change's settle: the tick the
    first block waits for comes during it, the GPU idle in the fit's gap)."""
    decide = agree or _alone
    rng = random.Random(seed)
    variants = len(runs)
    batch = _Batch(runs, timer, cuda)
    per_run_s = [_warm_up(run, timer, cuda) for run in runs]
    first, block_s = first_round(variants, period_s, policy, noise_known=noise_mj is not None,
                                 lag_known=lag_s is not None)
    counts = [first] * variants
    with TickRecorder(read_mj, timer, policy.poll_s) as recorder:
        if lead_in is not None:
            lead_in()
        for round_ in range(policy.max_rounds):
            sizes = [decide(runs_to_fill(per_run_s[v], block_s)) if count else 0
                     for v, count in enumerate(counts)]
            recorder.wait(bool, policy.silent_s)  # a tick before the first block
            for variant in schedule(counts, rng):
                batch.run_block(variant, sizes[variant], round_)
            reported = functools.partial(
                _reported, end_s=batch.blocks[-1].end_s, period_s=period_s,
                wait_s=None if lag_s is None else lag_s + policy.max_spread_s,
            )
            ticks = recorder.wait(reported, policy.silent_s)
            period = period_s or _period(ticks)
            usable = regular(ticks, period, policy.poll_s) or sharp(ticks, policy.max_spread_s)
            fit = (solve(usable, batch.blocks, variants, period_s=period,
                         lag_step_s=policy.lag_step_s, noise_mj=noise_mj) if lag_s is None
                   else fit_at(usable, batch.blocks, variants, lag_s, noise_mj,
                               lag_fitted=False))
            if round_ == policy.max_rounds - 1:
                break
            counts = [decide(more_blocks(fit.error[v], len(batch.of(v)), policy))
                      for v in range(variants)]
            if not any(counts):
                break
            counts[control] = max(counts[control], 1)
            per_run_s = [batch.per_run_s(v) for v in range(variants)]
            block_s = policy.block_s  # added blocks are the policy's own length
    split = fit_at(usable, by_round(batch.blocks, control, variants), variants + round_ + 1,
                   fit.lag_s, noise_mj, lag_fitted=lag_s is None)
    result = Multiplexed(
        tuple(batch.estimate(v, fit) for v in range(variants)),
        control,
        split.power_w[variants:],
        split.error[variants:],
        fit.lag_s,
        fit.gap_power_w,
    )
    _report(result, policy)
    return result


def _alone(count: int) -> int:
    return count


def _warm_up(run: Callable[[], object], timer: Callable[[], float], cuda: bool) -> float:
    """Wall time of one run, outside the recorded stretch: what sizes the first blocks."""
    start, end, _ = run_timed(run, 1, timer, cuda)
    return end - start


def _reported(ticks: tuple[Tick, ...], end_s: float, period_s: float | None,
              wait_s: float | None = None) -> bool:
    """Whether the counter has reported the energy up to ``end_s``: a tick came at least
    ``wait_s`` (the known lag and a tick's spread) or else one update period (the largest
    lag the solver tries) after it; and two ticks, where the period is told from them."""
    period = period_s or update_period_s(ticks)
    return period is not None and ticks[-1].time_s >= end_s + (
        period if wait_s is None else wait_s)


def _period(ticks: Sequence[Tick]) -> float:
    """The update period told from ``ticks`` (which ``_reported`` made at least two)."""
    period = update_period_s(ticks)
    assert period is not None
    return period


def _report(result: Multiplexed, policy: MultiplexPolicy) -> None:
    unsure = [v for v, e in enumerate(result.estimates) if e.error > policy.max_error]
    if result.drifted(policy.max_drift):
        logger.warning(
            "the control variant's power drifted by %.1f%% over %d rounds of multiplexed "
            "measurement (%s W): the GPU's temperature or clock changed while measuring",
            100 * result.control_drift,
            result.rounds,
            ", ".join(f"{p:.1f}" for p in result.control_power_w),
        )
    if unsure:
        logger.info(
            "multiplexed measurement: %d of %d variants above %.1f%% error after %d rounds "
            "(variants %s)",
            len(unsure), len(result.estimates), 100 * policy.max_error, result.rounds,
            ", ".join(map(str, unsure)),
        )


def details(estimate: Estimate, result: Multiplexed, variant: int) -> dict[str, float]:
    """What a ``Measurement`` records of how one variant's estimate came about."""
    return {
        "error": estimate.error,
        "power_w": estimate.power_w,
        "runs": float(estimate.runs),
        "blocks": float(estimate.blocks),
        "rounds": float(result.rounds),
        "lag_s": result.lag_s,
        "control": float(variant == result.control),
        "control_drift": result.control_drift,
    }
