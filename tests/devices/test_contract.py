"""The one device contract, checked on both devices: the simulated GPU and the NVML GPU
(against a fake driver). Same error classes for the same mistakes; capabilities instead
of type checks."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
import torch.distributed as dist
from conftest import init_fake_pg
from fake_pynvml import FakeClock, FakeNvml
from sim_graphs import collective

from kareus.devices import Device, SimulatedGPU, Workload, errors
from kareus.devices.errors import UnsupportedClockError, UnsupportedMeasurementError
from kareus.devices.nvml.gpu import NvmlGPU
from kareus.errors import KareusError

DEVICES = ("simulated", "nvml", "nvml-dry-run")


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def workload(clock: FakeClock) -> Iterator[Workload]:
    """An 8-rank all-reduce the simulator costs from its graph and the NVML GPU times by
    running it (the run only moves the fake driver's clock)."""
    init_fake_pg(8)
    gm = collective("all_reduce", 1 << 20, dist.group.WORLD.group_name)
    yield Workload("all_reduce", gm, run=lambda: clock.advance(0.01), world_size=8)
    dist.destroy_process_group()


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest, clock: FakeClock) -> Iterator[Device]:
    """Both devices model or have an A100 SXM4 (SM clocks 210..1410 MHz in 15 MHz steps)."""
    if request.param == "simulated":
        yield SimulatedGPU("sim:a100-sxm4-40gb")
        return
    with NvmlGPU(
        dry_run=request.param == "nvml-dry-run",
        nvml_module=FakeNvml(clock=clock),
        cuda=False,
        timer=clock,
        sleep=lambda seconds: None,
        min_window_s=0.05,
        reset_at_exit=False,
    ) as gpu:
        yield gpu


def test_every_device_error_is_a_kareus_error_and_a_runtime_error() -> None:
    classes = [
        c for c in vars(errors).values() if isinstance(c, type) and c.__module__ == errors.__name__
    ]
    assert len(classes) > 10
    for cls in classes:
        assert issubclass(cls, errors.DeviceError)
        assert issubclass(cls, KareusError) and issubclass(cls, RuntimeError)


def test_an_unsupported_clock_raises_the_same_class(device: Device, workload: Workload) -> None:
    assert 1234 not in device.supported_clocks()
    message = "1234 MHz is not a supported SM clock.*nearest: 1230 MHz"
    with pytest.raises(UnsupportedClockError, match=message):
        device.measure(workload, 1234)


@pytest.mark.parametrize(
    "resources",
    [
        {"no_such_node": 8},
        {"all_reduce": 0},
        {"all_reduce": 108},  # every SM of an A100: none left for compute
        {"all_reduce": 2.5},
        {"all_reduce": True},
    ],
    ids=["unknown-collective", "zero", "all-sms", "float", "bool"],
)
def test_a_cap_the_device_cannot_apply_raises_the_same_class(
    device: Device, workload: Workload, resources: dict[str, object]
) -> None:
    message = f"{re.escape(device.name)} cannot measure with"
    with pytest.raises(UnsupportedMeasurementError, match=message):
        device.measure(workload, 1410, resources=resources)


def test_default_caps_measure_like_no_caps(device: Device, workload: Workload) -> None:
    plain = device.measure(workload, 1410)
    for resources in ({}, {"all_reduce": None}):
        again = device.measure(workload, 1410, resources=resources)
        assert again.time_s == pytest.approx(plain.time_s)
        assert again.energy_j == pytest.approx(plain.energy_j, rel=1e-3)
        assert again.resources == plain.resources == ()


def test_estimate_without_running_where_the_device_can(device: Device, workload: Workload) -> None:
    estimate = device.estimate(workload.gm, workload.world_size)
    if isinstance(device, SimulatedGPU):
        assert estimate == device.measure(workload, device.search_clocks()[0])
    else:
        assert estimate is None  # a real GPU measures only by running


@pytest.mark.regression
def test_only_this_process_gpu_takes_the_graphs_clock_switches(device: Device) -> None:
    assert device.controls_clocks is not isinstance(device, SimulatedGPU)
