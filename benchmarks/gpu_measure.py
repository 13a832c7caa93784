"""What the checks run on a lent GPU share: default clocks only, each measurement beside the model.

The rules (``gpu_check.py``, ``gpu_plan_check.py``): the GPU is opened as kareus's
"nvml-dry-run" device, whose clock controller validates and records switches but never
applies one, so every measurement is at the GPU's default clocks; and while a check runs,
every NVML function that changes the GPU's state is replaced by one that raises and
records the call (``setters_refused``), so a check that would change a clock, a power
limit or any other setting fails instead of doing it.
"""

from __future__ import annotations

import contextlib
import platform
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from kareus.devices import Measurement, SimulatedGPU, Workload
from kareus.devices.nvml.gpu import NvmlGPU
from kareus.errors import KareusError
from kareus.passes.ops import DEFAULT_CLOCK_MHZ

MIN_WINDOW_S = 2.0
WARMUP_RUNS = 3  # before measuring: cuBLAS handles and heuristics, allocator blocks, compiles
CLOCKS = "default (dry run: no clock was set)"
H200_RECORD = Path(__file__).resolve().parent / "results" / "h200_default.json"
"""``gpu_plan_check.py``'s record of an H200 at default clocks, which ``fidelity.py`` reads."""
H200_KERNELS = Path(__file__).resolve().parent / "results" / "gpu_check_h200.json"
"""``gpu_check.py``'s record of an H200's kernels at default clocks, which ``fidelity.py``
reads."""

_WORDS = re.compile(r"[A-Z][a-z]+|[A-Z]+(?![a-z])|\d+")
_CHANGES = frozenset({"Set", "Reset", "Clear"})


class NvmlSetterError(KareusError, RuntimeError):
    """An NVML function that changes the GPU's state was called during a default-clocks check."""


def is_setter(name: str) -> bool:
    """Whether the NVML function ``name`` changes state: a Set, Reset or Clear word and no Get
    (nvmlDeviceSetGpuLockedClocks, nvmlDeviceResetApplicationsClocks,
    nvmlDevicePowerSmoothingSetState...). In nvmlEventSet* "Set" names an event set."""
    if not name.startswith("nvml"):
        return False
    words = _WORDS.findall(name.removeprefix("nvml"))
    return "Get" not in words and any(
        word in _CHANGES and before != "Event" for before, word in zip(["", *words], words)
    )


@contextlib.contextmanager
def setters_refused(nvml: ModuleType | Any | None) -> Iterator[list[str]]:
    """Within the block, every setter of ``nvml`` (the pynvml module, or a stand-in with its
    interface; None: its bindings are not installed, so nothing can call one) raises
    ``NvmlSetterError``; yields the names of the refused calls, in order, so that a caller
    which swallowed the error still sees it. The functions are restored after."""
    refused: list[str] = []
    if nvml is None:
        yield refused
        return
    names = [n for n in dir(nvml) if is_setter(n) and callable(getattr(nvml, n))]
    own = vars(nvml)
    saved = {name: own[name] for name in names if name in own}

    def refusing(name: str) -> Callable[..., None]:
        def refuse(*args: object, **kwargs: object) -> None:
            refused.append(name)
            raise NvmlSetterError(
                f"{name} was called: this check measures at the GPU's default clocks and "
                "must never change its state (only the nvml-dry-run controller may run)"
            )

        return refuse

    for name in names:
        setattr(nvml, name, refusing(name))
    try:
        yield refused
    finally:
        for name in names:
            if name in saved:
                setattr(nvml, name, saved[name])
            else:
                delattr(nvml, name)  # an instance's override of its class's method


def pynvml_module() -> ModuleType | None:
    """The pynvml module NvmlGPU opens (None where its bindings are not installed)."""
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


def dry_run_gpu() -> NvmlGPU:
    """This process's GPU as kareus's "nvml-dry-run" device (``device="nvml-dry-run"``),
    measured in windows of at least ``MIN_WINDOW_S``."""
    return NvmlGPU(dry_run=True, min_window_s=MIN_WINDOW_S)


def gpu_info(gpu: NvmlGPU) -> dict[str, object]:
    """The GPU and how it is measured; read before any workload runs (idle power)."""
    return {
        "gpu": gpu.gpu_name,
        "nvml_device": gpu.name,
        "energy_method": gpu.method,
        "idle_power_w": _idle_power_w(gpu),
        "static_power_w_assumed": gpu.static_power_w,
    }


def _idle_power_w(gpu: NvmlGPU) -> float:
    """Power with a CUDA context open and nothing running."""
    torch.cuda.synchronize()
    samples = [gpu.power_w() for _ in range(20)]
    return sum(samples) / len(samples)


def measure_warm(gpu: NvmlGPU, workload: Workload) -> Measurement:
    """``workload`` at the default clocks, after ``WARMUP_RUNS`` runs that are not measured."""
    assert workload.run is not None
    for _ in range(WARMUP_RUNS):
        workload.run()
    torch.cuda.synchronize()
    return gpu.measure(workload, DEFAULT_CLOCK_MHZ)


def model_version(preset: str) -> object:
    return getattr(SimulatedGPU(preset).spec, "model_version", None)


def header(preset: str) -> dict[str, object]:
    """What every record starts with: the model it is compared with, torch, host, clocks."""
    return {
        "preset": preset,
        "model_version": model_version(preset),
        "torch": torch.__version__,
        "host": platform.node(),
        "clocks": CLOCKS,
    }


_QUANTITIES = (("time_s", "time_s"), ("energy_j", "energy_j"), ("power_w", "average_power_w"))


def comparison(
    measured: Measurement | None, predicted: Measurement | None
) -> dict[str, object]:
    """Measured and predicted time, energy and power side by side, with predicted/measured
    ratios; a side is None where there is none (and so are the ratios)."""
    sides = {"measured": measured, "predicted": predicted}
    row: dict[str, object] = {
        f"{side}_{key}": None if m is None else getattr(m, attr)
        for side, m in sides.items()
        for key, attr in _QUANTITIES
    }
    both = measured is not None and predicted is not None
    row["time_ratio"] = predicted.time_s / measured.time_s if both else None
    row["energy_ratio"] = predicted.energy_j / measured.energy_j if both else None
    row["measurement_details"] = None if measured is None else measured.details
    return row
