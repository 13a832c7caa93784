"""Resetting locked clocks when the process ends: at interpreter exit and on fatal signals.

A locked SM clock outlives the process (REFERENCE.md s4), so the clock controllers of a
process are reset at exit and on SIGTERM, SIGINT, SIGHUP and SIGQUIT (then the signal does
what it did before). Which controllers those are is state of the process, like the clock
ownerships they hold: an ``ExitGuard`` belongs to a ``HeldClockLocks``
(``HeldClockLocks.exit_guard``), the runtime's one guards every device the runtime opens,
and a controller built without one gets a guard of its own.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
from types import FrameType
from typing import TYPE_CHECKING, Any

from kareus.devices.errors import ClockResetError

if TYPE_CHECKING:
    from kareus.devices.nvml.clock import NvmlClockController

logger = logging.getLogger("kareus")

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
"""The signals whose default action ends the process without running ``atexit``."""


class ExitGuard:
    """Resets its controllers at exit and on SIGTERM, SIGINT, SIGHUP and SIGQUIT, before
    the usual outcome; at exit it also gives up their clock ownership.

    After resetting, a signal goes to the handler that was there before; a default
    disposition is restored and the signal re-raised, so the process still dies of it
    (exit status -SIGTERM). Ownership survives a signal (a handler may let the process go
    on, as KeyboardInterrupt does); the record then says the clocks are reset. SIGKILL and
    ``os._exit`` cannot be caught: the next owner of the GPU finds the stale record and
    resets the clocks. A forked child forgets the parent's controllers (``HeldClockLocks``
    tells it): they are the parent's to reset.

    Handlers and ``atexit`` are process-wide, but guards are not: tests, and code that
    builds ``NvmlClockController`` directly, make one per controller. So a guard holds them
    only while it has controllers, rather than once and for ever, which would stack a
    handler per controller: it installs them when the first registers (signal handlers only
    from the main thread, where Python allows them) and, when the last leaves, puts back the
    handler it replaced. The runtime's guard so installs them once while its devices are
    open. A handler installed over a guard's may chain to it, so such a guard's stays,
    passing signals on, until the guard above it leaves and skips over it (or its next
    controller uses it again).
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()  # reentrant: a signal handler may reset meanwhile
        self._controllers: list[NvmlClockController] = []
        self._previous: dict[int, Any] = {}
        """The handler each signal had before this guard's, once installed."""
        self._installed: set[int] = set()
        """Signals whose handler chain holds this guard's handler."""
        self._at_exit = False

    @property
    def controllers(self) -> tuple[NvmlClockController, ...]:
        """The controllers this guard resets, in registration order."""
        with self._lock:
            return tuple(self._controllers)

    def register(self, controller: NvmlClockController) -> None:
        """Reset ``controller`` at exit and on those signals, until ``unregister``."""
        with self._lock:
            self._controllers.append(controller)
            if len(self._controllers) == 1:
                self._install()

    def unregister(self, controller: NvmlClockController) -> None:
        """Stop guarding ``controller`` (closed); the last one out removes the handlers."""
        with self._lock:
            if controller not in self._controllers:
                return
            self._controllers.remove(controller)
            if not self._controllers:
                self._uninstall()

    def reset_all(self) -> None:
        """Reset every registered controller; a failure is logged, then the next is reset."""
        for controller in self.controllers:
            try:
                controller.reset()
            except ClockResetError:
                pass  # already logged CRITICAL; keep resetting the others

    def at_exit(self) -> None:
        """Reset every registered controller and give up ownership where the reset held."""
        self.reset_all()
        for controller in self.controllers:
            controller._release_ownership()  # the record stays where the reset failed

    def after_fork_in_child(self) -> None:
        """The parent's controllers are the parent's to reset: a forked child forgets them.

        The handlers the child inherited stay and, with nothing to reset, pass signals on.
        """
        self._lock = threading.RLock()  # another thread may have held it at the fork
        self._controllers = []

    def _install(self) -> None:
        if not self._at_exit:
            atexit.register(self.at_exit)
            self._at_exit = True
        if threading.current_thread() is not threading.main_thread():
            if not self._installed:
                logger.warning(
                    "kareus clock controller created off the main thread: no signal handlers "
                    "installed, clocks are reset only at normal exit"
                )
            return
        for signum in SIGNALS:
            if signum not in self._installed:
                self._previous[signum] = signal.signal(signum, self._on_signal)
                self._installed.add(signum)

    def _uninstall(self) -> None:
        if self._at_exit:
            atexit.unregister(self.at_exit)
            self._at_exit = False
        if threading.current_thread() is not threading.main_thread():
            return  # Python sets handlers only there: they stay, passing signals on
        for signum in list(self._installed):
            if signal.getsignal(signum) != self._on_signal:
                continue  # installed over ours, and may chain to it: ours stays
            previous = _skip_idle_guards(signum, self._previous[signum])
            if previous is None:
                continue  # set outside Python, so it cannot be put back: ours stays
            signal.signal(signum, previous)
            self._installed.discard(signum)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.reset_all()
        previous = self._previous[signum]
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)


def _skip_idle_guards(signum: int, handler: Any) -> Any:
    """``handler``, or, where it is the handler of a guard without controllers (left in the
    chain because another was installed over it), the first handler below such guards,
    each of which leaves the chain."""
    while True:
        guard = getattr(handler, "__self__", None)
        if not isinstance(guard, ExitGuard):
            return handler
        with guard._lock:
            idle = not guard._controllers and signum in guard._installed
            if not idle or handler != guard._on_signal:
                return handler
            guard._installed.discard(signum)
            handler = guard._previous[signum]
