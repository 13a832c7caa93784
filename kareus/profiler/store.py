"""The profile store: every measurement of a partition variant, kept on disk across runs.

Measuring one variant on a real GPU takes seconds, so nothing measured is measured twice:
each evaluation is committed the moment it completes (a crash loses at most the one being
taken, and a restarted search finds the others and resumes), and a second compile of the
same partition on the same device reads its evaluations back instead of measuring.

Layout. One SQLite file, ``profiles.sqlite`` in the cache directory (``cache_dir``, else
``$KAREUS_CACHE_DIR``, else ``$XDG_CACHE_HOME/kareus``, else ``~/.cache/kareus``)::

    keys(digest TEXT PRIMARY KEY, key_json TEXT)        -- one row per ProfileKey
    evaluations(id INTEGER PRIMARY KEY, key, knobs, time_s, energy_j, static_power_w,
                clock_mhz, method, resources, details, model_version, measured_at,
                UNIQUE(key, knobs))                     -- id: insertion order
    searches(key, settings, knobs, stopped, hypervolumes, updated_at,
             PRIMARY KEY (key, settings))           -- a finished search, in order
    counters(gpu, driver, behaviour, probed_at,
             PRIMARY KEY (gpu, driver))             -- how a GPU model's energy counter
                                                    -- behaves under a driver, probed

A row's ``key`` is :meth:`ProfileKey.digest` (sha256 of the key's fields as canonical
JSON) and ``knobs`` is :meth:`Knobs.json`, so a lookup is one probe of the unique index
with exact, canonical values: no float or ordering ambiguity can make a hit a miss.
``PRAGMA application_id`` marks the file as kareus's and ``PRAGMA user_version`` holds
:data:`SCHEMA_VERSION`. A store of schema 2 (before ``counters``) gains the table in place
when opened to write, and is read as it is.

Several writers. Every process (every rank) opens its own :class:`ProfileStore`; a
connection is never shared across processes (a store used in a forked child refuses to
run), and within one it is used by one thread at a time (the compiling thread hands it to
the profiling thread and waits). The file is in WAL mode, so readers never block the
writer; each record is one short ``BEGIN IMMEDIATE`` transaction (the write lock is taken
up front, so the busy timeout applies instead of a deadlock error on upgrade) and ``INSERT
OR IGNORE`` against the unique index, so two ranks recording the same variant leave one
row, the first. ``synchronous=FULL`` makes each commit durable even against a power cut;
its fsync costs milliseconds against seconds per measurement. WAL needs shared memory
between the processes, so the cache directory must be on a local filesystem: where the
home directory is on NFS, point ``KAREUS_CACHE_DIR`` at a local disk.

The store is the one ``.sqlite`` file. Commits go to its ``-wal`` companion first;
closing a store (or its being collected, or the interpreter exiting with it open: a
``weakref.finalize`` the store owns) checkpoints them into the file with
``wal_checkpoint(TRUNCATE)``, whether or not other processes still have it open, so a
closed store can be copied or moved as that file alone. Only a process killed with the
store open, or a checkpoint kept from finishing (a lock holder or a long reader elsewhere),
leaves rows in the ``-wal``; the next store to close the file checkpoints them.

A locked file. A kareus transaction holds the write lock for milliseconds, so a statement
that waits :data:`LOCK_WAIT_S` for it has found the file held by something else (a
``BEGIN EXCLUSIVE`` in another program, a stopped process). The store then says so once
(the backend opens one store per graph), a warning on the ``kareus`` logger naming the
file and the process holding the lock (from ``/proc/locks``: SQLite does not say), and
carries on without waiting: what cannot be written is not kept, what cannot be read is
not found, so profiling measures instead of stalling at every partition. A file locked
while it is being checked at open is not used at all: the store finds nothing and keeps
nothing. Going on without the store rather than stopping keeps the ranks of a group in
step: only a search's leading rank reads and writes the store, its followers measure what
it tells them, so whatever the leader's store does, every rank measures the same variants
and plans from the same frontiers, where a leader that stopped would leave its followers
waiting out their timeout; and a store is a cache, no reason to fail a compile.

Damaged files. Opening checks the file (SQLite header, ``PRAGMA quick_check``, the
application id and schema version, and that the schema's tables are there with their
columns) under an exclusive ``flock`` on ``<file>.lock``, so that ranks opening at once
neither rebuild the store twice nor set aside each other's fresh one. A file that fails
is renamed next to itself (``<file>.corrupt-<time>`` or ``<file>.schema-<version>-<time>``,
its ``-wal``/``-shm`` companions alongside), a warning on the ``kareus`` logger names it,
why and where it went, and an empty store replaces it: a cache is rebuilt by measuring
again, and user data is never deleted. ``ProfileStore(path, read_only=True)`` (``kareus
show``) makes the same checks and refuses a file that fails them, creating, renaming and
writing nothing.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import sqlite3
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypeVar

from kareus.closing import Closing
from kareus.devices.base import Measurement
from kareus.errors import KareusError
from kareus.version import build

logger = logging.getLogger("kareus")

SCHEMA_VERSION = 3  # 2: searches replace frontiers; 3: counters
UPGRADES = {2: """
CREATE TABLE counters (
    gpu TEXT NOT NULL,
    driver TEXT NOT NULL,
    behaviour TEXT NOT NULL,
    probed_at REAL NOT NULL,
    PRIMARY KEY (gpu, driver)
);
"""}
"""What turns a store of each older schema into the next one, in place: nothing in it is lost."""
APPLICATION_ID = 0x4B415245  # "KARE": tells a kareus store from any other SQLite file.
FILENAME = "profiles.sqlite"
LOCK_WAIT_S = 5.0
"""How long a statement waits for another connection's lock before the store counts the
file as held by something else (module docstring): a kareus transaction holds it for
milliseconds, a few ranks queueing for it well under a second."""
WAL_WRITE_LOCK_BYTE = 120  # SQLite's WAL write lock: this byte of the -shm file.

T = TypeVar("T")

_SCHEMA = """
CREATE TABLE keys (
    digest TEXT PRIMARY KEY,
    key_json TEXT NOT NULL
);
CREATE TABLE evaluations (
    id INTEGER PRIMARY KEY,
    key TEXT NOT NULL REFERENCES keys(digest),
    knobs TEXT NOT NULL,
    time_s REAL NOT NULL,
    energy_j REAL NOT NULL,
    static_power_w REAL NOT NULL,
    clock_mhz INTEGER NOT NULL,
    method TEXT NOT NULL,
    resources TEXT NOT NULL,
    details TEXT NOT NULL,
    model_version TEXT,
    measured_at REAL NOT NULL,
    UNIQUE (key, knobs)
);
CREATE TABLE searches (
    key TEXT NOT NULL REFERENCES keys(digest),
    settings TEXT NOT NULL,
    knobs TEXT NOT NULL,
    stopped TEXT NOT NULL,
    hypervolumes TEXT NOT NULL,
    updated_at REAL NOT NULL,
    PRIMARY KEY (key, settings)
);
""" + UPGRADES[2]


class ProfileStoreError(KareusError, OSError):
    """The profile store cannot be created, opened or written; the message names the file."""


class ProfileStoreLockedError(ProfileStoreError):
    """The profile store's file is held by another connection past :data:`LOCK_WAIT_S`."""


class AmbiguousStoreLocationError(KareusError, ValueError):
    """A profile store was given both a file and a directory to live in."""


class MismatchedMeasurementError(KareusError, ValueError):
    """A measurement was recorded for knobs at another clock: every later lookup would be
    wrong."""


@dataclass(frozen=True)
class ProfileKey:
    """What makes two measurements interchangeable: the same partition, measured on the same
    device (and model version, for a simulated one), for the same search, by the same kareus.

    ``clocks`` is the clock set searched, kept descending without repeats whatever order it
    is given in, so the same set always gives the same key.
    """

    partition_key: str
    """The partition's structural hash (``PartitionReport.key``), or for a whole graph's
    variant ``graph <graph hash> k<count> <partition choices>`` (``profiler.graph_cost``:
    its knobs then hold only the clock and the count)."""
    device: str
    """The device's identity: NVML name and UUID, or the simulated GPU's spec name."""
    model_version: str | None
    """The simulated model's version (``Measurement.model_version``); None for hardware."""
    clocks: tuple[int, ...]
    group_size: int
    kareus_version: str = field(default_factory=build)
    """The kareus build that measured it (``version.build``: version and source digest)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "clocks", tuple(sorted({int(c) for c in self.clocks}))[::-1])

    def json(self) -> str:
        """The fields as canonical JSON (kept in the store, so ``keys()`` can rebuild it)."""
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    def digest(self) -> str:
        """sha256 of :meth:`json`: the row key, stable across processes and runs."""
        return hashlib.sha256(self.json().encode()).hexdigest()

    @classmethod
    def from_json(cls, text: str) -> ProfileKey:
        fields = json.loads(text)
        return cls(**{**fields, "clocks": tuple(fields["clocks"])})


@dataclass(frozen=True)
class Knobs:
    """One variant of a partition: the launch slot of its collective, the SMs each
    collective is capped to, the SM clock and the nanobatch count.

    ``resources`` is kept sorted by collective name, without entries of None (the library's
    default, the same as no entry), so equal settings give equal knobs; a mapping is
    accepted too.
    """

    slot: int
    resources: tuple[tuple[str, int], ...]
    clock_mhz: int
    nanobatches: int

    def __post_init__(self) -> None:
        pairs = self.resources.items() if isinstance(self.resources, Mapping) else self.resources
        canonical = tuple(sorted((str(n), int(s)) for n, s in pairs if s is not None))
        object.__setattr__(self, "resources", canonical)

    def json(self) -> str:
        """Canonical JSON: the column the unique index compares."""
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Knobs:
        return cls._from_fields(json.loads(text))

    @classmethod
    def _from_fields(cls, fields: dict) -> Knobs:
        return cls(**{**fields, "resources": tuple(map(tuple, fields["resources"]))})


@dataclass(frozen=True)
class Evaluation:
    """A variant and what measuring it gave, exactly as recorded (``measurement`` compares
    equal to the one passed to :meth:`ProfileStore.record`)."""

    knobs: Knobs
    measurement: Measurement
    measured_at: float
    """Unix time of the record."""


@dataclass(frozen=True)
class SearchRecord:
    """What a finished search evaluated, in order, and how it ended."""

    knobs: tuple[Knobs, ...]
    stopped: str
    hypervolumes: tuple[float, ...]


def default_cache_dir() -> Path:
    """``$KAREUS_CACHE_DIR``, else ``$XDG_CACHE_HOME/kareus``, else ``~/.cache/kareus``."""
    if os.environ.get("KAREUS_CACHE_DIR"):
        return Path(os.environ["KAREUS_CACHE_DIR"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "kareus"


class ProfileStore(Closing):
    """Evaluations per :class:`ProfileKey`, persisted in one SQLite file (module docstring).

    ``ProfileStore()`` opens the default file, ``ProfileStore(cache_dir=d)`` the one in
    ``d``, ``ProfileStore(path)`` a given file. Open one per process; close it (or use it
    as a context manager) when done: closing checkpoints the file whole. ``read_only``
    opens an existing store to read it and changes nothing on disk: a damaged, foreign,
    old-schema, empty or locked file is refused with a :class:`ProfileStoreError`.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        cache_dir: str | os.PathLike[str] | None = None,
        read_only: bool = False,
    ) -> None:
        if path is not None and cache_dir is not None:
            raise AmbiguousStoreLocationError("ProfileStore: pass path or cache_dir, not both")
        if path is None:
            path = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
            path = Path(path) / FILENAME
        self.path = Path(path)
        self.read_only = read_only
        self._pid = os.getpid()
        self._closed = False
        self._locked = False  # found locked: said once, not waited for again
        self._conn: sqlite3.Connection | None = None
        if read_only:
            self._conn = _open_read_only(self.path)
        else:
            _ensure_writable_dir(self.path)
            with _file_lock(self.path):
                try:
                    self._conn = _open_checked(self.path)
                except ProfileStoreLockedError as exc:
                    self._found_locked(exc)  # no connection: reads find nothing, writes skip
        # Closes (and checkpoints) at close(), at collection or at exit, whichever is first;
        # it holds the connection, not the store, so an unclosed store is still collected.
        self._finalizer = weakref.finalize(self, _close, self._conn, self._pid, not read_only)

    # -- writing -------------------------------------------------------------------------

    def record(
        self, key: ProfileKey, knobs: Knobs, measurement: Measurement, *, replace: bool = False
    ) -> bool:
        """Commit one evaluation now; True if it was added, False if (key, knobs) already
        had one (the first is kept, so a rerun or a second rank recording it is harmless,
        unless ``replace``: a re-measurement that supersedes it) or the file is locked
        (nothing is kept; the module docstring says why).

        ``measurement.clock_mhz`` must be ``knobs.clock_mhz``: a mismatch is a caller's bug
        that would otherwise poison every later lookup.
        """
        if measurement.clock_mhz != knobs.clock_mhz:
            raise MismatchedMeasurementError(
                f"profile store: measurement at {measurement.clock_mhz} MHz recorded for "
                f"knobs at {knobs.clock_mhz} MHz"
            )
        m = measurement
        row = (
            key.digest(),
            knobs.json(),
            m.time_s,
            m.energy_j,
            m.static_power_w,
            m.clock_mhz,
            m.method,
            json.dumps(m.resources),
            json.dumps(m.details, sort_keys=True),
            m.model_version,
            time.time(),
        )

        def insert(conn: sqlite3.Connection) -> bool:
            self._add_key(conn, key)
            cursor = conn.execute(
                f"INSERT OR {'REPLACE' if replace else 'IGNORE'} INTO evaluations (key, knobs, "
                "time_s, energy_j, "
                "static_power_w, clock_mhz, method, resources, details, model_version, "
                "measured_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                row,
            )
            return cursor.rowcount == 1

        return self._write(insert, False)

    def record_search(self, key: ProfileKey, settings: str, search: SearchRecord) -> None:
        """Keep a finished search of ``key`` under ``settings`` (the caller's canonical
        text of what determines it: space, budget, seed), replacing an earlier one; its
        numbers are the evaluations of its knobs."""
        row = (
            key.digest(), settings, json.dumps([asdict(k) for k in search.knobs]),
            search.stopped, json.dumps(list(search.hypervolumes)), time.time(),
        )

        def insert(conn: sqlite3.Connection) -> None:
            self._add_key(conn, key)
            conn.execute(
                "INSERT OR REPLACE INTO searches (key, settings, knobs, stopped, hypervolumes, "
                "updated_at) VALUES (?, ?, ?, ?, ?, ?)",
                row,
            )

        self._write(insert, None)

    # -- reading -------------------------------------------------------------------------

    def evaluations(self, key: ProfileKey) -> list[Evaluation]:
        """Every evaluation recorded for ``key``, in the order they were recorded."""
        rows = self._query(f"{_SELECT} WHERE key = ? ORDER BY id", (key.digest(),))
        return [_evaluation(row) for row in rows]

    def lookup(self, key: ProfileKey, knobs: Knobs) -> Evaluation | None:
        """The evaluation of exactly these knobs under ``key``, or None (one index probe)."""
        rows = self._query(f"{_SELECT} WHERE key = ? AND knobs = ?", (key.digest(), knobs.json()))
        return _evaluation(rows[0]) if rows else None

    def search(self, key: ProfileKey, settings: str) -> SearchRecord | None:
        """The finished search of ``key`` under ``settings``, or None if none was recorded."""
        rows = self._query(
            "SELECT knobs, stopped, hypervolumes FROM searches WHERE key = ? AND settings = ?",
            (key.digest(), settings),
        )
        if not rows:
            return None
        knobs, stopped, volumes = rows[0]
        return SearchRecord(
            tuple(Knobs._from_fields(k) for k in json.loads(knobs)), stopped,
            tuple(json.loads(volumes)),
        )

    def record_counter(self, gpu: str, driver: str, behaviour: str) -> None:
        """Keep how ``gpu``'s energy counter behaves under ``driver`` (the probe's JSON),
        replacing what was kept: a probe is asked only where nothing was."""
        self._write(lambda conn: conn.execute(
            "INSERT OR REPLACE INTO counters VALUES (?, ?, ?, ?)",
            (gpu, driver, behaviour, time.time())), None)

    def counter(self, gpu: str, driver: str) -> str | None:
        """What :meth:`record_counter` kept for ``gpu`` and ``driver``, or None."""
        if self._version < 3:
            return None
        rows = self._query("SELECT behaviour FROM counters WHERE gpu = ? AND driver = ?",
                           (gpu, driver))
        return rows[0][0] if rows else None

    @property
    def _version(self) -> int:
        rows = self._query("PRAGMA user_version", ())
        return rows[0][0] if rows else SCHEMA_VERSION

    def keys(self) -> list[ProfileKey]:
        """Every key with something recorded, in the order first seen."""
        rows = self._query("SELECT key_json FROM keys ORDER BY rowid", ())
        return [ProfileKey.from_json(text) for (text,) in rows]

    # -- lifetime ------------------------------------------------------------------------

    def close(self) -> None:
        self._closed = True
        self._conn = None
        self._finalizer()  # Runs once: a second close() does nothing.

    def __repr__(self) -> str:
        return f"ProfileStore({str(self.path)!r})"

    # -- internals -----------------------------------------------------------------------

    def _use(self, work: Callable[[sqlite3.Connection], T], locked: T) -> T:
        """``work`` on the connection; ``locked`` where the file is held by another
        connection (at once, once it has been found so: see the module docstring)."""
        if os.getpid() != self._pid:
            # A forked child sharing the parent's SQLite handle corrupts its locks.
            raise ProfileStoreError(
                f"profile store {self.path} was opened in process {self._pid} and used in "
                f"process {os.getpid()}; open a ProfileStore in each process"
            )
        if self._closed:
            raise ProfileStoreError(f"profile store {self.path} is closed")
        if self._conn is None:  # found locked at open
            return locked
        try:
            return work(self._conn)
        except sqlite3.OperationalError as exc:
            if not _is_busy(exc):
                raise ProfileStoreError(f"profile store {self.path}: {exc}") from exc
            error = _locked_error(self.path, exc)
            if self.read_only:
                raise error from exc
            self._found_locked(error)
            return locked
        except sqlite3.Error as exc:
            raise ProfileStoreError(f"profile store {self.path}: {exc}") from exc

    def _write(self, statements: Callable[[sqlite3.Connection], T], locked: T) -> T:
        """``statements`` in one ``BEGIN IMMEDIATE`` transaction, committed now."""

        def transaction(conn: sqlite3.Connection) -> T:
            conn.execute("BEGIN IMMEDIATE")
            try:
                result = statements(conn)
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:  # COMMIT itself may fail busy in a rollback journal
                    conn.execute("ROLLBACK")
                raise
            return result

        return self._use(transaction, locked)

    def _query(self, sql: str, params: tuple[object, ...]) -> list[tuple]:
        return self._use(lambda conn: conn.execute(sql, params).fetchall(), [])

    def _found_locked(self, error: ProfileStoreLockedError) -> None:
        """Say once that the file is locked, and stop waiting for it."""
        if self._locked:
            return
        self._locked = True
        logger.warning(
            "%s; profiling goes on without it: what is measured while it is locked is not "
            "kept, and will be measured again next time",
            error,
        )
        if self._conn is not None:
            self._conn.execute("PRAGMA busy_timeout = 0")

    @staticmethod
    def _add_key(conn: sqlite3.Connection, key: ProfileKey) -> None:
        conn.execute(
            "INSERT OR IGNORE INTO keys (digest, key_json) VALUES (?, ?)",
            (key.digest(), key.json()),
        )


_SELECT = (
    "SELECT knobs, time_s, energy_j, static_power_w, clock_mhz, method, resources, details, "
    "model_version, measured_at FROM evaluations"
)


def _evaluation(row: tuple) -> Evaluation:
    knobs, time_s, energy_j, static_w, clock, method, resources, details, version, at = row
    measurement = Measurement(
        time_s=time_s,
        energy_j=energy_j,
        static_power_w=static_w,
        clock_mhz=clock,
        method=method,
        resources=tuple((str(n), int(s)) for n, s in json.loads(resources)),
        details=json.loads(details),
        model_version=version,
    )
    return Evaluation(Knobs.from_json(knobs), measurement, at)


# -- opening ------------------------------------------------------------------------------


def _ensure_writable_dir(path: Path) -> None:
    """Create the store's directory; refuse, naming it, one this process cannot write."""
    directory = path.parent
    hint = "set KAREUS_CACHE_DIR (or pass cache_dir) to a writable directory"
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ProfileStoreError(
            f"cannot create the profile store directory {directory}: {exc}; {hint}"
        ) from exc
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ProfileStoreError(f"the profile store directory {directory} is not writable; {hint}")
    if path.exists() and not os.access(path, os.R_OK | os.W_OK):
        raise ProfileStoreError(f"the profile store {path} is not readable and writable; {hint}")


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive flock on ``<path>.lock`` while the store is checked and built."""
    lock_path = path.with_name(path.name + ".lock")
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as exc:
        raise ProfileStoreError(f"cannot create the profile store lock {lock_path}: {exc}") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # Closing releases the lock.


def _open_checked(path: Path) -> sqlite3.Connection:
    """A connection to a valid store at ``path``: the file as found, or a fresh one after
    setting aside a damaged or foreign file. Call under :func:`_file_lock`."""
    _upgrade(path)
    problem = _problem_at(path)
    if problem is not None:
        reason, suffix = problem
        moved = _set_aside(path, suffix)
        logger.warning(
            "profile store %s %s; moved it to %s and started an empty store (what it held "
            "will be measured again)",
            path,
            reason,
            moved,
        )
    conn = None
    try:
        conn = _connect(path)
        _create_schema(conn)
    except sqlite3.Error as exc:
        if conn is not None:
            conn.close()
        if isinstance(exc, sqlite3.OperationalError) and _is_busy(exc):
            raise _locked_error(path, exc) from exc
        raise ProfileStoreError(f"cannot open the profile store {path}: {exc}") from exc
    return conn


def _open_read_only(path: Path) -> sqlite3.Connection:
    """A read-only connection to the valid store at ``path`` that creates, renames and
    writes nothing; a :class:`ProfileStoreError` naming the file and what is wrong with it
    otherwise."""
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise ProfileStoreError(f"cannot read the profile store {path}: {exc}") from exc
    if size == 0:
        raise ProfileStoreError(f"profile store {path} is an empty file, not a store yet")
    # A store with both WAL companions is open elsewhere (or its writer was killed): its
    # latest rows may be in the -wal, which mode=ro reads. Without them everything is in
    # the file, and immutable=1 reads it as it is: mode=ro would create the companions and
    # leave them behind.
    live = all(path.with_name(path.name + c).exists() for c in ("-wal", "-shm"))
    uri = f"{path.resolve().as_uri()}?{'mode=ro' if live else 'immutable=1'}"
    try:
        conn = _connect(uri, uri=True)
    except sqlite3.Error as exc:
        raise ProfileStoreError(f"cannot read the profile store {path}: {exc}") from exc
    try:
        problem = _problem(conn, path, empty="is an empty SQLite database, not a store yet",
                           read_only=True)
    except BaseException:
        conn.close()
        raise
    if problem is not None:
        conn.close()
        raise ProfileStoreError(f"profile store {path} {problem[0]}")
    return conn


def _connect(database: str | Path, *, uri: bool = False) -> sqlite3.Connection:
    # isolation_level=None: no implicit transactions; _write issues BEGIN IMMEDIATE itself.
    # check_same_thread=False: a store is used by one thread at a time, but not always the
    # one that opened it (the profiling thread; the finalizer at exit).
    conn = sqlite3.connect(
        database, timeout=LOCK_WAIT_S, isolation_level=None, check_same_thread=False, uri=uri
    )
    conn.execute(f"PRAGMA busy_timeout = {int(LOCK_WAIT_S * 1000)}")
    return conn


def _close(conn: sqlite3.Connection | None, pid: int, checkpoint: bool) -> None:
    """Checkpoint the WAL into the file (``checkpoint``: a writable store) and close.

    TRUNCATE copies every committed frame into the file even while other processes keep
    it open (closing the last connection would too, but the ranks close at about the same
    time and each then finds the others still there). A checkpoint that cannot finish (a
    reader or a lock holder elsewhere) leaves the frames to the next close."""
    # In a forked child the handle is the parent's: closing it could checkpoint and delete
    # the WAL under the parent, so the child leaves it.
    if conn is None or os.getpid() != pid:
        return
    try:
        if checkpoint:
            busy, frames, copied = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            if busy:
                logger.debug("profile store: checkpoint incomplete (%d of %d frames)",
                             copied, frames)
    except sqlite3.Error as exc:
        logger.debug("profile store: no checkpoint at close: %s", exc)
    finally:
        conn.close()


def _is_busy(exc: sqlite3.OperationalError) -> bool:
    """Whether ``exc`` is SQLite's "locked by another connection" (SQLITE_BUSY/LOCKED)."""
    code = getattr(exc, "sqlite_errorcode", None)  # Python 3.11+
    if code is not None:
        return code & 0xFF in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)
    return "locked" in str(exc)


def _locked_error(path: Path, exc: sqlite3.Error) -> ProfileStoreLockedError:
    return ProfileStoreLockedError(
        f"profile store {path} is locked by {_holder(path)} ({exc} after {LOCK_WAIT_S:g} s)"
    )


def _holder(path: Path) -> str:
    """Who holds the write lock on the store at ``path``, as far as Linux's ``/proc/locks``
    tells: SQLite does not say, and asking the kernel (``F_GETLK``) would take a descriptor
    of the file outside SQLite, whose closing drops this process's own locks on it."""
    inodes = {}
    for name, byte in ((path.name, None), (path.name + "-shm", WAL_WRITE_LOCK_BYTE)):
        try:
            st = os.stat(path.with_name(name))
        except OSError:
            continue
        inodes[f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"] = byte
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        lines = []
    pids = set()
    for line in lines:
        # "1: POSIX  ADVISORY  WRITE 4242 fe:00:2147849 120 120"; "->" marks a waiter.
        fields = line.split()
        if len(fields) != 8 or fields[1] != "POSIX" or fields[3] != "WRITE":
            continue
        if fields[5] not in inodes or not fields[4].isdigit():
            continue
        byte, start, end = inodes[fields[5]], int(fields[6]), fields[7]
        if byte is None or start <= byte and (end == "EOF" or byte <= int(end)):
            pids.add(int(fields[4]))
    if not pids:
        return "another connection (which one, SQLite does not say)"
    return ", ".join(_process(pid) for pid in sorted(pids))


def _process(pid: int) -> str:
    try:
        name = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        name = ""
    own = "; this process" if pid == os.getpid() else ""
    return f"process {pid}" + (f" ({name}{own})" if name or own else "")


def _problem_at(path: Path) -> tuple[str, str] | None:
    """:func:`_problem` of the file at ``path``; None for a missing or empty file."""
    # Only SQLite opens the file: closing any other descriptor of it drops every POSIX lock
    # this process holds on it, those of its live connections too (SQLite's "how to
    # corrupt" list); a profiling thread opening the store while the compiling thread has it
    # open did that, and the ranks' WAL reads then failed with "disk I/O error".
    try:
        if path.stat().st_size == 0:
            return None
    except FileNotFoundError:
        return None
    conn = _connect(path)
    try:
        return _problem(conn, path)
    finally:
        conn.close()


def _upgrade(path: Path) -> None:
    """Bring a kareus store of an older schema in :data:`UPGRADES` to the current one in
    place (under :func:`_file_lock`); anything else is left for :func:`_problem` to judge."""
    if not path.exists():
        return
    try:
        conn = _connect(path)
    except sqlite3.Error:
        return
    try:
        if conn.execute("PRAGMA application_id").fetchone()[0] != APPLICATION_ID:
            return
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version not in UPGRADES:
            return
        _run_script(conn, UPGRADES[version], f"PRAGMA user_version = {version + 1}")
        logger.info("profile store %s: upgraded from schema %d to %d", path, version,
                    version + 1)
    except sqlite3.Error:
        return  # a damaged file: _problem says what is wrong with it
    finally:
        conn.close()


def _problem(
    conn: sqlite3.Connection, path: Path, *, empty: str | None = None,
    read_only: bool = False,
) -> tuple[str, str] | None:
    """Why the database on ``conn`` cannot be used as a store, and the suffix to set it
    aside under; None for a valid store, and for an empty database unless ``empty`` says
    why it cannot be used either. Reads only."""
    try:
        check = [row[0] for row in conn.execute("PRAGMA quick_check").fetchall()]
        if check != ["ok"]:
            return f"is corrupt ({'; '.join(check[:3])})", "corrupt"
        app_id = conn.execute("PRAGMA application_id").fetchone()[0]
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        tables = _tables(conn)
    except sqlite3.OperationalError as exc:
        # I/O errors and locks are not damage: setting the file aside would take a live
        # store from under the processes using it.
        if _is_busy(exc):
            raise _locked_error(path, exc) from exc
        code = getattr(exc, "sqlite_errorname", "")
        raise ProfileStoreError(
            f"cannot check the profile store {path}: {exc} {code}".rstrip()
        ) from exc
    except sqlite3.DatabaseError as exc:
        return f"is corrupt ({exc})", "corrupt"
    if app_id == 0 and version == 0 and not tables:
        # An empty database: a store whose creation was interrupted, or is under way.
        return None if empty is None else (empty, "empty")
    if app_id != APPLICATION_ID:
        return "is a SQLite database but not a kareus profile store", f"schema-{version}"
    if version != SCHEMA_VERSION and not (read_only and version in UPGRADES):
        return (
            f"has schema version {version}, this kareus uses {SCHEMA_VERSION}",
            f"schema-{version}",
        )
    # Marked as a current store, yet a table dropped or altered by hand would fail every
    # write (or every read) that touches it: the store would be half used.
    expected = _schema_tables(version)
    missing = [name for name in expected if name not in tables]
    changed = [name for name in expected if name in tables and tables[name] != expected[name]]
    if missing or changed:
        lacks = "; ".join(
            [f"no table {', '.join(missing)}"] * bool(missing)
            + [f"other columns in {', '.join(changed)}"] * bool(changed)
        )
        return f"does not hold schema {SCHEMA_VERSION}'s tables ({lacks})", "corrupt"
    return None


def _tables(conn: sqlite3.Connection) -> dict[str, tuple[str, ...]]:
    """Each table of ``conn``'s database and its columns, in order."""
    names = [n for (n,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
    # The name as a parameter, not in the SQL text: a foreign file's names can be anything.
    return {
        n: tuple(row[0] for row in conn.execute("SELECT name FROM pragma_table_info(?)", (n,)))
        for n in names
    }


def _schema_tables(version: int = SCHEMA_VERSION) -> dict[str, tuple[str, ...]]:
    """The tables :data:`_SCHEMA` makes (less those added after ``version``), and their
    columns: what a store's must be."""
    conn = sqlite3.connect(":memory:")
    try:
        conn.executescript(_SCHEMA)
        if version == 2:
            conn.execute("DROP TABLE counters")
        return _tables(conn)
    finally:
        conn.close()


def _set_aside(path: Path, suffix: str) -> Path:
    """Rename ``path`` (and its WAL companions, which must not replay onto the new store)
    to ``<path>.<suffix>-<time>``, never over an existing file."""
    stamp = time.strftime("%Y%m%dT%H%M%S")
    target = path.with_name(f"{path.name}.{suffix}-{stamp}")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.{suffix}-{stamp}-{n}")
    try:
        path.rename(target)
        for companion in ("-wal", "-shm"):
            old = path.with_name(path.name + companion)
            if old.exists():
                old.rename(target.with_name(target.name + companion))
    except OSError as exc:
        raise ProfileStoreError(f"cannot set aside the profile store {path}: {exc}") from exc
    return target


def _create_schema(conn: sqlite3.Connection) -> None:
    """Make ``conn``'s database a current store, if it is not one yet (idempotent)."""
    conn.execute("PRAGMA journal_mode = WAL")  # Persistent in the file; a no-op once set.
    conn.execute("PRAGMA synchronous = FULL")  # Per connection.
    if conn.execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID:
        return
    _run_script(conn, _SCHEMA, f"PRAGMA application_id = {APPLICATION_ID}",
                f"PRAGMA user_version = {SCHEMA_VERSION}")


def _run_script(conn: sqlite3.Connection, script: str, *then: str) -> None:
    """``script``'s statements, then ``then``'s, in one transaction; statement by statement:
    executescript would COMMIT the transaction first."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        for statement in [*filter(str.strip, script.split(";")), *then]:
            conn.execute(statement)
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
