"""The fake NVML driver's power model and energy counter, which the NVML tests rely on."""

from __future__ import annotations

import time

import pytest
from fake_pynvml import FakeClock, FakeGpu, FakeNvml, FakePowerModel, opened

from kareus.devices.base import Workload
from kareus.devices.nvml.gpu import NvmlGPU
from kareus.devices.sim.presets import A100_SXM4_40GB


class CpuTime:
    """This process's CPU time as a test on a ``FakeClock`` says it went."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def modelled(**kwargs: object) -> tuple[FakeNvml, FakeGpu, FakeClock, CpuTime]:
    clock, cpu = FakeClock(), CpuTime()
    gpu = FakeGpu(power_model=FakePowerModel.of(cpu_time=cpu), **kwargs)
    fake, handle = opened(FakeNvml([gpu], clock=clock))
    return fake, handle, clock, cpu


def joules_over(fake: FakeNvml, gpu: FakeGpu, clock: FakeClock, cpu: CpuTime, busy: float) -> float:
    """Energy of one second of fake time during which the CPU was busy ``busy`` of it."""
    start = fake.nvmlDeviceGetTotalEnergyConsumption(gpu)
    clock.advance(1.0)
    cpu.now += busy
    return (fake.nvmlDeviceGetTotalEnergyConsumption(gpu) - start) / 1000.0


def test_power_follows_the_locked_clock_and_the_activity() -> None:
    fake, gpu, clock, cpu = modelled()
    model = gpu.power_model
    assert model.active_w(900) == pytest.approx(
        85.0 + A100_SXM4_40GB.sm_power_coeff * 900 * A100_SXM4_40GB.voltage(900) ** 2
    )
    assert model.active_w(1410) == 400.0  # 528 W unlimited: held at the limit
    assert joules_over(fake, gpu, clock, cpu, busy=0.0) == pytest.approx(45.0, abs=1e-3)
    assert joules_over(fake, gpu, clock, cpu, busy=1.0) == pytest.approx(400.0, abs=1e-3)
    fake.nvmlDeviceSetGpuLockedClocks(gpu, 900, 900)
    assert gpu.sm_clock_mhz == 900
    assert joules_over(fake, gpu, clock, cpu, busy=0.5) == pytest.approx(
        45.0 + (model.active_w(900) - 45.0) * 0.5, abs=1e-3
    )
    assert fake.nvmlDeviceGetPowerUsage(gpu) == round(1000 * model.power_w(900, 0.5))
    busier_than_one_cpu = joules_over(fake, gpu, clock, cpu, busy=3.0)  # other threads too
    assert busier_than_one_cpu == pytest.approx(model.active_w(900), abs=1e-2)


def test_energy_before_a_clock_change_is_counted_at_the_old_clock() -> None:
    fake, gpu, clock, cpu = modelled()
    start = fake.nvmlDeviceGetTotalEnergyConsumption(gpu)
    clock.advance(1.0)
    cpu.now += 1.0
    fake.nvmlDeviceSetGpuLockedClocks(gpu, 900, 900)
    clock.advance(1.0)
    cpu.now += 1.0
    joules = (fake.nvmlDeviceGetTotalEnergyConsumption(gpu) - start) / 1000.0
    assert joules == pytest.approx(400.0 + gpu.power_model.active_w(900), abs=1e-3)


def test_without_a_model_power_is_constant() -> None:
    fake, gpu = opened(FakeNvml(clock=(clock := FakeClock())))
    fake.nvmlDeviceSetGpuLockedClocks(gpu, 900, 900)
    start = fake.nvmlDeviceGetTotalEnergyConsumption(gpu)
    clock.advance(2.0)
    assert fake.nvmlDeviceGetTotalEnergyConsumption(gpu) - start == 600_000
    assert fake.nvmlDeviceGetPowerUsage(gpu) == 300_000


def test_the_counter_reads_the_energy_at_its_last_update() -> None:
    clock = FakeClock(1000.0)
    fake, gpu = opened(FakeNvml([FakeGpu(counter_period_s=0.5)], clock=clock))
    first = fake.nvmlDeviceGetTotalEnergyConsumption(gpu)  # at 1000.0, a boundary
    clock.advance(0.4)
    assert fake.nvmlDeviceGetTotalEnergyConsumption(gpu) == first  # same period
    clock.advance(0.2)  # 1000.6: the 1000.5 update is read
    assert fake.nvmlDeviceGetTotalEnergyConsumption(gpu) - first == 150_000
    clock.advance(1.3)  # 1001.9: two more updates since
    assert fake.nvmlDeviceGetTotalEnergyConsumption(gpu) - first == 450_000
    assert gpu.energy_mj - 5.0e7 == pytest.approx(570_000)  # the truth moves on


def test_a_stalled_counter_never_advances() -> None:
    clock = FakeClock()
    fake, gpu = opened(FakeNvml([FakeGpu(counter_stalled=True)], clock=clock))
    first = fake.nvmlDeviceGetTotalEnergyConsumption(gpu)
    clock.advance(60.0)
    assert fake.nvmlDeviceGetTotalEnergyConsumption(gpu) == first


def test_real_cpu_work_draws_more_energy_at_a_higher_clock_than_idling() -> None:
    """As a CPU-only gloo test sees it: real time, real CPU time, real work."""
    fake = FakeNvml([FakeGpu(power_model=FakePowerModel.of())])

    def spin() -> None:
        end = time.perf_counter() + 0.005
        while time.perf_counter() < end:
            pass

    def rest() -> None:
        time.sleep(0.005)

    with NvmlGPU(nvml_module=fake, cuda=False, reset_at_exit=False, min_window_s=0.1,
                 settle_s=0.0) as gpu:
        power = {
            (name, mhz): gpu.measure(Workload(name, run=run), mhz).average_power_w
            for name, run in (("spin", spin), ("rest", rest))
            for mhz in (1410, 900)
        }
    # How busy spinning keeps this process depends on what else the machine runs (about
    # half of a CPU on a loaded one), so only the orderings are checked.
    assert power["spin", 1410] > power["spin", 900] > 1.5 * power["rest", 900]
    assert power["spin", 1410] > 1.5 * power["rest", 1410]
    assert power["rest", 1410] < 0.25 * fake.gpus[0].power_model.active_w(1410)
