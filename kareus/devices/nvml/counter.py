"""How a GPU's energy counter behaves, probed in a few seconds when a device is first used.

NVML's total-energy counter (mJ) changes only every 20-100 ms, and nobody has published
whether it integrates the power continuously or, like the A100/H100 power reading (which
updates every 100 ms but averages only 25 ms of it), samples part of the time. Measuring
several variants together by least squares over counter readings (``nvml.multiplex``) is
right only for an integrating counter, so the probe measures both facts:

* **Update period.** Poll the counter about every millisecond while the GPU is busy; the
  period is the span of the changes of its value over their number (the median gap tells
  how many updates the span holds).
* **Integration.** Run a busy/idle square wave (50% duty) whose period is a multiple of the
  update period (``periods``), started at ``phases`` evenly spaced phases relative to the
  counter's updates (one random offset), and read each window between two detected changes
  of the counter, so the window is a whole number of updates (and of waves) and its span
  is known from the two change times. An integrating counter reads the same average power
  at every phase: the window holds whole periods of a periodic power. A counter that
  samples a fixed part of each update period sees, at a wave as long as the period, only
  the part of the wave its sample covers, which moves with the phase. The swing (max - min
  of the windows' average powers over the busy-idle power difference, the worst period)
  decides; ``SWING_LIMIT`` says where.

The probe only reads the counter and never calls an NVML setter: it must be safe to run
where this process may not (or must not yet) change clocks, and it measures the counter
at whatever clock the GPU runs. It is device-agnostic: ``busy``/``idle`` drive the load (a
CUDA GEMM loop and a sleep on a GPU; a ``BusyTimeline`` in the tests).
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields

from kareus.devices.errors import (
    CounterBehaviourFormatError,
    CounterProbeError,
    CounterProbeStalledError,
)
from kareus.devices.nvml.multiplex import Block, Tick, solve

logger = logging.getLogger("kareus")

SWING_LIMIT = 0.2
"""Largest swing (in busy-idle power differences) of an integrating counter.

An integrating counter's windows differ only by timing errors (each window's busy
fraction, as the ``busy`` calls took, is taken off, so slices a loaded machine stretched do
not count): changes seen a poll or a preemption late against a window of 8 updates, and
drifts of the GPU's power with temperature over a few seconds, a few percent (at most 0.06
on the fake counters with the CPU loaded three times over). A counter that samples a
fraction f of each update period, at 3 evenly spaced phases of a wave as long as the
period, swings by at least 0.83 (f = 1/4, the power reading's 25 of 100 ms), 0.67 (f =
1/2) or 0.28 (f = 3/4), whatever the random offset. The limit sits well above the
first and below the second: counters that sample more than ~80% of each update pass as
integrating, which they nearly are."""

POLL_S = 0.001
"""How long each slice of load lasts between two reads of the counter."""

MIN_WAVE_S = 0.02
"""Shortest square wave: busy slices under 10 ms are not reliable on a GPU."""

MIN_WINDOW_S = 0.2
"""Shortest window, for counters that update every few milliseconds (or continuously)."""

NOISE_UPDATES = 12
"""Updates (at least) over which the period and the noise of an update are measured: the
noise's standard deviation is then known to about 20% (sqrt(1 / (2 * 9)), the first two
gaps left out)."""

LEVEL_UPDATES = 4
"""Updates in each of the windows that measure the busy and the idle power."""


@dataclass(frozen=True)
class CounterBehaviour:
    """How this GPU model's energy counter behaves, probed: kept per GPU model and driver."""

    gpu: str
    """GPU model name (``nvmlDeviceGetName``)."""
    driver: str
    """Driver version (``nvmlSystemGetDriverVersion``; "unknown" if unavailable)."""
    update_period_s: float
    """Interval between changes of the counter's value while busy (over ~0.5 s; the median
    gap tells changes seen twice or missed)."""
    integrates: bool
    """True: integrates power continuously; False: samples part of the time."""
    swing: float
    """Spread (max - min) across phases of the square-wave windows' average powers, in
    busy-idle power differences, less the busy fraction each window had (as the ``busy``
    calls took), the worst wave period: ~0 integrating, up to 1."""
    probe_s: float
    """How long the probe took."""
    update_noise_mj: float | None = None
    """Standard deviation of one update's increment while steadily busy (the counter's
    noise and the power's own jitter): the scatter a multiplexed fit's residuals show,
    known before the fit, so that a batch of few readings still states its error
    (``multiplex.POOLED_FREEDOM``). None: not probed (a record from before it was)."""
    lag_s: float | None = None
    """How late the counter reports energy: a change seen at t counts the energy up to
    t - lag. Fitted over the probe's square waves (``multiplex.solve``: their edges pin
    it), so that a multiplexed fit need not fit it again, one unknown fewer, and a batch
    waits for its report only as long as the lag (``multiplex.multiplex(lag_s=...)``).
    None: not probed (a record from before it was, or a counter that does not integrate)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> CounterBehaviour:
        """The record ``to_json`` wrote; ``CounterBehaviourFormatError`` on anything else."""
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, TypeError) as exc:
            raise CounterBehaviourFormatError(f"not JSON ({exc})") from exc
        if not isinstance(data, dict):
            raise CounterBehaviourFormatError(f"a {type(data).__name__}, not an object")
        expected = {f.name: f.type for f in fields(cls)}
        for later in ("update_noise_mj", "lag_s"):  # records from before they were probed
            data.setdefault(later, None)
        if set(data) != set(expected):
            raise CounterBehaviourFormatError(
                f"fields {sorted(data)}, expected {sorted(expected)}"
            )
        for name, kind in expected.items():
            if not _is(data[name], kind):
                raise CounterBehaviourFormatError(f"{name}={data[name]!r} is not a {kind}")
        return cls(**{k: float(v) if expected[k] == "float" else v for k, v in data.items()})


def _is(value: object, kind: str) -> bool:
    """Whether a JSON value is of a field's annotated type (a bool is no number here)."""
    if kind == "float | None":
        return value is None or _is(value, "float")
    if kind == "float":
        return isinstance(value, int | float) and not isinstance(value, bool)
    return isinstance(value, {"str": str, "bool": bool}[kind])


Activity = Callable[[float], tuple[bool, float]]
"""At a time: whether to be busy, and for how long at most before that changes."""


def _steady(busy: bool) -> Activity:
    return lambda now: (busy, math.inf)


def _square(period_s: float, origin: float) -> Activity:
    """Busy for the first half of each period from ``origin``, idle for the second."""
    half = period_s / 2

    def at(now: float) -> tuple[bool, float]:
        into = (now - origin) % period_s
        if into < half and half - into > 1e-6:
            return True, half - into
        return False, (period_s - into) % period_s or period_s  # an edge a hair away: next

    return at


@dataclass(frozen=True)
class _Window:
    """What one window between two changes of the counter read."""

    power_w: float
    """Its energy over its span (a whole number of updates)."""
    duty: float
    """The busy fraction of the window, as long as the ``busy`` calls took."""


@dataclass(frozen=True)
class _Levels:
    """The idle power and the power per unit of busy fraction, from one window each."""

    idle_w: float
    per_duty_w: float

    def excess(self, window: _Window) -> float:
        """How much more busy a window read than it was (busy fractions): ~0 for every
        window of an integrating counter, however a loaded machine stretched the slices."""
        return (window.power_w - self.idle_w) / self.per_duty_w - window.duty


class _Poller:
    """Runs an activity in slices, reading the counter after each, and reports changes."""

    def __init__(
        self,
        read_mj: Callable[[], int],
        busy: Callable[[float], None],
        idle: Callable[[float], None],
        timer: Callable[[], float],
        *,
        gpu: str,
        poll_s: float,
        stall_s: float,
    ) -> None:
        self.read_mj, self.busy, self.idle, self.timer = read_mj, busy, idle, timer
        self.gpu, self.poll_s, self.stall_s = gpu, poll_s, stall_s
        self.value = read_mj()
        self.changed_at = timer()
        """When the counter's value last changed (or the first read)."""
        self.busy_s = 0.0
        """How long the ``busy`` calls took, in all."""
        self.slices: list[tuple[float, float]] = []
        """Each ``busy`` call's start and end."""
        self.changes: list[tuple[float, int]] = []
        """Each change of the counter seen: when, and its new value."""

    def next_change(self, activity: Activity) -> tuple[float, int]:
        """Run ``activity`` until the counter's value changes: (when, value)."""
        since = self.timer()
        while True:
            now = self.timer()
            if now - since > self.stall_s:
                raise CounterProbeStalledError(self.gpu, self.stall_s)
            busy, left = activity(now)
            step = max(min(self.poll_s, left), 1e-6)
            if busy:
                self.busy(step)
                ended = self.timer()
                self.busy_s += ended - now
                self.slices.append((now, ended))
            else:
                self.idle(step)
            value = self.read_mj()
            if value != self.value:
                self.value, self.changed_at = value, self.timer()
                self.changes.append((self.changed_at, value))
                return self.changed_at, value

    def window(self, activity: Activity, span_s: float, period_s: float) -> _Window:
        """Run ``activity`` over a window from one change of the counter to the first at
        least ``span_s`` later (less half an update: change times jitter).

        The window opens at the second change after the activity starts: the first may
        still count the previous activity, read up to an update late. It spans a whole
        number of updates, counted from the two change times: their product with the
        update period is its duration, free of the jitter of the moments the changes were
        seen (a loaded machine sees them milliseconds late), which would swing alike."""
        self.next_change(activity)
        start, start_mj = self.next_change(activity)
        busy_s = self.busy_s
        end, end_mj = start, start_mj
        while end - start < span_s - period_s / 2:
            end, end_mj = self.next_change(activity)
        updates = max(round((end - start) / period_s), 1)
        return _Window(
            power_w=(end_mj - start_mj) / 1000.0 / (updates * period_s),
            duty=(self.busy_s - busy_s) / (end - start),
        )


def probe_counter(
    read_mj: Callable[[], int],
    *,
    busy: Callable[[float], None],
    idle: Callable[[float], None],
    timer: Callable[[], float],
    gpu: str,
    driver: str,
    periods: Sequence[float] = (1.0, 2.0),
    phases: int = 3,
    window_updates: int = 8,
    rng: random.Random | None = None,
    poll_s: float = POLL_S,
    stall_s: float = 1.0,
) -> CounterBehaviour:
    """Probe the energy counter ``read_mj`` (mJ) reads: its update period and whether it
    integrates power; about 9 s at a 100 ms update period, 5 s at 50 ms.

    ``busy(s)``/``idle(s)`` keep the GPU busy/idle for about ``s`` seconds of ``timer``.
    ``periods`` are the square waves' periods in update periods: 1 catches counters that
    sample part of each update, 2 those whose sampling cycle spans two updates (wave
    periods under ``MIN_WAVE_S`` are raised to it). Each of the ``phases`` windows per
    period spans ``window_updates`` updates. A counter that does not change for
    ``stall_s`` raises ``CounterProbeStalledError``; busy power not clearly above idle
    power (``busy`` does not load the GPU) raises ``CounterProbeError``."""
    rng = rng or random.Random()
    began = timer()
    poller = _Poller(read_mj, busy, idle, timer, gpu=gpu, poll_s=poll_s, stall_s=stall_s)
    period_s, noise_mj = _update_period(poller)
    # the lag is fitted from here on: the period's first changes may count what ran before
    slices, changes = len(poller.slices), len(poller.changes)
    level_s = max(LEVEL_UPDATES * period_s, MIN_WINDOW_S)
    loaded, unloaded = (poller.window(_steady(b), level_s, period_s) for b in (True, False))
    levels = _Levels(
        idle_w=unloaded.power_w,
        per_duty_w=(loaded.power_w - unloaded.power_w) / loaded.duty,
    )
    if levels.per_duty_w < 0.2 * levels.idle_w:
        raise CounterProbeError(
            gpu,
            f"busy() raised the power only from {unloaded.power_w:.1f} W idle to "
            f"{loaded.power_w:.1f} W, too little to tell a sampling counter from an "
            "integrating one: busy() must keep the GPU loaded",
        )
    swing = max(
        _swing(poller, levels, max(m * period_s, MIN_WAVE_S), period_s, window_updates, phases, rng)
        for m in periods
    )
    integrates = swing < SWING_LIMIT
    lag_s = (_lag(poller.changes[changes:], poller.slices[slices:], period_s) if integrates
             else None)
    behaviour = CounterBehaviour(
        gpu=gpu,
        driver=driver,
        update_period_s=period_s,
        integrates=integrates,
        swing=swing,
        probe_s=timer() - began,
        update_noise_mj=noise_mj,
        lag_s=lag_s,
    )
    logger.info(
        "%s (driver %s): energy counter updates every %.1f ms (noise %s mJ an update, lag "
        "%s) and %s (swing %.3f of the busy-idle power %.0f W; probed in %.1f s)",
        gpu,
        driver,
        1e3 * period_s,
        "unknown" if noise_mj is None else f"{noise_mj:.1f}",
        "unknown" if lag_s is None else f"{1e3 * lag_s:.1f} ms",
        "integrates the power" if behaviour.integrates else "samples the power part of the time",
        swing,
        levels.per_duty_w,
        behaviour.probe_s,
    )
    return behaviour


def _update_period(
    poller: _Poller, min_s: float = 0.5, min_gaps: int = NOISE_UPDATES
) -> tuple[float, float | None]:
    """The interval between the counter's changes while busy, over at least ``min_s`` and
    ``min_gaps`` gaps, and the standard deviation of one update's increment then.

    The median gap says how many updates the span from the first change to the last holds
    (a change seen twice or missed does not count), and the span over that many is the
    period, without the median's error of a poll's jitter (waves of the period must keep
    their phase to the updates over a window of several). The noise is the scatter of the
    increments of the gaps one update long (the busy power is steady) but the first two;
    None where fewer than two such gaps were one update long."""
    changes = [poller.next_change(_steady(True))]
    while len(changes) <= min_gaps or changes[-1][0] - changes[0][0] < min_s:
        changes.append(poller.next_change(_steady(True)))
    gaps = [(b[0] - a[0], b[1] - a[1]) for a, b in itertools.pairwise(changes)]
    median = statistics.median(gap for gap, _ in gaps)
    span = changes[-1][0] - changes[0][0]
    period_s = span / max(round(span / median), 1)
    # The first gaps may still count the activity before the probe (read up to an update
    # late), so the noise skips them.
    single = [mj for gap, mj in gaps[2:] if round(gap / period_s) == 1]
    noise_mj = statistics.stdev(single) if len(single) >= 2 else None
    return period_s, noise_mj


def _swing(
    poller: _Poller,
    levels: _Levels,
    wave_s: float,
    period_s: float,
    window_updates: int,
    phases: int,
    rng: random.Random,
) -> float:
    """Spread of the windows' excess (``_Levels.excess``) over square waves of ``wave_s``
    at ``phases`` evenly spaced phases, each window of whole waves, at least
    ``window_updates`` updates and ``MIN_WINDOW_S``. Phases are relative to the counter's
    last change, hence to its updates."""
    span_s = wave_s * math.ceil(max(window_updates * period_s, MIN_WINDOW_S) / wave_s)
    offset = rng.random()
    excess = []
    for k in range(phases):
        origin = poller.changed_at + (offset + k / phases) % 1.0 * wave_s
        excess.append(levels.excess(poller.window(_square(wave_s, origin), span_s, period_s)))
    logger.debug("energy counter probe: %.0f ms waves read excesses %s", 1e3 * wave_s, excess)
    return max(excess) - min(excess)


def _lag(changes: Sequence[tuple[float, int]], slices: Sequence[tuple[float, float]],
         period_s: float) -> float:
    """The counter's lag: the one at which the energies between its ``changes`` are best
    explained by a busy power over the ``busy`` ``slices`` and an idle one between them
    (``multiplex.solve``, as a batch of one variant; the square waves' many edges pin it)."""
    ticks = [Tick(at, mj) for at, mj in changes]
    blocks = [Block(0, start, end, 1, end - start) for start, end in slices]
    return solve(ticks, blocks, 1, period_s=period_s).lag_s
