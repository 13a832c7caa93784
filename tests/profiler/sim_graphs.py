"""Graphs the simulated GPU is tested on, traced over fake tensors (nothing is allocated).

Collectives need a process group: call from tests that run in an 8-rank fake world
(``conftest.init_fake_pg(8)``); ``group`` is its name.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

c10d = torch.ops._c10d_functional
GiB = 1 << 30


def trace(fn: Callable, *shapes: tuple[int, ...], dtype=torch.bfloat16) -> torch.fx.GraphModule:
    """``fn`` traced to an aten graph over fake tensors."""
    with FakeTensorMode():
        return make_fx(fn)(*(torch.empty(s, dtype=dtype) for s in shapes))


def gemm(n: int = 8192) -> torch.fx.GraphModule:
    return trace(torch.mm, (n, n), (n, n))


def copy(nbytes: int = GiB) -> torch.fx.GraphModule:
    return trace(torch.clone, (nbytes // 2,))


def collective(kind: str, nbytes: int, group: str) -> torch.fx.GraphModule:
    """One 8-rank collective and its wait; ``nbytes`` is the nccl-tests message size."""
    ops = {
        "all_reduce": (lambda a: c10d.all_reduce(a, "sum", group), nbytes),
        "all_gather": (lambda a: c10d.all_gather_into_tensor(a, 8, group), nbytes // 8),
        "reduce_scatter": (lambda a: c10d.reduce_scatter_tensor(a, "sum", 8, group), nbytes),
    }
    fn, input_bytes = ops[kind]
    return trace(lambda a: c10d.wait_tensor(fn(a)), (max(input_bytes // 2, 8),))


def beside(group: str, comm_bytes: int, compute: Callable, *shapes, overlap: bool = True):
    """An all-reduce of ``comm_bytes`` and independent ``compute``: overlapped (issued
    before the compute, waited after it) or sequential (waited before it)."""

    def fn(a, *xs):
        handle = c10d.all_reduce(a, "sum", group)
        if overlap:
            out = compute(*xs)
            return c10d.wait_tensor(handle), out
        done = c10d.wait_tensor(handle)
        return done, compute(*xs)

    return trace(fn, (comm_bytes // 2,), *shapes)


def all_reduces(group: str, *sizes: int) -> torch.fx.GraphModule:
    """All-reduces of ``sizes`` bytes one after the other, each waited before the next."""

    def fn(*xs):
        return [c10d.wait_tensor(c10d.all_reduce(x, "sum", group)) for x in xs]

    return trace(fn, *((size // 2,) for size in sizes))
