"""Devices the profiler measures on: simulated GPUs here, real ones (NVML) alongside."""

from kareus.profiler.devices.base import Device, Measurement, Resources, Workload
from kareus.profiler.devices.presets import GPUSpec, load_preset, preset_names
from kareus.profiler.devices.simulated import SimulatedGPU

__all__ = [
    "Device",
    "GPUSpec",
    "Measurement",
    "Resources",
    "SimulatedGPU",
    "Workload",
    "load_preset",
    "preset_names",
]
