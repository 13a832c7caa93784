"""Ctrl-C in ``kareus plan`` and ``kareus bench``, acted on where it is safe to act.

Python raises ``KeyboardInterrupt`` at whatever instruction the main thread runs when
SIGINT arrives. In a plan that is often inside torch: a weakref callback run by the garbage
collector (Dynamo's caches), where the exception is printed as "Exception ignored" and
lost, so the plan went on for minutes; or a function the autograd engine calls, which can
end in a native abort. So within ``at_safe_points`` SIGINT only marks itself pending, and
``KeyboardInterrupt`` is raised at the command's next ``raise_if_interrupted``: between
compiled regions and graphs, between graphs of a step's frontier, at every poll of a
solve's wait (``planner.pipeline.side_by_side``), before outputs are written. A signal
handed over by code at a point it chose (``profiler.interrupt.DeferredSignals``, once the
profiling stopped) raises at once, and so does a second Ctrl-C.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType

_pending = threading.Event()  # process-wide, as signal handlers are


def raise_if_interrupted() -> None:
    """Raise ``KeyboardInterrupt`` if SIGINT came within ``at_safe_points``."""
    if _pending.is_set():
        raise KeyboardInterrupt


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    if frame is None or _pending.is_set():
        raise KeyboardInterrupt
    _pending.set()


@contextlib.contextmanager
def at_safe_points() -> Iterator[None]:
    """SIGINT pending until the next ``raise_if_interrupted`` within the block (on the
    main thread, where Python runs signal handlers, and only where SIGINT raises
    ``KeyboardInterrupt``)."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    _pending.clear()
    signal.signal(signal.SIGINT, _on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _pending.clear()


def end_process(status: int) -> None:
    """End an interrupted command's process with ``status`` at once, outputs flushed. The
    interpreter's own exit can abort natively under what the command left running ("terminate
    called without an active exception": a HiGHS solve, which returns only when it ends, or
    torch code on a thread, pytorch/pytorch#38228), and an interrupted ``plan`` or ``bench``
    has nothing left to finish: its outputs are written whole (a temporary, then renamed),
    its profile store is SQLite's (a transaction is whole or absent), its GPU simulated."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
