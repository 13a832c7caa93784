"""The profile store keeps every evaluation across processes, crashes and damaged files.

The multi-process tests start their children from a ``forkserver`` that has imported the
store: fresh processes, as with ``spawn``, that share no state (no SQLite handle, no lock)
with pytest's, without each paying the ~2 s import of kareus and torch.
"""

from __future__ import annotations

import importlib.util
import logging
import multiprocessing
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

import kareus
from kareus import KareusError
from kareus.devices.base import Measurement
from kareus.profiler import store as store_module
from kareus.profiler.store import (
    FILENAME,
    SCHEMA_VERSION,
    Knobs,
    ProfileKey,
    ProfileStore,
    ProfileStoreError,
    SearchRecord,
)
from kareus.version import build

KEY = ProfileKey("3f" * 32, "sim:h200", "sim-v2", (1980, 1500, 1200), 2, "0.1.0")


def knobs(slot: int, clock_mhz: int = 1980) -> Knobs:
    return Knobs(slot, (("all_reduce_3", 16),), clock_mhz, 2)


def measurement(slot: int, clock_mhz: int = 1980) -> Measurement:
    return Measurement(
        time_s=1e-3 * (slot + 1) / 3,
        energy_j=0.1 + slot / 7,
        static_power_w=110.5,
        clock_mhz=clock_mhz,
        method="sim:h200/v2",
        resources=(("all_reduce_3", 16),),
        details={"compute_s": 1 / 3, "comm_s": 2e-4},
        model_version="sim-v2",
    )


def set_aside(directory: Path, kind: str) -> list[Path]:
    return sorted(directory.glob(f"{FILENAME}.{kind}-*[0-9]"))


# -- records ------------------------------------------------------------------------------


def test_round_trip(tmp_path):
    with ProfileStore(cache_dir=tmp_path) as store:
        assert store.lookup(KEY, knobs(0)) is None
        assert store.record(KEY, knobs(0), measurement(0)) is True
        found = store.lookup(KEY, knobs(0))
    with ProfileStore(tmp_path / FILENAME) as store:
        again = store.lookup(KEY, knobs(0))
        assert store.keys() == [KEY]
    assert found == again and found is not None
    assert found.knobs == knobs(0)
    assert found.measurement == measurement(0)  # floats and details exactly


def test_record_keeps_the_first(tmp_path):
    with ProfileStore(cache_dir=tmp_path) as store:
        assert store.record(KEY, knobs(1), measurement(1))
        first = store.lookup(KEY, knobs(1))
        assert not store.record(KEY, knobs(1), replace(measurement(1), time_s=9.0))
        assert store.evaluations(KEY) == [first]


def test_evaluations_in_recorded_order(tmp_path):
    with ProfileStore(cache_dir=tmp_path) as store:
        for slot in (3, 0, 2):
            store.record(KEY, knobs(slot), measurement(slot))
        assert [e.knobs.slot for e in store.evaluations(KEY)] == [3, 0, 2]


def test_knobs_are_canonical():
    assert Knobs(0, {"b": 8, "a": 4, "c": None}, 1980, 2) == Knobs(0, (("a", 4), ("b", 8)), 1980, 2)
    assert Knobs(0, {"a": None}, 1980, 2).json() == Knobs(0, (), 1980, 2).json()
    assert replace(KEY, clocks=(1200, 1980, 1500, 1500)) == KEY


@pytest.mark.parametrize(
    "change",
    [
        {"partition_key": "40" * 32},
        {"device": "NVIDIA H200 GPU-1234"},
        {"model_version": None},
        {"model_version": "sim-v3"},
        {"clocks": (1980, 1500)},
        {"group_size": 4},
        {"kareus_version": "0.2.0"},
    ],
)
def test_keys_do_not_mix(tmp_path, change):
    other = replace(KEY, **change)
    assert other.digest() != KEY.digest()
    with ProfileStore(cache_dir=tmp_path) as store:
        store.record(KEY, knobs(0), measurement(0))
        assert store.lookup(other, knobs(0)) is None
        assert store.evaluations(other) == []
        store.record(other, knobs(0), measurement(5))
        assert store.lookup(KEY, knobs(0)).measurement == measurement(0)
        assert store.keys() == [KEY, other]


def _build_of(package: Path) -> str:
    """``version.build()`` of the kareus package at ``package``."""
    spec = importlib.util.spec_from_file_location("copied_kareus_version", package / "version.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build()


def test_a_key_is_by_default_the_running_builds_which_changes_with_kareus_source(tmp_path):
    """A stored measurement keyed by the version number alone outlived rule changes."""
    package = tmp_path / "kareus"
    shutil.copytree(Path(kareus.__file__).parent, package,
                    ignore=shutil.ignore_patterns("__pycache__"))
    default = ProfileKey("3f" * 32, "sim:h200", None, (1980,), 2)
    assert _build_of(package) == build() == default.kareus_version
    assert build().startswith(kareus.__version__ + "+")
    rules = package / "passes" / "placement.py"
    rules.write_text(rules.read_text() + "\n# a rule changed\n")
    assert _build_of(package) != build()


def test_knobs_do_not_mix(tmp_path):
    variants = [
        knobs(0),
        knobs(1),
        knobs(0, 1500),
        Knobs(0, (), 1980, 2),
        replace(knobs(0), nanobatches=4),
    ]
    with ProfileStore(cache_dir=tmp_path) as store:
        for slot, k in enumerate(variants):
            assert store.record(KEY, k, measurement(slot, k.clock_mhz))
        for slot, k in enumerate(variants):
            assert store.lookup(KEY, k).measurement == measurement(slot, k.clock_mhz)


def test_measurement_at_another_clock_is_refused(tmp_path):
    with ProfileStore(cache_dir=tmp_path) as store, pytest.raises(ValueError, match="1500 MHz"):
        store.record(KEY, knobs(0, 1980), measurement(0, 1500))


def test_search(tmp_path):
    first = SearchRecord((knobs(0), knobs(2)), "budget", (1.0, 2.0))
    again = SearchRecord((knobs(1), knobs(0, 1500)), "converged", (3.0, 3.0))
    with ProfileStore(cache_dir=tmp_path) as store:
        assert store.search(KEY, "budget=2") is None
        store.record_search(KEY, "budget=2", first)
        store.record_search(KEY, "budget=3", first)
        store.record_search(KEY, "budget=2", again)
    with ProfileStore(cache_dir=tmp_path) as store:
        assert store.search(KEY, "budget=2") == again
        assert store.search(KEY, "budget=3") == first
        assert store.search(replace(KEY, group_size=4), "budget=2") is None


def test_default_location(tmp_path, monkeypatch):
    monkeypatch.setenv("KAREUS_CACHE_DIR", str(tmp_path / "kc"))
    with ProfileStore() as store:
        assert store.path == tmp_path / "kc" / FILENAME
    monkeypatch.delenv("KAREUS_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    with ProfileStore() as store:
        assert store.path == tmp_path / "xdg" / "kareus" / FILENAME


def test_a_store_is_not_used_across_processes(tmp_path):
    with ProfileStore(cache_dir=tmp_path) as store:
        store._pid = -1  # as if this process were a fork of the one that opened it
        with pytest.raises(ProfileStoreError, match="open a ProfileStore in each process"):
            store.lookup(KEY, knobs(0))


# -- several processes --------------------------------------------------------------------


@pytest.fixture(scope="module")
def processes():
    ctx = multiprocessing.get_context("forkserver")
    # Not this module: Python 3.11's server ignores the parent's sys.path. No effect if a
    # server already runs.
    ctx.set_forkserver_preload(["kareus.profiler.store"])
    return ctx


def _writer(path: str, worker: int, start) -> None:
    start.wait()
    with ProfileStore(path) as store:
        store.record(KEY, knobs(-1), measurement(0))  # every worker: one row survives
        for i in range(50):
            slot = worker * 100 + i
            store.record(KEY, knobs(slot), measurement(slot))


def test_concurrent_writers_lose_nothing(tmp_path, processes):
    # The file starts damaged, so the four also race to set it aside and rebuild it: the
    # open lock must let exactly one do that.
    path = tmp_path / FILENAME
    path.write_bytes(b"not a database" * 100)
    start = processes.Event()
    workers = [processes.Process(target=_writer, args=(str(path), w, start)) for w in range(4)]
    for p in workers:
        p.start()
    start.set()
    for p in workers:
        p.join(60)
    assert [p.exitcode for p in workers] == [0, 0, 0, 0]
    assert len(set_aside(tmp_path, "corrupt")) == 1
    with ProfileStore(path) as store:
        slots = [e.knobs.slot for e in store.evaluations(KEY)]
    assert len(slots) == 201 and slots.count(-1) == 1
    for w in range(4):
        assert [s for s in slots if s // 100 == w] == [w * 100 + i for i in range(50)]


def _crash_mid_search(path: str) -> None:
    with ProfileStore(path) as store:
        for slot in range(10):
            store.record(KEY, knobs(slot), measurement(slot))
    # Die inside a write transaction, holding the write lock, with the 11th uncommitted.
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("BEGIN IMMEDIATE")
    conn.execute(
        "INSERT INTO evaluations (key, knobs, time_s, energy_j, static_power_w, clock_mhz, "
        "method, resources, details, measured_at) VALUES (?, ?, 1, 1, 1, 1980, 'x', '[]', "
        "'{}', 0)",
        (KEY.digest(), knobs(10).json()),
    )
    os.kill(os.getpid(), signal.SIGKILL)


def test_crash_mid_search_then_resume(tmp_path, processes):
    path = tmp_path / FILENAME
    child = processes.Process(target=_crash_mid_search, args=(str(path),))
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL
    with ProfileStore(path) as store:
        before = store.evaluations(KEY)
        assert [e.knobs.slot for e in before] == list(range(10))
        # Resume: measure only what is missing (the lock the child held is free again).
        for slot in range(20):
            if store.lookup(KEY, knobs(slot)) is None:
                store.record(KEY, knobs(slot), measurement(slot))
        after = store.evaluations(KEY)
    assert [e.knobs.slot for e in after] == list(range(20))
    assert after[:10] == before
    assert [e.measurement for e in after] == [measurement(slot) for slot in range(20)]


# -- whole in its file ---------------------------------------------------------------------


def copied_alone(path: Path, directory: Path) -> Path:
    """``path`` copied to ``directory`` without its -wal and -shm: what a user moving the
    store takes."""
    directory.mkdir()
    return Path(shutil.copy2(path, directory / FILENAME))


def test_a_closed_store_is_whole_in_its_file(tmp_path):
    """Closing checkpoints the WAL into the file even while another process (another rank)
    still has it open: SQLite's own checkpoint at close waits for the last connection."""
    path = tmp_path / FILENAME
    search = SearchRecord((knobs(0), knobs(1)), "budget", (1.0, 2.0))
    with ProfileStore(path) as other_rank:
        with ProfileStore(path) as store:
            for slot in range(5):
                store.record(KEY, knobs(slot), measurement(slot))
            store.record_search(KEY, "budget=2", search)
        copy = copied_alone(path, tmp_path / "copy")
        with ProfileStore(copy) as moved:
            assert [e.knobs.slot for e in moved.evaluations(KEY)] == list(range(5))
            assert moved.search(KEY, "budget=2") == search
        other_rank.keys()


_UNCLOSED = """
import sys
from kareus.devices.base import Measurement
from kareus.profiler.store import Knobs, ProfileKey, ProfileStore
KEY = ProfileKey("3f" * 32, "sim:h200", "sim-v2", (1980, 1500, 1200), 2, "0.1.0")
store = ProfileStore(sys.argv[1])  # never closed: the interpreter exits with it open
for slot in range(3):
    store.record(KEY, Knobs(slot, (), 1980, 2), Measurement(1e-3, 0.1, 110.0, 1980, "x"))
"""


def test_a_store_left_open_is_checkpointed_at_exit(tmp_path):
    path = tmp_path / FILENAME
    with ProfileStore(path) as other_rank:  # so that the child's is not the last connection
        subprocess.run([sys.executable, "-c", _UNCLOSED, str(path)], check=True, timeout=120)
        with ProfileStore(copied_alone(path, tmp_path / "copy")) as moved:
            assert [e.knobs.slot for e in moved.evaluations(KEY)] == [0, 1, 2]
        other_rank.keys()


# -- a locked file ------------------------------------------------------------------------

_HOLDER = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN EXCLUSIVE")
conn.execute("SELECT count(*) FROM sqlite_master").fetchall()
print("held", flush=True)
sys.stdin.read()  # until the test is done
"""


@pytest.fixture
def lock(tmp_path):
    """Hold ``BEGIN EXCLUSIVE`` on a file from another process; yields a function that
    starts it and returns its pid."""
    holders = []

    def hold(path: Path) -> int:
        holder = subprocess.Popen(
            [sys.executable, "-c", _HOLDER, str(path)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True,
        )
        holders.append(holder)
        assert holder.stdout.readline() == "held\n"
        return holder.pid

    yield hold
    for holder in holders:
        holder.communicate(timeout=30)


def test_a_locked_store_is_said_once_and_not_waited_for(tmp_path, lock, caplog, monkeypatch):
    monkeypatch.setattr(store_module, "LOCK_WAIT_S", 1.0)
    path = tmp_path / FILENAME
    _real_store(path, 2)
    pid = lock(path)
    with caplog.at_level(logging.WARNING, logger="kareus"), ProfileStore(path) as store:
        assert len(store.evaluations(KEY)) == 2  # WAL: reading goes on
        start = time.monotonic()
        assert store.record(KEY, knobs(5), measurement(5)) is False  # waited once
        first = time.monotonic() - start
        for slot in range(6, 20):  # then not at all
            store.record(KEY, knobs(slot), measurement(slot))
            store.record_search(KEY, "s", SearchRecord((knobs(slot),), "budget", (1.0,)))
        rest = time.monotonic() - start - first
    closed = time.monotonic() - start - first - rest
    assert 1.0 <= first < 5 and rest < 1 and closed < 1
    [message] = [r.getMessage() for r in caplog.records if r.name == "kareus"]
    assert f"profile store {path} is locked by process {pid} (python" in message
    assert "not kept" in message
    with ProfileStore(path) as store:
        assert [e.knobs.slot for e in store.evaluations(KEY)] == [0, 1]
    assert set_aside(tmp_path, "corrupt") == []


def test_a_store_locked_while_opening_is_not_used(tmp_path, lock, caplog, monkeypatch):
    """A file another program holds in a rollback journal cannot even be checked: the store
    is used without it, and it is not taken for damage."""
    monkeypatch.setattr(store_module, "LOCK_WAIT_S", 1.0)
    path = tmp_path / FILENAME
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE notes (text TEXT)")
    conn.close()
    original = path.read_bytes()
    pid = lock(path)
    with caplog.at_level(logging.WARNING, logger="kareus"), ProfileStore(path) as store:
        assert store.record(KEY, knobs(0), measurement(0)) is False
        assert store.lookup(KEY, knobs(0)) is None and store.keys() == []
    [message] = [r.getMessage() for r in caplog.records if r.name == "kareus"]
    assert f"is locked by process {pid}" in message
    assert path.read_bytes() == original and list(tmp_path.glob(f"{FILENAME}.*-*")) == []


# -- damaged files ------------------------------------------------------------------------


def _real_store(path: Path, n: int = 200) -> None:
    with ProfileStore(path) as store:
        for slot in range(n):
            store.record(KEY, knobs(slot), measurement(slot))


def _garbage(path: Path) -> None:
    path.write_bytes(bytes(range(256)) * 64)


def _truncated(path: Path) -> None:
    _real_store(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _header_only(path: Path) -> None:
    _real_store(path, 1)
    path.write_bytes(path.read_bytes()[:50])


@pytest.mark.parametrize("damage", [_garbage, _truncated, _header_only])
def test_corrupted_file_is_set_aside(tmp_path, caplog, damage):
    path = tmp_path / FILENAME
    damage(path)
    original = path.read_bytes()
    with caplog.at_level(logging.WARNING, logger="kareus"), ProfileStore(path) as store:
        assert store.evaluations(KEY) == []
        store.record(KEY, knobs(0), measurement(0))
        assert store.lookup(KEY, knobs(0)).measurement == measurement(0)
    [moved] = set_aside(tmp_path, "corrupt")
    assert moved.read_bytes() == original
    [message] = [r.getMessage() for r in caplog.records if r.name == "kareus"]
    assert str(path) in message and str(moved) in message and "corrupt" in message


def test_an_io_error_while_checking_is_not_damage(tmp_path, monkeypatch):
    """An I/O error or a lock is no reason to set a store aside: other processes may be
    using it. An error names the store; the file stays."""
    path = tmp_path / FILENAME
    _real_store(path, 3)
    connect = store_module._connect

    class Failing:
        def __init__(self, conn):
            self.conn = conn

        def execute(self, sql, *args):
            if sql == "PRAGMA quick_check":
                raise sqlite3.OperationalError("disk I/O error")
            return self.conn.execute(sql, *args)

        def close(self):
            self.conn.close()

    monkeypatch.setattr(store_module, "_connect", lambda p: Failing(connect(p)))
    with pytest.raises(KareusError, match="cannot check the profile store .*disk I/O error"):
        ProfileStore(path)
    monkeypatch.undo()
    assert set_aside(tmp_path, "corrupt") == []
    with ProfileStore(path) as store:
        assert len(store.evaluations(KEY)) == 3


def test_opening_leaves_the_locks_of_live_connections(tmp_path):
    """Opening a second connection in one process (a profiling thread's) must not open the
    file outside SQLite: closing that descriptor would drop the first's POSIX locks."""
    import builtins

    path = tmp_path / FILENAME
    _real_store(path, 1)
    opened = []
    real_open = builtins.open

    def recording(file, *args, **kwargs):
        opened.append(str(file))
        return real_open(file, *args, **kwargs)

    with ProfileStore(path):
        builtins.open = recording
        try:
            with ProfileStore(path) as second:
                second.keys()
        finally:
            builtins.open = real_open
    assert str(path) not in opened


def test_how_a_counter_behaves_is_kept_per_gpu_and_driver(tmp_path):
    with ProfileStore(cache_dir=tmp_path) as store:
        assert store.counter("NVIDIA H200", "570.1") is None
        store.record_counter("NVIDIA H200", "570.1", '{"integrates": true}')
        store.record_counter("NVIDIA H200", "570.1", '{"integrates": false}')  # probed again
    with ProfileStore(cache_dir=tmp_path) as store:
        assert store.counter("NVIDIA H200", "570.1") == '{"integrates": false}'
        assert store.counter("NVIDIA H200", "575.0") is None


def test_a_schema_2_store_gains_the_counters_table_in_place(tmp_path):
    path = tmp_path / FILENAME
    _real_store(path, 3)
    with sqlite3.connect(path) as conn:
        conn.execute("DROP TABLE counters")
        conn.execute("PRAGMA user_version = 2")
    conn.close()
    with ProfileStore(path, read_only=True) as old:  # read as it is
        assert len(old.evaluations(KEY)) == 3 and old.counter("gpu", "driver") is None
    with ProfileStore(path) as store:
        assert len(store.evaluations(KEY)) == 3  # nothing lost
        store.record_counter("gpu", "driver", "{}")
    assert set_aside(tmp_path, "schema-2") == []
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 3
    conn.close()


def test_old_schema_is_set_aside(tmp_path, caplog):
    path = tmp_path / FILENAME
    _real_store(path, 3)
    with sqlite3.connect(path) as conn:
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 98}")
    conn.close()
    original = path.read_bytes()
    with caplog.at_level(logging.WARNING, logger="kareus"), ProfileStore(path) as store:
        assert store.evaluations(KEY) == []
    [moved] = set_aside(tmp_path, f"schema-{SCHEMA_VERSION + 98}")
    assert moved.read_bytes() == original
    assert f"schema version {SCHEMA_VERSION + 98}" in caplog.text and str(moved) in caplog.text


@pytest.mark.parametrize("change", ["DROP TABLE evaluations", "DROP TABLE searches",
                                    "ALTER TABLE keys ADD COLUMN note TEXT"])
def test_a_store_with_tables_dropped_or_changed_is_set_aside(tmp_path, caplog, change):
    path = tmp_path / FILENAME
    _real_store(path, 3)
    with sqlite3.connect(path) as conn:
        conn.execute(change)
    conn.close()
    with caplog.at_level(logging.WARNING, logger="kareus"), ProfileStore(path) as store:
        assert store.evaluations(KEY) == []
        store.record(KEY, knobs(0), measurement(0))
        store.record_search(KEY, "s", SearchRecord((knobs(0),), "budget", (1.0,)))
        assert store.search(KEY, "s") is not None
    [moved] = set_aside(tmp_path, "corrupt")
    table = change.split()[2]
    assert f"does not hold schema {SCHEMA_VERSION}'s tables" in caplog.text
    assert table in caplog.text and str(moved) in caplog.text
    with pytest.raises(ProfileStoreError, match=f"{re.escape(str(moved))} does not hold"):
        ProfileStore(moved, read_only=True)


def test_another_programs_database_is_set_aside(tmp_path, caplog):
    path = tmp_path / FILENAME
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE notes (text TEXT)")
    conn.close()
    with caplog.at_level(logging.WARNING, logger="kareus"), ProfileStore(path) as store:
        store.record(KEY, knobs(0), measurement(0))
    assert len(set_aside(tmp_path, "schema-0")) == 1
    assert "not a kareus profile store" in caplog.text


def test_empty_file_is_a_fresh_store(tmp_path, caplog):
    (tmp_path / FILENAME).touch()
    with caplog.at_level(logging.WARNING, logger="kareus"), ProfileStore(cache_dir=tmp_path) as s:
        s.record(KEY, knobs(0), measurement(0))
    assert caplog.records == [] and list(tmp_path.glob(f"{FILENAME}.*-*")) == []


# -- unusable directories -----------------------------------------------------------------


def test_directory_that_cannot_be_created(tmp_path):
    (tmp_path / "file").write_text("a file, not a directory")
    cache_dir = tmp_path / "file" / "sub"
    with pytest.raises(ProfileStoreError, match=re.escape(str(cache_dir))) as info:
        ProfileStore(cache_dir=cache_dir)
    assert isinstance(info.value, KareusError) and isinstance(info.value, OSError)
    assert "KAREUS_CACHE_DIR" in str(info.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through file permissions")
def test_directory_that_cannot_be_written(tmp_path):
    cache_dir = tmp_path / "ro"
    cache_dir.mkdir(mode=0o500)
    try:
        with pytest.raises(ProfileStoreError, match=re.escape(f"{cache_dir} is not writable")):
            ProfileStore(cache_dir=cache_dir)
    finally:
        cache_dir.chmod(0o700)
