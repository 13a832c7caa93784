"""Who owns a GPU's clocks: lock files, stale owners, other processes, forks (fake NVML only)."""

from __future__ import annotations

import fcntl
import gc
import json
import logging
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import weakref
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
from fake_pynvml import LOCK, RESET, FakeGpu, FakeNvml, controller, locked_child, opened

from kareus.devices.errors import (
    ClockLockDirError,
    ClockOwnedError,
    ForkedClockControllerError,
    StaleClockLockError,
)
from kareus.devices.nvml import ownership
from kareus.devices.nvml.clock import NvmlClockController, no_event
from kareus.devices.nvml.gpu import NvmlGPU
from kareus.passes.ops import DEFAULT_CLOCK_MHZ
from kareus.runtime import ProcessRuntime, process_runtime

UUID = FakeGpu().uuid


@pytest.fixture(autouse=True)
def lock_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Lock files of this test only (its subprocesses inherit the variable)."""
    directory = tmp_path / "clock-locks"
    monkeypatch.setenv(ownership.LOCK_DIR_ENV, str(directory))
    return directory




def record(lock_dir: Path) -> dict[str, object]:
    return json.loads((lock_dir / f"{UUID}.lock").read_text())


def start_ticks(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[19])


def write_record(lock_dir: Path, pid: int, **fields: object) -> Path:
    """A lock file as an owner that is gone left it (nobody holds its flock)."""
    lock_dir.mkdir(exist_ok=True)
    path = lock_dir / f"{UUID}.lock"
    owner = {
        "pid": pid,
        "start_ticks": start_ticks(pid) if Path(f"/proc/{pid}").exists() else 12345,
        "boot_id": Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
        "host": socket.gethostname(),
        "uid": 1000,
        "user": "bob",
        "command": "python train.py",
        "since": "2025-01-01T00:00:00+00:00",
        "gpu": "GPU 0",
        "locked_mhz": 1200,
    }
    path.write_text(json.dumps({**owner, **fields}))
    return path


def dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_ownership_is_recorded_while_held_and_released_on_close(lock_dir: Path) -> None:
    fake, handle = opened()
    ctl = controller(fake, handle)
    assert ctl.owns_clocks and ctl.lock_path == lock_dir / f"{UUID}.lock"
    owner = record(lock_dir)
    assert owner["pid"] == os.getpid() and owner["start_ticks"] == start_ticks(os.getpid())
    assert owner["locked_mhz"] is None and owner["gpu"] == "GPU 0"
    assert {"host", "uid", "user", "command", "since", "boot_id"} <= owner.keys()
    ctl.set_clock("fwd", 1200)
    ctl.flush()
    assert record(lock_dir)["locked_mhz"] == 1200
    # Built without the runtime's clock locks, so refused through the flock, by this
    # process's record (the runtime's refuse by name: see the next test).
    with pytest.raises(ClockOwnedError, match="another clock controller of this process") as info:
        controller(fake, handle)
    assert f"pid {os.getpid()}" in str(info.value) and "locked at 1200 MHz" in str(info.value)
    ctl.close()
    assert (lock_dir / f"{UUID}.lock").read_text() == ""  # released cleanly
    assert not ctl.owns_clocks
    with controller(fake, handle) as again:
        assert again.owns_clocks
    assert fake.setter_calls() == [(LOCK, 0, 1200, 1200), (RESET, 0)]  # no stale reset


def test_a_second_device_of_one_process_is_refused_even_if_the_lock_file_went(
    lock_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runtime's ``clock_locks`` refuses by name what a flock alone would not: the lock
    file removed meanwhile (a /tmp cleaner), a second open would lock a new one."""
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml())  # what the runtime opens
    runtime = ProcessRuntime()
    with runtime.device("nvml") as first:
        assert isinstance(first, NvmlGPU) and first.clock_controller().owns_clocks
        first.clock_controller().lock_path.unlink()
        runtime.forget_devices()  # as if opened by another spec: a second device of the GPU
        with pytest.raises(ClockOwnedError, match="another clock controller of this process"):
            runtime.device("nvml")
    with runtime.device("nvml") as again:  # once the first closed
        assert again.clock_controller().owns_clocks


def test_held_clock_locks_are_collected() -> None:
    """Each instance's fork hook lives as long as the process; it must not keep it alive."""
    held = weakref.ref(ownership.HeldClockLocks())
    gc.collect()
    assert held() is None


def test_dry_run_never_takes_ownership(lock_dir: Path) -> None:
    fake, handle = opened()
    with controller(fake, handle) as owner, controller(fake, handle, dry_run=True) as dry:
        assert owner.owns_clocks and not dry.owns_clocks
    with controller(fake, handle, dry_run=True) as dry:
        dry.set_clock("g", 1200)
        dry.flush()
    assert (lock_dir / f"{UUID}.lock").read_text() == ""


def _second_controller(conn: Connection, lock_dir: str) -> None:
    """A spawned process: try to own the fake GPU; report; when told, try again."""
    os.environ[ownership.LOCK_DIR_ENV] = lock_dir
    fake, handle = opened()
    for _attempt in range(2):
        try:
            with controller(fake, handle) as ctl:
                ctl.set_clock("fwd", 1410)
                ctl.flush()
                conn.send(("owned", ctl.owns_clocks))
        except ClockOwnedError as exc:
            conn.send(("refused", str(exc)))
        conn.recv()


def test_a_second_process_is_refused_while_the_owner_lives(lock_dir: Path) -> None:
    fake, handle = opened()
    ctl = controller(fake, handle)
    ctl.set_clock("fwd", 1200)
    ctl.flush()
    spawn = multiprocessing.get_context("spawn")
    here, there = spawn.Pipe()
    child = spawn.Process(target=_second_controller, args=(there, str(lock_dir)))
    child.start()
    try:
        assert here.poll(60)
        outcome, message = here.recv()
        assert outcome == "refused", message
        assert f"owned by another process: pid {os.getpid()} " in message
        assert f"`kill {os.getpid()}`" in message and 'device="nvml-dry-run"' in message
        assert "locked at 1200 MHz" in message and str(lock_dir / f"{UUID}.lock") in message
        ctl.close()
        here.send("go")
        assert here.poll(60)
        assert here.recv() == ("owned", True)  # once the first owner closed
        here.send("go")
        child.join(60)
    finally:
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0
    assert fake.gpus[0].locked is None




def test_sigkill_leaves_a_stale_lock_that_the_next_start_resets(
    tmp_path: Path, lock_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = tmp_path / "state.json"
    code = locked_child(state)
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None and child.stdout.readline() == "locked\n"
    child.send_signal(signal.SIGKILL)  # no handler runs: the lock outlives the process
    assert child.wait(timeout=20) == -signal.SIGKILL
    assert FakeNvml.read_state(state)["locked"] == [[1200, 1200]]
    assert record(lock_dir)["pid"] == child.pid and record(lock_dir)["locked_mhz"] == 1200

    fake, handle = opened()
    fake.gpus[0].locked = (1200, 1200)  # what the driver still holds
    caplog.set_level(logging.WARNING, logger="kareus")
    with controller(fake, handle) as ctl:
        assert fake.setter_calls() == [(RESET, 0)] and fake.gpus[0].locked is None
        (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert f"pid {child.pid} " in warning and "locked at 1200 MHz" in warning
        assert "Reset the SM clock of GPU 0" in warning and "no longer running" in warning
        assert record(lock_dir)["pid"] == os.getpid()
        ctl.set_clock("g", DEFAULT_CLOCK_MHZ)  # known to be at default now: nothing to send
        ctl.flush()
        assert fake.setter_calls() == [(RESET, 0)]


def test_a_reused_pid_is_stale(lock_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    alive = os.getppid()
    write_record(lock_dir, alive, start_ticks=start_ticks(alive) + 1)
    fake, handle = opened()
    with controller(fake, handle):
        assert fake.setter_calls() == [(RESET, 0)]
    assert f"pid {alive} " in caplog.text
    assert "its pid now belongs to another process" in caplog.text


def test_an_owner_that_gave_up_without_resetting_is_stale(
    lock_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write_record(lock_dir, os.getppid())  # still running, but it holds no flock
    fake, handle = opened()
    with controller(fake, handle):
        assert fake.setter_calls() == [(RESET, 0)]
    assert "still running but gave up ownership" in caplog.text


def test_a_failed_reset_at_close_leaves_the_record_for_the_next_owner(lock_dir: Path) -> None:
    fake, handle = opened(FakeNvml(reset_fails=True))
    ctl = controller(fake, handle)
    ctl.set_clock("fwd", 1200)
    ctl.flush()
    with pytest.raises(Exception, match="FAILED to reset"):
        ctl.close()
    assert record(lock_dir)["locked_mhz"] == 1200 and not ctl.owns_clocks
    fake.reset_fails = False
    with controller(fake, handle):
        assert fake.setter_calls()[-1] == (RESET, 0) and fake.gpus[0].locked is None


def test_stale_clocks_that_cannot_be_reset_say_what_to_run(
    lock_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pid = dead_pid()
    path = write_record(lock_dir, pid)
    before = path.read_text()
    fake, handle = opened(FakeNvml(can_set_clocks=False))
    with pytest.raises(StaleClockLockError) as info:
        controller(fake, handle)
    message = str(info.value)
    for fact in (f"pid {pid} ", "locked at 1200 MHz", "NVML_ERROR_NO_PERMISSION"):
        assert fact in message
    advice = f"run `sudo nvidia-smi -i 0 -rgc`, then remove the stale record with `sudo rm {path}`"
    assert advice in message
    assert any(r.levelno == logging.CRITICAL for r in caplog.records)
    assert path.read_text() == before  # kept, and its flock released: the next start retries
    fake.can_set_clocks = True
    with controller(fake, handle) as ctl:
        assert ctl.owns_clocks and fake.setter_calls()[-1] == (RESET, 0)


def test_a_record_left_unlocked_or_before_a_reboot_needs_no_reset(lock_dir: Path) -> None:
    fake, handle = opened()
    write_record(lock_dir, dead_pid(), locked_mhz=None)  # e.g. died after a SIGTERM reset
    with controller(fake, handle):
        pass
    write_record(lock_dir, dead_pid(), boot_id="an-earlier-boot")
    with controller(fake, handle):
        pass
    assert fake.setter_calls() == []


def test_an_unreadable_record_is_treated_as_locked(lock_dir: Path) -> None:
    lock_dir.mkdir()
    (lock_dir / f"{UUID}.lock").write_text("{not json")
    fake, handle = opened()
    with controller(fake, handle):
        assert fake.setter_calls() == [(RESET, 0)]


def test_a_forked_child_cannot_set_clocks_and_the_parent_keeps_ownership(lock_dir: Path) -> None:
    fake, handle = opened()
    held = process_runtime().clock_locks  # the child must forget what the process holds
    ctl = NvmlClockController(
        fake,
        handle,
        gpu="GPU 0",
        index=0,
        supported_clocks=(1410, 1200),
        event_factory=no_event,
        held=held,
    )  # reset_at_exit: registered with the exit guard, which the child must not inherit
    ctl.set_clock("fwd", 1200)
    ctl.flush()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave without running any exit handler
        try:
            seen: dict[str, object] = {"guarded": len(held.exit_guard.controllers)}
            try:
                ctl.set_clock("fwd", 1410)
            except ForkedClockControllerError as exc:
                seen["set"] = str(exc)
            ctl.flush()
            ctl.reset()
            ctl.close()
            seen["calls"] = len(fake.setter_calls())
            try:
                controller(fake, handle, held=held)
            except ClockOwnedError as exc:
                seen["own"] = str(exc)
            os.write(write, json.dumps(seen).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        seen = json.loads(pipe.read())
    assert os.waitpid(pid, 0)[1] == 0
    assert seen["guarded"] == 0 and seen["calls"] == 1  # only the parent's lock, before the fork
    assert f"This process (pid {pid}) was forked from pid {os.getpid()}" in seen["set"]
    assert f"owned by another process: pid {os.getpid()} " in seen["own"]
    # The child closed its copy of the lock file: the parent's flock holds all the same.
    with open(ctl.lock_path) as other, pytest.raises(BlockingIOError):
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    assert ctl.owns_clocks and record(lock_dir)["pid"] == os.getpid()
    ctl.set_clock("bwd", 1410)
    ctl.flush()
    ctl.close()
    assert fake.setter_calls() == [(LOCK, 0, 1200, 1200), (LOCK, 0, 1410, 1410), (RESET, 0)]
    assert ctl not in held.exit_guard.controllers


def test_dry_run_warns_when_the_clocks_are_not_the_default(
    lock_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fake, handle = opened()
    write_record(lock_dir, os.getppid())
    controller(fake, handle, dry_run=True).close()
    assert f"owned by pid {os.getppid()} " in caplog.text and "not at the default" in caplog.text
    caplog.clear()
    write_record(lock_dir, dead_pid())
    controller(fake, handle, dry_run=True).close()
    assert "may still have its SM clock locked at 1200 MHz" in caplog.text
    assert "sudo nvidia-smi -i 0 -rgc" in caplog.text
    assert fake.setter_calls() == []


def test_an_unusable_lock_directory_says_what_to_set(lock_dir: Path) -> None:
    lock_dir.write_text("a file, not a directory")
    fake, handle = opened()
    with pytest.raises(ClockLockDirError, match="not a directory.*KAREUS_CLOCK_LOCK_DIR"):
        controller(fake, handle)


def test_where_lock_files_live(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(ownership.LOCK_DIR_ENV)
    assert ownership.lock_dir() == Path("/tmp/kareus-clocks")
    monkeypatch.setenv(ownership.LOCK_DIR_ENV, "/srv/locks")
    assert ownership.lock_dir() == Path("/srv/locks")
    assert ownership.lock_dir(tmp_path) == tmp_path
    assert ownership.lock_path(tmp_path, "GPU-1/x", 3) == tmp_path / "GPU-1_x.lock"
    by_index = ownership.lock_path(tmp_path, None, 3)  # no UUID: an index is per host
    assert by_index.name == f"{socket.gethostname()}-gpu3.lock"
