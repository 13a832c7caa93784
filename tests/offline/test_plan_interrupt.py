"""Ctrl-C during ``kareus plan`` of a deep pipeline (the case that once hung in HiGHS for
10 minutes, SIGINT ignored): the process ends at once with one line, status 130, and
writes nothing."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

PLAN = ["plan", "llama3.2-1b", "--tp", "2", "--pp", "16", "--microbatches", "16",
        "--microbatch-size", "1", "--seq", "256"]


@pytest.mark.parametrize("after_s", [5.0])
def test_sigint_mid_plan_ends_at_once_with_one_line_and_no_file(tmp_path, after_s):
    # As in a terminal: the default handler (a child of a background job ignores SIGINT).
    argv = [*PLAN, "--json", str(tmp_path / "r.json"), "--cache-dir", str(tmp_path / "store")]
    code = ("import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
            f"from kareus.cli import console; console({argv!r})")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    store, started = tmp_path / "store", time.monotonic()
    # ``after_s`` into the plan, counted from its store's opening: a signal during the
    # imports before it (seconds on a loaded machine) ends Python, before kareus runs
    while not store.exists() and child.poll() is None and time.monotonic() - started < 120:
        time.sleep(0.05)
    time.sleep(after_s)
    assert child.poll() is None, "the plan ended before the signal"
    sent = time.perf_counter()
    child.send_signal(signal.SIGINT)
    _, err = child.communicate(timeout=60)
    waited = time.perf_counter() - sent
    assert child.returncode == 130
    assert err == "kareus plan: interrupted\n"
    assert waited < 5, f"ended {waited:.1f} s after the signal: it waited for a solve"
    assert not [p for p in tmp_path.iterdir() if p.name != "store"]
