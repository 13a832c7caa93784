"""The collectives of torch's SDPA context parallelism (all-gather rotation) split into
nanobatches.

torch's ring attention (``_templated_ring_attention`` with ``_AllGatherRotater``) gathers
every rank's keys and values at once: one ``all_gather_single`` of
``cat([key.flatten(), value.flatten()])``, then each rank's part of the result
(``chunk(world)[i]``) is sliced back into its keys and values. Its backward passes the
keys' and values' gradients, flattened and concatenated the same way, to the next rank
with ``permute_tensor``: an all-to-all whose split sizes send all rows to one rank
(``[0, N]`` on rank 0 of 2, ``[N, 0]`` on rank 1). On an H200 (torch 2.11,
``benchmarks/gpu_context_parallel.py``) kareus split neither: the gathered buffer is a
blocked split (two blocks, keys and values) and its all-to-all sizes differ by rank.

It runs only on CUDA's attention kernels, so here the same collectives surround CPU
attention: ``RingAttention`` gathers the keys and values as torch does and, in its
backward, hands each rank the gradients of its keys and values computed on the other rank
through ``permute_tensor``. Both collectives split, forward and backward, and the step is
exact with eager and Inductor lowering on 2 gloo ranks.
"""

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from conftest import analysed
from gloo import against_eager, leave, report, run_ranks, sequence_shards
from test_all_to_all import UlyssesAttention, dense_attention
from torch.testing import FileCheck

from kareus.codegen.apply import apply
from kareus.passes.decide import Policy, decide
from kareus.passes.placement import Split

GATHER = "torch.ops._c10d_functional.all_gather_into_tensor.default"
A2A = "torch.ops._c10d_functional.all_to_all_single.default"


class _GatherKeysValues(torch.autograd.Function):
    """Every rank's ``cat([key.flatten(), value.flatten()])``, in rank order (the
    all-gather rotater's one exchange); backward: this rank's part of the gradient plus the
    part the other rank computed for it, shifted over with ``permute_tensor`` (the
    rotation of dK and dV in torch's backward, on 2 ranks)."""

    @staticmethod
    def forward(ctx, kv: torch.Tensor) -> torch.Tensor:
        return funcol.wait_tensor(funcol.all_gather_tensor(kv, 0, dist.group.WORLD))

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        rank = dist.get_rank()
        parts = grad.chunk(2)
        shifted = funcol.permute_tensor(parts[1 - rank].contiguous(), [1, 0], dist.group.WORLD)
        return parts[rank] + funcol.wait_tensor(shifted)


class RingAttention(UlyssesAttention):
    """Attention of this rank's queries over every rank's keys and values: ``[batch,
    seq / 2, dim]`` on each of 2 ranks (the projections of ``UlyssesAttention``)."""

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, self.heads, -1).transpose(1, 2)
                   for p in (self.q, self.k, self.v))
        gathered = _GatherKeysValues.apply(torch.cat([k.flatten(), v.flatten()]))
        keys, values = [], []
        for part in gathered.chunk(2):  # each rank's keys, then its values
            keys.append(part[: k.numel()].reshape(k.shape))
            values.append(part[k.numel() :].reshape(v.shape))
        o = F.scaled_dot_product_attention(q, torch.cat(keys, 2), torch.cat(values, 2))
        return x + self.o(o.transpose(1, 2).reshape(b, s, -1))


def test_the_gather_and_the_shift_split_forward_and_backward(fake_pg):
    torch.manual_seed(0)
    graphs = analysed(RingAttention(), torch.randn(4, 8, 32))
    assert [g.kind for g, _ in graphs] == ["forward", "backward"]
    expected = {"forward": ["all_gather"], "backward": ["all_to_all"]}
    for g, analysis in graphs:
        assert [c.kind for c in analysis.collectives] == expected[g.kind]
        placed = analysis.placements_at(2)
        assert placed.barriers == (), (g.kind, placed.barriers)
        (c,) = analysis.collectives
        # keys and values: two blocks, laid end to end per rank
        assert placed.placements[c.node] == Split(0, 4 if g.kind == "forward" else 2)
        decision = decide(analysis, Policy(2))
        assert decision.choice.nanobatches == 2, (g.kind, decision.fallback)
        code = apply(g.gm, analysis, decision.choice).code
        FileCheck().check_count(GATHER if g.kind == "forward" else A2A, 2, exactly=True).run(
            code)
    # a nanobatch's shift moves half the rows, still all to the other rank
    backward_code = apply(graphs[1][0].gm, graphs[1][1], decide(graphs[1][1], Policy(2)).choice)
    FileCheck().check(f"{A2A}(").check("[0, 1024], [0, 1024]").run(backward_code.code)


def _worker(rank, port, out_dir, lowering):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = RingAttention()
        shards, x = sequence_shards(rank)
        ref, ref_grads, result = against_eager(model, x, lowering)
        dense = dense_attention(model, torch.cat(shards, dim=1), causal=False)  # every key
        dense.square().mean().backward()
        summed = [g.clone() for g in ref_grads]
        for g in summed:  # each rank's loss is its half's mean: half the whole's, summed
            dist.all_reduce(g)
        report(out_dir, rank, {
            "layout_diff": (ref - dense[:, 8 * rank : 8 * (rank + 1)]).abs().max().item(),
            "layout_grad_diff": max((2 * p.grad - g).abs().max().item()
                                    for p, g in zip(model.parameters(), summed, strict=True)),
            **result,
        })
    finally:
        dist.destroy_process_group()
    leave()


@pytest.mark.slow
@pytest.mark.parametrize("lowering", ["eager", "inductor"])
def test_ring_attention_split_into_nanobatches_is_exact_on_gloo(lowering):
    for result in run_ranks(_worker, lowering):
        assert result["layout_diff"] < 1e-5 and result["layout_grad_diff"] < 1e-5, result
        assert result["out_diff"] < 1e-5 and result["grad_diff"] < 1e-5, result
        assert result["graphs"] == [("forward", 2, 1, 1), ("backward", 2, 1, 1)], result
