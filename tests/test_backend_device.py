"""The ``device`` option as the backend uses it: estimates on simulated GPUs, NVML clock control."""

import pytest
import torch
from conftest import tp_llama
from fake_pynvml import FakeNvml

import kareus
import kareus.backend
from kareus.runtime.clock import NullClockController, active_controller, set_active_controller
from kareus.profiler.devices.errors import NvmlUnavailableError
from kareus.profiler.devices.nvml import NvmlGPU


@pytest.fixture(autouse=True)
def fresh_devices():
    kareus.backend.open_device.cache_clear()
    previous = set_active_controller(NullClockController())
    yield
    kareus.backend.open_device.cache_clear()
    set_active_controller(previous)


def test_simulated_device_estimates_each_graph_at_its_default_clock(fake_pg):
    model = torch.compile(tp_llama(1), backend="kareus", options={"device": "sim:a100-sxm4-40gb"})
    model(torch.randint(0, 256, (2, 8))).sum().backward()
    for report in kareus.graph_reports():
        assert report.device == "sim:a100-sxm4-40gb"
        est = report.estimate
        assert est.method == "simulated" and est.clock_mhz == 1410
        assert est.time_s > 0 and est.energy_j > est.static_power_w * est.time_s
    # a simulated device controls no clock: the process-wide controller is untouched
    assert isinstance(active_controller(), NullClockController)


def test_auto_on_a_cpu_machine_uses_the_simulated_default_and_says_so(caplog):
    torch.compile(lambda x: x * 2, backend="kareus")(torch.randn(3))
    (report,) = kareus.graph_reports()
    assert report.device == "sim:h200"
    assert 'device="auto": torch sees no CUDA GPU' in caplog.text


def test_nvml_without_a_gpu_fails_with_what_to_do():
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        torch.compile(lambda x: x * 2, backend="kareus", options={"device": "nvml"})(torch.randn(3))
    assert isinstance(info.value.inner_exception, NvmlUnavailableError)


def test_nvml_device_drives_clock_switches(monkeypatch):
    fake = FakeNvml()
    gpu = NvmlGPU(nvml_module=fake, cuda=False, reset_at_exit=False)
    monkeypatch.setattr(kareus.backend, "resolve_device", lambda spec: gpu)
    f = torch.compile(lambda x: x.sin(), backend="kareus", options={"device": "nvml"})
    f(torch.randn(3))
    controller = active_controller()
    assert controller is gpu.clock_controller()
    controller.flush()
    # the graph asks for the default clock, which the GPU already runs: no setter call
    assert fake.setter_calls() == []
    assert kareus.graph_reports()[0].estimate is None
    gpu.close()


def test_a_controller_installed_by_the_user_wins(monkeypatch):
    fake = FakeNvml()
    gpu = NvmlGPU(nvml_module=fake, cuda=False, reset_at_exit=False)
    monkeypatch.setattr(kareus.backend, "resolve_device", lambda spec: gpu)
    recorder = kareus.RecordingClockController()
    with kareus.use_controller(recorder):
        torch.compile(lambda x: x.cos(), backend="kareus", options={"device": "nvml"})(torch.randn(3))
        assert active_controller() is recorder
    assert len(recorder.switches) == 1
    gpu.close()
