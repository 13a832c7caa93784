"""Row ids: the split resumes after an MoE's sort of its tokens by expert.

The experts' compute (transformers' grouped-mm experts, all its EP forms) sorts the
tokens' top-k slots by expert, runs each expert on its rows, and puts the rows back in
batch order through the sort's inverse permutation. The sort mixes the batch, so the
experts run once on the whole batch; but the inverse permutation is laid out like the
batch again, so what follows (the experts' all-reduce, the residual) splits, forward and
backward.
"""

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from conftest import analysed
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing import FileCheck

from kareus import KareusBackend
from kareus.codegen.apply import apply
from kareus.passes.decide import Policy, decide
from kareus.passes.ops import OP_TABLE
from kareus.passes.placement import Aligned, RowIds, Split, Whole, propagate
from kareus.profiler.workloads import partition_workload


class _SumGradients(torch.autograd.Function):
    """Identity; the backward all-reduces the gradient (every rank's experts saw every
    token: transformers' ``_AllReduceBackward``)."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return funcol.all_reduce(grad, "sum", dist.group.WORLD)


class SortedExperts(torch.nn.Module):
    """Top-2 routing over 4 experts, the experts run on slots sorted by expert (as
    transformers' grouped-mm experts do), the outputs all-reduced (its all-reduce EP)."""

    def __init__(self, dim: int = 8, experts: int = 4):
        super().__init__()
        self.router = torch.nn.Linear(dim, experts)
        self.w = torch.nn.Parameter(torch.randn(experts, dim, dim) / dim**0.5)

    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        weights, ids = self.router(tokens).softmax(-1).topk(2, dim=-1)
        expert_ids, order = torch.sort(ids.reshape(-1))
        rows = _SumGradients.apply(tokens)[order // 2]
        out = torch.bmm(rows.unsqueeze(1), self.w[expert_ids]).squeeze(1)
        out = out * weights.reshape(-1)[order].unsqueeze(-1)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.shape[0])
        out = out[inverse].view(tokens.shape[0], 2, -1).sum(1)
        out = funcol.all_reduce(out, "sum", dist.group.WORLD)
        return x + out.view_as(x)


def test_a_sorts_indices_are_row_ids_and_its_inverse_is_laid_out_like_the_batch(fake_pg):
    def fn(keys, values):  # the fresh tensors as AOT autograd writes them (empty, full)
        _, order = torch.sort(keys)
        tokens = order // 2
        inverse = torch.empty(8, dtype=torch.long).index_put([order], torch.arange(8))
        added = torch.full((4, 3), 0.0).index_put([tokens], values[order], accumulate=True)
        return (values[order] * 2)[inverse], added + 1, tokens + 1

    gm = make_fx(fn)(torch.randn(8), torch.randn(8, 3))
    keys, values = gm.graph.find_nodes(op="placeholder")
    p = {n.name: q for n, q in propagate(gm.graph, {keys: Split(0), values: Split(0)}, 2,
                                         OP_TABLE).placements.items()}
    values_sorted, order = p["sort"]
    assert type(values_sorted) is Whole and order == RowIds(values_sorted.reason, 8, True)
    assert p["floor_divide"] == RowIds(values_sorted.reason, 4, False)  # each slot's token
    assert p["index_put"] == Aligned(values_sorted.reason, Split(0))  # the inverse
    assert type(p["mul"]) is Whole and p["index_2"] == Split(0)  # batch order again
    assert p["index_put_1"] == Aligned(values_sorted.reason, Split(0))  # added to tokens
    assert p["add"] == Split(0)
    assert type(p["add_1"]) is Whole  # arithmetic on ids: neither ids nor rows


def test_ids_that_a_nanobatch_boundary_divides_are_not_row_ids(fake_pg):
    gm = make_fx(lambda keys: torch.sort(keys)[1].div(4, rounding_mode="floor"))(torch.randn(24))
    (keys,) = gm.graph.find_nodes(op="placeholder")
    (div,) = gm.graph.find_nodes(op="call_function", target=torch.ops.aten.div.Tensor_mode)
    for k, expected in ((2, RowIds), (4, Whole)):  # 4 nanobatches of 6 slots: groups of 4 span two
        p = propagate(gm.graph, {keys: Split(0)}, k, OP_TABLE).placements[div]
        assert type(p) is expected, (k, p)


def test_the_experts_all_reduce_splits_forward_and_backward(fake_pg):
    torch.manual_seed(0)
    graphs = analysed(SortedExperts(), torch.randn(4, 6, 8, requires_grad=True))
    for g, analysis in graphs:
        placed = analysis.placements_at(2).placements
        reduces = [placed[c.node] for c in analysis.collectives]
        assert reduces == [Split(0)] * (1 if g.kind == "forward" else 2), (g.kind, reduces)
        decision = decide(analysis, Policy(2))
        assert decision.choice.nanobatches == 2, (g.kind, decision.fallback)
        code = apply(g.gm, analysis, decision.choice).code
        FileCheck().check_count(
            "_c10d_functional.all_reduce.default", 2 * len(reduces), exactly=True
        ).run(code)
        if g.kind == "forward":  # the experts run once, on the whole batch
            FileCheck().check_count("aten.sort.default", 1, exactly=True).run(code)


def _run(model, x, nanobatches):
    torch._dynamo.reset()
    backend = KareusBackend({"nanobatches": nanobatches, "lowering": "eager", "profile": "off"})
    out = torch.compile(model, backend=backend)(x)
    out.square().sum().backward()
    grads = [x.grad.clone(), *(p.grad.clone() for p in model.parameters())]
    model.zero_grad()
    x.grad = None
    return out, grads, backend.reports()


def test_split_after_the_sort_computes_what_the_graph_does(fake_pg):
    torch.manual_seed(0)
    model, x = SortedExperts(), torch.randn(4, 6, 8, requires_grad=True)
    ref, ref_grads, _ = _run(model, x, 1)
    out, grads, reports = _run(model, x, 2)
    assert [(r.nanobatches, r.coverage.split) for r in reports] == [(2, 1), (2, 2)]
    torch.testing.assert_close(out, ref)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r)


def test_partitions_run_alone_with_aligned_values_sliced(fake_pg):
    # The backward's gradient of the tokens the experts saw is scattered back into batch
    # order (aligned) and all-reduced: the profiler's partition takes it whole and
    # issues the other nanobatch's all-reduce on a slice of it.
    torch.manual_seed(0)
    for _, analysis in analysed(SortedExperts(), torch.randn(4, 6, 8, requires_grad=True)):
        place = analysis.placements[2]
        for partition in analysis.partitioning.partitions:
            for slot in range(len(partition.slots) + 1):
                waited, *_ = partition_workload(partition, place, 2, slot, world_size=2).run()
                assert waited.shape[0] == 12  # one nanobatch of the 24 tokens
    _, backward = analysed(SortedExperts(), torch.randn(4, 6, 8, requires_grad=True))[1]
    sources = [backward.placements[2].placements[c.node.args[0]] for c in backward.collectives]
    assert any(isinstance(p, Aligned) for p in sources), sources
