"""Which controller a set_clock call reaches, per thread (``runtime.clock.ClockRouter``)."""

import threading

import pytest

from kareus.devices.base import NullClockController, RecordingClockController
from kareus.runtime.clock import ClockRouter


def _in_thread(fn):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def test_a_thread_reaches_its_own_controller_else_the_default():
    router, default, mine = ClockRouter(), RecordingClockController(), RecordingClockController()
    router.set_default(default)
    assert router.current() is default
    with router.use(mine):
        assert router.current() is mine
        with router.use(inner := RecordingClockController()):
            assert router.current() is inner
        assert router.current() is mine
    assert router.current() is default
    assert (mine.resets, inner.resets, default.resets) == (1, 1, 0)  # reset on the way out


def test_a_thread_without_one_follows_the_one_thread_that_has_one():
    """Autograd runs a CUDA backward on its own worker thread: its switches go where the
    training thread's go; with two training threads the owner is ambiguous: the default."""
    router, default = ClockRouter(), NullClockController()
    router.set_default(default)
    first, second = RecordingClockController(), RecordingClockController()
    with router.use(first):
        assert _in_thread(router.current) is first
        installed, release = threading.Event(), threading.Event()

        def other():
            with router.use(second):
                installed.set()
                release.wait()

        t = threading.Thread(target=other)
        t.start()
        installed.wait()
        assert router.current() is first
        assert _in_thread(router.current) is default
        release.set()
        t.join()
    assert _in_thread(router.current) is default


def test_only_controllers_are_accepted():
    with pytest.raises(TypeError, match="does not implement set_clock"):
        ClockRouter().set_default(object())
