"""One partition materialised alone, as the profiler measures it."""

import pytest
import torch
from conftest import analysed, tp_llama

from kareus.passes.placement import Split
from kareus.profiler.devices import SimulatedGPU
from kareus.profiler.devices.simulated import Step, graph_cost
from kareus.profiler.workloads import _random_like, partition_workload


def test_partition_alone_runs_and_costs_on_one_nanobatch(fake_pg):
    ((_, a),) = analysed(tp_llama(2), torch.randint(0, 256, (4, 16)), backward=False)
    mlp = a.partitioning.partitions[4]
    gpu = SimulatedGPU("sim:h200")
    times = []
    for slot in (0, len(mlp.slots)):
        workload = partition_workload(mlp, a.placements[2], 2, slot, world_size=2)
        waited, *_ = workload.run()
        assert waited.shape == (2, 16, 64)  # the other nanobatch's all-reduce: half the batch
        times.append(gpu.measure(workload, gpu.search_clocks()[0]).time_s)
    # Issued first, the collective runs behind the compute (joined at the end); issued
    # last, all of it is exposed.
    assert times[0] < times[1], "issuing the collective first hides it behind the compute"
    first = graph_cost(partition_workload(mlp, a.placements[2], 2, 0, world_size=2).gm, 2)
    steps = [step for step, _ in first.program]
    assert steps[0] is Step.ISSUE and steps[-1] is Step.WAIT and Step.COMPUTE in steps


def test_random_inputs_keep_the_graphs_layout():
    # A backward graph may take a permuted saved tensor and view it in a way only that
    # layout allows (seen on a TP8 Llama block's backward partition).
    val = torch.empty(4, 16, 3, 8).permute(0, 1, 3, 2)  # [4, 16, 8, 3], channels-last-like
    half = _random_like(val, Split(0), 2)
    assert half.shape == (2, 16, 8, 3) and half.stride() == val.stride()
    half.permute(0, 1, 3, 2).view(2, 16, 24)  # the view the graph makes: needs the layout
    with pytest.raises(RuntimeError, match="view"):
        torch.randn(2, 16, 8, 3).permute(0, 1, 3, 2).view(2, 16, 24)
