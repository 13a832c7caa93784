"""Placement rules on small traced graphs, and one partition materialised alone."""

import pytest
import torch
from conftest import tp_llama
from torch.fx.experimental.proxy_tensor import make_fx

import kareus
import kareus.backend
from kareus.passes.collectives import find_collectives
from kareus.passes.partition import partition_graph
from kareus.passes.placement import PARTIAL, REPLICATE, Split, Whole, _reshaped, propagate
from kareus.passes.variants import partition_workload
from kareus.profiler.devices import SimulatedGPU

aten = torch.ops.aten


@pytest.mark.parametrize(
    "src, dst, split, k, expected",
    [
        ((4, 16, 64), (64, 64), Split(0), 2, Split(0)),  # merge batch and sequence
        ((64, 32), (4, 16, 32), Split(0), 2, Split(0)),  # and split them back
        ((4, 16, 64), (4, 16, 4, 16), Split(0), 4, Split(0)),  # heads
        ((1, 4, 16), (4, 16), Split(1), 2, Split(0)),  # leading 1s do not matter
        ((16, 4), (64,), Split(1), 2, "reshape merges the split dim into a dim it is not the outer part of"),
        ((4, 16), (2, 32), Split(0), 4, "reshape splits the split dim in a way nanobatches cannot follow"),
    ],
)
def test_reshape_follows_the_split_dim(src, dst, split, k, expected):
    assert _reshaped(split, src, dst, k) == expected


def _placements(fn, *args, split_inputs=(0,), k=2):
    gm = make_fx(fn)(*args)
    inputs = list(gm.graph.find_nodes(op="placeholder"))
    result = propagate(gm.graph, {inputs[i]: Split(0) for i in split_inputs}, k)
    return gm, {n.name: p for n, p in result.placements.items()}, result


def test_matmuls_keep_rows_and_turn_split_contractions_into_partial_sums():
    x, w = torch.randn(8, 4), torch.randn(4, 3)
    _, p, _ = _placements(lambda x, w: (x @ w, x.t() @ (x @ w)), x, w)
    assert p["mm"] == Split(0) and p["t"] == Split(1) and p["mm_2"] == PARTIAL
    assert p["w_1"] == REPLICATE


def test_sums_over_the_batch_are_partial_other_reductions_are_barriers():
    _, p, result = _placements(lambda x: (x.sum(0) * 2, x.mean(0), x.sum(1)), torch.randn(8, 4))
    assert p["sum_1"] == PARTIAL and p["mul"] == PARTIAL and p["sum_2"] == Split(0)
    assert isinstance(p["mean"], Whole)
    assert [b.reason for b in result.barriers] == ["reduction over the split dim"]


def test_broadcasting_and_replicated_operands():
    x, bias, per_row = torch.randn(8, 4), torch.randn(4), torch.randn(8, 1)
    _, p, result = _placements(lambda x, b, r: (x + b) * r, x, bias, per_row)
    # a replicated operand spanning the split dim is sliced, one of size 1 broadcasts
    assert p["mul"] == Split(0) and result.barriers == ()


def test_partial_sums_only_pass_linear_ops():
    _, p, result = _placements(lambda x: (x.sum(0) + 1, -x.sum(0)), torch.randn(8, 4))
    assert isinstance(p["add"], Whole) and p["neg"] == PARTIAL
    assert [b.reason for b in result.barriers] == ["partial sum plus a replicated value"]


def test_partition_alone_runs_and_costs_on_one_nanobatch(fake_pg):
    model = torch.compile(tp_llama(2), backend="kareus", options={"lowering": "eager"})
    graphs = []
    real_lower = kareus.backend.lower

    def spy(gm, *args, **kwargs):
        graphs.append(gm)
        return real_lower(gm, *args, **kwargs)

    kareus.backend.lower = spy
    try:
        model(torch.randint(0, 256, (4, 16)))
    finally:
        kareus.backend.lower = real_lower
    graph = graphs[0].graph
    from kareus.passes.interface import forward_inputs

    (report,) = kareus.graph_reports()
    collectives = find_collectives(graph)
    partitioning = partition_graph(graph, collectives)
    placements = propagate(graph, forward_inputs(graph, _static_inputs(graph)), 2)
    mlp = partitioning.partitions[4]
    gpu = SimulatedGPU("sim:h200")
    times = []
    for slot in (0, len(mlp.slots)):
        workload = partition_workload(mlp, placements, 2, slot, world_size=2)
        waited, *rest = workload.run()
        assert waited.shape == (2, 16, 64)  # the other nanobatch's all-reduce: half the batch
        times.append(gpu.measure(workload, gpu.search_clocks()[0]).time_s)
    assert times[0] < times[1], "issuing the collective first hides it behind the compute"


def _static_inputs(graph):
    """Parameters: every input but the tokens (the first) in this model's forward."""
    return list(range(1, len(list(graph.find_nodes(op="placeholder")))))


@pytest.mark.parametrize("mask_batch, split", [(1, True), (4, False)])
def test_attention_splits_unless_its_mask_varies_over_the_batch(mask_batch, split):
    import torch.nn.functional as F

    q = torch.randn(4, 2, 8, 16)
    mask = torch.randn(mask_batch, 1, 8, 8)
    gm, p, result = _placements(
        lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m), q, q, q, mask,
        split_inputs=(0, 1, 2),
    )
    (attention,) = [n for n in gm.graph.nodes if "attention" in str(n.target)]
    if split:
        assert p[attention.name][0] == Split(0) and result.barriers == ()
    else:
        assert isinstance(p[attention.name], Whole)
        assert "varies over the batch" in result.barriers[0].reason
