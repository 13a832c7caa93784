"""Turning the ``device`` option into a Device (NVML parts against the fake driver)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fake_pynvml import FakeGpu, FakeNvml

from kareus.devices import resolve
from kareus.devices.errors import DeviceSpecError, GPUSpecError, NvmlUnavailableError
from kareus.devices.nvml import gpu as nvml
from kareus.devices.nvml.gpu import NvmlGPU
from kareus.devices.resolve import DEFAULT_SIMULATED, resolve_device
from kareus.devices.sim.model import SimulatedGPU

NO_GPU = FakeNvml.NVML_ERROR_DRIVER_NOT_LOADED
FAKE_OPTIONS = {"cuda": False, "reset_at_exit": False}


def test_auto_without_a_gpu_uses_the_simulated_default(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(nvml, "cuda_available", lambda: False)
    device = resolve_device("auto")
    assert isinstance(device, SimulatedGPU)
    assert device.name == resolve_device(DEFAULT_SIMULATED).name
    [record] = [r for r in caplog.records if r.name == "kareus"]
    assert "torch.cuda.is_available() is False" in record.getMessage()
    assert DEFAULT_SIMULATED in record.getMessage()


def test_auto_with_a_gpu_but_no_nvml_falls_back_and_says_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(nvml, "cuda_available", lambda: True)
    device = resolve_device("auto", nvml_module=FakeNvml(init_error=NO_GPU), **FAKE_OPTIONS)
    assert isinstance(device, SimulatedGPU)
    assert "driver is not loaded" in caplog.records[-1].getMessage()


def test_auto_with_a_gpu_and_nvml_opens_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nvml, "cuda_available", lambda: True)
    with resolve_device("auto", nvml_module=FakeNvml(), **FAKE_OPTIONS) as device:
        assert isinstance(device, NvmlGPU) and not device.dry_run


def test_nvml_and_dry_run() -> None:
    fake = FakeNvml([FakeGpu(name="NVIDIA H200", default_power_limit_mw=700_000)])
    with resolve_device("nvml-dry-run", nvml_module=fake, **FAKE_OPTIONS) as device:
        assert device.dry_run and device.name.startswith("nvml-dry-run:0")
    with resolve_device("nvml", nvml_module=fake, static_power_w=100.0, **FAKE_OPTIONS) as device:
        assert not device.dry_run and device.static_power_w == 100.0


def test_nvml_without_a_gpu_is_a_clear_error() -> None:
    with pytest.raises(NvmlUnavailableError, match="driver is not loaded.*sim:h200"):
        resolve_device("nvml", nvml_module=FakeNvml(init_error=NO_GPU), **FAKE_OPTIONS)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the real library on a GPU-less host")
def test_nvml_without_a_gpu_through_the_real_bindings() -> None:
    with pytest.raises(NvmlUnavailableError, match="NVML is not usable"):
        resolve_device("nvml", reset_at_exit=False)


def test_simulated_presets_and_the_same_device_back() -> None:
    device = resolve_device("sim:h200")
    assert isinstance(device, SimulatedGPU)
    assert resolve_device(device) is device


@pytest.mark.parametrize("spec", ["", "cuda", "sim:", "sim:h300", "nvml:0", "gpu", 42, None])
def test_bad_values_name_the_accepted_ones(spec: object) -> None:
    with pytest.raises(DeviceSpecError) as info:
        resolve_device(spec)  # type: ignore[arg-type]
    for accepted in resolve.ACCEPTED_DEVICES:
        assert accepted in str(info.value)


def test_unknown_preset_lists_the_presets() -> None:
    with pytest.raises(DeviceSpecError, match="presets: .*sim:h200"):
        resolve_device("sim:h300")


def test_custom_gpu_file(tmp_path: Path) -> None:
    path = tmp_path / "my-gpu.json"
    path.write_text(json.dumps({"base": "sim:h200", "name": "my-h200", "static_power_w": 99.0}))
    for spec in (str(path), path):
        device = resolve_device(spec)
        assert isinstance(device, SimulatedGPU) and device.static_power_w == 99.0
    with pytest.raises(DeviceSpecError, match="no such file"):
        resolve_device(f"{tmp_path}/missing.json")



def test_a_directory_is_reported_as_one_not_as_a_missing_file(tmp_path: Path) -> None:
    for name in ("specs", "gpu.json"):
        (tmp_path / name).mkdir()
        with pytest.raises(DeviceSpecError, match=f"{tmp_path / name} is a directory") as info:
            resolve_device(str(tmp_path / name))
        assert "no such file" not in str(info.value)


def test_an_invalid_custom_gpu_is_refused_without_opening_a_device(tmp_path: Path) -> None:
    path = tmp_path / "gpu.json"
    path.write_bytes(b"\x89PNG\r\n")
    with pytest.raises(GPUSpecError, match="gpu.json.*not a UTF-8 JSON file"):
        resolve.check_device(str(path))
    path.write_text(json.dumps({"base": "sim:h200", "name": "x", "tdp_w": 1e300}))
    with pytest.raises(GPUSpecError, match=r"gpu.json.*tdp_w must be a finite number in"):
        resolve.check_device(str(path))
    with pytest.raises(DeviceSpecError, match="no such file"):
        resolve.check_device(str(tmp_path / "missing.json"))
    for fine in ("auto", "nvml", "sim:h200"):
        resolve.check_device(fine)  # names only: no NVML opened, no file read
