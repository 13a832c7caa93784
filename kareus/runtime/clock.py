"""The clock router: which controller a ``kareus::set_clock`` call reaches, per thread.

Controllers (the protocol, the two that touch no hardware) belong to the devices
(``devices.base``); what a process routes to them, and for which thread, is the runtime's.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from kareus.devices.base import ClockController, NullClockController
from kareus.errors import KareusError


class NotAClockControllerError(KareusError, TypeError):
    """What was given as a clock controller lacks ``set_clock(graph, mhz)`` or ``reset()``."""


class ClockRouter:
    """Which controller a ``kareus::set_clock`` call reaches, per thread.

    ``use`` installs a controller for the calling thread only, so two threads that train
    under their own controllers never see each other's switches. A thread without one
    (autograd runs a CUDA backward on its own worker thread) reaches the controller of the
    one thread that has one installed, and where none or several do, the process default:
    the controller of the device whose clocks this process drives (``set_default``).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._default: ClockController = NullClockController()
        self._stacks: dict[int, list[ClockController]] = {}

    def current(self) -> ClockController:
        with self._lock:
            own = self._stacks.get(threading.get_ident())
            if own:
                return own[-1]
            if len(self._stacks) == 1:
                (only,) = self._stacks.values()
                return only[-1]
            return self._default

    def set_default(self, controller: ClockController) -> ClockController:
        """Make ``controller`` the process default; returns the one it replaces."""
        _check(controller)
        with self._lock:
            previous, self._default = self._default, controller
        return previous

    @contextmanager
    def use(self, controller: ClockController) -> Iterator[ClockController]:
        """Route this thread's switches to ``controller`` in the block; reset clocks on exit."""
        _check(controller)
        me = threading.get_ident()
        with self._lock:
            self._stacks.setdefault(me, []).append(controller)
        try:
            yield controller
        finally:
            try:
                controller.reset()
            finally:
                with self._lock:
                    stack = self._stacks[me]
                    stack.pop()
                    if not stack:
                        del self._stacks[me]


def _check(controller: object) -> None:
    if not isinstance(controller, ClockController):
        raise NotAClockControllerError(
            f"{controller!r} does not implement set_clock(graph, mhz) and reset()"
        )
