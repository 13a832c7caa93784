"""Context parallelism on CPU: what torch's ``context_parallel`` does there, with and
without kareus, on 2 gloo ranks (CP2).

In torch 2.13 it does not run on CPU at all, not even eagerly: CPU attention dispatches to
``aten._scaled_dot_product_flash_attention_for_cpu``, for which DTensor has no sharding
strategy (ring attention handles the CUDA kernels only). Under ``torch.compile`` it fails
the same way in Dynamo's fake-tensor run, before any backend gets a graph, so kareus has
nothing to split or to explain: the user sees torch's error, the same with kareus as with
any other backend. When a torch release runs it on CPU, this test fails, and the K/V
all-gather and dK/dV reduce-scatter partitions can be built and checked on CPU.
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
        self.qkv, self.out = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.heads = heads

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, d))


def _worker(rank, port, out_dir):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
        set_rotate_method("allgather")
        torch.manual_seed(0)
        model = Attention()
        outcomes = {}
        for name, run in (
            ("eager", model),
            ("aot_eager", torch.compile(model, backend="aot_eager")),
            ("kareus", torch.compile(model, backend="kareus",
                                     options={"nanobatches": 2, "lowering": "eager"})),
        ):
            torch._dynamo.reset()
            x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1))
            try:
                with context_parallel(mesh, buffers=[x], buffer_seq_dims=[1]):
                    run(x).sum().backward()
                outcomes[name] = "ran"
            except Exception as exc:  # noqa: BLE001 - what the user sees is the result
                outcomes[name] = str(exc)
        report(out_dir, rank, outcomes)
    finally:
        dist.destroy_process_group()
    leave()


def test_context_parallel_fails_on_cpu_alike_with_and_without_kareus():
    for outcomes in run_ranks(_worker):
        assert NO_STRATEGY in outcomes["eager"], outcomes
        assert NO_STRATEGY in outcomes["aot_eager"], outcomes
        assert NO_STRATEGY in outcomes["kareus"], outcomes
