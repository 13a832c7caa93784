"""Devices the profiler measures on: simulated GPUs here, real ones (NVML) alongside."""

from kareus.devices.base import Device, Measurement, Resources, Workload
from kareus.devices.sim.model import SimulatedGPU
from kareus.devices.sim.presets import GPUSpec, load_preset, preset_names

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
