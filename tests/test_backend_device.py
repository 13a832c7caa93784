"""The ``device`` option as the backend uses it: estimates on simulated GPUs, NVML clock control."""

import pytest
import torch
from conftest import tp_llama
from fake_pynvml import LOCK, RESET, FakeNvml

import kareus
from kareus import KareusBackend
from kareus.devices.errors import NvmlUnavailableError
from kareus.devices.nvml.gpu import NvmlGPU

pytestmark = pytest.mark.usefixtures("fresh_runtime")


def test_simulated_device_estimates_each_graph_at_its_default_clock(fake_pg, fresh_runtime):
    backend = KareusBackend({"device": "sim:a100-sxm4-40gb", "nanobatches": 1, "profile": "off"})
    torch.compile(tp_llama(1), backend=backend)(torch.randint(0, 256, (2, 8))).sum().backward()
    for report in backend.reports():
        assert report.device == "sim:a100-sxm4-40gb"
        est = report.estimate
        assert est.method == "simulated" and est.clock_mhz == 1410
        assert est.time_s > 0 and est.energy_j > est.static_power_w * est.time_s
    # a simulated device controls no clock: the process's default controller is untouched
    assert isinstance(fresh_runtime.clocks.current(), kareus.NullClockController)


def test_auto_on_a_cpu_machine_uses_the_simulated_default_and_says_so(caplog):
    backend = KareusBackend()
    torch.compile(lambda x: x * 2, backend=backend)(torch.randn(3))
    (report,) = backend.reports()
    assert report.device == "sim:h200"
    assert 'device="auto": torch sees no CUDA GPU' in caplog.text


def test_nvml_without_a_gpu_fails_with_what_to_do():
    backend = KareusBackend({"device": "nvml"})
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        torch.compile(lambda x: x * 2, backend=backend)(torch.randn(3))
    assert isinstance(info.value.inner_exception, NvmlUnavailableError)
    assert isinstance(info.value.inner_exception, kareus.KareusError)


@pytest.fixture
def nvml_gpu():
    """A GPU behind a fake NVML."""
    fake = FakeNvml()
    gpu = NvmlGPU(nvml_module=fake, cuda=False, reset_at_exit=False)
    yield fake, gpu
    gpu.close()


def test_nvml_device_drives_the_graphs_clock_switches(nvml_gpu, fresh_runtime):
    fake, gpu = nvml_gpu
    backend = KareusBackend({"device": "nvml"}, clock_mhz=1200, device=gpu)
    torch.compile(lambda x: x.sin(), backend=backend)(torch.randn(3))
    controller = fresh_runtime.clocks.current()
    assert controller is gpu.clock_controller()
    controller.flush()
    (report,) = backend.reports()
    assert report.clock_mhz == 1200 and report.estimate is None
    # the graph's entry asked the GPU for its decided clock: one lock through NVML (after
    # the reset that probed, at open, whether this process may lock clocks)
    assert [c[0] for c in fake.setter_calls()] == [RESET, LOCK]
    assert fake.setter_calls()[1][-2:] == (1200, 1200)
    assert [(s.graph, s.mhz) for s in controller.switches] == [(report.label, 1200)]


def test_a_controller_installed_by_the_user_wins(nvml_gpu, fresh_runtime):
    fake, gpu = nvml_gpu
    backend = KareusBackend({"device": "nvml"}, clock_mhz=1200, device=gpu)
    recorder = kareus.RecordingClockController()
    with kareus.use_controller(recorder):
        torch.compile(lambda x: x.cos(), backend=backend)(torch.randn(3))
        assert fresh_runtime.clocks.current() is recorder
    assert [s.mhz for s in recorder.switches] == [1200]
    gpu.clock_controller().flush()
    assert fake.setter_calls() == [(RESET, 0)]  # only the permission probe at open
