"""What the multi-process tests share: a block with one all-reduce, and a run of ranks.

``run_ranks(worker, *args)`` starts ``worker(rank, port, out_dir, *args)`` in 2 fresh
gloo-ready processes; each rank writes its result with ``report(out_dir, rank, result)``
and the results come back in rank order. A worker that got that far ends with
``leave()``. Every multi-process test starts its ranks with ``start_ranks``.
"""

import multiprocessing
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


PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "torch._inductor.compile_fx",
           "kareus", "transformers")
"""What the ranks' parent process imports once: each rank is forked from it, so a run of
ranks pays no imports (spawned, 6-10 s a run on 2 cores; the multi-process test files took
13:44 spawned, 7:30 forked). A module that is not installed is skipped."""


_START_PROCESSES = mp.start_processes
"""torch's, kept where a test puts ``start_ranks`` in its place (``fork_the_demo``)."""


def start_ranks(worker: Callable[..., None], args: tuple[Any, ...], nprocs: int = 2,
                join: bool = True) -> mp.ProcessContext | None:
    """``torch.multiprocessing.start_processes(worker, args, nprocs, join)``, each rank
    forked from a server that has imported ``PRELOAD`` (``forkserver``) and given the
    caller's environment as it is now: the server keeps the environment it started with,
    and tests set theirs (``KAREUS_CACHE_DIR`` per test)."""
    multiprocessing.set_forkserver_preload(list(PRELOAD))  # read when the server starts
    return _START_PROCESSES(_in_environment, args=(dict(os.environ), worker, *args),
                            nprocs=nprocs, join=join, start_method="forkserver")


def fork_the_demo(monkeypatch) -> None:
    """The demo's ranks started by ``start_ranks``: the same workers and arguments, forked
    instead of spawned (the demo's own spawn is tested by tests/test_cli.py)."""
    def start(worker, args=(), nprocs=1, join=True, daemon=False, start_method="spawn"):
        return start_ranks(worker, args, nprocs, join)

    monkeypatch.setattr(mp, "start_processes", start)


def _in_environment(rank: int, environ: dict[str, str], worker: Callable[..., None],
                    *args: Any) -> None:
    os.environ.clear()
    os.environ.update(environ)
    worker(rank, *args)


def run_ranks(worker: Callable[..., None], *args: Any, nprocs: int = 2) -> list[Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        start_ranks(worker, (port, out, *args), nprocs)
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
