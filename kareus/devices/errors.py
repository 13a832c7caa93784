"""Device errors whose messages say what the user can do next.

Each class builds its own message from the facts at hand, so every place that raises it
gives the same advice (REFERENCE.md s4 lists the problems Zeus users keep running into).
"""

from __future__ import annotations

from collections.abc import Sequence

from kareus.errors import KareusError

SIMULATED_ALTERNATIVE = 'run on a simulated GPU instead, e.g. device="sim:h200"'
DRY_RUN_HINT = (
    'or use device="nvml-dry-run" to measure on this GPU at its default clocks while only '
    "recording the clock switches"
)


def nvml_error_code(exc: BaseException) -> int | None:
    """The NVML_ERROR_* value carried by a pynvml ``NVMLError`` (None for other exceptions)."""
    return getattr(exc, "value", None)


class DeviceError(KareusError, RuntimeError):
    """Base of every error raised while opening, measuring on or controlling a device.

    A ``RuntimeError`` too, so callers written before ``KareusError`` still catch it.
    """


class NvmlUnavailableError(DeviceError):
    """NVML cannot be used at all: bindings missing, driver not loaded, or no GPU."""

    def __init__(self, reason: str) -> None:
        super().__init__(
            f"NVML is not usable: {reason}. Install the NVIDIA driver (it provides "
            "libnvidia-ml.so.1) and the Python bindings (pip install nvidia-ml-py); inside a "
            "container, start it with GPU access (NVIDIA Container Toolkit, --gpus all); "
            f"or {SIMULATED_ALTERNATIVE}."
        )


ZEUSD_HINT = (
    "let Zeus's privileged daemon zeusd change them for this process: start it (`sudo zeusd "
    "serve --socket-path /run/zeusd/zeusd.sock`) and set ZEUSD_SOCK_PATH to its socket"
)
CLOCK_PERMISSION_HINT = (
    "locking GPU clocks needs root or the CAP_SYS_ADMIN capability: run the job as root (or "
    f"grant CAP_SYS_ADMIN to the container), or {ZEUSD_HINT}, {DRY_RUN_HINT}"
)


class ClockPermissionError(DeviceError):
    """Locking clocks needs privileges this process does not have (NVML_ERROR_NO_PERMISSION).

    ``zeusd`` says why zeusd, where one was configured, did not take over.
    """

    def __init__(self, gpu: str, zeusd: str | None = None) -> None:
        tried = f" zeusd did not take over ({zeusd})." if zeusd else ""
        super().__init__(
            f"No permission to change the SM clock of {gpu} (NVML_ERROR_NO_PERMISSION).{tried} "
            f"{CLOCK_PERMISSION_HINT[0].upper()}{CLOCK_PERMISSION_HINT[1:]}."
        )


def no_clock_permission(gpu: str) -> str:
    """``Device.clock_limitation`` of a GPU whose clocks this process may not lock."""
    return (
        f"no permission to lock the SM clock of {gpu} (NVML_ERROR_NO_PERMISSION): planned "
        f"at the default clock only; {CLOCK_PERMISSION_HINT}."
    )


class ClockControlUnsupportedError(DeviceError):
    """The GPU or driver has no locked-clock support (NVML_ERROR_NOT_SUPPORTED)."""

    def __init__(self, gpu: str) -> None:
        super().__init__(
            f"{gpu} does not support locked SM clocks (NVML_ERROR_NOT_SUPPORTED; needs a "
            f"Volta or newer GPU and a recent driver); {DRY_RUN_HINT}."
        )


class MigClockControlError(DeviceError):
    """Clocks belong to the whole GPU, so no MIG instance can set them for itself."""

    def __init__(self, gpu: str) -> None:
        super().__init__(
            f"{gpu} is in MIG mode: the SM clock is shared by every MIG instance of the GPU, "
            "so it cannot be locked per instance and energy cannot be attributed to one. "
            "Disable MIG (nvidia-smi -i <index> -mig 0, as root, then reset the GPU) to let "
            f"kareus control clocks, or {SIMULATED_ALTERNATIVE}."
        )


class UnsupportedClockError(DeviceError, ValueError):
    """A requested SM clock is not one the device accepts (a real GPU: at its memory clock)."""

    def __init__(self, gpu: str, mhz: int, supported: Sequence[int]) -> None:
        nearest = min(supported, key=lambda clock: (abs(clock - mhz), -clock))
        super().__init__(
            f"{mhz} MHz is not a supported SM clock of {gpu}: it accepts {len(supported)} "
            f"values from {min(supported)} to {max(supported)} MHz (nearest: {nearest} MHz). "
            "Pick clocks from Device.supported_clocks()."
        )


class ClockControlError(DeviceError):
    """Any other NVML failure while setting a clock."""

    def __init__(self, gpu: str, mhz: int, cause: BaseException) -> None:
        super().__init__(f"Setting the SM clock of {gpu} to {mhz} MHz failed: {cause}")


class ClockResetError(DeviceError):
    """Resetting clocks failed: the GPU may stay slowed until someone resets it."""

    def __init__(self, gpu: str, index: int, cause: BaseException) -> None:
        super().__init__(
            f"FAILED to reset the SM clock of {gpu} to its default ({cause}). The lock "
            "persists until reset or driver reload and slows every later job on this GPU: "
            f"reset it now with `sudo nvidia-smi -i {index} -rgc`."
        )


class ZeusdError(DeviceError):
    """A request to zeusd, the privileged daemon that locks clocks for this process where NVML
    denies it permission (``devices.nvml.zeusd``), failed; ``socket_path`` is where it went.

    Each concrete class is also the clock error it stands for, so a caller that handles
    ``ClockPermissionError`` or ``ClockControlError`` handles it too. Their messages are the
    daemon's story, not NVML's, so they build it themselves; ``reason`` is its gist.
    """

    socket_path: str
    reason: str


class ZeusdUnreachableError(ZeusdError, ClockPermissionError):
    """zeusd did not answer its first request (no socket, nobody listening, or no answer in
    time): this process can change clocks neither through NVML nor through it."""

    def __init__(self, socket_path: str, request: str, cause: BaseException) -> None:
        self.socket_path = socket_path
        self.reason = f"zeusd cannot be reached at {socket_path} ({cause})"
        DeviceError.__init__(
            self,
            f"This process may not change GPU clocks through NVML (NVML_ERROR_NO_PERMISSION), "
            f"and zeusd, the daemon that would, cannot be reached at {socket_path} to "
            f"{request} ({type(cause).__name__}: {cause}). Start zeusd on that socket (`sudo "
            f"zeusd serve --socket-path {socket_path}`) or set ZEUSD_SOCK_PATH to the socket "
            "it serves; otherwise run the job as root or with CAP_SYS_ADMIN, "
            f"{DRY_RUN_HINT}.",
        )


ZEUSD_STATUS_HINTS = {
    401: "zeusd requires a token: set ZEUSD_TOKEN to one with the gpu-control scope",
    403: "a token needs the gpu-control scope (ZEUSD_TOKEN), and zeusd must run as root",
    404: (
        "this zeusd serves no gpu-control routes: start it with `--enable gpu-control` (on by "
        "default); a zeusd older than 0.3 (Zeus 0.14) speaks an older API, upgrade it"
    ),
}
"""What to do about an HTTP status zeusd answers for reasons of its own, not NVML's."""


class ZeusdRefusedError(ZeusdError, ClockControlError):
    """zeusd answered a clock request with an HTTP error; ``status`` and ``daemon_message``
    (the body it sent: NVML's error on its side, a bad request, an auth failure) say why."""

    def __init__(self, socket_path: str, request: str, status: int, daemon_message: str) -> None:
        self.socket_path = socket_path
        self.status = status
        self.daemon_message = daemon_message
        self.reason = f"zeusd at {socket_path} answered HTTP {status}: {daemon_message}"
        hint = ZEUSD_STATUS_HINTS.get(status)
        DeviceError.__init__(
            self,
            f"zeusd at {socket_path} refused to {request}: HTTP {status}: {daemon_message}"
            + (f" ({hint})." if hint else "."),
        )


class ZeusdDiedError(ZeusdError, ClockControlError):
    """zeusd, which had answered this process before, stopped answering (it exited, its
    socket is gone, or it hangs past the timeout): the clocks stay where it last put them."""

    def __init__(self, socket_path: str, request: str, index: int, cause: BaseException) -> None:
        self.socket_path = socket_path
        self.reason = f"zeusd at {socket_path} stopped answering ({cause})"
        DeviceError.__init__(
            self,
            f"zeusd at {socket_path} stopped answering; it was asked to {request} "
            f"({type(cause).__name__}: {cause}). The SM clock of GPU {index} stays where zeusd "
            "last set it: restart zeusd on that socket (kareus's next request, and its reset at "
            f"exit, go through it), or reset the clock with `sudo nvidia-smi -i {index} -rgc`.",
        )


class ClockOwnedError(DeviceError):
    """Another live clock controller owns the GPU's clocks (devices/nvml/ownership.py): two
    would override each other's clocks, so the second is refused."""

    def __init__(
        self,
        gpu: str,
        owner: str | None,
        path: str,
        *,
        pid: int | None = None,
        same_process: bool = False,
    ) -> None:
        if same_process:
            message = (
                f"The SM clock of {gpu} is already owned by another clock controller of this "
                f"process: {owner} (record: {path}). Two controllers on one GPU override each "
                "other's clocks: close the first (its close(), or NvmlGPU.close()) before "
                "opening another on this GPU, or use the first."
            )
        else:
            who = owner or (
                "a process that has not yet written its record (it is starting; the flock "
                "on the file shows it is alive)"
            )
            stop = (
                f"stop it (`kill {pid}`: kareus resets the clocks on SIGTERM)" if pid else "stop it"
            )
            message = (
                f"The SM clock of {gpu} is owned by another process: {who}; record: "
                f"{path}. Two jobs controlling one GPU's clocks override each other, so this "
                f"one is refused. Wait for it to finish, or {stop}, or run this job with "
                'device="nvml-dry-run", which never locks clocks nor takes ownership (it then '
                f"measures at whatever clocks the owner sets), or {SIMULATED_ALTERNATIVE}."
            )
        super().__init__(message)


class ClosedClockControllerError(DeviceError):
    """A clock switch was asked of a controller after its close (its thread is stopped)."""

    def __init__(self, gpu: str) -> None:
        super().__init__(f"the clock controller of {gpu} is closed")


class StaleClockLockError(DeviceError):
    """A previous owner died leaving the GPU's clocks possibly locked, and resetting them
    failed: every later job would run at that clock."""

    def __init__(self, gpu: str, index: int, left_by: str, path: str, cause: object) -> None:
        super().__init__(
            f"The SM clock of {gpu} may still be locked by {left_by} (record: {path}), and "
            f"resetting it now failed ({cause}). Every job on this GPU runs at that clock "
            f"until it is reset: run `sudo nvidia-smi -i {index} -rgc`, then "
            f"remove the stale record with `sudo rm {path}` (or start kareus once as root or "
            "with CAP_SYS_ADMIN, which does both)."
        )


class ForkedClockControllerError(DeviceError):
    """A process forked from a clock controller's owner tried to set clocks through it."""

    def __init__(self, gpu: str, owner_pid: int, pid: int) -> None:
        super().__init__(
            f"This process (pid {pid}) was forked from pid {owner_pid}, which owns the clock "
            f"controller of {gpu}: a forked child does not own the GPU's clocks and cannot set "
            f"them (pid {owner_pid} keeps ownership and resets them). Set clocks from pid "
            f"{owner_pid}; a child process that must control clocks needs its own controller, "
            "opened after the parent closed its one."
        )


class ClockLockDirError(DeviceError):
    """The directory of clock lock files cannot be used."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(
            f"Cannot record which process owns GPU clocks in {path}: {reason}. kareus keeps "
            "one lock file per GPU there, so that two jobs never lock one GPU's clocks at once "
            "and clocks a crashed job left locked are found and reset. Set "
            "KAREUS_CLOCK_LOCK_DIR to a directory every job on this machine can write (in "
            "containers, the same host directory mounted into each), or use "
            'device="nvml-dry-run", which never locks clocks.'
        )


class EnergyUnavailableError(DeviceError):
    """Neither the energy counter nor power readings work, so energy cannot be measured."""

    def __init__(self, gpu: str, cause: BaseException) -> None:
        super().__init__(
            f"{gpu} reports neither total energy nor power through NVML ({cause}); energy "
            f"cannot be measured on it; {SIMULATED_ALTERNATIVE}."
        )


class EnergyCounterStalledError(DeviceError):
    """NVML's total-energy counter did not advance over a window of runs lengthened to
    its bound, so the window's energy would read as zero."""

    def __init__(self, gpu: str, window_s: float, runs: int, min_window_s: float) -> None:
        super().__init__(
            f"NVML's total-energy counter of {gpu} did not advance during a {window_s:.2f} s "
            f"window ({runs} runs of the workload), so its energy cannot be measured: the "
            "counter normally updates every 20-100 ms. Give it longer windows (a larger "
            f"min_window_s=, now {min_window_s:g} s) if it updates more rarely on this GPU; "
            "a counter that never advances is a driver problem: check that the NVIDIA "
            "driver is loaded and current (some vGPU and container setups freeze the "
            "counter), or measure elsewhere."
        )


class UnsupportedMeasurementError(DeviceError, NotImplementedError):
    """The device cannot apply a knob setting the caller asked for: it lacks the knob, or
    the value is outside what the device (or the workload) offers."""

    def __init__(self, device: str, knob: str, reason: str) -> None:
        super().__init__(f"{device} cannot measure with {knob}: {reason}")


class UnmeasurableWorkloadError(DeviceError, ValueError):
    """The workload lacks what the device measures it by (a ``run`` to time on a real GPU,
    a traced graph to cost on a simulated one)."""

    def __init__(self, workload: str, lacks: str, because: str) -> None:
        super().__init__(f"workload {workload!r} has no {lacks}: {because}")


class UntracedGraphError(DeviceError, ValueError):
    """A graph node carries no ``meta['val']``, so the simulated GPU cannot cost it."""

    def __init__(self, node: str, target: object) -> None:
        super().__init__(
            f"node {node} ({target}) has no meta['val']: cost a graph traced with fake or "
            "real tensors (make_fx, AOT autograd)"
        )


class UnsupportedCollectiveError(DeviceError, ValueError):
    """The simulated GPU met a functional collective it does not pair with a wait."""

    def __init__(self, target: object) -> None:
        super().__init__(
            f"simulated GPU cannot cost {target}: it is not a collective kareus pairs with a "
            "wait (all_reduce, all_gather_into_tensor, reduce_scatter_tensor, "
            "all_to_all_single and their coalesced forms)"
        )


class ClockSwitchIntervalError(DeviceError, ValueError):
    """Clock switches came closer together than the (simulated) device allows."""

    def __init__(self, device: str, apart_s: float, min_interval_s: float) -> None:
        super().__init__(
            f"{device}: clock switches {1e3 * apart_s:.1f} ms apart; this device allows at "
            f"most one per {1e3 * min_interval_s:.0f} ms (switch per graph, not inside one)"
        )


class DeviceSpecError(DeviceError, ValueError):
    """The ``device`` option names no device kareus knows how to open."""

    def __init__(
        self, spec: object, accepted: Sequence[str], reason: str = "unknown device"
    ) -> None:
        super().__init__(
            f"Bad device {spec!r} ({reason}). Accepted values: {', '.join(accepted)}."
        )


class GPUSpecError(DeviceError, ValueError):
    """A simulated GPU's spec (a custom JSON file, or a ``GPUSpec`` built in code) is
    invalid; the message names the file where there is one, the field, the value and the
    accepted range."""


class EnergyCounterSilentError(EnergyCounterStalledError):
    """NVML's total-energy counter stopped changing while several variants were measured
    together (``nvml.multiplex``), which needs its every update."""

    def __init__(self, waited_s: float, changes: int) -> None:
        DeviceError.__init__(
            self,
            f"NVML's total-energy counter did not change for {waited_s:.1f} s while "
            f"variants were measured together (after {changes} changes): it normally "
            "updates every 20-100 ms. A counter that updates more rarely needs windowed "
            "measurement (NvmlGPU(counter=...) with integrates=False); one that never "
            "advances is a driver problem: check that the NVIDIA driver is loaded and "
            "current (some vGPU and container setups freeze the counter)."
        )


class CounterProbeError(DeviceError):
    """The probe of how a GPU's energy counter behaves (``devices.nvml.counter``) could not
    tell its update period or whether it integrates the power."""

    def __init__(self, gpu: str, reason: str) -> None:
        super().__init__(f"Cannot tell how NVML's total-energy counter of {gpu} behaves: {reason}.")


class CounterProbeStalledError(CounterProbeError, EnergyCounterStalledError):
    """The energy counter did not change while the probe kept the GPU busy; also an
    ``EnergyCounterStalledError``, so callers that handle a stalled counter handle it."""

    def __init__(self, gpu: str, stall_s: float) -> None:
        DeviceError.__init__(
            self,
            f"NVML's total-energy counter of {gpu} did not change during {stall_s:.2f} s of "
            "load, so energy cannot be measured on it: the counter normally updates every "
            "20-100 ms. A counter that never advances is a driver problem: check that the "
            "NVIDIA driver is loaded and current (some vGPU and container setups freeze the "
            f"counter), or {SIMULATED_ALTERNATIVE}.",
        )


class CounterBehaviourFormatError(DeviceError, ValueError):
    """A stored record of how an energy counter behaves (``CounterBehaviour``) is malformed."""

    def __init__(self, reason: str) -> None:
        super().__init__(
            f"Malformed energy counter behaviour record: {reason}. Delete the record: the "
            "counter is probed again (a few seconds) the next time the GPU is used."
        )
