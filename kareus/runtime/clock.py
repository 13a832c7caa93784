"""Clock controllers: what the ``kareus::set_clock`` op calls when a graph starts.

A controller turns "graph G wants SM clock F" into an action. This module holds the
protocol and the two controllers that touch no hardware: one that does nothing and one
that records every switch (tests, and dry runs on GPUs whose clocks must not change).
Hardware controllers (NVML) implement the same protocol elsewhere.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

DEFAULT_CLOCK_MHZ = 0
"""The clock request meaning "the device's default clocks" (no lock)."""


@runtime_checkable
class ClockController(Protocol):
    def set_clock(self, graph: str, mhz: int) -> None:
        """Request SM clock ``mhz`` (``DEFAULT_CLOCK_MHZ``: default clocks) as ``graph`` starts."""

    def reset(self) -> None:
        """Return the device to its default clocks."""


class NullClockController:
    """No device to control: every request is accepted and ignored."""

    def set_clock(self, graph: str, mhz: int) -> None:
        pass

    def reset(self) -> None:
        pass


@dataclass(frozen=True)
class ClockSwitch:
    order: int
    graph: str
    mhz: int


class RecordingClockController:
    """Records every request in call order; changes nothing on any device."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.switches: list[ClockSwitch] = []
        self.resets = 0

    def set_clock(self, graph: str, mhz: int) -> None:
        with self._lock:
            self.switches.append(ClockSwitch(len(self.switches), graph, mhz))

    def reset(self) -> None:
        with self._lock:
            self.resets += 1


_active: ClockController = NullClockController()


def active_controller() -> ClockController:
    return _active


def set_active_controller(controller: ClockController) -> ClockController:
    """Install ``controller`` process-wide; returns the one it replaces."""
    global _active
    if not isinstance(controller, ClockController):
        raise TypeError(f"{controller!r} does not implement set_clock(graph, mhz) and reset()")
    previous, _active = _active, controller
    return previous


@contextmanager
def use_controller(controller: ClockController) -> Iterator[ClockController]:
    """Install ``controller`` for the duration of the block, resetting clocks on the way out."""
    previous = set_active_controller(controller)
    try:
        yield controller
    finally:
        try:
            controller.reset()
        finally:
            set_active_controller(previous)
