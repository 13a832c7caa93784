"""SIGINT and SIGTERM while a graph is profiled on a GPU behind a fake NVML: the profiling
thread stops (no measurement starts after the signal but the one in flight), the clocks are
reset after its last measurement, and the signal then does what it would have done
(KeyboardInterrupt; death by SIGTERM). Each case runs in a subprocess, several times, the
signal landing at different points of the search."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from fake_pynvml import LOCK, REPO, RESET, TESTS

from kareus.profiler.interrupt import DeferredSignals, ProfilingInterrupted, check

_CHILD = """
import logging, signal, sys
# As in a terminal: a child of a background job starts with SIGINT ignored.
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.path[:0] = [{tests!r}, {repo!r}]
logging.basicConfig(stream=sys.stdout, level=logging.WARNING, format="%(message)s")
import torch
from fake_pynvml import FakeNvml
from conftest import init_fake_pg
from gloo import AllReduceBlock
import kareus
from kareus.devices.nvml.gpu import NvmlGPU

init_fake_pg(2)
gpu = NvmlGPU(nvml_module=FakeNvml(state_file={state!r}), cuda=False, min_window_s=0.01,
              settle_s=0.0)
measure = gpu.measure

def printing(workload, clock_mhz, **kwargs):
    print("measure", workload.name, clock_mhz, flush=True)
    return measure(workload, clock_mhz, **kwargs)

gpu.measure = printing
backend = kareus.KareusBackend(
    {{"nanobatches": 2, "lowering": "eager", "cache_dir": {cache!r}, "search_budget": 400}},
    device=gpu,
)
torch.compile(AllReduceBlock(), backend=backend)(torch.randn(4, 8)).sum().backward()
print("finished", flush=True)
"""


def _interrupt(
    tmp_path: Path, signum: int, after: int, *, twice: bool = False
) -> tuple[int, list[str], str, dict]:
    """Run the child, send ``signum`` once its ``after``-th measurement has started (and,
    ``twice``, again once it says it is stopping); its exit status, stdout lines, stderr
    and the fake driver's final state."""
    state = tmp_path / "nvml.json"
    code = _CHILD.format(tests=str(TESTS), repo=str(REPO), state=str(state),
                         cache=str(tmp_path / "cache"))
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    lines = []
    timer = threading.Timer(240, child.kill)  # a hang fails the test, it does not stall it
    timer.start()
    try:
        assert child.stdout is not None
        sent = 0
        for line in child.stdout:
            lines.append(line.rstrip("\n"))
            started = sum(x.startswith("measure") for x in lines)
            if sent == 0 and started == after or sent == 1 and twice and "stopping" in line:
                child.send_signal(signum)
                sent += 1
        rc = child.wait()
        stderr = child.stderr.read() if child.stderr is not None else ""
    finally:
        timer.cancel()
    return rc, lines, stderr, json.loads(state.read_text())


def _measures(lines: list[str]) -> list[str]:
    return [x for x in lines if x.startswith("measure")]


def _after_the_signal(lines: list[str]) -> list[str]:
    stopping = next(i for i, x in enumerate(lines) if "stopping the profiling" in x)
    return [x for x in lines[stopping + 1:] if x.startswith("measure")]


@pytest.mark.parametrize(("signum", "after"), [
    (signal.SIGINT, 1), (signal.SIGINT, 4), (signal.SIGINT, 9), (signal.SIGTERM, 2),
    (signal.SIGTERM, 7),
])
def test_a_signal_stops_the_measuring_then_resets_the_clocks_then_acts(tmp_path, signum, after):
    rc, lines, stderr, state = _interrupt(tmp_path, signum, after)
    assert "terminate called" not in stderr
    assert "finished" not in lines  # the compile did not go on
    assert rc == -signum, stderr[-2000:]
    if signum == signal.SIGINT:
        assert stderr.rstrip().endswith("KeyboardInterrupt"), stderr[-2000:]
    # No measurement started after the signal: at most the repeats of the one in flight.
    assert set(_after_the_signal(lines)) <= {_measures(lines)[after - 1]}
    # The clocks were locked while measuring, and reset after the last lock.
    setters = [call[0] for call in state["setter_calls"]]
    assert LOCK in setters and setters[-1] == RESET
    assert state["locked"] == [None] * len(state["locked"])


@pytest.mark.parametrize("after", [3, 8])
def test_a_second_ctrl_c_changes_nothing_and_the_process_ends_after_the_measurement(
    tmp_path, after
):
    rc, lines, stderr, state = _interrupt(tmp_path, signal.SIGINT, after, twice=True)
    assert "terminate called" not in stderr  # the thread was not left running at exit
    assert rc == -signal.SIGINT and stderr.rstrip().endswith("KeyboardInterrupt")
    assert set(_after_the_signal(lines)) <= {_measures(lines)[after - 1]}
    setters = [call[0] for call in state["setter_calls"]]
    assert setters[-1] == RESET  # at exit, after the measurement in flight
    assert state["locked"] == [None] * len(state["locked"])


@pytest.fixture
def ctrl_c():
    """SIGINT raising KeyboardInterrupt, as in a terminal (a background job ignores it)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_deferred_signals_hand_the_signal_on_when_the_block_ends(ctrl_c):
    with pytest.raises(KeyboardInterrupt), DeferredSignals() as signals:
        signal.raise_signal(signal.SIGINT)
        assert signals.stop.is_set()  # held: the block goes on to its end
        with pytest.raises(ProfilingInterrupted):
            check(signals.stop)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_second_signal_changes_nothing_and_the_first_is_handed_on(ctrl_c):
    reached_the_end = threading.Event()
    with pytest.raises(KeyboardInterrupt) as raised, DeferredSignals():
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)  # raises nothing: a join it interrupted would
        reached_the_end.set()               # mark the thread it waits for as stopped
    assert reached_the_end.is_set()
    assert raised.value.__suppress_context__


def test_a_handler_that_lets_the_process_go_on_still_stops_the_profiling():
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        with pytest.raises(ProfilingInterrupted, match="SIGTERM"), DeferredSignals() as s:
            signal.raise_signal(signal.SIGTERM)
            check(s.stop)
        assert seen == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)
