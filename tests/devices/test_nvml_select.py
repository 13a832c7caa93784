"""GPU selection on its own: which NVML index a rank's GPU has, against a fake driver."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
from fake_pynvml import FakeGpu, FakeNvml, opened

from kareus.devices.errors import DeviceError, MigClockControlError
from kareus.devices.nvml.select import select_gpu


def node(*uuids: str) -> FakeNvml:
    """An initialised fake driver whose GPUs have these UUIDs, in NVML (PCI bus) order."""
    fake, _ = opened(FakeNvml([FakeGpu(uuid=uuid) for uuid in uuids]))
    return fake


EIGHT = node(*(f"GPU-{i}bcd-ef" for i in range(8)))


@dataclass
class FakeCuda:
    """``torch.cuda`` as selection reads it: CUDA device i has UUID ``uuids[i]`` (no prefix)."""

    uuids: tuple[str, ...]
    current: int = 0

    def current_device(self) -> int:
        return self.current

    def device_count(self) -> int:
        return len(self.uuids)

    def get_device_properties(self, device: int) -> SimpleNamespace:
        return SimpleNamespace(uuid=self.uuids[device])


@pytest.mark.parametrize(
    ("env", "cuda_index", "expected"),
    [
        ({}, None, 0),
        ({"LOCAL_RANK": "3"}, None, 3),  # torchrun: each rank its own GPU
        ({"LOCAL_RANK": "3"}, 5, 5),  # the script chose
        ({"LOCAL_RANK": "3", "CUDA_VISIBLE_DEVICES": "6"}, None, 6),  # one GPU per process
        ({"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "2, 0"}, None, 0),
        ({"CUDA_VISIBLE_DEVICES": "GPU-2bcd-ef,GPU-0bcd-ef"}, None, 2),
        ({"CUDA_VISIBLE_DEVICES": "4bcd"}, None, 4),  # abbreviated, no prefix
    ],
)
def test_without_cuda_the_visible_devices_map_the_rank_to_nvml(
    env: dict[str, str], cuda_index: int | None, expected: int
) -> None:
    assert select_gpu(EIGHT, cuda_index, cuda=None, env=env) == expected


def test_with_cuda_the_device_uuid_decides() -> None:
    # CUDA orders devices its own way (fastest first by default): device 1 is NVML GPU 5.
    cuda = FakeCuda(("3bcd-ef", "5bcd-ef", "0bcd-ef"))
    assert select_gpu(EIGHT, cuda=cuda, env={"LOCAL_RANK": "1"}) == 5
    assert select_gpu(EIGHT, 2, cuda=cuda, env={"LOCAL_RANK": "1"}) == 0
    cuda.current = 2  # torch.cuda.set_device(2) was called: believed over LOCAL_RANK
    assert select_gpu(EIGHT, cuda=cuda, env={"LOCAL_RANK": "1"}) == 0


@pytest.mark.parametrize(
    ("visible", "error", "message"),
    [
        ("0,1", DeviceError, "CUDA device 2 is not visible"),
        ("0,1,MIG-1234", MigClockControlError, "MIG instance MIG-1234"),
        ("0,1,GPU-ffff", DeviceError, "matches 0 GPUs"),
    ],
)
def test_a_gpu_that_cannot_be_told_apart_is_refused(
    visible: str, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        select_gpu(EIGHT, 2, cuda=None, env={"CUDA_VISIBLE_DEVICES": visible})


def test_an_ambiguous_uuid_prefix_is_refused() -> None:
    fake = node("GPU-1bcd-ef", "GPU-1bcd-ff")
    with pytest.raises(DeviceError, match="matches 2 GPUs"):
        select_gpu(fake, cuda=None, env={"CUDA_VISIBLE_DEVICES": "1bcd"})


def test_old_bindings_return_bytes() -> None:
    fake = node("GPU-0bcd-ef", "GPU-1bcd-ef")
    fake.nvmlDeviceGetUUID = lambda gpu: gpu.uuid.encode()  # as old pynvml versions do
    assert select_gpu(fake, cuda=None, env={"CUDA_VISIBLE_DEVICES": "GPU-1bcd"}) == 1
