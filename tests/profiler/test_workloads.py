"""One partition materialised alone, as the profiler measures it."""

import operator

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from conftest import analysed, tp_llama
from torch.testing import FileCheck

from kareus.devices import SimulatedGPU
from kareus.devices.sim.model import Step, graph_cost
from kareus.passes.placement import Split, Whole
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
    for sliced in (True, False):  # a graph input the rewrite slices, or a value computed
        half = _random_like(val, Split(0), sliced, 2)
        assert half.shape == (2, 16, 8, 3)
        half.permute(0, 1, 3, 2).view(2, 16, 24)  # the view the graph makes: needs the layout
    assert _random_like(val, Split(0), True, 2).stride() == val.stride()
    with pytest.raises(RuntimeError, match="view"):
        torch.randn(2, 16, 8, 3).permute(0, 1, 3, 2).view(2, 16, 24)


def test_a_value_computed_per_nanobatch_is_dense_where_a_slice_would_not_be():
    # One nanobatch of a value split along an inner dim: the rewrite's op computes it
    # dense (torch 2.11's collectives take nothing else); a graph input is sliced.
    val = torch.empty(8, 4, 16)
    assert _random_like(val, Split(1), False, 2).is_contiguous()
    assert not _random_like(val, Split(1), True, 2).is_contiguous()
    grouped = torch.empty(4, 2, 1, 8, 16).expand(4, 2, 3, 8, 16)  # GQA keys over heads
    assert _random_like(grouped, Split(0), False, 2).stride() == (256, 128, 0, 16, 1)


class MaskedBlock(torch.nn.Module):
    """Two all-reduces; between them a per-sample mask made by ops that mix the batch
    (barriers: computed once on the whole batch) and applied per nanobatch."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 16)

    def forward(self, x, mask):
        h = torch.relu(funcol.all_reduce(self.a(x), "sum", dist.group.WORLD))
        h = self.b(h * torch.flip(mask, dims=[0]).cumsum(0))
        return funcol.all_reduce(h, "sum", dist.group.WORLD)


def test_barriers_stay_out_and_whole_values_come_in_sliced(fake_pg):
    # As the rewrite runs them: barriers once per graph, outside a nanobatch's compute;
    # their value comes in whole and is sliced where the compute pairs it with a nanobatch.
    # (On HF Llama with padding the profiler refused the partitions holding the mask and
    # broadcast the whole mask against a nanobatch.)
    torch.manual_seed(0)
    graphs = analysed(MaskedBlock(), torch.randn(4, 8), torch.randn(4, 16))
    (_, forward), _ = graphs
    place = forward.placements[2]
    first, second = forward.partitioning.partitions
    assert {n.name for n in first.nodes if isinstance(place.placements[n], Whole)} == {
        "rev", "cumsum"
    }
    code = partition_workload(first, place, 2, 0, world_size=2).gm.code
    FileCheck().check("all_reduce").check("addmm").check_not("flip").check_not("cumsum").run(code)
    code = partition_workload(second, place, 2, 0, world_size=2).gm.code
    FileCheck().check("forward(").check("cumsum").check("slice.Tensor(cumsum, 0, 0, 2)").check(
        "mul.Tensor").run(code)
    for _, a in graphs:
        for p in a.partitioning.partitions:
            for slot in range(len(p.slots) + 1):
                waited, *sinks = partition_workload(p, a.placements[2], 2, slot, world_size=2).run()
                assert waited.shape[0] == 2 and all(s.shape[0] in (2, 16, 8) for s in sinks)


def test_items_of_a_tuple_computed_elsewhere_come_in_as_tensors(fake_pg):
    # Sequence parallelism over heads: the attention backward ends one partition and each
    # of its gradients (items of its tuple) is the all-to-all of a later one.
    from test_all_to_all import UlyssesAttention

    torch.manual_seed(0)
    _, (_, backward) = analysed(UlyssesAttention(), torch.randn(4, 8, 32))
    place = backward.placements[2]
    attention = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    reading = [p for p in backward.partitioning.partitions
               if any(n.target is operator.getitem and n.args[0].target is attention
                      and n.args[0] not in p.nodes for n in p.nodes)]
    assert reading, "no partition takes the attention's gradients from another"
    for p in reading:
        workload = partition_workload(p, place, 2, 0, world_size=2)
        assert "operator.getitem" not in workload.gm.code  # the items are its inputs
        waited, *_ = workload.run()
        assert waited.shape[1] == 2  # the other nanobatch's all-to-all: half the batch
