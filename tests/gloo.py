"""What the multi-process tests share: a block with one all-reduce, and a run of ranks.

``run_ranks(worker, *args)`` starts ``worker(rank, port, out_dir, *args)`` in 2 spawned
gloo-ready processes; each rank writes its result with ``report(out_dir, rank, result)``
and the results come back in rank order. A worker that got that far ends with
``leave()``.
"""

import os
import pickle
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.multiprocessing as mp

from kareus import KareusBackend


class AllReduceBlock(torch.nn.Module):
    def __init__(self, hidden: int = 16):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, hidden), torch.nn.Linear(hidden, 8)

    def forward(self, x):
        return self.b(torch.relu(funcol.all_reduce(self.a(x), "sum", dist.group.WORLD)))


def report(out_dir: str, rank: int, result: Any) -> None:
    Path(out_dir, str(rank)).write_bytes(pickle.dumps(result))


def leave() -> None:
    """End a worker whose result is written and whose process group is destroyed, without
    the interpreter's teardown: there, now and then (about 1 run in 10 of
    test_profile_e2e.py on 2 cores, and before the demo's final barrier 6 of 86 of
    test_agreement_e2e.py), a rank aborts with "terminate called without an active
    exception" after all its work is done; the cause is not found yet."""
    os._exit(0)


def run_ranks(worker: Callable[..., None], *args: Any, nprocs: int = 2) -> list[Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(
            worker, args=(port, out, *args), nprocs=nprocs, start_method="spawn"
        )
        return [pickle.loads(Path(out, str(r)).read_bytes()) for r in range(nprocs)]


def sequence_shards(rank: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Both ranks' shards of a ``[4, 16, 32]`` batch along the sequence, and this rank's."""
    shards = [torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(r)) for r in (0, 1)]
    return shards, shards[rank]


def against_eager(
    model: torch.nn.Module, x: torch.Tensor, lowering: str
) -> tuple[torch.Tensor, list[torch.Tensor], dict[str, Any]]:
    """``model`` on ``x`` (loss: the output's mean square) run eagerly and compiled with
    kareus at 2 nanobatches: the eager output and gradients, and what to report: how far
    kareus's are from them, and the graphs kareus compiled (kind, applied count,
    collectives split, collectives)."""
    backend = KareusBackend({"nanobatches": 2, "lowering": lowering, "profile": "off"})
    runs = {}
    for name, run in (("eager", model), ("kareus", torch.compile(model, backend=backend))):
        out = run(x)
        out.square().mean().backward()
        runs[name] = out.detach(), [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
    (ref, ref_grads), (out, grads) = runs["eager"], runs["kareus"]
    return ref, ref_grads, {
        "out_diff": (out - ref).abs().max().item(),
        "grad_diff": max((a - b).abs().max().item() for a, b in zip(grads, ref_grads, strict=True)),
        "graphs": [(r.kind, r.choice.nanobatches, r.coverage.split, r.coverage.total)
                   for r in backend.reports()],
    }
