"""The NVML clock controller: locks SM clocks in stream order without stalling training.

``set_clock`` runs on the training thread (inside a compiled graph, through the
``kareus::set_clock`` op). An NVML call takes 10-20 ms and a host synchronize would drain
the GPU queue, so neither may happen there. Instead ``set_clock`` records a CUDA event on
the current stream and hands (event, clock) to a controller thread, which waits for the
event and only then calls NVML: the switch lands where the graph starts in the stream.

A lock outlives the process (REFERENCE.md s4), so every controller is reset at interpreter
exit, on SIGTERM, SIGINT, SIGHUP and SIGQUIT (then the signal does what it did before; the
exit guard of its ``HeldClockLocks``, ``devices.nvml.exit_guard``) and when used as a
context manager. A reset that fails is logged at CRITICAL level and raised.
SIGKILL, ``os._exit`` and crashes in native code run no handler: for them, a controller that
may lock clocks owns the GPU's clocks from construction to ``close`` (or exit) through a
per-GPU lock file (``devices.nvml.ownership``). At construction it refuses a GPU another
live process owns (``ClockOwnedError``) and resets clocks a dead owner may have left locked
(a WARNING names it; ``StaleClockLockError`` says what to run if the reset fails). The dry
run takes no ownership; it warns if the GPU is owned or may be left locked.

NVML has no reliable getter of locked clocks (the current SM clock moves with load, power
and temperature), so the controller does not assume the GPU is at its default clocks: until
it has set or reset them itself, its first request is always sent to NVML, and ``reset``
leaves a GPU it has not touched alone. A forked child does not own its parent's controller:
setting clocks through it raises ``ForkedClockControllerError``; reset and close do nothing.

``probe_permission`` finds out whether the process may lock clocks at all, by resetting
them once (the default clocks are where kareus leaves a GPU anyway). Without permission
(common on shared clusters) requests for the default clocks then make no NVML call, and a
request for any other clock raises ``ClockPermissionError``.

Where NVML denies permission and zeusd, Zeus's privileged daemon, is at hand (its socket
passed as ``zeusd_socket``, else in ``ZEUSD_SOCK_PATH``; ``devices.nvml.zeusd``), clocks are
locked and reset through zeusd instead, from the same threads as NVML calls (so the
controller's reset at exit and on signals goes through it too): the probe's reset, or the
first lock NVML refuses, tries zeusd, and once zeusd has answered every later switch goes
to it. An INFO line says once which way clocks are set. A controller whose probe found
neither NVML nor zeusd willing gives up the GPU's ownership as before and never turns to
zeusd later (it would change clocks it does not own); a WARNING says why zeusd failed.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol

from kareus.devices.base import ClockSwitch
from kareus.devices.errors import (
    ClockControlError,
    ClockControlUnsupportedError,
    ClockPermissionError,
    ClockResetError,
    ClosedClockControllerError,
    ForkedClockControllerError,
    MigClockControlError,
    StaleClockLockError,
    UnsupportedClockError,
    ZeusdError,
    nvml_error_code,
)
from kareus.devices.nvml import ownership
from kareus.devices.nvml.driver import nvml_text
from kareus.devices.nvml.exit_guard import ExitGuard
from kareus.devices.nvml.zeusd import DEFAULT_TIMEOUT_S, ZeusdClient, zeusd_socket_path
from kareus.passes.ops import DEFAULT_CLOCK_MHZ

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11

logger = logging.getLogger("kareus")


class StreamEvent(Protocol):
    """What the controller thread waits on: a recorded ``torch.cuda.Event`` or a stand-in."""

    def synchronize(self) -> None: ...


EventFactory = Callable[[], StreamEvent | None]


def record_cuda_event() -> StreamEvent:
    """An event recorded now on the current CUDA stream: it completes when the GPU gets there."""
    import torch

    event = torch.cuda.Event()
    event.record()
    return event


def no_event() -> None:
    """Without CUDA there is no stream to order against: switch as soon as the thread runs."""


def default_event_factory() -> EventFactory:
    import torch

    return record_cuda_event if torch.cuda.is_available() else no_event


@dataclass(frozen=True)
class _Request:
    graph: str
    mhz: int
    event: StreamEvent | None
    generation: int


_STOP = object()


class NvmlClockController:
    """Locks the SM clock of one GPU (min = max = the request); the memory clock is untouched.

    Unless ``dry_run``, the controller owns the GPU's clocks from construction to ``close``
    (lock files in ``lock_dir``, else ``$KAREUS_CLOCK_LOCK_DIR``, else /tmp/kareus-clocks;
    see ``devices.nvml.ownership``): it raises ``ClockOwnedError`` if another live
    controller owns them, and resets clocks a dead owner may have left locked (or raises
    ``StaleClockLockError`` saying to run ``sudo nvidia-smi -i <index> -rgc``). ``held`` is
    where the process keeps its ownerships (the runtime's ``clock_locks``); without one the
    controller keeps its ownership alone, and a second controller of the GPU in this
    process is refused by the lock file's flock instead. With ``reset_at_exit`` the
    controller is reset at exit and on fatal signals by ``held``'s exit guard (by a guard
    of its own without ``held``) until ``close``.
    ``dry_run`` runs the same path (validation, events, thread) but only records switches;
    it takes no ownership. Where NVML denies this process clock changes, they go through
    zeusd at ``zeusd_socket`` (None: ``$ZEUSD_SOCK_PATH``, if set), each request given
    ``zeusd_timeout_s`` to answer.
    """

    def __init__(
        self,
        nvml: ModuleType | Any,
        handle: object,
        *,
        gpu: str,
        index: int,
        supported_clocks: Sequence[int],
        dry_run: bool = False,
        event_factory: EventFactory | None = None,
        reset_at_exit: bool = True,
        lock_dir: str | os.PathLike[str] | None = None,
        held: ownership.HeldClockLocks | None = None,
        zeusd_socket: str | os.PathLike[str] | None = None,
        zeusd_timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self._nvml = nvml
        self._handle = handle
        self.gpu = gpu
        self.index = index
        self.dry_run = dry_run
        self._supported = frozenset(supported_clocks)
        self._sorted_supported = tuple(sorted(supported_clocks, reverse=True))
        self._event_factory = event_factory or default_event_factory()
        if not dry_run:
            self._refuse_mig()
        # Training side (cheap, never held across NVML calls) and controller side. Both are
        # reentrant because a signal handler may reset while the main thread holds them.
        self._request_lock = threading.RLock()
        self._apply_lock = threading.RLock()
        # None: not known (NVML cannot say whether clocks are locked), so sent whatever it is.
        self._requested: int | None = None
        self._generation = 0
        self._applied: int | None = None
        self._error: BaseException | None = None
        self._queue: queue.Queue[object] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._pid = os.getpid()
        self.switches: list[ClockSwitch] = []
        """Switches applied (or, in a dry run, that would have been), in order."""
        self._zeusd_socket = zeusd_socket_path(zeusd_socket)
        self._zeusd_timeout_s = zeusd_timeout_s
        self._zeusd: ZeusdClient | None = None
        """Set once zeusd has set clocks NVML denied this process; then it sets them all."""
        self._zeusd_failure: str | None = None
        self._route: str | None = None
        self.lock_path = ownership.lock_path(ownership.lock_dir(lock_dir), self._uuid(), index)
        """This GPU's lock file (owned unless ``dry_run``)."""
        self._owner: ownership.Ownership | None = None
        held = held if held is not None else ownership.HeldClockLocks()
        if dry_run:
            self._warn_if_taken()
        else:
            self._take_ownership(held)
        self._exit_guard: ExitGuard | None = held.exit_guard if reset_at_exit else None
        if self._exit_guard is not None:
            self._exit_guard.register(self)

    @property
    def applied_mhz(self) -> int | None:
        """The clock the controller last applied (``DEFAULT_CLOCK_MHZ``: not locked; None:
        not known, nothing applied yet)."""
        return self._applied

    @property
    def clock_route(self) -> str | None:
        """How clocks were last set: "nvml", "zeusd", or None before the first setter call."""
        return self._route

    @property
    def owns_clocks(self) -> bool:
        """Whether this controller holds the GPU's clock ownership (never in a dry run)."""
        return self._owner is not None and self._owner.held and not self._forked()

    def probe_permission(self) -> bool:
        """Whether this process may lock the GPU's clocks, found by resetting them once.

        Either way the controller then knows the GPU is at its default clocks (a GPU it may
        not change counts as there: it cannot be changed), so requests for them make no
        NVML call until another clock is locked. Only NVML_ERROR_NO_PERMISSION answers
        "no"; the controller then gives up the GPU's lock file (it will never change the
        clocks, so another job on the GPU, with or without permission, may own them). With
        zeusd configured, the reset NVML denies goes to zeusd: "yes" if zeusd did it, "no"
        (with a WARNING saying why) if it failed. After any other failure the clocks stay
        unknown and the first request goes to NVML, which then raises what is wrong, as
        without a probe. A dry run, or a forked child, calls nothing and answers "yes".
        """
        if self.dry_run or self._forked():
            return True
        with self._apply_lock:
            try:
                self._set_clocks(None)
            except ZeusdError as exc:
                logger.warning("%s: clocks cannot be locked through zeusd: %s", self.gpu, exc)
                self._zeusd_failure = exc.reason
                allowed = False
            except Exception as exc:  # noqa: BLE001 - reported by the first request instead
                if nvml_error_code(exc) != self._nvml.NVML_ERROR_NO_PERMISSION:
                    logger.info("%s: resetting clocks at open failed (%s)", self.gpu, exc)
                    return True
                allowed = False
            else:
                allowed = True
                self._record(None)
            with self._request_lock:
                self._applied = self._requested = DEFAULT_CLOCK_MHZ
            if not allowed:
                self._release_ownership()
                self._zeusd_socket = None  # clocks given up: zeusd may not change them either
        return allowed

    def set_clock(self, graph: str, mhz: int) -> None:
        """Queue a switch to ``mhz`` at the current point of the stream; returns at once."""
        if self._forked():
            raise ForkedClockControllerError(self.gpu, self._pid, os.getpid())
        self._raise_pending_error()
        if mhz != DEFAULT_CLOCK_MHZ and mhz not in self._supported:
            raise UnsupportedClockError(self.gpu, mhz, self._sorted_supported)
        with self._request_lock:
            if self._closed:
                raise ClosedClockControllerError(self.gpu)
            if mhz == self._requested:
                return
            self._requested = mhz
            generation = self._generation
        self._start_thread()
        self._queue.put(_Request(graph, mhz, self._event_factory(), generation))

    def flush(self) -> None:
        """Block until every queued switch has been applied; raise what the thread hit."""
        if self._forked():
            return  # nothing of this process is queued; the thread stayed in the parent
        self._queue.join()
        self._raise_pending_error()

    def reset(self) -> None:
        """Unlock clocks now, from the calling thread, dropping queued switches.

        Not stream-ordered (it serves exits and errors); a graph that wants default clocks
        at its start calls ``set_clock(graph, DEFAULT_CLOCK_MHZ)`` instead. A GPU this
        controller has not set yet is left as it is; so is a forked child's parent's GPU.
        """
        if self._forked():
            return
        with self._apply_lock:
            touched = self._applied is not None
            with self._request_lock:
                self._generation += 1
                self._requested = DEFAULT_CLOCK_MHZ if touched else None
            if touched:
                self._apply("reset", DEFAULT_CLOCK_MHZ)

    def close(self) -> None:
        """Reset clocks, stop the controller thread and give up ownership; idempotent.

        If the reset fails, the ownership record stays, so the next owner resets the clock.
        """
        if self._forked():
            self._closed = True
            return
        with self._request_lock:
            if self._closed:
                return
            self._closed = True
        try:
            self.reset()
        finally:
            if self._exit_guard is not None:
                self._exit_guard.unregister(self)
            if self._thread is not None:
                self._queue.put(_STOP)
                self._thread.join()
            self._release_ownership()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _forked(self) -> bool:
        return os.getpid() != self._pid

    def _uuid(self) -> str | None:
        try:
            return nvml_text(self._nvml.nvmlDeviceGetUUID(self._handle))
        except self._nvml.NVMLError:
            return None

    def _take_ownership(self, held: ownership.HeldClockLocks) -> None:
        owner = held.acquire(self.lock_path, gpu=self.gpu)
        try:
            if owner.stale is not None:
                self._clear_stale(owner.stale)
            owner.write(locked_mhz=None)
        except BaseException:
            owner.release(clean=False)  # the stale record stays for the next start
            raise
        self._owner = owner

    def _clear_stale(self, stale: ownership.StaleOwner) -> None:
        """Reset the clocks a previous owner may have left locked; say who left them."""
        if not stale.may_be_locked:
            logger.info(
                "%s: previous clock owner %s; its clocks are not locked", self.gpu, stale.describe()
            )
            return
        try:
            self._set_clocks(None)
        except (self._nvml.NVMLError, ZeusdError) as exc:
            if nvml_error_code(exc) == self._nvml.NVML_ERROR_NOT_SUPPORTED:
                logger.info("%s has no locked clocks (left by %s)", self.gpu, stale.describe())
                return
            error = StaleClockLockError(
                self.gpu, self.index, stale.describe(), str(self.lock_path), exc
            )
            logger.critical("%s", error)
            raise error from exc
        self._applied = self._requested = DEFAULT_CLOCK_MHZ
        logger.warning(
            "Reset the SM clock of %s, which may have been left locked by %s (record: %s)",
            self.gpu,
            stale.describe(),
            self.lock_path,
        )

    def _warn_if_taken(self) -> None:
        """A dry run measures at the clocks the GPU has: say if they may not be the default."""
        found = ownership.read_owner(self.lock_path)
        if found is None or found[0].pid == os.getpid():
            return
        record, alive = found
        if alive:
            logger.warning(
                "%s: its clocks are owned by %s (record: %s); this dry run measures at "
                "whatever clocks that process sets, not at the default clocks",
                self.gpu,
                record.describe(),
                self.lock_path,
            )
        elif record.locked_mhz is not None:
            logger.warning(
                "%s may still have its SM clock locked at %d MHz by %s, which is no longer "
                "running (record: %s); this dry run would measure at that clock: reset it "
                "with `sudo nvidia-smi -i %d -rgc`, or open the GPU once with "
                'device="nvml", which resets it',
                self.gpu,
                record.locked_mhz,
                record.describe(),
                self.lock_path,
                self.index,
            )

    def _release_ownership(self) -> None:
        owner, self._owner = self._owner, None
        if owner is not None:
            owner.release(clean=self._applied in (None, DEFAULT_CLOCK_MHZ))

    def _refuse_mig(self) -> None:
        try:
            current, _pending = self._nvml.nvmlDeviceGetMigMode(self._handle)
        except self._nvml.NVMLError as exc:
            if nvml_error_code(exc) == self._nvml.NVML_ERROR_NOT_SUPPORTED:
                return  # pre-Ampere GPUs have no MIG
            raise
        if current == self._nvml.NVML_DEVICE_MIG_ENABLE:
            raise MigClockControlError(self.gpu)

    def _start_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"kareus-clock-{self.index}", daemon=True
            )
            self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                assert isinstance(item, _Request)
                if item.event is not None:
                    item.event.synchronize()
                with self._apply_lock:
                    if item.generation == self._generation:
                        self._apply(item.graph, item.mhz)
            except Exception as exc:  # noqa: BLE001 - surfaced on the training thread next call
                logger.error("clock switch on %s failed: %s", self.gpu, exc)
                with self._request_lock:
                    self._error = exc
            finally:
                self._queue.task_done()

    def _apply(self, graph: str, mhz: int) -> None:
        """Make ``mhz`` the GPU's clock; caller holds the apply lock."""
        if mhz == self._applied:
            return
        if not self.dry_run:
            if mhz == DEFAULT_CLOCK_MHZ:
                self._reset_clocks()
                self._record(None)
            else:
                self._record(mhz)  # before locking: a record may overstate, never miss, a lock
                try:
                    self._lock_clocks(mhz)
                except BaseException:
                    self._record(None if self._applied == DEFAULT_CLOCK_MHZ else self._applied)
                    raise
        self._applied = mhz
        self.switches.append(ClockSwitch(len(self.switches), graph, mhz))

    def _record(self, locked_mhz: int | None) -> None:
        if self._owner is not None:
            self._owner.write(locked_mhz)

    def _lock_clocks(self, mhz: int) -> None:
        """Lock the SM clock at ``mhz``; NVML's failures become clock errors, zeusd's stay."""
        try:
            self._set_clocks(mhz)
        except self._nvml.NVMLError as exc:
            code = nvml_error_code(exc)
            if code == self._nvml.NVML_ERROR_NO_PERMISSION:
                raise ClockPermissionError(self.gpu, self._zeusd_failure) from exc
            if code == self._nvml.NVML_ERROR_NOT_SUPPORTED:
                raise ClockControlUnsupportedError(self.gpu) from exc
            raise ClockControlError(self.gpu, mhz, exc) from exc

    def _reset_clocks(self) -> None:
        try:
            self._set_clocks(None)
        except Exception as exc:
            error = ClockResetError(self.gpu, self.index, exc)
            logger.critical("%s", error)
            raise error from exc

    def _set_clocks(self, mhz: int | None) -> None:
        """Lock the SM clock at ``mhz`` (None: reset it) through NVML, or through zeusd once
        NVML has denied this process permission; raises NVML's or zeusd's error as it is.

        zeusd is tried only where configured, and no more once a probe found neither way
        willing (the controller then gave up the GPU's clocks).
        """
        if self._zeusd is not None:
            self._zeusd_set(self._zeusd, mhz)
            return
        try:
            if mhz is None:
                self._nvml.nvmlDeviceResetGpuLockedClocks(self._handle)
            else:
                self._nvml.nvmlDeviceSetGpuLockedClocks(self._handle, mhz, mhz)
        except self._nvml.NVMLError as exc:
            denied = nvml_error_code(exc) == self._nvml.NVML_ERROR_NO_PERMISSION
            if not denied or self._zeusd_socket is None:
                raise
            zeusd = ZeusdClient(self._zeusd_socket, timeout_s=self._zeusd_timeout_s)
            self._zeusd_set(zeusd, mhz)  # a failure leaves NVML the way to try next time
            self._zeusd = zeusd
            return
        self._using("nvml", "NVML")

    def _zeusd_set(self, zeusd: ZeusdClient, mhz: int | None) -> None:
        if mhz is None:
            zeusd.reset_gpu_clocks(self.index)
        else:
            zeusd.lock_gpu_clocks(self.index, mhz)
        self._using(
            "zeusd",
            f"zeusd at {zeusd.socket_path} (NVML denies this process clock changes: "
            "NVML_ERROR_NO_PERMISSION)",
        )

    def _using(self, route: str, description: str) -> None:
        """Say once (per change) which way this controller sets clocks."""
        if route != self._route:
            self._route = route
            logger.info("%s: setting SM clocks through %s", self.gpu, description)

    def _raise_pending_error(self) -> None:
        with self._request_lock:
            error, self._error = self._error, None
        if error is not None:
            raise error
