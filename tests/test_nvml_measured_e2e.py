"""Measured steps on a real GPU's path, on CPU: 2 gloo ranks, each an ``nvml`` device on a
fake driver (the setup of test_nvml_plan_e2e.py). Once the plan runs, each rank measures its
steps with the energy counter: ``kareus.current_plan()`` carries the energy and time per step
beside the prediction, each the counter's difference (and the time) between two readings
over the window's steps; with the GPU drawing a constant power from then on, energy over
time is that power. The ranks' energies add up to the total, and ``kareus show`` of the plan
rank 0 stored prints the measurement."""

import pytest
import torch
import torch.distributed as dist
from gloo import leave, report, run_ranks
from rich.console import Console
from test_nvml_plan_e2e import CLOCKS, Block

from kareus.runtime.step_meter import WINDOW_STEPS

pytestmark = pytest.mark.slow

WATTS = (250.0, 320.0)  # what each rank's GPU draws once the plan runs
STEPS = 40


def _worker(rank, port, out_dir, cache_dir):
    from fake_pynvml import FakeGpu, FakeNvml, FakePowerModel

    import kareus
    from kareus.devices.nvml.gpu import NvmlGPU
    from kareus.profiler.measure import Protocol
    from kareus.show import show

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        fake = FakeNvml([FakeGpu(uuid=f"GPU-fake-{rank}", power_model=FakePowerModel.of(),
                                 graphics_clocks={1215: CLOCKS})])
        # static power under the fake's idle 45 W: a busy machine's rank, idle for most of a
        # window, would otherwise measure a negative effective energy, which a plan file
        # cannot hold
        gpu = NvmlGPU(nvml_module=fake, cuda=False, min_window_s=0.05, settle_s=0.0,
                      reset_at_exit=False, static_power_w=40.0)
        counted, readings = [], []  # what the counter returned (mJ); what the meter read
        counter, read = fake.nvmlDeviceGetTotalEnergyConsumption, gpu.read_energy

        def counting(handle):
            counted.append(counter(handle))
            return counted[-1]

        def reading():
            readings.append(read())
            return readings[-1]

        fake.nvmlDeviceGetTotalEnergyConsumption, gpu.read_energy = counting, reading
        torch._dynamo.reset()
        backend = kareus.KareusBackend(
            {"lowering": "eager", "cache_dir": cache_dir, "search_budget": 3,
             "agreement_timeout_s": 60.0, "nanobatches": 2,
             "energy_time_tradeoff": 0.5},  # a budget every frontier meets
            device=gpu, protocol=Protocol(repeats=1, max_repeats=1),  # profiles fast
        )
        torch.manual_seed(0)
        compiled = torch.compile(Block(), backend=backend)
        x = torch.randn(32, 256, generator=torch.Generator().manual_seed(1))
        measured = []
        for step in range(STEPS):
            compiled(x).sum().backward()
            if step == 0:  # planned at the first backward: a constant power from now on
                assert backend.planner.plan is not None
                fake.set_power(0, WATTS[rank])
                fake.gpus[0].power_model = None
            now = kareus.current_plan().measured
            if now is not None and (not measured or measured[-1] != now):
                measured.append(now)
        shown = Console(record=True, width=300)
        if rank == 0:
            show(backend.planner.path, out=f"{out_dir}/plan.png", console=shown)
        report(out_dir, rank, {
            "plan": kareus.current_plan(), "made": backend.planner.plan, "measured": measured,
            "readings": readings, "counted": counted, "shown": shown.export_text(),
        })
        gpu.close()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    leave()


def test_a_planned_run_reports_its_measured_steps_beside_the_prediction(tmp_path):
    ranks = run_ranks(_worker, str(tmp_path))
    for r, result in enumerate(ranks):
        plan, measured, readings = result["plan"], result["measured"], result["readings"]
        assert plan.measured == measured[-1] and plan.digest == result["made"].digest
        assert result["made"].measured is None  # the decision is the plan without it
        # each window is the counter's difference between two readings, per step
        assert len(readings) == len(measured) + 1 >= 3
        for m, start, end in zip(measured, readings, readings[1:]):
            assert m.rank == r and m.world_size == 2 and m.method == "nvml-energy-counter"
            assert m.steps >= WINDOW_STEPS and m.first_step >= 2  # step 1 warms up
            assert m.energy_j == (end.energy_j - start.energy_j) / m.steps
            assert m.time_s == (end.time_s - start.time_s) / m.steps
            # the driver integrates on its own clock: a rank descheduled between reading
            # the timer and the counter (2 ranks share 2 cores) shifts a window's ends
            assert m.energy_j / m.time_s == pytest.approx(WATTS[r], rel=0.1)
            assert m.energy_j != plan.predicted.energy_j
        for later, earlier in zip(measured[1:], measured):
            assert later.first_step == earlier.first_step + earlier.steps
        # ... read from the driver's counter itself
        assert {round(e.energy_j * 1000) for e in readings} <= set(result["counted"])
    for r, result in enumerate(ranks):  # every rank's energy, as the other measured it
        last = result["measured"][-1]
        assert [rank for rank, _ in last.gpu_energy_j] == [0, 1]
        other = dict(last.gpu_energy_j)[1 - r]
        assert other in {m.energy_j for m in ranks[1 - r]["measured"]}
        assert last.total_energy_j == sum(j for _, j in last.gpu_energy_j)
    shown = ranks[0]["shown"]
    assert "measured per step (rank 0, steps " in shown and "J on all 2 GPUs" in shown
    assert "of the prediction" in shown
