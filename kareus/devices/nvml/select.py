"""Which GPU, by NVML index, this process trains on.

CUDA numbers the devices a process sees after ``CUDA_VISIBLE_DEVICES`` (indices or UUIDs,
possibly abbreviated); NVML numbers all GPUs by PCI bus. With CUDA the device's UUID from
torch is matched, which always holds. Without CUDA at hand, a numeric visible entry is
taken as an NVML index, which holds with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` and on nodes of
identical GPUs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from types import ModuleType
from typing import Any, Protocol

from kareus.devices.errors import DeviceError, MigClockControlError
from kareus.devices.nvml.driver import nvml_text


class CudaDevices(Protocol):
    """The part of ``torch.cuda`` selection reads (tests pass a stand-in)."""

    def current_device(self) -> int: ...

    def device_count(self) -> int: ...

    def get_device_properties(self, device: int) -> Any: ...


def select_gpu(
    nvml: ModuleType | Any,
    cuda_index: int | None = None,
    *,
    cuda: CudaDevices | None,
    env: Mapping[str, str] = os.environ,
) -> int:
    """The NVML index of CUDA device ``cuda_index`` (None: the one this rank trains on).

    ``cuda`` is ``torch.cuda`` where torch sees a GPU, else None. A script that already
    picked a device (``torch.cuda.set_device``) is believed; before that the current
    device is 0 on every rank and ``LOCAL_RANK`` (torchrun) says which GPU this rank will
    use, unless each process sees only its own GPU(s).
    """
    if cuda is not None:
        if cuda_index is None:
            cuda_index = _local_index(env, cuda.current_device(), cuda.device_count())
        return _index_by_uuid(nvml, f"GPU-{cuda.get_device_properties(cuda_index).uuid}")
    visible = env.get("CUDA_VISIBLE_DEVICES")
    entries = None if visible is None else _entries(visible)
    if cuda_index is None:
        count = nvml.nvmlDeviceGetCount() if entries is None else len(entries)
        cuda_index = _local_index(env, 0, count)
    if entries is None:
        return cuda_index
    if cuda_index >= len(entries):
        raise DeviceError(
            f"CUDA device {cuda_index} is not visible (CUDA_VISIBLE_DEVICES={visible!r}); "
            "check LOCAL_RANK and CUDA_VISIBLE_DEVICES of this process"
        )
    entry = entries[cuda_index]
    if entry.startswith("MIG-"):
        raise MigClockControlError(f"the GPU of MIG instance {entry}")
    return int(entry) if entry.isdigit() else _index_by_uuid(nvml, entry)


def _local_index(env: Mapping[str, str], current_device: int, visible_count: int) -> int:
    if current_device:
        return current_device
    local_rank = int(env.get("LOCAL_RANK", "0"))
    return local_rank if 0 <= local_rank < visible_count else 0


def _index_by_uuid(nvml: ModuleType | Any, uuid: str) -> int:
    """The NVML index of the one GPU whose UUID starts with ``uuid`` ("GPU-" optional)."""
    prefix = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
    handles = (nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount()))
    uuids = [nvml_text(nvml.nvmlDeviceGetUUID(handle)) for handle in handles]
    matches = [index for index, full in enumerate(uuids) if full.startswith(prefix)]
    if len(matches) != 1:
        raise DeviceError(
            f"{uuid!r} matches {len(matches)} GPUs known to NVML, expected one (a MIG instance "
            "matches none: clocks cannot be controlled per MIG instance)"
        )
    return matches[0]


def _entries(visible_devices: str) -> list[str]:
    return [entry.strip() for entry in visible_devices.split(",") if entry.strip()]
