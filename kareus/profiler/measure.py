"""The measurement protocol: how variants' time and energy are taken, and summed over a group.

Two protocols, chosen by the device (``Device.estimates_error``; ranks measuring together
agree on one: windows where any of them cannot multiplex, :func:`multiplexes`):

- multiplexed, where the GPU's energy counter integrates power continuously (probed when
  the GPU is first measured on: ``devices.nvml.counter``): the variants of one clock run
  interleaved in blocks, each variant's power is recovered by least squares
  over the counter's readings, with its error, and a point whose error exceeds 1.5% gets
  more blocks (``devices.nvml.multiplex``). A point costs about one
  block: the device answers once, and its estimate is kept.
- windows, elsewhere (a counter that samples part of the time, or none): a variant is
  measured ``repeats`` times in windows of at least the device's ``min_window_s`` and the
  medians are kept; where the repeats disagree by more than ``max_spread`` more are taken,
  up to ``max_repeats``, and a variant that stays unsteady is kept with its spread in the
  details and a warning.

The device does the rest, per clock: the settle after a clock change, and the warm-up run
that sizes a block or a window (``NvmlGPU(settle_s=..., min_window_s=...)``). A
deterministic device (the simulated GPU) is measured once: its answer is analytic and
instant, and it is charged what the multiplexed protocol would take on a real GPU whose
counter integrates.

A partition variant runs on every rank of its collective's group at once, so what it
costs is the group's: time is the slowest rank's, energy the sum over the ranks
(:func:`group_measurement`).

What profiling costs is counted in GPU-seconds on this rank (:class:`GpuTime`), per graph
and in total, and may be capped (the ``profile_budget_s`` option): a real GPU's are the
wall time of its measurements; a simulated GPU's, what the protocol would take on a real
one (:meth:`Protocol.seconds_per_evaluation`), so a cap behaves alike on both.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from kareus.devices.base import Device, Measurement, Resources, Workload
from kareus.devices.nvml.energy import DEFAULT_MIN_WINDOW_S
from kareus.devices.nvml.gpu import CHECK_WINDOW_S, DEFAULT_SETTLE_S
from kareus.devices.nvml.multiplex import (
    DEFAULT_POLICY,
    WAIT_AFTER_UPDATES,
    WAIT_BEFORE_UPDATES,
    MultiplexPolicy,
    first_round,
)
from kareus.devices.nvml.replay import WARMUP_RUNS
from kareus.errors import KareusError
from kareus.profiler.interrupt import check

log = logging.getLogger("kareus")

COUNTER_PERIOD_S = 0.1
"""The energy counter's update period a simulated device's measurements are charged for:
about 100 ms on A100 (REFERENCE.md s4); a real GPU's is probed (``nvml.counter``)."""


class MeasurementProtocolError(KareusError, ValueError):
    """A measurement protocol's settings contradict each other or are out of range."""


class GroupMeasurementError(KareusError, ValueError):
    """The measurements handed over for a group are not one, nor one per rank."""


class ProfileBudgetSpent(KareusError, RuntimeError):
    """The GPU-seconds ``profile_budget_s`` allows for profiling are spent: what is not
    measured yet is not measured (its partition or graph runs without a search)."""


@dataclass
class GpuTime:
    """GPU-seconds profiling took on this rank, per graph label and in total, against an
    optional cap (``budget_s``). ``estimated``: the seconds are what a real GPU would take
    (a simulated device measures instantly)."""

    budget_s: float | None = None
    by_graph: dict[str, float] = field(default_factory=dict)
    estimated: bool = False
    announced: bool = False  # the spent budget's warning was logged

    @property
    def total_s(self) -> float:
        return sum(self.by_graph.values())

    @property
    def spent(self) -> bool:
        return self.budget_s is not None and self.total_s >= self.budget_s

    def charge(self, graph: str, seconds: float) -> None:
        self.by_graph[graph] = self.by_graph.get(graph, 0.0) + seconds

    def check(self) -> None:
        """Raise ``ProfileBudgetSpent`` once the cap is reached: called before measuring."""
        if self.spent:
            raise ProfileBudgetSpent(
                f"the profiling budget of {self.budget_s:g} GPU-s is spent "
                f"({self.total_s:.1f} GPU-s{' estimated' if self.estimated else ''})"
            )

    def warn(self, what: str, why: str) -> None:
        """Log that ``what`` was not measured: a warning, except where the reason is the
        spent budget and that was said already (every partition and graph after it would
        repeat it); those go to the debug log."""
        if not self.spent:
            log.warning("%s: %s", what, why)
        elif not self.announced:
            self.announced = True
            log.warning("%s: %s; what is not measured yet will not be, without a search "
                        "(the profile_budget_s option)", what, why)
        else:
            log.debug("%s: %s", what, why)

    def describe(self, graph: str) -> str:
        """This graph's and the total, for reports and tables."""
        kind = "estimated GPU-s" if self.estimated else "GPU-s"
        cap = "" if self.budget_s is None else f" of {self.budget_s:g}"
        return (f"{self.by_graph.get(graph, 0.0):.1f} {kind} profiling this graph, "
                f"{self.total_s:.1f}{cap} in total")


@dataclass(frozen=True)
class Protocol:
    """How long a variant runs to be measured, and how steady its measurement must be.

    Multiplexed (the default where the counter integrates; ``multiplex.MultiplexPolicy``
    holds its settings): a 0.1 s settle (the counter watched meanwhile), then blocks of
    0.15 s, enough of them that the counter's readings state each variant's error, more
    where it exceeds 1.5%, and the wait for the counter's report: about 0.75 s for one
    variant, 0.18 s each for ten, where the probe measured the counter's noise
    (:meth:`seconds_per_batch`). Windows (elsewhere):
    3 repeats, at most 6, a spread
    (max - min over the median, of time and of energy) of at most 5%, no pause between
    repeats; with the NVML device's defaults (0.1 s settle after a clock change, windows of
    at least 0.5 s) about 2 s per variant (:meth:`seconds_per_evaluation`).
    """

    repeats: int = 3
    max_repeats: int = 6
    max_spread: float = 0.05
    cooldown_s: float = 0.0
    """Pause between repeats (the method's artifact waited 5 s for thermals to settle)."""

    def __post_init__(self) -> None:
        if not 1 <= self.repeats <= self.max_repeats:
            raise MeasurementProtocolError(
                f"measurement protocol: need 1 <= repeats <= max_repeats, got "
                f"repeats={self.repeats}, max_repeats={self.max_repeats}"
            )
        if not self.max_spread > 0:
            raise MeasurementProtocolError(
                f"measurement protocol: max_spread must be > 0: {self.max_spread}"
            )
        if not self.cooldown_s >= 0:
            raise MeasurementProtocolError(
                f"measurement protocol: cooldown_s must be >= 0: {self.cooldown_s}"
            )

    def seconds_per_evaluation(
        self,
        run_s: float,
        *,
        settle_s: float = DEFAULT_SETTLE_S,
        min_window_s: float = DEFAULT_MIN_WINDOW_S,
    ) -> float:
        """GPU time one steady evaluation of a variant taking ``run_s`` per run costs: the
        settle after its clock change, then per repeat its capture's warm-up runs
        (``nvml.replay``), a warm-up run and a window of 110% of ``min_window_s`` (as the
        energy meter sizes it), and the pauses between repeats."""
        window_s = max(run_s, 1.1 * min_window_s)
        return (settle_s + self.repeats * (_WARMUPS * run_s + window_s)
                + (self.repeats - 1) * self.cooldown_s)

    @staticmethod
    def seconds_per_check(run_s: float, *, settle_s: float = DEFAULT_SETTLE_S) -> float:
        """GPU time checking a chosen point takes (``Device.check``): the settle, the
        capture's warm-up runs and a warm-up run, and one window of 110% of
        ``CHECK_WINDOW_S``, as the NVML meter sizes it."""
        return settle_s + _WARMUPS * run_s + max(run_s, 1.1 * CHECK_WINDOW_S)

    @staticmethod
    def seconds_per_batch(
        run_s: Sequence[float], *, switched: bool = True, settle_s: float = DEFAULT_SETTLE_S,
        period_s: float = COUNTER_PERIOD_S, policy: MultiplexPolicy = DEFAULT_POLICY,
        noise_known: bool = True, lag_known: bool = True,
    ) -> float:
        """GPU time the multiplexed protocol takes for variants taking ``run_s`` per run at
        one clock, on a counter updating every ``period_s``: the settle where the clock
        ``switched``, then per variant its capture's warm-up runs and a warm-up run, and
        the first round's blocks
        (``multiplex.first_round``: enough of the counter's updates to state an error,
        however few the variants; fewer where the probe measured the counter's noise,
        ``noise_known``, and its lag, ``lag_known``, as it does on an integrating counter),
        and the round's waits for
        the counter: for a tick before the first block where no settle of an update or
        more held one (``multiplex.WAIT_BEFORE_UPDATES``; the NVML device settles while it
        watches the counter), and for the report after the last
        (``WAIT_AFTER_UPDATES``: an upper bound where the lag is known). Rounds added for
        points above the policy's ``max_error`` are not counted: how many a GPU needs is
        what it measures."""
        if not run_s:
            return settle_s * switched
        blocks, block_s = first_round(len(run_s), period_s, policy, noise_known=noise_known,
                                      lag_known=lag_known)
        settled = switched and settle_s >= period_s
        waits = (0.0 if settled else WAIT_BEFORE_UPDATES) + WAIT_AFTER_UPDATES
        return (settle_s * switched + waits * period_s
                + sum(_WARMUPS * r + blocks * max(r, block_s) for r in run_s))


_WARMUPS = WARMUP_RUNS + 1
"""Runs of a variant before it is measured: its CUDA graph's capture's warm-up runs
(``nvml.replay``), then the meter's own warm-up."""


def measure_variant(
    device: Device,
    workload: Workload,
    clock_mhz: int,
    *,
    resources: Resources | None = None,
    protocol: Protocol = Protocol(),
    sleep: Callable[[float], None] = time.sleep,
    stop: threading.Event | None = None,
    spent: Callable[[float], None] = lambda seconds: None,
    multiplex: bool | None = None,
) -> Measurement:
    """One variant on this rank's GPU under ``protocol``: the medians of its repeats. Once
    ``stop`` is set no repeat starts (``interrupt.ProfilingInterrupted``): each sets the
    clock, which must stay reset after an interrupt. ``spent`` is told the GPU-seconds it
    took (see :class:`GpuTime`). ``multiplex``: whether it is multiplexed, where the caller
    agreed on it (None: :func:`multiplexes`, with the workload's ranks)."""
    def once() -> Measurement:
        check(stop)
        return device.measure(workload, clock_mhz, resources=resources)

    if device.deterministic:
        m = once()
        spent(protocol.seconds_per_batch([m.time_s]))
        return m
    started = time.perf_counter()
    try:
        multiplexed = (multiplexes(device, workload.agree) if multiplex is None
                       else multiplex)
        if multiplexed and not resources:
            check(stop)
            return device.measure_batch([workload], clock_mhz, workload.agree)[0]
        return _repeated(device, workload, clock_mhz, once, protocol, sleep)
    finally:
        spent(time.perf_counter() - started)


def multiplexes(device: Device, agree: Callable[[int], int] | None) -> bool:
    """Whether a measurement is multiplexed: where this rank's device estimates its errors
    (its counter integrates) and, for ranks measuring together (``agree``), where every
    one's does. Each rank probed its own counter, and one that could not tell measures in
    windows; the others must too, or they would run their variants' collectives in other
    orders and wait on each other until the timeout."""
    mine = device.estimates_error
    return mine if agree is None else not agree(int(not mine))


def measure_batch(
    device: Device,
    workloads: Sequence[Workload],
    clock_mhz: int,
    *,
    agree: Callable[[int], int] | None = None,
    resources: Sequence[Resources | None] | None = None,
    protocol: Protocol = Protocol(),
    switched: bool = True,
    sleep: Callable[[float], None] = time.sleep,
    stop: threading.Event | None = None,
    spent: Callable[[float], None] = lambda seconds: None,
) -> list[Measurement]:
    """Every one of ``workloads`` at one clock, in their order, under ``protocol``: together
    (``Device.measure_batch``) where the device estimates its own errors (every rank's
    measuring together: :func:`multiplexes`), else each in windows, as
    :func:`measure_variant` would. ``agree`` is the batch's (ranks measuring together);
    ``resources``: each workload's SM caps, for a device that models them (one that
    realises them measures none: its caps are its communicators'); ``switched``: the clock
    changes for this batch (what a simulated device is charged)."""
    check(stop)
    caps = list(resources) if resources is not None else [None] * len(workloads)
    if device.deterministic:
        found = device.measure_batch(workloads, clock_mhz, agree, caps)
        spent(protocol.seconds_per_batch([m.time_s for m in found], switched=switched))
        return found
    if multiplexes(device, agree):
        started = time.perf_counter()
        try:
            return device.measure_batch(workloads, clock_mhz, agree, caps)
        finally:
            spent(time.perf_counter() - started)
    return [measure_variant(device, w if agree is None else replace(w, agree=agree), clock_mhz,
                            resources=r, protocol=protocol, sleep=sleep, stop=stop, spent=spent,
                            multiplex=False)
            for w, r in zip(workloads, caps, strict=True)]


def _repeated(
    device: Device, workload: Workload, clock_mhz: int, once: Callable[[], Measurement],
    protocol: Protocol, sleep: Callable[[float], None],
) -> Measurement:
    decide = workload.agree or (lambda more: more)  # ranks measuring together repeat alike
    runs = [once()]
    while decide(int(len(runs) < protocol.repeats or (
        _spread(runs) > protocol.max_spread and len(runs) < protocol.max_repeats
    ))):
        if protocol.cooldown_s:
            sleep(protocol.cooldown_s)
        runs.append(once())
    spread = _spread(runs)
    if spread > protocol.max_spread:
        log.warning(
            "%s at %d MHz on %s: %d repeats still spread by %.1f%% (> %.1f%%); keeping "
            "their medians", workload.name, clock_mhz, device.name, len(runs), 100 * spread,
            100 * protocol.max_spread,
        )
    middle = min(runs, key=lambda m: abs(m.time_s - statistics.median(r.time_s for r in runs)))
    return replace(
        middle,
        time_s=statistics.median(m.time_s for m in runs),
        energy_j=statistics.median(m.energy_j for m in runs),
        details={**middle.details, "repeats": float(len(runs)), "spread": spread},
    )


def group_measurement(per_rank: Sequence[Measurement], group_size: int) -> Measurement:
    """What a variant costs its whole group: the slowest rank's time, the ranks' energy and
    static power summed. One measurement stands for a symmetric group of ``group_size``
    (a process modelling its group, e.g. under the fake process group); otherwise there must
    be one per rank, in rank order (the result is the same on every rank that reduces them).
    """
    if not per_rank:
        raise GroupMeasurementError("group_measurement: no measurements")
    if len(per_rank) not in (1, group_size):
        raise GroupMeasurementError(
            f"group_measurement: {len(per_rank)} measurements for a group of {group_size}"
        )
    copies = group_size if len(per_rank) == 1 else 1
    slowest = max(range(len(per_rank)), key=lambda r: per_rank[r].time_s)
    first = per_rank[0]
    return replace(
        first,
        time_s=per_rank[slowest].time_s,
        energy_j=copies * sum(m.energy_j for m in per_rank),
        static_power_w=copies * sum(m.static_power_w for m in per_rank),
        details={**first.details, "ranks": float(group_size), "slowest_rank": float(slowest)},
    )


def _spread(runs: Sequence[Measurement]) -> float:
    """The larger of time's and energy's (max - min) / median over the repeats."""
    def relative(values: list[float]) -> float:
        middle = statistics.median(values)
        return (max(values) - min(values)) / middle if middle > 0 else 0.0

    return max(relative([m.time_s for m in runs]), relative([m.energy_j for m in runs]))
