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
