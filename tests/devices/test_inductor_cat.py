"""What Inductor copies when it lowers a concatenation, against the simulated GPU's rule.

The model costs a concatenation's input as free when Inductor computes it straight into the
output's slice and as a copy otherwise (``model._into_slice``). Each case here compiles a
small graph with Inductor on the CPU (its ConcatKernel: the lowering of every CPU
concatenation, and of a CUDA one not taken as one pointwise kernel) and reads the generated
code: a copy is a kernel that carries ``aten.cat`` in its name (Inductor names kernels by
the ops they come from); a value written in place is computed into an alias of the output.
The model must say the same of the traced graph's input.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from sim_graphs import trace
from torch._inductor.utils import run_and_get_code
from torch.testing import FileCheck

from kareus.devices.sim import model as simulated
from kareus.passes.ops import OP_TABLE

c10d = torch.ops._c10d_functional
ROWS, COLS = 8, 16
COPY = r"cpp_fused_(\w+_)?cat_"  # a kernel made (in part) of the concatenation: a copy


def _mm_read_by_mm(a, b, y):
    m = a @ b
    return torch.cat([m, y.sin()], 1), m @ b


def _mm_and_pointwise(a, b, y):
    m = a @ b
    return torch.cat([m, y.sin()], 1), m.relu()


def _mm_returned(a, b, y):
    m = a @ b
    return torch.cat([m, y.sin()], 1), m


def _rms_norm(a, b, y):
    return torch.cat([a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True)), y.sin()], 1)


def _attention(a, b, y):
    q = a.view(1, 1, ROWS, COLS)
    return torch.cat([F.scaled_dot_product_attention(q, q, q), y.view(1, 1, ROWS, COLS).sin()], 3)


def _all_reduced(a, b, y):
    group = dist.group.WORLD.group_name
    return torch.cat([c10d.wait_tensor(c10d.all_reduce(a, "sum", group)), y.sin()], 1)


# (case, function of a (ROWS, COLS), b (COLS, COLS) and y (ROWS, COLS) concatenating first a
# value, then y.sin(), whether Inductor copies that value)
CASES: list[tuple[str, Callable, bool]] = [
    ("matmul", lambda a, b, y: torch.cat([a @ b, y.sin()], 1), False),
    ("addmm", lambda a, b, y: torch.cat([torch.addmm(y, a, b), y.sin()], 1), False),
    ("generated kernel (reduction and pointwise)", _rms_norm, False),
    ("matmul also read by a pointwise op", _mm_and_pointwise, False),
    ("graph input", lambda a, b, y: torch.cat([a, y.sin()], 1), True),
    ("transposed matmul", lambda a, b, y: torch.cat(
        [(a @ b).t(), y.view(COLS, ROWS).sin()], 1), True),
    ("reshaped matmul", lambda a, b, y: torch.cat(
        [(a @ b).view(COLS, ROWS), y.view(COLS, ROWS).sin()], 0), True),
    ("attention (a fallback kernel)", _attention, True),
    ("all-reduce's waited output", _all_reduced, True),
    ("matmul also read by a matmul", _mm_read_by_mm, True),
    ("matmul also a graph output", _mm_returned, True),
    ("concatenation", lambda a, b, y: torch.cat(
        [torch.cat([a[:, :4].cos(), y[:, 4:].cos()], 1), y.sin()], 1), True),
]


@pytest.mark.parametrize(("fn", "copied"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_the_model_copies_what_inductor_copies(fake_pg, fn, copied):
    shapes = ((ROWS, COLS), (COLS, COLS), (ROWS, COLS))
    torch._dynamo.reset()
    args = [torch.randn(s) for s in shapes]
    _, (code, *_) = run_and_get_code(torch.compile(fn, backend="inductor"), *args)
    torch._dynamo.reset()
    if copied:
        FileCheck().check("def call(").check_regex(COPY).run(code)
    else:
        FileCheck().check("def call(").check("# alias").run(code)
        assert not re.search(COPY, code), "Inductor copied a value it takes in place"
    *_, cat = (n for n in trace(fn, *shapes, dtype=torch.float32).graph.nodes
               if n.target is torch.ops.aten.cat.default)  # the last: the outer one
    assert simulated._into_slice(cat.args[0][0], OP_TABLE) is not copied


def test_a_value_is_computed_into_one_concatenation_and_copied_into_another():
    def fn(a, b, y):
        m = a @ b
        return torch.cat([m, y.sin()], 1), torch.cat([y.cos(), m], 1)

    _, (code, *_) = run_and_get_code(
        torch.compile(fn, backend="inductor"), *(torch.randn(ROWS, ROWS) for _ in range(3))
    )
    torch._dynamo.reset()
    FileCheck().check("# alias").check("extern_kernels.mm(").check_regex(COPY).run(code)
    gm = trace(fn, (ROWS, ROWS), (ROWS, ROWS), (ROWS, ROWS), dtype=torch.float32)
    first, second = (n for n in gm.graph.nodes if n.target is torch.ops.aten.cat.default)
    cost = simulated.graph_cost(gm)
    tile = ROWS * ROWS * 4
    # the first writes sin's slice (the matmul wrote its own); the second cos's and m's copy
    memory = [k for k in cost.kernels if k.kind is simulated.KernelClass.MEMORY]
    assert sum(k.write_bytes for k in memory) == 3 * tile
    assert first.args[0][0] is second.args[0][1]
