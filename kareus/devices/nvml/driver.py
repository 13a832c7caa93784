"""Opening NVML and reading its values, shared by the parts of the NVML device.

``pynvml`` (the ``nvidia-ml-py`` distribution) is imported only when a device is opened,
and any module with its interface can be injected (tests pass a fake driver).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from kareus.devices.errors import NvmlUnavailableError, nvml_error_code


def load_nvml(module: ModuleType | Any = None) -> ModuleType | Any:
    """Import (unless given) and initialize NVML, turning each failure into advice."""
    if module is None:
        try:
            import pynvml as module
        except ImportError as exc:
            raise NvmlUnavailableError(f"the Python bindings are missing ({exc})") from exc
    try:
        module.nvmlInit()
    except module.NVMLError as exc:
        code = nvml_error_code(exc)
        if code == module.NVML_ERROR_LIBRARY_NOT_FOUND:
            reason = "libnvidia-ml.so.1, the NVIDIA driver's NVML library, was not found"
        elif code == module.NVML_ERROR_DRIVER_NOT_LOADED:
            reason = "the NVIDIA kernel driver is not loaded (no GPU or no driver installed)"
        else:
            reason = f"nvmlInit failed ({exc})"
        raise NvmlUnavailableError(reason) from exc
    if module.nvmlDeviceGetCount() == 0:
        module.nvmlShutdown()
        raise NvmlUnavailableError("NVML sees no GPU on this machine")
    return module


def nvml_text(value: str | bytes) -> str:
    """A name or UUID from NVML as text (old pynvml versions return bytes)."""
    return value.decode() if isinstance(value, bytes) else value
