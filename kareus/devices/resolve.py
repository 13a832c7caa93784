"""Turn the ``device`` option into a Device.

Accepted values: "auto" (the local GPU through NVML when torch sees a CUDA GPU and NVML
works, else the simulated default, saying why on the "kareus" logger), "nvml",
"nvml-dry-run" (real measurements, clock switches only recorded), "sim:<preset>", or a
path to a custom GPU JSON file (the simulator's format, see ``presets.load_preset``).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from types import ModuleType
from typing import Any

from kareus.devices.base import Device
from kareus.devices.errors import DeviceError, DeviceSpecError
from kareus.devices.nvml import gpu as nvml

logger = logging.getLogger("kareus")

SIM_PREFIX = "sim:"
DEFAULT_SIMULATED = "sim:h200"
ACCEPTED_DEVICES = (
    '"auto"',
    '"nvml"',
    '"nvml-dry-run"',
    '"sim:<preset>" (e.g. "sim:h200")',
    "a path to a custom GPU .json file",
)


def resolve_device(
    spec: str | os.PathLike[str] | Device = "auto",
    *,
    nvml_module: ModuleType | Any = None,
    **nvml_options: Any,
) -> Device:
    """The Device named by ``spec``; ``nvml_options`` go to ``NvmlGPU`` when one is opened
    (the runtime passes ``clock_locks``, the process's ``HeldClockLocks``, this way)."""
    if isinstance(spec, Device):
        return spec
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    problem = spec_problem(spec)
    if problem:
        raise DeviceSpecError(spec, ACCEPTED_DEVICES, problem)
    if spec == "auto":
        return _auto(nvml_module, nvml_options)
    if spec in ("nvml", "nvml-dry-run"):
        dry_run = spec == "nvml-dry-run"
        return nvml.NvmlGPU(dry_run=dry_run, nvml_module=nvml_module, **nvml_options)
    return _simulated(spec)


def spec_problem(spec: object) -> str | None:
    """Why ``spec`` names no device (None when it does), without opening any device."""
    from kareus.devices.sim.presets import preset_names

    if not isinstance(spec, str):
        return f"expected a string, got {type(spec).__name__}"
    if spec in ("auto", "nvml", "nvml-dry-run"):
        return None
    if spec.startswith(SIM_PREFIX):
        if spec in preset_names():
            return None
        return f"no simulated preset of that name; presets: {', '.join(preset_names())}"
    if not spec.strip():
        return "empty"
    if Path(spec).is_dir():
        return f"{spec} is a directory, not a GPU .json file"
    if not Path(spec).is_file():
        return f"no such file: {spec}; and not a device name"
    return None


def check_device(spec: object) -> None:
    """Refuse what ``resolve_device`` would, without opening any device: a name that names
    none (``DeviceSpecError``), or a custom GPU file that is no valid spec (``GPUSpecError``
    naming the file). A parent checks this before its workers each open the device."""
    from kareus.devices.sim.presets import load_preset

    problem = spec_problem(spec)
    if problem:
        raise DeviceSpecError(spec, ACCEPTED_DEVICES, problem)
    if spec not in ("auto", "nvml", "nvml-dry-run"):
        load_preset(spec)


def _auto(nvml_module: ModuleType | Any, nvml_options: dict[str, Any]) -> Device:
    if not nvml.cuda_available():
        reason = "torch sees no CUDA GPU (torch.cuda.is_available() is False)"
    else:
        try:
            return nvml.NvmlGPU(nvml_module=nvml_module, **nvml_options)
        except DeviceError as exc:
            reason = f"a CUDA GPU is present but cannot be used through NVML: {exc}"
    logger.warning(
        'device="auto": %s; using the simulated GPU %r, so time and energy are modeled, '
        "not measured, and no clock is changed",
        reason,
        DEFAULT_SIMULATED,
    )
    return _simulated(DEFAULT_SIMULATED)


def _simulated(preset_or_file: str) -> Device:
    """A simulated GPU from a preset name ("sim:h200") or a custom GPU JSON file."""
    from kareus.devices.sim.model import SimulatedGPU

    return SimulatedGPU(preset_or_file)
