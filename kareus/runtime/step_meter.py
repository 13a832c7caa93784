"""What a training step really took on this rank's GPU once the plan runs, and on all of them.

Where a step starts: at the plan's first graph (a plan lists its graphs in the order a step
runs them), at the first of the step's microbatches; the step planner sees every planned
graph's call (``runtime.selectable`` tells it) and calls :meth:`StepMeter.step_started`
there, so no user call is needed. A step runs from its start to the next step's: its time
and energy are everything in between (the optimizer's step and the data loading included),
what a step of the user's loop costs.

Windows. The first step after the plan takes over is a warm-up (each graph compiles the
plan's choice at its first call in it, and checks it where ``verify`` is on). A window
opens at the next step's start and closes at the first start where it spans at least
``WINDOW_STEPS`` steps and the device's ``min_window_s`` (long enough for its energy
counter, which updates every 20-100 ms); the next window opens there. The measurement is
the counter's difference and the time between the window's two ends, per step. A window
over which the counter did not advance stays open until it does.

Synchronizing. The counter counts what the GPU did, and the host runs ahead of it: each
end of a window is read once the work queued before it ran (``Device.read_energy``
synchronizes on CUDA). That is one synchronize per window (every >= 0.5 s by default), at
a step boundary, where it costs at most the host's lead over the GPU; at every other
boundary only the host's clock is read, and nothing waits inside graphs. CUDA events would
spare that one wait, but the counter would then have to be read by a thread when each
event completes: not worth it for one wait per window.

Per GPU and in total. Per GPU is this rank's. The total sums what every rank measured on
its own GPU: each rank posts its latest window's energy per step to the default process
group's store (``kareus/measured/<plan digest>/<rank>``) and reads all ranks' with one
``check`` (it never blocks) and, where every key exists, one ``multi_get`` (of keys known
to exist): no collective, no wait, three store round trips per window. This rank's energy
x world size would be a guess that looks like a measurement: the GPUs of one job do not
draw alike (the ranks holding the embedding or the loss, uneven shards, a few percent
from chip to chip). Ranks step in lockstep through the training's own collectives, so
their latest windows cover nearly the same steps. Until every rank has posted the total
is unknown (``StepMeasurement.total_energy_j`` is None); a store that fails is warned
about once and no longer asked.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_store

from kareus.devices.base import Device, EnergyReading, StepMeasurement

log = logging.getLogger("kareus")

WINDOW_STEPS = 5
"""The fewest steps a window spans: a measurement averages at least this many."""


@dataclass(frozen=True)
class _End:
    """One end of a window: the step that starts there, its reading, the host's clock."""

    step: int
    reading: EnergyReading
    host_s: float


class RankBoard:
    """Every rank's latest energy per step, in the default process group's store under
    ``prefix`` (see the module docstring)."""

    def __init__(self, store: dist.Store, prefix: str, rank: int, world_size: int) -> None:
        self.store, self.prefix, self.rank, self.world_size = store, prefix, rank, world_size

    @classmethod
    def of_job(cls, prefix: str) -> RankBoard | None:
        """The job's board; None without other ranks to ask (no torch.distributed, one
        rank, or a fake process group of one process)."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return None
        if dist.get_backend() == "fake":
            return None
        return cls(_get_default_store(), prefix, dist.get_rank(), dist.get_world_size())

    def post(self, energy_j: float) -> None:
        self.store.set(f"{self.prefix}/{self.rank}", repr(energy_j))

    def read(self) -> tuple[tuple[int, float], ...] | None:
        """(rank, J per step) of every rank; None until all have posted."""
        keys = [f"{self.prefix}/{r}" for r in range(self.world_size)]
        if not self.store.check(keys):
            return None
        return tuple((r, float(v)) for r, v in enumerate(self.store.multi_get(keys)))


class StepMeter:
    """Measures this rank's steps in windows (see the module docstring): ``read`` gives
    the device's readings (``Device.read_energy``; None: it reads none, and the meter
    measures nothing), ``board`` the other ranks' energies; ``join``, where given, says
    (rank, world size, board) when the first window opens, replacing those given (the
    process group may start after the plan was loaded); ``host_clock`` tells, without a
    synchronize, whether a window is long enough to be read."""

    def __init__(
        self,
        read: Callable[[], EnergyReading | None],
        *,
        min_window_s: float,
        rank: int = 0,
        world_size: int = 1,
        board: RankBoard | None = None,
        join: Callable[[], tuple[int, int, RankBoard | None]] | None = None,
        window_steps: int = WINDOW_STEPS,
        host_clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._read, self.min_window_s = read, min_window_s
        self.rank, self.world_size, self._board, self._join = rank, world_size, board, join
        self.window_steps, self._host_clock = window_steps, host_clock
        self._started: int | None = None  # the first step seen: the warm-up
        self._open: _End | None = None
        self.off = False
        """True: the device reads no energy; nothing is measured."""

    @classmethod
    def of(cls, device: Device, prefix: str) -> StepMeter:
        """The meter of ``device``'s steps on this rank, its board under ``prefix``."""

        def join() -> tuple[int, int, RankBoard | None]:
            if not dist.is_initialized():
                return 0, 1, None
            return dist.get_rank(), dist.get_world_size(), RankBoard.of_job(prefix)

        return cls(device.read_energy, min_window_s=device.min_window_s, join=join)

    def step_started(self, step: int) -> StepMeasurement | None:
        """Step ``step`` (counted from the process's first) starts: the window that ends
        here, measured, where one does; else None."""
        if self.off:
            return None
        if self._started is None or step <= self._started:
            self._started = step  # the warm-up runs from here to the next start
            return None
        opened, host_s = self._open, self._host_clock()
        if opened is not None and (step - opened.step < self.window_steps
                                   or host_s - opened.host_s < self.min_window_s):
            return None  # nothing is read: no synchronize
        reading = self._read()
        if reading is None:
            self.off = True
            return None
        if opened is not None and reading.energy_j <= opened.reading.energy_j:
            log.debug("the energy counter did not advance over steps %d-%d: the window "
                      "stays open", opened.step, step - 1)
            return None
        self._open = _End(step, reading, host_s)
        if opened is None:
            if self._join is not None:
                self.rank, self.world_size, self._board = self._join()
            return None
        return self._measured(opened, self._open)

    def _measured(self, start: _End, end: _End) -> StepMeasurement:
        steps = end.step - start.step
        energy_j = (end.reading.energy_j - start.reading.energy_j) / steps
        return StepMeasurement(
            first_step=start.step, steps=steps,
            time_s=(end.reading.time_s - start.reading.time_s) / steps,
            gpu_energy_j=self._every_rank(energy_j), rank=self.rank,
            world_size=self.world_size, method=end.reading.method,
        )

    def _every_rank(self, energy_j: float) -> tuple[tuple[int, float], ...]:
        """Every rank's energy per step, this one's ``energy_j`` posted first; this rank's
        alone until all have posted (or without a board)."""
        mine = ((self.rank, energy_j),)
        if self._board is None:
            return mine
        try:
            self._board.post(energy_j)
            every = self._board.read()
        except Exception as exc:  # noqa: BLE001 - a total is not worth failing training
            log.warning("kareus: the ranks' measured energies cannot be exchanged through "
                        "the store (%s: %s): the total over GPUs stays unknown",
                        type(exc).__name__, exc)
            self._board = None
            return mine
        return mine if every is None else every
