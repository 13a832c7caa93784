"""Context parallelism on CPU: what torch's ``context_parallel`` does there, with and
without kareus, on gloo ranks: CP2 (2 ranks) and CP2 x TP2 (4 ranks, the attention's
projections under torch's own colwise / rowwise plans).

In torch 2.13 (and 2.14.1) it does not run on CPU at all, not even eagerly: CPU attention
dispatches to ``aten._scaled_dot_product_flash_attention_for_cpu``, for which DTensor has
no sharding strategy (ring attention handles the CUDA kernels only). Under
``torch.compile`` Dynamo's fake-tensor run of the attention meets the same missing
strategy, so it breaks the graph there: the backend gets the projections before the
attention and the DTensor unwrapping after it (no collective in either: the K/V
all-gather would be inside the attention), and the attention then fails eagerly with
torch's error, the same with kareus as with any other backend. When a torch release runs
it on CPU, this test fails, and the K/V all-gather and dK/dV reduce-scatter partitions can
be built and checked on CPU.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from gloo import leave, report, run_ranks

pytestmark = pytest.mark.slow

NO_STRATEGY = ("Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not "
               "have a sharding strategy registered.")


class Attention(torch.nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4):
        super().__init__()
        self.q, self.k, self.v, self.out = (torch.nn.Linear(dim, dim) for _ in range(4))
        self.head_dim = dim // heads

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, -1))


def _worker(rank, port, out_dir, tp):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    import kareus

    world = 2 * tp
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        mesh = init_device_mesh("cpu", (2, tp), mesh_dim_names=("cp", "tp"))
        set_rotate_method("allgather")
        torch.manual_seed(0)
        model = Attention()
        if tp > 1:
            parallelize_module(model, mesh["tp"], {
                "q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(),
                "out": RowwiseParallel(),
            })
        backend = kareus.KareusBackend({"nanobatches": 2, "lowering": "eager"})
        outcomes = {}
        for name, run in (
            ("eager", model),
            ("aot_eager", torch.compile(model, backend="aot_eager")),
            ("kareus", torch.compile(model, backend=backend)),
        ):
            torch._dynamo.reset()
            x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1))
            try:
                with context_parallel(mesh["cp"], buffers=[x], buffer_seq_dims=[1]):
                    run(x).sum().backward()
                outcomes[name] = "ran"
            except Exception as exc:  # noqa: BLE001 - what the user sees is the result
                outcomes[name] = str(exc)
        outcomes["graphs"] = [(r.kind, len(r.collectives), r.choice.nanobatches)
                              for r in backend.reports()]
        report(out_dir, rank, outcomes)
    finally:
        dist.destroy_process_group()
    leave()


@pytest.mark.parametrize("tp", [1, 2], ids=["cp2", "cp2xtp2"])
def test_context_parallel_fails_on_cpu_alike_with_and_without_kareus(tp):
    for outcomes in run_ranks(_worker, tp, nprocs=2 * tp):
        assert NO_STRATEGY in outcomes["eager"], outcomes
        assert NO_STRATEGY in outcomes["aot_eager"], outcomes
        assert NO_STRATEGY in outcomes["kareus"], outcomes
        # kareus got the projections before the attention's graph break (and the
        # DTensor unwrapping after it): graphs without a collective, run unrewritten.
        kinds = [kind for kind, collectives, k in outcomes["graphs"]
                 if collectives == 0 and k == 1]
        assert "forward" in kinds and len(kinds) == len(outcomes["graphs"]), outcomes
