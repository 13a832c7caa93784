"""Probe graphs for the simulated GPU, and its prediction of each calibration point.

The probes are small aten graphs traced over fake tensors (nothing is allocated): a matmul
of any shape and dtype, HBM streams (copy, read, write, STREAM triad), scaled-dot-product
attention (forward, or forward and backward), 8-rank collectives alone, beside compute or
one after another. Collectives need a process group: :func:`fake_world` provides one.

:func:`predict` is the model's value of a :class:`~calibration.DataPoint`'s quantity, the
way the source measured it (see ``calibration.QUANTITIES``): for instance the best of a
sweep of square matmuls, or the achieved fraction of peak FLOP/s of FlashAttention-2's
benchmark shape. Each probe graph is traced once per process (``functools.cache``), so the
whole table predicts in seconds.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.fx
import torch.nn.functional as F
from calibration import DataPoint
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from kareus.devices.base import Measurement, Workload
from kareus.devices.sim.model import SimulatedGPU, graph_cost

c10d = torch.ops._c10d_functional
GiB = 1 << 30
WORLD_SIZE = 8  # every collective point was measured on one 8-GPU NVLink node

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


# --- probe graphs ---------------------------------------------------------------------------


def trace(fn: Callable, *shapes: tuple[int, ...], dtype=torch.bfloat16) -> torch.fx.GraphModule:
    """``fn`` traced to an aten graph over fake tensors."""
    with FakeTensorMode():
        return make_fx(fn)(*(torch.empty(s, dtype=dtype) for s in shapes))


def gemm(
    m: int = 8192, n: int | None = None, k: int | None = None, dtype=torch.bfloat16
) -> torch.fx.GraphModule:
    """(m, k) @ (k, n); square (m = n = k) when only ``m`` is given."""
    n = m if n is None else n
    k = m if k is None else k
    return trace(torch.mm, (m, k), (k, n), dtype=dtype)


def copy(nbytes: int = GiB, dtype=torch.bfloat16) -> torch.fx.GraphModule:
    """``clone`` of ``nbytes``: reads and writes ``nbytes``."""
    return trace(torch.clone, (nbytes // dtype.itemsize,), dtype=dtype)


def copy_into(nbytes: int, dtype=torch.float16) -> torch.fx.GraphModule:
    """``dst.copy_(src)`` of ``nbytes`` each: reads and writes ``nbytes``."""
    shape = (nbytes // dtype.itemsize,)
    return trace(lambda dst, src: dst.copy_(src), shape, shape, dtype=dtype)


def read(nbytes: int, dtype=torch.bfloat16) -> torch.fx.GraphModule:
    """``x.sum()`` over ``nbytes``: a read-only stream."""
    return trace(torch.sum, (nbytes // dtype.itemsize,), dtype=dtype)


def write(nbytes: int, dtype=torch.float16) -> torch.fx.GraphModule:
    """``x.zero_()`` of ``nbytes``: a write-only stream."""
    return trace(lambda x: x.zero_(), (nbytes // dtype.itemsize,), dtype=dtype)


def triad(nbytes: int, dtype=torch.float32) -> torch.fx.GraphModule:
    """STREAM triad ``a = b + s c`` over arrays of ``nbytes``: one kernel reading two and
    writing one."""
    shape = (nbytes // dtype.itemsize,)
    return trace(lambda b, c: torch.add(b, c, alpha=3.0), shape, shape, dtype=dtype)


def attention(
    batch: int, seq: int, heads: int, head_dim: int, *, causal: bool = False,
    backward: bool = False, dtype=torch.bfloat16,
) -> torch.fx.GraphModule:
    """``F.scaled_dot_product_attention`` on (batch, heads, seq, head_dim) q, k, v; with
    ``backward``, also the gradients of q, k and v for a given output gradient."""
    shape = (batch, heads, seq, head_dim)

    def forward(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def forward_backward(q, k, v, grad):
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        out = forward(q, k, v)
        return out, *torch.autograd.grad(out, (q, k, v), grad)

    if backward:
        return trace(forward_backward, shape, shape, shape, shape, dtype=dtype)
    return trace(forward, shape, shape, shape, dtype=dtype)


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


@dataclass(frozen=True)
class Compiled:
    """A graph as Inductor's inner compiler receives it: the graph, its example inputs and
    which of them are static (parameters and buffers; the forward's)."""

    gm: torch.fx.GraphModule
    inputs: tuple[object, ...]
    static_input_idxs: tuple[int, ...]


def compiled_layer(
    dim: int, heads: int, ffn_dim: int, batch: int, seq: int, tp: int = WORLD_SIZE
) -> tuple[Compiled, Compiled]:
    """Forward and backward of one Llama-style block (``kareus.models.llama``: RMSNorm,
    RoPE, causal attention, SwiGLU; no embedding or head, as in a middle pipeline stage)
    under tensor parallelism over the ``tp`` ranks of the default group, bf16, as AOT
    autograd hands them to Inductor (unrewritten)."""
    from functorch.compile import make_boxed_func
    from torch._inductor.compile_fx import compile_fx

    from kareus.models.llama import LlamaConfig, fake_parallel_llama

    compiled: list[Compiled] = []

    def capture(gm: torch.fx.GraphModule, inputs: object, **kwargs: object) -> Callable:
        static = tuple(kwargs.get("static_input_idxs") or ())  # type: ignore[arg-type]
        compiled.append(Compiled(gm, tuple(inputs), static))  # type: ignore[arg-type]
        return make_boxed_func(gm.forward)

    cfg = LlamaConfig(dim=dim, n_layers=1, n_heads=heads, ffn_dim=ffn_dim, max_seq_len=seq)
    torch._dynamo.reset()
    try:
        with fake_parallel_llama(cfg, tp) as model:
            block = model.layers[0]

            def step(x: torch.Tensor) -> torch.Tensor:
                return block(x, model.rope_cos, model.rope_sin)

            backend = functools.partial(compile_fx, inner_compile=capture)
            x = torch.empty(batch, seq, dim, requires_grad=True)
            torch.compile(step, backend=backend)(x).sum().backward()
    finally:
        torch._dynamo.reset()
    forward, backward = compiled
    return forward, backward


def transformer_layer(
    dim: int, heads: int, ffn_dim: int, batch: int, seq: int, tp: int = WORLD_SIZE
) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """The graphs of :func:`compiled_layer`."""
    forward, backward = compiled_layer(dim, heads, ffn_dim, batch, seq, tp)
    return forward.gm, backward.gm


def attention_partition(
    group: str, *, nanobatch: int, seq: int, hidden: int, heads: int, tp: int
) -> torch.fx.GraphModule:
    """The method's forward attention partition, not overlapped: one nanobatch's residual
    add, RMSNorm, QKV projection, RoPE, causal attention and output projection on its TP
    shard, then the other nanobatch's all-reduce over ``group`` (Megatron's [seq, batch,
    hidden] layout, bf16; ml-energy/kareus tests/fuser/attention/overlap_test_attn.py)."""
    local, head_dim = heads // tp, hidden // heads
    tokens = (seq, nanobatch, hidden)

    def rope(x, cos, sin):
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def fn(hidden_states, residual, norm_w, qkv_w, proj_w, cos, sin, other):
        x = hidden_states + residual
        h = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(x.dtype) * norm_w
        qkv = (h.view(-1, hidden) @ qkv_w).view(seq, nanobatch, 3, local, head_dim)
        q, k, v = (qkv[:, :, i].permute(1, 2, 0, 3) for i in range(3))  # [b, heads, s, d]
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = o.permute(2, 0, 1, 3).reshape(-1, local * head_dim) @ proj_w
        reduced = c10d.wait_tensor(c10d.all_reduce(other, "sum", group))
        return out.view(tokens), x, reduced

    shapes = (
        tokens, tokens, (hidden,), (hidden, 3 * hidden // tp), (hidden // tp, hidden),
        (seq, head_dim), (seq, head_dim), tokens,
    )
    return trace(fn, *shapes)


def _clones(*xs: torch.Tensor) -> list[torch.Tensor]:
    return [x.clone() for x in xs]


@contextlib.contextmanager
def fake_world(world_size: int = WORLD_SIZE) -> Iterator[str]:
    """The name of a default process group of ``world_size`` ranks to trace and cost
    collectives in: the current one, or else a fake one (this process is rank 0, as
    ``tests/conftest.init_fake_pg`` makes) destroyed on exit, restoring the state before."""
    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise ValueError(
                f"a process group of {dist.get_world_size()} ranks is initialised; the "
                f"probes need {world_size} (destroy it, or run them in another process)"
            )
        yield dist.group.WORLD.group_name
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()


# --- predictions ----------------------------------------------------------------------------


@functools.cache
def _probe(build: Callable[..., torch.fx.GraphModule], *args, **kwargs) -> torch.fx.GraphModule:
    """``build(*args, **kwargs)``, traced once per process (predictions never mutate it)."""
    return build(*args, **kwargs)


class _Model:
    """The simulated GPU of a point, measuring probes at its default clock."""

    def __init__(self, preset: str, group: str) -> None:
        self.gpu = SimulatedGPU(preset)
        self.group = group
        self.default = self.gpu.search_clocks()[0]

    def measure(
        self, gm: torch.fx.GraphModule, clock: int | None = None, *, tf32: bool | None = None
    ) -> Measurement:
        clock = self.default if clock is None else clock
        if tf32 is None:
            return self.gpu.measure(Workload("probe", gm, world_size=WORLD_SIZE), clock)
        cost = graph_cost(gm, WORLD_SIZE, tf32=tf32, table=self.gpu.table)
        return self.gpu.sweep(cost, (clock,))[clock]

    def seconds(self, gm: torch.fx.GraphModule, **kwargs) -> float:
        return self.measure(gm, **kwargs).time_s

    @property
    def peak_flops(self) -> float:
        """Dense bf16 tensor-core FLOP/s at the maximum clock (the datasheet's peak)."""
        spec = self.gpu.spec
        return spec.flop_per_clk * spec.max_clock_mhz * 1e6


def _gemm_shapes(point: DataPoint) -> list[tuple[int, int, int]]:
    if point.param("shape") is not None:
        return [point.param("shape")]
    sizes = point.param("square_sizes", (8192,))
    return [(s, s, s) for s in sizes]


def _gemm_tflops(point: DataPoint, model: _Model) -> float:
    """The best over the point's shapes (one shape, or a sweep of square sizes)."""
    dtype = _DTYPES[point.param("dtype", "bfloat16")]
    tf32 = point.param("tf32") if dtype == torch.float32 else None
    return max(
        2 * m * n * k / model.seconds(_probe(gemm, m, n, k, dtype), tf32=tf32) / 1e12
        for m, n, k in _gemm_shapes(point)
    )


def _gemm_clock_mhz(point: DataPoint, model: _Model) -> float:
    return model.measure(_probe(gemm)).details["effective_clock_mhz"]


def _gemm_power_w(point: DataPoint, model: _Model) -> float:
    return model.measure(_probe(gemm)).average_power_w


def _copy_tbps(point: DataPoint, model: _Model) -> float:
    size, dtype = point.size_bytes, _DTYPES[point.param("dtype", "bfloat16")]
    build = copy_into if point.param("op", "clone") == "copy_" else copy
    return 2 * size / model.seconds(_probe(build, size, dtype)) / 1e12


def _read_tbps(point: DataPoint, model: _Model) -> float:
    dtype = _DTYPES[point.param("dtype", "bfloat16")]
    return point.size_bytes / model.seconds(_probe(read, point.size_bytes, dtype)) / 1e12


def _write_tbps(point: DataPoint, model: _Model) -> float:
    dtype = _DTYPES[point.param("dtype", "float16")]
    return point.size_bytes / model.seconds(_probe(write, point.size_bytes, dtype)) / 1e12


def _triad_tbps(point: DataPoint, model: _Model) -> float:
    dtype = _DTYPES[point.param("dtype", "float32")]
    return 3 * point.size_bytes / model.seconds(_probe(triad, point.size_bytes, dtype)) / 1e12


def _attention_fwd_efficiency(point: DataPoint, model: _Model) -> float:
    """FLOPs as FlashAttention-2 counts them (4 b s^2 h d forward, half of it if causal)
    per second, over the peak at the maximum clock."""
    b, s, h, d = (point.param(name) for name in ("batch", "seq", "heads", "head_dim"))
    causal = point.param("causal", False)
    flops = 4 * b * s * s * h * d * (0.5 if causal else 1.0)
    seconds = model.seconds(_probe(attention, b, s, h, d, causal=causal))
    return flops / seconds / model.peak_flops


def _all_reduce_us(point: DataPoint, model: _Model) -> float:
    gm = _probe(collective, "all_reduce", point.size_bytes, model.group)
    return model.seconds(gm) * 1e6


def _busbw_gbps(point: DataPoint, model: _Model) -> float:
    """nccl-tests bus bandwidth: size * 2(n-1)/n for all-reduce, size (n-1)/n otherwise."""
    kind, n = point.quantity.removesuffix("_busbw_gbps"), WORLD_SIZE
    factor = 2 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n
    gm = _probe(collective, kind, point.size_bytes, model.group)
    return point.size_bytes * factor / model.seconds(gm) / 1e9


def _static_power_w(point: DataPoint, model: _Model) -> float:
    return model.gpu.static_power_w


def _idle_power_w(point: DataPoint, model: _Model) -> float:
    return model.gpu.idle_power_w


def _blocked_power_w(point: DataPoint, model: _Model) -> float:
    return model.measure(_probe(collective, "all_reduce", 32 << 10, model.group)).average_power_w


def _memory_clock_saving(point: DataPoint, model: _Model) -> float:
    gpu = model.gpu
    sweep = gpu.sweep(Workload("copy", _probe(copy)), gpu.supported_clocks())
    return 1 - min(m.energy_j for m in sweep.values()) / sweep[model.default].energy_j


def _overlap_compute_slowdown(point: DataPoint, model: _Model) -> float:
    """Four 8192^3 matmuls with a 64 MiB all-reduce beside them, against the same matmuls
    alone: compute-dominated, as in the training steps the source measured (the power limit
    sees the same load in both)."""
    shapes = ((8192, 8192), (8192, 8192))
    both = model.measure(_probe(beside, model.group, 64 << 20, _four_mms, *shapes))
    alone = model.measure(_probe(trace, _four_mms, *shapes))
    return both.details["compute_s"] / alone.time_s - 1


def _four_mms(a: torch.Tensor, b: torch.Tensor) -> list[torch.Tensor]:
    return [torch.mm(a, b) for _ in range(4)]


def _overlap_comm_slowdown(point: DataPoint, model: _Model) -> float:
    """HBM-bound copies (longer than the collective) beside a 256 MiB all-reduce."""
    size = 256 << 20
    clones = _probe(beside, model.group, size, _clones, *[(GiB // 2,)] * 4)
    alone = model.seconds(_probe(collective, "all_reduce", size, model.group))
    return model.measure(clones).details["comm_s"] / alone - 1


# Workloads of the clock-response points: what the source measured, as the model sees it.
# GPT-3 175B and BLOOM 176B layers as Llama-style layers of the same width and heads, with
# a SwiGLU FFN of the same FLOPs as their 4h GELU MLP (2/3 * 4h, rounded to the TP degree).
_LAYERS = {
    "gpt3-175b-layer": {"dim": 12288, "heads": 96, "ffn_dim": 32768},
    "bloom-176b-layer": {"dim": 14336, "heads": 112, "ffn_dim": 38232},
}


def _workload(point: DataPoint, model: _Model) -> torch.fx.GraphModule:
    name = point.param("workload")
    if name in _LAYERS:
        forward, backward = _probe(
            transformer_layer, **_LAYERS[name], batch=point.param("batch"),
            seq=point.param("seq"), tp=WORLD_SIZE,
        )
        return forward if point.param("graph") == "forward" else backward
    if name == "attention-partition":
        tp = point.param("tp")
        group = dist.new_group(list(range(tp))).group_name
        return attention_partition(
            group, nanobatch=point.param("nanobatch"), seq=point.param("seq"),
            hidden=point.param("hidden"), heads=point.param("heads"), tp=tp,
        )
    raise ValueError(f"no workload {name!r} for {point.label}")


def _clock_response(point: DataPoint, model: _Model) -> tuple[Measurement, Measurement]:
    """The point's workload at its clock and at the default clock."""
    gm = _workload(point, model)
    sweep = model.gpu.sweep(Workload(point.label, gm, world_size=WORLD_SIZE),
                            (point.param("clock"), model.default))
    return sweep[point.param("clock")], sweep[model.default]


def _clock_time_ratio(point: DataPoint, model: _Model) -> float:
    at, default = _clock_response(point, model)
    return at.time_s / default.time_s


def _clock_energy_ratio(point: DataPoint, model: _Model) -> float:
    at, default = _clock_response(point, model)
    return at.energy_j / default.energy_j


def _workload_time_ms(point: DataPoint, model: _Model) -> float:
    return model.measure(_workload(point, model)).time_s * 1e3


def _workload_power_w(point: DataPoint, model: _Model) -> float:
    return model.measure(_workload(point, model)).average_power_w


def _copy_power_w(point: DataPoint, model: _Model) -> float:
    return model.measure(_probe(copy, point.size_bytes)).average_power_w


_PREDICTORS: dict[str, Callable[[DataPoint, _Model], float]] = {
    "clock_time_ratio": _clock_time_ratio,
    "clock_energy_ratio": _clock_energy_ratio,
    "workload_time_ms": _workload_time_ms,
    "workload_power_w": _workload_power_w,
    "copy_power_w": _copy_power_w,
    "gemm_tflops": _gemm_tflops,
    "gemm_clock_mhz": _gemm_clock_mhz,
    "gemm_power_w": _gemm_power_w,
    "copy_tbps": _copy_tbps,
    "read_tbps": _read_tbps,
    "write_tbps": _write_tbps,
    "triad_tbps": _triad_tbps,
    "attention_fwd_efficiency": _attention_fwd_efficiency,
    "all_reduce_us": _all_reduce_us,
    "all_reduce_busbw_gbps": _busbw_gbps,
    "all_gather_busbw_gbps": _busbw_gbps,
    "reduce_scatter_busbw_gbps": _busbw_gbps,
    "static_power_w": _static_power_w,
    "blocked_power_w": _blocked_power_w,
    "idle_power_w": _idle_power_w,
    "memory_clock_saving": _memory_clock_saving,
    "overlap_compute_slowdown": _overlap_compute_slowdown,
    "overlap_comm_slowdown": _overlap_comm_slowdown,
}


def predict(point: DataPoint) -> float:
    """The simulated GPU's value of ``point.quantity`` for what the point measured, at the
    preset's default clock (in an 8-rank fake world unless one is initialised)."""
    with fake_world() as group:
        return _PREDICTORS[point.quantity](point, _Model(point.preset, group))
