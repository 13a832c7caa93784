"""Ctrl-C in ``kareus plan`` and ``bench`` is acted on at safe points (``kareus.interrupts``):
one that arrives where Python cannot raise (a weakref callback the garbage collector runs,
as Dynamo's caches do) is not lost, a solve's wait ends at its next poll, a second Ctrl-C
raises at once, and outside the block SIGINT is as it was."""

from __future__ import annotations

import gc
import signal
import sys
import threading
import time
import weakref

import pytest

from kareus import interrupts
from kareus.planner.pipeline import side_by_side


class _Held:
    pass


@pytest.fixture(autouse=True)
def _sigint_raises():
    """SIGINT's handler as in a terminal: a background job's children ignore it."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_a_ctrl_c_in_a_weakref_callback_is_raised_at_the_next_check(monkeypatch):
    ignored: list[object] = []
    monkeypatch.setattr(sys, "unraisablehook", ignored.append)
    with interrupts.at_safe_points():
        held = _Held()
        ref = weakref.ref(held, lambda _: signal.raise_signal(signal.SIGINT))
        del held
        gc.collect()
        assert ref() is None and not ignored  # nothing raised where it would be swallowed
        with pytest.raises(KeyboardInterrupt):
            interrupts.raise_if_interrupted()


def test_a_solves_wait_ends_at_its_next_poll_and_a_second_ctrl_c_at_once():
    with interrupts.at_safe_points():
        threading.Timer(0.2, signal.raise_signal, (signal.SIGINT,)).start()
        started = time.perf_counter()
        with pytest.raises(KeyboardInterrupt):
            side_by_side([lambda: time.sleep(30)], poll_s=0.05)
        assert time.perf_counter() - started < 5
    with interrupts.at_safe_points():
        signal.raise_signal(signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)


def test_outside_the_block_sigint_raises_as_before_and_nothing_stays_pending():
    with interrupts.at_safe_points():
        signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    interrupts.raise_if_interrupted()  # the pending one ended with its block
    with pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)


def test_a_handler_the_caller_set_is_left_alone():
    calls: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: calls.append(signum))
    try:
        with interrupts.at_safe_points():
            signal.raise_signal(signal.SIGINT)
            interrupts.raise_if_interrupted()
        assert calls == [signal.SIGINT]
    finally:
        signal.signal(signal.SIGINT, previous)
