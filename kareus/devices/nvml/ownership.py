"""Which process owns a GPU's clocks: one lock file per GPU, shared by every job on the machine.

A locked SM clock belongs to the GPU, not to the process that locked it (REFERENCE.md s4):
it outlives a process killed by SIGKILL, ended by ``os._exit`` or crashed in native code,
and a second job on the same GPU silently overrides the first's clocks. So a controller
that may lock clocks first takes ownership of the GPU's clocks here:

1. open ``<dir>/<GPU UUID>.lock`` (created mode 0o666 in a directory created mode 0o1777,
   like /tmp, so jobs of every user meet in it) and take an exclusive, non-blocking
   ``flock`` on it. The kernel drops a flock when the last descriptor of its open file is
   closed, so a flock held means its holder is alive, however a process ends;
2. write the owner's record into the file as JSON: pid, the pid's start time
   (``/proc/<pid>/stat`` field 22, clock ticks after boot: a reused pid has another), the
   boot id, host, uid, user, command, since when, and the clock it has locked (written
   before each lock and after each reset, so a dead owner's record tells what it left);
3. release: empty the file, then drop the flock. An empty file means "released cleanly".

What the next process finds, and what it makes of it (``HeldClockLocks.acquire``):

- the flock held by another process: owned, refused (``ClockOwnedError`` names the
  owner from its record); held in this process (the process's ``HeldClockLocks`` has it,
  or the record is this process's): another controller here owns it, refused;
- the flock free and the file empty (or absent): free;
- the flock free and a record: stale, since an owner holds its flock as long as it owns.
  Its owner died (the pid no longer runs, is a zombie, or was reused: its start time
  differs) or gave up ownership without resetting (a failed reset at close, in this
  process or another). ``Ownership.stale`` carries it; the controller resets the clocks
  the record says may be locked. A record from an earlier boot needs nothing: a reboot
  reloads the driver, which unlocks clocks.

The pid and start time only say which of these it was, and tell a dry run (which locks
nothing, so reads records without a flock) whether a recorded owner is still running.

The directory is ``lock_dir=`` if given, else ``$KAREUS_CLOCK_LOCK_DIR``, else
``/tmp/kareus-clocks``. Jobs must share it to see each other: containers on one GPU need
the same host directory mounted and ``KAREUS_CLOCK_LOCK_DIR`` pointing at it.

A process forked from an owner shares the owner's open file, hence its flock: in the child,
every ownership is forgotten and its descriptor closed without unlocking (``flock(LOCK_UN)``
there would unlock the parent), so the parent stays the owner and the child owns nothing.
Closing matters beyond the child: a flock lasts while any descriptor of its open file does,
so a long-lived child (a data loader worker) would otherwise keep the GPU owned after the
parent released it.

Which ownerships a process holds is state of the process, kept by ``HeldClockLocks``
with the guard that resets its controllers' clocks at exit and on fatal signals
(``devices.nvml.exit_guard``): the runtime has one (``ProcessRuntime.clock_locks``) and
hands it to every device it opens.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import shlex
import socket
import stat
import sys
import threading
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

from kareus.devices.errors import ClockLockDirError, ClockOwnedError
from kareus.devices.nvml.exit_guard import ExitGuard

logger = logging.getLogger("kareus")

LOCK_DIR_ENV = "KAREUS_CLOCK_LOCK_DIR"
DEFAULT_LOCK_DIR = Path("/tmp/kareus-clocks")
"""Clocks are machine-wide, so the default directory is one for every user, like /tmp."""

_COMMAND_CHARS = 300


@dataclass(frozen=True)
class OwnerRecord:
    """What an owner writes into its lock file (JSON), for diagnostics and stale checks."""

    pid: int
    start_ticks: int | None
    """``/proc/<pid>/stat`` field 22 (clock ticks after boot); None where there is no /proc."""
    boot_id: str | None
    host: str
    uid: int
    user: str
    command: str
    since: str
    """When ownership was taken, ISO 8601 UTC."""
    gpu: str
    locked_mhz: int | None = None
    """The SM clock the owner has locked, None while it has not (or has reset it)."""

    def describe(self) -> str:
        """``pid 123 (user alice, `python train.py`, owner since ..., clocks ...)``."""
        host = "" if self.host == socket.gethostname() else f" on host {self.host}"
        clocks = (
            f"SM clock locked at {self.locked_mhz} MHz"
            if self.locked_mhz is not None
            else "SM clock not locked"
        )
        return (
            f"pid {self.pid}{host} (user {self.user}, `{self.command}`, owner since "
            f"{self.since}, {clocks})"
        )


@dataclass(frozen=True)
class StaleOwner:
    """A previous owner that is gone without releasing: what it left, and why it is stale."""

    record: OwnerRecord | None
    """None: the file held something that is not a record (the clocks may be locked)."""
    reason: str
    """``"dead"``, ``"pid reused"``, ``"gave up"`` (still running), ``"this process"``,
    ``"earlier boot"``, ``"other host"`` or ``"unreadable"``."""

    @property
    def may_be_locked(self) -> bool:
        """Whether the GPU may still be locked at what the previous owner left."""
        if self.reason == "earlier boot":
            return False  # a reboot reloads the driver, which unlocks clocks
        return self.record is None or self.record.locked_mhz is not None

    def describe(self) -> str:
        """Who left the GPU, and why they are no longer its owner."""
        if self.record is None:
            return "an unknown owner (its record is unreadable)"
        ended = "it ended without releasing the GPU: SIGKILL, os._exit or a crash"
        why = {
            "dead": f"which is no longer running ({ended})",
            "pid reused": f"which is no longer running ({ended}; its pid now belongs to "
            "another process)",
            "gave up": "which is still running but gave up ownership without resetting the clock",
            "this process": "in this process, whose earlier clock controller gave up ownership "
            "without resetting the clock",
            "earlier boot": "before the last reboot",
            "other host": "recorded on another host, and its flock is free",
        }[self.reason]
        return f"{self.record.describe()}, {why}"


class Ownership:
    """This process's ownership of one GPU's clocks: an open, flocked lock file."""

    def __init__(
        self,
        fd: int,
        path: Path,
        record: OwnerRecord,
        stale: StaleOwner | None,
        held: HeldClockLocks,
    ) -> None:
        self._fd: int | None = fd
        self._held = held
        self.path = path
        self.record = record
        self.stale = stale
        """What the previous owner left, for the caller to clear before ``write``."""
        self._lock = threading.RLock()  # a signal handler may write while this thread writes

    @property
    def held(self) -> bool:
        return self._fd is not None

    def write(self, locked_mhz: int | None) -> None:
        """Record the clock this owner has locked (None: not locked) in the lock file.

        A failure to write is logged, not raised: it only costs the next job's diagnosis.
        """
        with self._lock:
            self.record = replace(self.record, locked_mhz=locked_mhz)
            if self._fd is None:
                return
            data = json.dumps(asdict(self.record), indent=1).encode()
            try:  # write over, then cut: the file is never empty ("released") meanwhile
                os.pwrite(self._fd, data, 0)
                os.ftruncate(self._fd, len(data))
            except OSError as exc:
                logger.warning("could not update the clock owner record %s: %s", self.path, exc)

    def release(self, *, clean: bool) -> None:
        """Give up ownership; ``clean``: the clocks are not locked, so empty the record.

        Otherwise the record stays, and the next owner finds it stale and resets the clock.
        Idempotent.
        """
        with self._lock:
            fd, self._fd = self._fd, None
            if fd is None:
                return
            try:
                if clean:
                    os.ftruncate(fd, 0)
            except OSError as exc:
                logger.warning("could not empty the clock owner record %s: %s", self.path, exc)
            finally:
                self._held.forget(self.path)
                os.close(fd)  # drops the flock

    def _forget_after_fork(self) -> None:
        """In a forked child: close the inherited descriptor, keeping the parent's flock."""
        self._lock = threading.RLock()  # another thread may have held it at the fork
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


# -- where lock files live -------------------------------------------------------------


def lock_dir(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The directory of lock files: ``explicit``, else ``$KAREUS_CLOCK_LOCK_DIR``, else
    ``/tmp/kareus-clocks``."""
    if explicit is not None:
        return Path(explicit)
    return Path(os.environ.get(LOCK_DIR_ENV) or DEFAULT_LOCK_DIR)


def lock_path(directory: Path, uuid: str | None, index: int) -> Path:
    """``<uuid>.lock``; without a UUID, ``<host>-gpu<index>.lock`` (an index is per host)."""
    name = uuid or f"{socket.gethostname()}-gpu{index}"
    return directory / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}.lock"


# -- taking ownership ------------------------------------------------------------------


class HeldClockLocks:
    """The GPU clock ownerships one process holds, by lock file path, and the guard that
    resets the clocks of its controllers when the process ends.

    A second controller of a GPU in the process that owns it is refused by name here,
    without touching the file (which a /tmp cleaner may have removed meanwhile). The
    runtime keeps the process's one (``ProcessRuntime.clock_locks``); devices are handed
    it, never look it up. In a forked child every instance forgets what it held and
    which controllers it guarded.
    """

    def __init__(self) -> None:
        self._held: dict[Path, Ownership] = {}
        self._lock = threading.RLock()
        self.exit_guard = ExitGuard()
        """Resets the clocks of the controllers registered in it at exit and on SIGTERM,
        SIGINT, SIGHUP and SIGQUIT (``NvmlClockController(reset_at_exit=True)`` registers)."""
        # A weak reference: the fork hook lives as long as the process, this object need not.
        os.register_at_fork(after_in_child=_after_fork_hook(weakref.ref(self)))

    def acquire(self, path: Path, *, gpu: str) -> Ownership:
        """Own the clocks of ``gpu`` through the lock file ``path``, or raise
        ``ClockOwnedError``.

        The file is left as found (a stale record included) until the caller ``write``s.
        """
        path = Path(os.path.abspath(path))
        with self._lock:
            if path in self._held:
                owner = self._held[path].record.describe()
                raise ClockOwnedError(gpu, owner, str(path), same_process=True)
        _prepare_dir(path.parent)
        fd = _flocked(path, gpu)
        try:
            previous = _read(fd)
            stale = None if previous is None else _stale(previous)
            ownership = Ownership(fd, path, _own_record(gpu), stale, self)
        except BaseException:
            os.close(fd)
            raise
        with self._lock:
            self._held[path] = ownership
        return ownership

    def forget(self, path: Path) -> None:
        """``path`` is no longer owned (its ownership was released)."""
        with self._lock:
            self._held.pop(path, None)

    def _after_fork_in_child(self) -> None:
        """A forked child owns nothing: drop every inherited ownership, keeping the flocks,
        and every guarded controller, whose clocks are the parent's to reset."""
        self._lock = threading.RLock()  # another thread may have held it at the fork
        for ownership in list(self._held.values()):
            ownership._forget_after_fork()
        self._held.clear()
        self.exit_guard.after_fork_in_child()


def _after_fork_hook(held: weakref.ref[HeldClockLocks]) -> Callable[[], None]:
    def after_fork_in_child() -> None:
        alive = held()
        if alive is not None:
            alive._after_fork_in_child()

    return after_fork_in_child


def read_owner(path: Path) -> tuple[OwnerRecord, bool] | None:
    """The record in ``path`` and whether its process is alive, without locking anything
    (what a dry run checks); None where there is no record or it is unreadable."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        record = _read(fd)
    finally:
        os.close(fd)
    if not isinstance(record, OwnerRecord):
        return None
    return record, _liveness(record) == "alive"


def _prepare_dir(directory: Path) -> None:
    shared = directory == DEFAULT_LOCK_DIR
    try:
        if shared:
            os.mkdir(directory)
            os.chmod(directory, 0o1777)  # mkdir's mode is masked by the umask
        else:
            os.makedirs(directory)
    except FileExistsError:
        pass
    except OSError as exc:
        raise ClockLockDirError(str(directory), exc.strerror or str(exc)) from exc
    mode = (os.lstat if shared else os.stat)(directory).st_mode
    if stat.S_ISLNK(mode):
        reason = "it is a symbolic link, which kareus does not follow"
        raise ClockLockDirError(str(directory), reason)
    if not stat.S_ISDIR(mode):
        raise ClockLockDirError(str(directory), "it exists and is not a directory")


def _flocked(path: Path, gpu: str) -> int:
    """A descriptor of ``path`` holding its exclusive flock; raises if another holds it."""
    for _attempt in range(10):
        fd = _open(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = _read(fd)
            os.close(fd)
            raise _owned_error(gpu, owner, path) from None
        except OSError as exc:
            os.close(fd)
            reason = f"cannot flock {path.name}: {exc.strerror or exc}"
            raise ClockLockDirError(str(path.parent), reason) from exc
        if _same_file(fd, path):
            return fd
        os.close(fd)  # the file was removed or replaced meanwhile: lock the current one
    raise ClockLockDirError(str(path.parent), f"{path.name} keeps being replaced")


def _owned_error(gpu: str, owner: OwnerRecord | str | None, path: Path) -> ClockOwnedError:
    """Refusal of a flock another holds. It may be a controller of this process that keeps
    its ownership in another ``HeldClockLocks`` (one built without the runtime's): say so,
    rather than advise killing this very process."""
    if not isinstance(owner, OwnerRecord):
        return ClockOwnedError(gpu, None, str(path))
    if _liveness(owner) == "this process":
        return ClockOwnedError(gpu, owner.describe(), str(path), same_process=True)
    return ClockOwnedError(gpu, owner.describe(), str(path), pid=owner.pid)


def _open(path: Path) -> int:
    """Open ``path`` read-write, creating it (mode 0o666, so every user can lock it) if absent.

    Opening without O_CREAT first: where fs.protected_regular is set, O_CREAT on another
    user's file in a sticky directory fails even when its mode allows writing.
    """
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    for _attempt in range(10):
        try:
            try:
                return os.open(path, flags)
            except FileNotFoundError:
                pass
            try:
                fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o666)
            except FileExistsError:
                continue
            os.fchmod(fd, 0o666)  # the mode given to open is masked by the umask
            return fd
        except OSError as exc:
            reason = exc.strerror or str(exc)
            if exc.errno == errno.ELOOP:
                reason = f"{path.name} is a symbolic link, which kareus does not follow"
            raise ClockLockDirError(str(path.parent), f"cannot open {path.name}: {reason}") from exc
    raise ClockLockDirError(str(path.parent), f"{path.name} keeps being replaced")


def _same_file(fd: int, path: Path) -> bool:
    try:
        current = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (current.st_dev, current.st_ino)


def _read(fd: int) -> OwnerRecord | str | None:
    """The record in the file; None if empty (released); the raw text if unreadable."""
    try:
        data = os.pread(fd, 1 << 16, 0)
    except OSError:
        return "<unreadable>"
    if not data.strip():
        return None
    try:
        fields = json.loads(data)
        return OwnerRecord(
            pid=int(fields["pid"]),
            start_ticks=_optional_int(fields.get("start_ticks")),
            boot_id=fields.get("boot_id"),
            host=str(fields.get("host", "?")),
            uid=int(fields.get("uid", -1)),
            user=str(fields.get("user", "?")),
            command=str(fields.get("command", "?")),
            since=str(fields.get("since", "?")),
            gpu=str(fields.get("gpu", "?")),
            locked_mhz=_optional_int(fields.get("locked_mhz")),
        )
    except (ValueError, TypeError, KeyError, AttributeError):
        return data.decode(errors="replace")


def _optional_int(value: object) -> int | None:
    return None if value is None else int(value)  # type: ignore[call-overload]


def _stale(previous: OwnerRecord | str) -> StaleOwner:
    """Why a record whose flock is free is stale."""
    if not isinstance(previous, OwnerRecord):
        return StaleOwner(None, "unreadable")
    reason = _liveness(previous)
    return StaleOwner(previous, "gave up" if reason == "alive" else reason)


def _liveness(record: OwnerRecord) -> str:
    """``"alive"`` or the reason the recorded process is not the one that wrote it."""
    if record.host != socket.gethostname():
        return "other host"
    boot = _boot_id()
    if record.boot_id and boot and record.boot_id != boot:
        return "earlier boot"
    if record.pid == os.getpid() and record.start_ticks == _start_ticks(os.getpid()):
        return "this process"
    running, start = _process(record.pid)
    if not running:
        return "dead"
    if None not in (start, record.start_ticks) and start != record.start_ticks:
        return "pid reused"
    return "alive"


def _process(pid: int) -> tuple[bool, int | None]:
    """Whether ``pid`` runs (a zombie does not) and its start time, where /proc says it."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False, None
    except OSError:
        return _signalable(pid), None
    fields = text[text.rindex(")") + 2 :].split()  # the command name may hold spaces
    return fields[0] not in ("Z", "X"), int(fields[19])  # fields 3 (state) and 22


def _signalable(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by another user
    return True


def _start_ticks(pid: int) -> int | None:
    return _process(pid)[1]


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _own_record(gpu: str) -> OwnerRecord:
    uid = os.getuid()
    try:
        import pwd

        user = pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        user = str(uid)
    command = shlex.join(getattr(sys, "orig_argv", sys.argv))
    if len(command) > _COMMAND_CHARS:
        command = command[: _COMMAND_CHARS - 3] + "..."
    return OwnerRecord(
        pid=os.getpid(),
        start_ticks=_start_ticks(os.getpid()),
        boot_id=_boot_id(),
        host=socket.gethostname(),
        uid=uid,
        user=user,
        command=command,
        since=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        gpu=gpu,
    )

