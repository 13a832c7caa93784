"""Stopping the profiling on SIGINT and SIGTERM: the measuring thread first, clocks last.

Profiling measures on a thread of its own (``profile._outside_the_compile``). Left alone, a
Ctrl-C raised ``KeyboardInterrupt`` in the compiling thread while the profiling thread went
on measuring (the interpreter waits for it at exit), and the exit guard's handler reset the
clocks at the signal, so the next measurement could lock them again with nothing left to
reset them; a native abort ("terminate called without an active exception") could follow.

So while a graph is profiled, ``DeferredSignals`` holds SIGINT and SIGTERM: the first sets
a stop event the profiling thread checks before every measurement and while it waits for
the other ranks (it then gives the search up, telling them), the compiling thread waits for
it, the caller resets the clocks, and only then is the signal handed to the handler it was
meant for: the exit guard's (which resets again and passes it on), Python's
``KeyboardInterrupt``, or the default action (the process dies of SIGTERM). A second signal
changes nothing: the wait is one measurement's (or a poll's). Raising from the handler to
stop waiting would interrupt the join, and an interrupted ``Thread.join`` on CPython 3.11
marks a thread that still runs as stopped (its tstate lock released, bpo-45274's fix), so
the interpreter exits under it and aborts natively ("terminate called without an active
exception", pytorch/pytorch#38228: seen in this project's tests).

Python runs signal handlers on the main thread only: a graph compiled on another thread is
profiled without them, as before.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any

from kareus.errors import KareusError

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11

log = logging.getLogger("kareus")

DEFERRED = (signal.SIGINT, signal.SIGTERM)


class ProfilingInterrupted(KareusError):
    """The profiling was stopped by a signal. Not a ``RuntimeError``: a search that sees it
    stops the whole profiling instead of being recorded as failed and followed by the next."""


def check(stop: threading.Event | None) -> None:
    """Raise ``ProfilingInterrupted`` once ``stop`` is set."""
    if stop is not None and stop.is_set():
        raise ProfilingInterrupted("profiling stopped by a signal")


class DeferredSignals:
    """Within the block, SIGINT and SIGTERM set ``stop`` instead of acting; on leaving it,
    the first one received goes to the handler it was meant for (which may raise
    ``KeyboardInterrupt`` or end the process). Off the main thread it does nothing."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> Self:
        if threading.current_thread() is threading.main_thread():
            for signum in DEFERRED:
                current = signal.getsignal(signum)
                if current is None or current == signal.SIG_IGN:
                    continue  # set outside Python (cannot be put back), or ignored anyway
                self._previous[signum] = signal.signal(signum, self._on_signal)
        return self

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signum
            self.stop.set()
            log.warning(
                "kareus: %s: stopping the profiling after the measurement in flight, then "
                "resetting the clocks", signal.Signals(signum).name,
            )
            return
        log.warning("kareus: %s: still stopping the profiling (the measurement in flight "
                    "ends first)", signal.Signals(signum).name)

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()
        if self.received is None:
            return False
        self._deliver(self.received)
        # The handler let the process go on: the profiling stopped all the same.
        if isinstance(exc, ProfilingInterrupted):
            raise ProfilingInterrupted(
                f"profiling stopped by {signal.Signals(self.received).name}"
            ) from None
        return False

    @staticmethod
    def _deliver(signum: int) -> None:
        handler = signal.getsignal(signum)
        if callable(handler):
            try:
                handler(signum, None)
            except BaseException as raised:  # re-raised without the interrupted block's context
                raised.__suppress_context__ = True
                raise
        elif handler == signal.SIG_DFL:
            signal.raise_signal(signum)  # the default action: for SIGTERM, the process ends
