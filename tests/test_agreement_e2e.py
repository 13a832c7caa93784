"""Ranks that compile differently never hang (2 gloo processes, the kareus backend).

The compile-time agreement goes through the store with a timeout: ranks asking for
different nanobatch counts both run the graph unrewritten, a slowed rank is waited for,
and every outcome is the same on both ranks.
"""

import time

import pytest
import torch
import torch.distributed as dist
from gloo import AllReduceBlock as Block
from gloo import leave, report, run_ranks

import kareus

pytestmark = pytest.mark.slow


def _worker(rank, port, out_dir, nanobatches, delay_s, timeout_s):
    import kareus

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = Block()
        reference = [p.detach().clone() for p in model.parameters()]
        time.sleep(delay_s[rank])
        compiled = torch.compile(
            model,
            backend="kareus",
            options={
                "nanobatches": nanobatches[rank],
                "lowering": "eager",
                "profile": "off",  # the rewrite as asked: nothing planned
                "agreement_timeout_s": timeout_s,
            },
        )
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
        out = compiled(x)
        out.sum().backward()
        eager = Block()
        with torch.no_grad():
            for p, r in zip(eager.parameters(), reference):
                p.copy_(r)
        expected = eager(x)
        expected.sum().backward()
        grads = max(
            (p.grad - q.grad).abs().max().item()
            for p, q in zip(model.parameters(), eager.parameters())
        )
        reports = [(r.kind, r.nanobatches, r.fallback) for r in kareus.graph_reports()]
        result = ((out - expected).abs().max().item(), grads, reports)
        report(out_dir, rank, result)
        dist.barrier()  # every rank done before any tears down (see kareus.demo._worker)
    finally:
        dist.destroy_process_group()
    leave()


def _run(nanobatches, delay_s=(0.0, 0.0), timeout_s=30.0):
    return run_ranks(_worker, nanobatches, delay_s, timeout_s)


def test_ranks_asking_for_different_counts_both_run_unrewritten():
    """Rank 0 asks for 2 nanobatches, rank 1 for none. The forward graphs meet: rank 0 falls
    back, told that rank 1 does. Their backward graphs differ (rank 0's forward hands its
    saved values over in two pieces, rank 1's whole: codegen/partitioner.py), so they never
    meet: rank 0 waits out the timeout and falls back, saying rank 1 did not arrive."""
    results = _run(nanobatches=(2, 1), timeout_s=10.0)
    for out_diff, grad_diff, reports in results:
        assert out_diff < 1e-5 and grad_diff < 1e-5
        assert [(kind, k) for kind, k, _ in reports] == [("forward", 1), ("backward", 1)]
    # rank 0 fell back, told why; rank 1 ran what it asked for, and waited for nobody
    assert all(why.kind is kareus.ReasonKind.RANKS_DISAGREED for _, _, why in results[0][2])
    forward, backward = (why.detail for _, _, why in results[0][2])
    assert "rank 1 falls back" in forward
    assert "rank(s) [1] did not arrive within 10 s" in backward
    assert [why for _, _, why in results[1][2]] == [None, None]


def test_a_slowed_rank_is_waited_for():
    results = _run(nanobatches=(2, 2), delay_s=(0.0, 3.0))
    for out_diff, grad_diff, reports in results:
        assert out_diff < 1e-5 and grad_diff < 1e-5
        assert reports == [("forward", 2, None), ("backward", 2, None)]
