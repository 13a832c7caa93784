"""Planning on a real GPU's path, on CPU, under the multiplexed protocol: 2 gloo ranks,
each an ``nvml`` device on a fake driver whose power follows the locked clock (busy
throughout: a loaded CI machine's scheduling would otherwise move power by more than the
clocks do). Whole graphs are measured on their first call's inputs, the step's together,
stored, planned under a budget, and the plan runs with its clock switches; the next run
measures nothing; without permission to lock clocks the
overlap is planned at the default clock and a budget that needs clocks is refused with the
reachable range; a rank slowed by 2 s is waited for."""

import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from gloo import leave, report, run_ranks

pytestmark = pytest.mark.slow

CLOCKS = (1410, 1200, 1005, 810)  # a short search: 3 measured clocks per variant


class Block(torch.nn.Module):
    """Enough work per call that the process is busy while it is measured."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(256, 1024), torch.nn.Linear(1024, 256)

    def forward(self, x):
        return self.b(torch.relu(funcol.all_reduce(self.a(x), "sum", dist.group.WORLD)))


def _train(gpu, options, cache_dir, steps=3):
    import kareus
    from kareus.profiler import graph_cost, profile

    measured = []
    for module, name in ((graph_cost, "measure_batch"), (profile, "measure_batch")):
        original = getattr(module, name)

        def counting(device, work, *args, _original=original, **kwargs):
            measured.extend(w.name for w in (work if isinstance(work, list) else [work]))
            return _original(device, work, *args, **kwargs)

        setattr(module, name, counting)
    torch._dynamo.reset()
    backend = kareus.KareusBackend(
        {"lowering": "eager", "cache_dir": cache_dir, "search_budget": 3,
         "agreement_timeout_s": 60.0, **options},
        device=gpu,
    )
    torch.manual_seed(0)
    compiled = torch.compile(Block(), backend=backend)
    x = torch.randn(32, 256, generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        compiled(x).sum().backward()
    plan = backend.planner.plan
    return {
        "plan": None if plan is None else (
            plan.digest, plan.predicted, plan.baseline,
            tuple((g.label, g.choice) for g in plan.graphs), plan.budget),
        "measured": len(measured),
        "notes": [n for r in backend.reports() for n in r.notes],
        "gpu_s": backend.spend.total_s,
    }


def _worker(rank, port, out_dir, cache_dir, case):
    from fake_pynvml import FakeGpu, FakeNvml, FakePowerModel

    from kareus.devices.nvml.counter import CounterBehaviour
    from kareus.devices.nvml.gpu import NvmlGPU
    from kareus.devices.nvml.multiplex import MultiplexPolicy
    from kareus.planner.budget import BudgetError
    from kareus.profiler.store import ProfileStore

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        model = FakePowerModel.of(cpu_time=time.monotonic)  # activity 1, on the fake's clock
        fake = FakeNvml([FakeGpu(uuid=f"GPU-fake-{rank}", power_model=model,
                                 graphics_clocks={1215: CLOCKS})],
                        can_set_clocks=case != "no permission")
        # the counter as a probe finds a continuous one (tests/devices/test_counter.py)
        counter = CounterBehaviour(fake.gpus[0].name, "fake", 0.001, True, 0.0, 0.0)
        gpu = NvmlGPU(nvml_module=fake, cuda=False, min_window_s=0.05, settle_s=0.0,
                      reset_at_exit=False, counter=counter,
                      multiplexing=MultiplexPolicy(block_s=0.03, max_block_s=0.05))
        results = {"search_clocks": gpu.search_clocks()}
        if rank == 1 and case == "first":
            time.sleep(2.0)  # the slow rank: the other waits for it at every exchange
        if case in ("first", "again"):
            results["energy"] = _train(gpu, {"nanobatches": 2, "energy_budget": 0.9},
                                       cache_dir)
        else:
            results["fastest"] = _train(gpu, {"nanobatches": "auto", "time_budget": None},
                                        cache_dir)
            try:
                _train(gpu, {"nanobatches": "auto", "energy_budget": 0.5}, cache_dir, steps=1)
            except BudgetError as exc:
                results["refused"] = str(exc)
        with ProfileStore(cache_dir=cache_dir, read_only=True) as store:
            results["methods"] = {e.measurement.method for k in store.keys()  # noqa: SIM118 (a method)
                                  for e in store.evaluations(k)}
        results["setters"] = fake.setter_calls()
        gpu.close()
        results["after close"] = fake.setter_calls()[len(results["setters"]):]
        results["locked"] = fake.gpus[0].locked
        report(out_dir, rank, results)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    leave()


def test_an_energy_budget_is_planned_from_measured_graphs_and_the_plan_runs(tmp_path):
    first = run_ranks(_worker, str(tmp_path), "first")
    plans = [r["energy"]["plan"] for r in first]
    assert plans[0] is not None and plans[0] == plans[1]  # one plan, on both ranks
    _digest, predicted, baseline, choices, _budget = plans[0]
    assert predicted.energy_j <= 0.9 * baseline.energy_j  # the budget, met by measured costs
    assert predicted.energy_j > 0
    clocks = {choice.clock_mhz for _, choice in choices}
    assert clocks - {0} and clocks <= {0, *CLOCKS[1:]}
    for rank in first:
        assert rank["methods"] == {"nvml-multiplexed"}  # every point, multiplexed
        run = rank["energy"]
        assert run["measured"] > 0 and run["gpu_s"] > 0
        # the forward and the backward measured together, the ranks agreeing on them
        assert any("whole graph measured on its first call's inputs with 1 other graph of "
                   "the step" in n for n in run["notes"])
        assert any("checked in one 2 s window" in n for n in run["notes"])
        assert not any("cannot cost a whole graph" in n for n in run["notes"])
        locked = [args[-1] for name, *args in rank["setters"]
                  if name == "nvmlDeviceSetGpuLockedClocks"]
        assert set(clocks - {0}) <= set(locked)  # the plan's clock switches ran
        setters = rank["setters"] + rank["after close"]
        assert setters[-1][0] == "nvmlDeviceResetGpuLockedClocks"  # left at default clocks
        assert rank["locked"] is None

    again = run_ranks(_worker, str(tmp_path), "again")
    for rank in again:
        assert rank["energy"]["measured"] == 0 and rank["energy"]["gpu_s"] == 0
        assert rank["energy"]["plan"] == plans[0]


def test_without_permission_the_overlap_is_planned_at_the_default_clock(tmp_path):
    for rank in run_ranks(_worker, str(tmp_path), "no permission"):
        assert rank["search_clocks"] == CLOCKS[:1]
        plan = rank["fastest"]["plan"]
        assert plan is not None and {c.clock_mhz for _, c in plan[3]} == {0}
        # the probing reset, refused, is the only setter ever called
        assert [name for name, *_ in rank["setters"]] == ["nvmlDeviceResetGpuLockedClocks"]
        assert rank["after close"] == []
        assert "no plan meets the energy budget 0.5 of the baseline" in rank["refused"]
        assert "NVML_ERROR_NO_PERMISSION" in rank["refused"]
