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


class ClockPermissionError(DeviceError):
    """Locking clocks needs privileges this process does not have (NVML_ERROR_NO_PERMISSION)."""

    def __init__(self, gpu: str) -> None:
        super().__init__(
            f"No permission to change the SM clock of {gpu} (NVML_ERROR_NO_PERMISSION). "
            "Locking GPU clocks needs root or the CAP_SYS_ADMIN capability: run the job as "
            "root (or grant CAP_SYS_ADMIN to the container), or route clock changes through a "
            f"privileged daemon such as Zeus's zeusd, {DRY_RUN_HINT}."
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


class EnergyUnavailableError(DeviceError):
    """Neither the energy counter nor power readings work, so energy cannot be measured."""

    def __init__(self, gpu: str, cause: BaseException) -> None:
        super().__init__(
            f"{gpu} reports neither total energy nor power through NVML ({cause}); energy "
            f"cannot be measured on it; {SIMULATED_ALTERNATIVE}."
        )


class UnsupportedMeasurementError(DeviceError, NotImplementedError):
    """The device cannot apply a knob setting the caller asked for: it lacks the knob, or
    the value is outside what the device (or the workload) offers."""

    def __init__(self, device: str, knob: str, reason: str) -> None:
        super().__init__(f"{device} cannot measure with {knob}: {reason}")


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
