"""FSDP (torch's ``fully_shard``, FSDP2) with kareus on gloo ranks: alone (2 ranks) and
under tensor parallelism (FSDP2 x TP2 on 4 ranks, the 2-D layout torchtitan trains with).

FSDP2's all-gathers and reduce-scatters run in its module hooks, eagerly, between the
graphs Dynamo hands the backend (it breaks the graph at each sharded module): kareus's
graphs hold none of them, so FSDP alone leaves nothing to split and every graph runs
unrewritten with the reason. Under TP the blocks' all-reduces are in the graphs and are
split into nanobatches. Either way two SGD steps train exactly as the same FSDP model run
eagerly: every loss, and every gradient gathered whole.
"""

import copy

import pytest
import torch
import torch.distributed as dist
from gloo import leave, report, run_ranks

pytestmark = pytest.mark.slow


class Block(torch.nn.Module):
    def __init__(self, dim: int = 32):
        super().__init__()
        self.up, self.down = torch.nn.Linear(dim, 4 * dim), torch.nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Net(torch.nn.Module):
    def __init__(self, dim: int = 32, layers: int = 2):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(dim) for _ in range(layers))
        self.head = torch.nn.Linear(dim, 8)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _worker(rank, port, out_dir, tp):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    import kareus

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2 * tp)
    try:
        mesh = init_device_mesh("cpu", (2, tp), mesh_dim_names=("dp", "tp"))
        torch.manual_seed(0)
        base = Net()
        backend = kareus.KareusBackend({"nanobatches": 2, "lowering": "eager", "profile": "off"})
        runs = {}
        for name in ("eager", "kareus"):
            model = copy.deepcopy(base)
            for block in model.blocks:
                if tp > 1:
                    parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(),
                                                           "down": RowwiseParallel()})
                fully_shard(block, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
            run = model if name == "eager" else torch.compile(model, backend=backend)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            losses, grads = [], []
            for step in range(2):  # each data-parallel rank its own batch
                x = torch.randn(8, 16, 32,
                                generator=torch.Generator().manual_seed(10 * step + rank // tp))
                loss = run(x).square().mean()
                loss.backward()
                losses.append(loss.item())
                grads.append([p.grad.full_tensor() for p in model.parameters()])
                optimizer.step()
                optimizer.zero_grad()
            runs[name] = losses, grads
        (eager_losses, eager_grads), (losses, grads) = runs["eager"], runs["kareus"]
        report(out_dir, rank, {
            "losses": losses, "eager_losses": eager_losses,
            "grad_diff": max((a - b).abs().max().item()
                             for step, eager_step in zip(grads, eager_grads, strict=True)
                             for a, b in zip(step, eager_step, strict=True)),
            "graphs": [(r.kind, [c.kind for c in r.collectives], r.choice.nanobatches,
                        r.fallback and r.fallback.kind) for r in backend.reports()],
        })
    finally:
        dist.destroy_process_group()
    leave()


def test_fsdp_alone_trains_exactly_and_its_graphs_hold_no_collective():
    for result in run_ranks(_worker, 1, nprocs=2):
        assert result["losses"] == pytest.approx(result["eager_losses"], rel=1e-6), result
        assert result["grad_diff"] < 1e-6, result
        graphs = result["graphs"]
        assert {kind for kind, *_ in graphs} == {"forward", "backward"}, graphs
        assert all(collectives == [] and k == 1 and why == "no-split-collective"
                   for _, collectives, k, why in graphs), graphs


def test_fsdp_under_tensor_parallelism_splits_the_tp_all_reduces_exactly():
    for result in run_ranks(_worker, 2, nprocs=4):
        assert result["losses"] == pytest.approx(result["eager_losses"], rel=1e-6), result
        assert result["grad_diff"] < 1e-6, result
        with_collectives = [g for g in result["graphs"] if g[1]]
        assert {kind for kind, *_ in with_collectives} == {"forward", "backward"}, result
        assert all(collectives == ["all_reduce"] * len(collectives) and k == 2 and why is None
                   for _, collectives, k, why in with_collectives), result
