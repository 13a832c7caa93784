"""A simulated GPU: time and energy of an FX graph at an SM clock, from an analytical model.

The graph (post-AOT-autograd aten, ``node.meta["val"]`` fake or real tensors) is costed
once per node, clock-independently (:func:`graph_cost`); a clock is then evaluated by a
two-stream fluid timeline. Constants and their sources are in presets.py; the model's
version is ``presets.MODEL_VERSION``, recorded in every measurement.

Kernel i (FLOPs F from ``torch.utils.flop_counter``, halved for causal attention; bytes
read R and written W, views free, ops that only fill their output read nothing), at SM
clock f with n of the SMs free of collectives, getting HBM bandwidth b::

    t_full = F / (eff * peak_per_clk * f)             (every SM busy, perfect waves)
    t_c    = t_full * SMs * waves / tiles             waves = ceil(tiles / n)
    t_i    = max(t_c, kernel_floor, (R + W) / b) + launch_overhead

Its class sets eff and the engine: a GEMM on tensor cores (fp32 with TF32 allowed at half
the bf16 rate; fp32 without TF32 on the FP32 CUDA cores; PyTorch's
``torch.backends.cuda.matmul.allow_tf32`` decides, read when the graph is costed), fused
attention forward or backward at FlashAttention-2's efficiency. tiles: the GEMM's output
tiles (``gemm_tile_m x gemm_tile_n``, split-K when fewer than the SMs) or attention's
row blocks (the backward's: key blocks of every query head, as FlashAttention-2 launches
it, which under grouped-query attention writes dk and dv per query head and sums them after
in two memory-bound kernels); other FLOP-counted kernels have perfect waves. b is at most
the HBM capacity of the kernel's read share (write-only, copy and read-only streams
differ), divided by ``1 + sigma (f_max / f - 1)``.

Collective on a group of n (bus bytes D = S 2(n-1)/n for all-reduce, S (n-1)/n for the
others, as nccl-tests count them), with k SMs (its own cap, else NCCL's default), and HBM
traffic h D::

    t = steps * ring_step_latency + (D + min(D, n * nccl_buffer)) / (busbw * min(1, k / k_sat))

with k_sat per collective kind. Timeline: compute kernels run in node order on the compute
stream; a collective is issued on the comm stream when its node is reached and runs after
the collectives before it; the compute stream blocks at its ``wait_tensor``. While both
run, the kernel gets the SMs the collective leaves (whole waves: the tail effect) and HBM
is shared max-min fairly, weighted by the SMs issuing requests.

Power = P_static + C f V(f)^2 (a_compute + a_comm) + e_hbm * HBM bytes/s, with V(f) flat
below a knee and linear above; a_compute = class power * t_full / t_i (1 for a GEMM on
every SM; attention's class power is its efficiency over a GEMM's, fp32's is
``fp32_activity``), or a_mem * b_used / b_copy if larger; a_comm = (k / SMs) a_mem
(achieved / saturated bus rate), so a collective that only waits on its peers costs
static power. P_static is the power of a GPU blocked in a collective (the method's static
power, and what effective energy subtracts); the bare-idle power is reported beside it.

Power limit: the firmware holds power averaged over ``power_window_s`` at or under
``tdp_w`` (a control loop, not a per-kernel cap): the graph is cut into stretches of one
window (one stretch when it is shorter, as partitions and layers are: the measurement
repeats it, so the loop sees its average), and a stretch whose average power exceeds the
limit runs at the highest supported clock, at most the requested one, that fits.
Energy integrates power over the timeline.

Clocks: ``measure(workload, clock_mhz)`` sets the SM clock to ``clock_mhz`` before the
graph starts (no stall). A ``kareus::set_clock`` node in the graph then composes with it:
``mhz`` = 0 (``DEFAULT_CLOCK_MHZ``, which every kareus graph starts with) means "the clock
the measurement set", so a graph measured at f runs as the same graph without that node
at f (after an earlier switch, it switches back to f); ``mhz`` > 0 switches to that clock,
and everything after it runs there. The compute stream stalls ``clock_switch_s`` only when
the target differs from the current clock (a graph whose first node asks for the measured
clock pays nothing), and two changes closer than ``min_switch_interval_s`` are refused.

Lowering (``graph_cost``): memory-bound kernels in a row are fused as Inductor fuses them,
reading what they take from outside the run once and writing what leaves it; a
concatenation costs only the inputs Inductor copies into it (a matmul or a generated kernel
writes straight into its slice; graph inputs, views and fallback kernels' outputs are
copied). Eager lowering (``fuse=False``): each aten node is one kernel.

Not modelled: temperature, data-dependent power, NCCL's protocol switches, NVLink power
(counted in static).
"""

from __future__ import annotations

import copy
import itertools
import math
import operator
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType

import torch
import torch.fx
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from kareus.devices.base import (
    ClockSwitch,
    Device,
    Measurement,
    RecordingClockController,
    Resources,
    Workload,
)
from kareus.devices.errors import (
    ClockSwitchIntervalError,
    UnmeasurableWorkloadError,
    UnsupportedClockError,
    UnsupportedCollectiveError,
    UnsupportedMeasurementError,
    UntracedGraphError,
)
from kareus.devices.sim.presets import TENSOR_TIME_SCALE, GPUSpec, load_preset
from kareus.passes.collectives import WAIT_OP, find_collectives, size_hint
from kareus.passes.collectives import Collective as CollectiveRecord
from kareus.passes.ops import DEFAULT_CLOCK_MHZ, OP_TABLE, SET_CLOCK, Cost, OpTable
from kareus.passes.schema import arguments, position

aten = torch.ops.aten

# CPU kernels of attention count like their CUDA counterparts.
_FLOP_ALIASES = MappingProxyType({
    aten._scaled_dot_product_flash_attention_for_cpu: aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: (
        aten._scaled_dot_product_flash_attention_backward
    ),
})

# Assumption: a GEMM with fewer output tiles than free SMs is split along K (cuBLAS's
# split-K) into chunks of at least 256 (a few k-tiles of 64), bounds 128-1024.
_SPLIT_K_MIN_DEPTH = 256


class Step(Enum):
    COMPUTE = "compute"  # run kernels[i] on the compute stream
    ISSUE = "issue"  # enqueue collectives[i] on the comm stream
    WAIT = "wait"  # compute stream waits for collectives[i]
    CLOCK = "clock"  # set the SM clock to i MHz (0: the clock the measurement set)


class KernelClass(Enum):
    """Which efficiency and engine a kernel's FLOPs run at (presets.GPUSpec fields)."""

    MEMORY = "memory"  # no FLOPs counted: bandwidth (or the kernel floor) sets its time
    GEMM = "gemm"  # tensor cores at gemm_efficiency (matmuls, convolutions)
    FP32_GEMM = "fp32_gemm"  # fp32 matmul without TF32: FP32 CUDA cores
    ATTENTION_FWD = "attention_fwd"
    ATTENTION_BWD = "attention_bwd"


@dataclass(frozen=True, slots=True)
class Kernel:
    name: str
    flops: float  # on tensor cores: bf16-equivalent FLOPs (dtype-scaled)
    read_bytes: float
    write_bytes: float
    kind: KernelClass = KernelClass.MEMORY
    # What sets its CTAs: a matmul's (batch, M, N, K); attention's (batch * heads, rows
    # blocked: queries forward, keys backward); () for perfect waves.
    grid: tuple[int, ...] = ()

    @property
    def bytes(self) -> float:
        return self.read_bytes + self.write_bytes


@dataclass(frozen=True, slots=True)
class Collective:
    name: str
    kind: str
    group_size: int
    bus_bytes: float
    steps: int


@dataclass(frozen=True)
class GraphCost:
    """Clock-independent cost of a graph: its kernels, collectives and the issue order."""

    kernels: tuple[Kernel, ...]
    collectives: tuple[Collective, ...]
    program: tuple[tuple[Step, int], ...]


# ---------------------------------------------------------------------------------------
# Graph -> GraphCost


def _tensors(value: object) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


def _nbytes(t: torch.Tensor) -> int:
    """Bytes a kernel touches for ``t``: broadcast (stride-0) dims are read once."""
    n = t.element_size()
    for size, stride in zip(t.shape, t.stride(), strict=True):
        if size_hint(stride) != 0:
            n *= size_hint(size)
    return n


def _is_free(node: torch.fx.Node, table: OpTable) -> bool:
    """Views, aliases, allocations (the op table) and non-tensor (symbolic) ops launch no kernel."""
    return not table.facts_of(node).launches_kernel or not _tensors(_val(node))


def _val(node: torch.fx.Node) -> object:
    if "val" not in node.meta:
        raise UntracedGraphError(node.name, node.target)
    return node.meta["val"]


def _reads(node: torch.fx.Node, write: int, table: OpTable) -> dict[torch.fx.Node, int]:
    """Bytes ``node`` reads of each input (a gather reads only the rows it returns, a fill
    reads nothing of the tensor it takes the shape of)."""
    facts = table.facts_of(node)
    named = arguments(node)
    partial_input = named.get(facts.partial_read) if facts.partial_read else None
    unread = {named.get(name) for name in facts.shape_only}
    reads: dict[torch.fx.Node, int] = {}
    for inp in node.all_input_nodes:
        if inp in unread:
            continue
        # get_attr inputs (subgraphs of higher-order ops) carry no tensor value.
        value = inp.meta.get("val") if inp.op == "get_attr" else _val(inp)
        b = sum(_nbytes(t) for t in _tensors(value))
        reads[inp] = min(b, write) if inp is partial_input else b
    return reads


def _kernel(node: torch.fx.Node, tf32: bool, table: OpTable) -> Kernel:
    facts = table.facts_of(node)
    out = _tensors(_val(node))
    write = sum(_nbytes(t) for t in out)
    read = sum(_reads(node, write, table).values())
    named = arguments(node)
    packet = getattr(node.target, "overloadpacket", node.target)
    formula = flop_registry.get(_FLOP_ALIASES.get(packet, packet))
    if formula is None or not out:
        return Kernel(node.name, 0.0, float(read), float(write))
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val", n))
    counted = _query_heads(node, args) if facts.cost is Cost.ATTENTION else args
    flops = float(size_hint(formula(*counted, **kwargs, out_val=_val(node))))
    # Causal attention skips the masked half (the registry counts all of it).
    flops *= 0.5 if named.get("is_causal") else 1.0
    if flops <= 0:
        return Kernel(node.name, 0.0, float(read), float(write))
    inputs = _tensors(args)
    dtype = str(inputs[0].dtype).removeprefix("torch.") if inputs else ""
    if facts.cost is Cost.ATTENTION:
        if "backward" not in str(packet):
            # Output [B, H, S_q, D]: the CTAs walk query blocks of each head.
            rows = [size_hint(d) for d in out[0].shape]
            grid = (math.prod(rows[:-2]), rows[-2]) if len(rows) >= 2 else ()
            return Kernel(node.name, flops, float(read), float(write),
                          KernelClass.ATTENTION_FWD, grid)
        # dk and dv written per query head (the sums of ``_grouped_kv_sums`` follow).
        expanded = (_kv_group(node) - 1) * sum(_nbytes(t) for t in out[1:3])
        return Kernel(node.name, flops, float(read), float(write + expanded),
                      KernelClass.ATTENTION_BWD, _backward_grid(node))
    tensor_flops = flops * TENSOR_TIME_SCALE.get(dtype, 1.0)
    kind = KernelClass.GEMM
    if dtype == "float32" and not tf32:
        kind, tensor_flops = KernelClass.FP32_GEMM, flops
    shape = [size_hint(d) for d in out[0].shape]
    grid: tuple[int, ...] = ()
    if facts.cost is Cost.MATMUL and len(shape) >= 2 and flops > 0:
        batch, m, n = math.prod(shape[:-2]), shape[-2], shape[-1]
        grid = (batch, m, n, max(1, round(flops / (2 * batch * m * n))))
    return Kernel(node.name, tensor_flops, float(read), float(write), kind, grid)


# FlashAttention-2's backward under grouped-query attention (PyTorch's flash backend, which
# is the only fused SDPA backend that takes fewer key/value heads than query heads:
# torch.nn.functional.scaled_dot_product_attention's docstring). Dao-AILab/flash-attention
# csrc/flash_attn/flash_api.cpp ``mha_bwd`` (PyTorch vendors it as
# aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp): when num_heads_k !=
# num_heads it allocates dk_expanded and dv_expanded of [batch, seqlen_k, num_heads,
# head_size], passes num_heads as the kernel's heads (``set_params_fprop``: params.h =
# num_heads), and after the kernel calls ``at::sum_out`` twice, summing each group of
# num_heads / num_heads_k query heads into dk and dv (two ATen reduction kernels).
# csrc/flash_attn/src/flash_bwd_launch_template.h ``run_flash_bwd_seqk_parallel`` launches
# the dq/dk/dv kernel on ``grid_n(num_n_block, params.b, params.h)``: key blocks of every
# query head.


def _query_key(node: torch.fx.Node) -> tuple[torch.Tensor, torch.Tensor] | None:
    """An attention backward's query and key values, both [B, H, S, D] (else None)."""
    named = arguments(node)
    values = [named.get(name) for name in ("query", "key")]
    if not all(isinstance(v, torch.fx.Node) for v in values):
        return None
    query, key = (_val(v) for v in values)
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (query, key)):
        return None
    return query, key


def _kv_group(node: torch.fx.Node) -> int:
    """Query heads per key/value head of an attention backward (1: multi-head)."""
    pair = _query_key(node)
    if pair is None:
        return 1
    query, key = pair
    return max(1, size_hint(query.shape[1]) // max(1, size_hint(key.shape[1])))


def _backward_grid(node: torch.fx.Node) -> tuple[int, ...]:
    """(batch * query heads, key rows): FlashAttention-2's backward grid (see above)."""
    pair = _query_key(node)
    if pair is None:
        return ()
    query, key = pair
    return (size_hint(query.shape[0]) * size_hint(query.shape[1]), size_hint(key.shape[2]))


def _grouped_kv_sums(node: torch.fx.Node, kernel: Kernel) -> list[Kernel]:
    """The two reductions FlashAttention-2 runs after a grouped-query backward: each reads
    dk (dv) of every query head and writes that of the key/value heads (see above)."""
    group = _kv_group(node) if kernel.kind is KernelClass.ATTENTION_BWD else 1
    if group == 1:
        return []
    out = _tensors(_val(node))
    return [
        Kernel(f"{node.name}.sum_{name}", 0.0, float(group * _nbytes(t)), float(_nbytes(t)))
        for name, t in zip(("dk", "dv"), out[1:3], strict=True)
    ]


def _query_heads(node: torch.fx.Node, args: tuple) -> tuple:
    """An attention kernel's arguments for its flop formula, grouped-query attention's keys
    and values with as many heads as its queries: the kernel broadcasts them, and torch
    2.11's formulas take equal heads only (2.13's count the same work either way)."""
    try:
        query, key, value = (position(node, name) for name in ("query", "key", "value"))
    except ValueError:
        return args
    if len(args) <= max(query, key, value) or args[query].dim() != 4:
        return args
    heads = args[query].shape[1]
    widened = list(args)
    for i in (key, value):
        t = args[i]
        if t.dim() == 4 and t.shape[1] != heads:
            shape = [size_hint(d) for d in (t.shape[0], heads, *t.shape[2:])]
            widened[i] = torch.empty(shape, dtype=t.dtype, device="meta")
    return tuple(widened)


def _collective(record: CollectiveRecord, world_size: int) -> Collective:
    n = record.group_size or world_size
    return Collective(
        record.name, record.kind, n, record.bus_bytes(n), record.ring_passes * (n - 1)
    )


class _Fusion:
    """Consecutive memory-bound kernels, fused as Inductor fuses pointwise ops and
    reductions: one kernel that reads what the run takes from outside it once and writes
    only what leaves it (used later or returned). Views between them are free. A
    concatenation copies only what Inductor copies (:func:`_into_slice`); one that copies
    nothing launches no kernel."""

    def __init__(self, table: OpTable) -> None:
        self.table = table
        self.nodes: list[torch.fx.Node] = []
        self.kernels: list[Kernel] = []
        self.placed: set[torch.fx.Node] = set()  # values a concatenation took in place

    def add(self, node: torch.fx.Node, kernel: Kernel) -> None:
        self.nodes.append(node)
        self.kernels.append(kernel)

    def flush(self, kernels: list[Kernel], program: list[tuple[Step, int]]) -> None:
        if not self.nodes:
            return
        cats = [_is_cat(n) for n in self.nodes]
        fused = self.kernels[0] if cats == [False] else self._fused()
        if not (all(cats) and fused.bytes == 0):  # a ConcatKernel alone is no kernel
            program.append((Step.COMPUTE, len(kernels)))
            kernels.append(fused)
        self.nodes, self.kernels = [], []

    def _fused(self) -> Kernel:
        members = set(self.nodes)
        reads: dict[torch.fx.Node, int] = {}
        write = 0.0
        for node, kernel in zip(self.nodes, self.kernels, strict=True):
            if _is_cat(node):
                taken, written = self._cat(node, members)
            else:
                taken = _reads(node, int(kernel.write_bytes), self.table).items()
                written = kernel.write_bytes if _escapes(node, members, self.table) else 0.0
            for inp, b in taken:
                source = _through_views(inp, self.table)
                if source not in members:
                    reads[source] = max(reads.get(source, 0), b)
            write += written
        name = f"{self.nodes[0].name}..{self.nodes[-1].name}"
        return Kernel(name, 0.0, float(sum(reads.values())), write)

    def _cat(
        self, node: torch.fx.Node, members: set[torch.fx.Node]
    ) -> tuple[list[tuple[torch.fx.Node, int]], float]:
        """(inputs read, bytes written) of a concatenation among ``members``: a value
        written into its slice costs the concatenation nothing (a member's write lands in
        the slice, counted here when the result leaves the run; a value from before the run
        is read only by members that use the result); any other input is copied."""
        table = self.table
        escapes = _escapes(node, members, table)
        used_here = _feeds(node, members, table)
        reads: dict[torch.fx.Node, int] = {}  # by source: the slices of a split add up
        write = 0
        for inp in arguments(node)["tensors"]:
            value = _val(inp)
            full = _nbytes(value)  # size hints: a symbolic size is read, never guarded on
            in_place = inp not in self.placed and _into_slice(inp, table)
            if in_place:
                self.placed.add(inp)
                if inp in members:
                    write += full if escapes and not _escapes(inp, members, table) else 0
            else:
                write += full if escapes else 0
            if not in_place or (inp not in members and used_here):
                source = _through_views(inp, table)
                reads[source] = reads.get(source, 0) + _nbytes(value)
        return [(s, min(b, _whole(s) or b)) for s, b in reads.items()], float(write)


def _whole(node: torch.fx.Node) -> int:
    """Bytes of all of ``node``'s tensors (0 where it carries no value)."""
    return sum(_nbytes(t) for t in _tensors(node.meta.get("val")))


def _is_cat(node: torch.fx.Node) -> bool:
    return getattr(node.target, "overloadpacket", None) is aten.cat


# Which producers Inductor (torch 2.13) computes straight into a concatenation's slice. Its
# cat lowering (_inductor/lowering.py ``cat``) builds a ConcatKernel, which launches no
# kernel: each input whose buffer still has a flexible layout gets a layout inside the
# output (ir.py ``ConcatKernel.realize_into``, ``can_realize_into_without_copy``); any
# other input is copied by a pointwise kernel. Flexible: kernels Inductor generates and its
# matmuls (``extern_kernels.mm(..., out=)``). Not: graph inputs, views (the copy reads the
# viewed buffer), outputs of fallback kernels (``OpFacts.allocates_output``), a value taken
# by an earlier concatenation, and values whose layout is fixed when lowered (graph.py
# ``GraphLowering.run_node``): graph outputs, and values with several users one of which is
# a matmul or a convolution (``need_fixed_layout``, below). These are facts of the graph
# around a value, not of its op, so they live here; tests/devices/test_inductor_cat.py
# checks each against Inductor on the CPU. On CUDA, Inductor lowers a concatenation of at
# most 8 inputs as one pointwise kernel instead (lowering.py ``pointwise_cat``) when all its
# inputs would be copied or are pointwise, or when only pointwise ops use it: that kernel
# reads the copied inputs, computes the pointwise ones into the output and, fused into its
# users, reads the matmul outputs, which is what a run holding the concatenation and its
# users costs here; a matmul output is then costed as written in place only where the
# users are not in the concatenation's run.
_FIXES_INPUT_LAYOUT = frozenset({
    aten.mm.default,
    aten._int_mm.default,
    aten.convolution.default,  # unless Inductor optimises convolution layouts
    aten.convolution_backward.default,
})


def _into_slice(node: torch.fx.Node, table: OpTable) -> bool:
    """Whether Inductor writes ``node``'s value straight into a concatenation's slice."""
    producer = node
    if node.op == "call_function" and node.target is operator.getitem:
        producer = node.args[0]  # one output of a multi-output kernel
    if not isinstance(producer, torch.fx.Node) or producer.op != "call_function":
        return False  # a graph input
    if _is_free(producer, table) or table.facts_of(producer).allocates_output:
        return False  # a view, or a fallback kernel's output
    users = node.users
    if any(user.op == "output" for user in users):
        return False
    return len(users) == 1 or not any(user.target in _FIXES_INPUT_LAYOUT for user in users)


def _feeds(node: torch.fx.Node, members: set[torch.fx.Node], table: OpTable) -> bool:
    """Whether a member of ``members`` reads ``node``'s result (or a view of it)."""
    for user in node.users:
        if user.op == "call_function" and _is_free(user, table):
            if _feeds(user, members, table):
                return True
        elif user in members:
            return True
    return False


def _through_views(node: torch.fx.Node, table: OpTable) -> torch.fx.Node:
    """The kernel (or graph input) whose data ``node`` aliases through free views."""
    while node.op == "call_function" and _is_free(node, table) and node.all_input_nodes:
        node = node.all_input_nodes[0]
    return node


def _escapes(node: torch.fx.Node, members: set[torch.fx.Node], table: OpTable) -> bool:
    """Whether ``node``'s result (or a view of it) is used outside ``members``."""
    for user in node.users:
        if user.op == "call_function" and _is_free(user, table):
            if _escapes(user, members, table):
                return True
        elif user not in members:
            return True
    return False


def graph_cost(
    gm: torch.fx.GraphModule,
    world_size: int = 1,
    *,
    tf32: bool | None = None,
    fuse: bool = True,
    table: OpTable = OP_TABLE,
) -> GraphCost:
    """Walk ``gm`` in node order once; ``world_size`` sizes groups that cannot be resolved.
    ``tf32``: whether fp32 matmuls may use TF32 tensor cores (None: what PyTorch allows
    now, ``torch.backends.cuda.matmul.allow_tf32``). ``fuse``: cost consecutive
    memory-bound kernels as one, as the Inductor lowering runs them (False: every aten
    node is a kernel, as eager lowering runs them). ``table``: which ops launch kernels,
    of which cost class, and what they read (the analysis's op facts)."""
    if tf32 is None:
        tf32 = bool(torch.backends.cuda.matmul.allow_tf32)
    kernels: list[Kernel] = []
    collectives: list[Collective] = []
    program: list[tuple[Step, int]] = []
    records = {c.node: c for c in find_collectives(gm.graph)}
    completed_by = {w: c.node for c in records.values() for w in c.waits}
    issued: dict[torch.fx.Node, int] = {}
    run = _Fusion(table)
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node in records:
            run.flush(kernels, program)
            issued[node] = len(collectives)
            collectives.append(_collective(records[node], world_size))
            program.append((Step.ISSUE, issued[node]))
        elif node in completed_by:
            run.flush(kernels, program)
            program.append((Step.WAIT, issued[completed_by[node]]))
        elif node.target is WAIT_OP:
            continue  # a second wait on a tensor already waited (MoE code does this): no-op
        elif getattr(node.target, "namespace", None) == "_c10d_functional":
            raise UnsupportedCollectiveError(node.target)
        elif node.target is SET_CLOCK:
            run.flush(kernels, program)
            program.append((Step.CLOCK, int(arguments(node)["mhz"])))
        elif not _is_free(node, table):
            kernel = _kernel(node, tf32, table)
            if fuse and kernel.kind is KernelClass.MEMORY:
                run.add(node, kernel)
                continue
            run.flush(kernels, program)
            for launched in (kernel, *_grouped_kv_sums(node, kernel)):
                program.append((Step.COMPUTE, len(kernels)))
                kernels.append(launched)
    run.flush(kernels, program)
    return GraphCost(tuple(kernels), tuple(collectives), tuple(program))


# ---------------------------------------------------------------------------------------
# Evaluation at a clock


@dataclass(frozen=True, slots=True)
class _Interval:
    """Rates while one kernel and/or one collective run at clock ``mhz``."""

    mhz: float
    kernel_s: float  # duration of the whole kernel at these rates (inf: none)
    comm_s: float  # duration of the whole collective at these rates (inf: none)
    dynamic_w: float


def _fair_share(d1: float, w1: float, d2: float, w2: float, cap: float) -> tuple[float, float]:
    """Weighted max-min fair split of bandwidth ``cap`` between demands d1 and d2."""
    if d1 + d2 <= cap:
        return d1, d2
    s1 = cap * w1 / (w1 + w2)
    if d1 <= s1:
        return d1, cap - d1
    if d2 <= cap - s1:
        return cap - d2, d2
    return s1, cap - s1


class _Evaluator:
    """Evaluates one GraphCost at many clocks, caching rates across them.

    ``caps`` maps collective names to their SM caps (validated); others get the default.
    """

    def __init__(self, spec: GPUSpec, cost: GraphCost, caps: Mapping[str, int]) -> None:
        self.spec = spec
        self.cost = cost
        self.clocks = spec.supported_clocks()[::-1]  # ascending, for the limit's search
        self.sm_coeff = spec.sm_power_coeff
        self.hbm_j_per_byte = spec.hbm_pj_per_bit * 8e-12
        # Per kernel class: (efficiency * peak FLOP per clock, power relative to a GEMM).
        gemm = spec.gemm_efficiency * spec.flop_per_clk
        self.engines = {
            KernelClass.MEMORY: (gemm, 0.0),  # no FLOPs: only its bytes count
            KernelClass.GEMM: (gemm, 1.0),
            KernelClass.FP32_GEMM: (
                spec.fp32_efficiency * spec.fp32_flop_per_clk, spec.fp32_activity
            ),
            KernelClass.ATTENTION_FWD: (
                spec.attention_fwd_efficiency * spec.flop_per_clk,
                spec.attention_fwd_efficiency / spec.gemm_efficiency,
            ),
            KernelClass.ATTENTION_BWD: (
                spec.attention_bwd_efficiency * spec.flop_per_clk,
                spec.attention_bwd_efficiency / spec.gemm_efficiency,
            ),
        }
        # Per collective: its SMs, its bus bandwidth with them, and its link-limited
        # duration and HBM traffic (all clock-independent).
        self.sms = [caps.get(c.name, spec.default_comm_sms) for c in cost.collectives]
        self.link_bytes_per_s = [
            spec.bus_bytes_per_s[c.kind] * min(1.0, sms / spec.saturating_comm_sms[c.kind])
            for c, sms in zip(cost.collectives, self.sms, strict=True)
        ]
        self.comm = [
            (
                c.steps * spec.ring_step_latency_s
                + (c.bus_bytes + min(c.bus_bytes, c.group_size * spec.nccl_buffer_bytes))
                / link,
                c.bus_bytes * spec.comm_hbm_bytes_per_bus_byte,
            )
            for c, link in zip(cost.collectives, self.link_bytes_per_s, strict=True)
        ]
        self.resources = tuple((c.name, caps[c.name]) for c in cost.collectives if c.name in caps)
        self.switches = any(step is Step.CLOCK for step, _ in cost.program)
        self._rates: dict[tuple[int | None, int | None, float], _Interval] = {}
        self._runs: dict[int, _Timeline] = {}

    def rates(self, kernel: int | None, comm: int | None, mhz: float) -> _Interval:
        key = (kernel, comm, mhz)
        if key not in self._rates:
            self._rates[key] = self._compute_rates(kernel, comm, mhz)
        return self._rates[key]

    def _waves(self, kern: Kernel, free_sms: int) -> float:
        """SMs * waves / tiles: how much longer than on perfect waves ``kern`` computes."""
        spec = self.spec
        if not kern.grid:
            return spec.sm_count / free_sms
        if kern.kind in (KernelClass.ATTENTION_FWD, KernelClass.ATTENTION_BWD):
            heads, rows = kern.grid
            tiles = heads * math.ceil(rows / spec.attention_block)
        else:
            batch, m, n, k = kern.grid
            tm, tn = spec.gemm_tile_m, spec.gemm_tile_n
            tiles = batch * min(
                math.ceil(m / tm) * math.ceil(n / tn), math.ceil(m / tn) * math.ceil(n / tm)
            )
            if tiles < free_sms:  # split-K fills the idle SMs, K chunks of at least 256
                tiles *= max(1, min(free_sms // tiles, k // _SPLIT_K_MIN_DEPTH))
        return spec.sm_count * math.ceil(tiles / free_sms) / tiles

    def _compute_rates(self, kernel: int | None, comm: int | None, mhz: float) -> _Interval:
        spec = self.spec
        sms = spec.sm_count
        k = self.sms[comm] if comm is not None else 0
        slow = 1.0 + spec.memory_clock_sensitivity * (spec.max_clock_mhz / mhz - 1.0)
        hbm_copy = spec.hbm_copy_bytes_per_s
        u_c = t_full = demand_c = u_m = demand_m = 0.0
        read_share = 0.5
        if kernel is not None:
            kern = self.cost.kernels[kernel]
            rate_per_clk, _ = self.engines[kern.kind]
            t_full = kern.flops / (rate_per_clk * mhz * 1e6)
            u_c = max(t_full * self._waves(kern, sms - k), spec.kernel_floor_s)
            demand_c = kern.bytes / u_c
            if kern.bytes:
                read_share = kern.read_bytes / kern.bytes
        if comm is not None:
            u_m, hbm_m = self.comm[comm]
            demand_m = hbm_m / u_m
        capacity = spec.hbm_capacity(read_share) / slow
        bw_c, bw_m = _fair_share(demand_c, sms - k, demand_m, k, capacity)
        activity = 0.0
        hbm_rate = 0.0
        kernel_s = comm_s = math.inf
        if kernel is not None:
            busy = max(u_c, kern.bytes / bw_c) if kern.bytes else u_c
            kernel_s = busy + spec.launch_overhead_s
            rate = kern.bytes / kernel_s
            class_power = self.engines[kern.kind][1]
            activity += max(
                class_power * t_full / kernel_s, spec.memory_sm_activity * rate / hbm_copy
            )
            hbm_rate += rate
        if comm is not None:
            comm_s = max(u_m, hbm_m / bw_m) if hbm_m else u_m
            coll = self.cost.collectives[comm]
            bus_rate = coll.bus_bytes / comm_s / self.link_bytes_per_s[comm]
            activity += k / sms * spec.memory_sm_activity * bus_rate
            hbm_rate += hbm_m / comm_s
        dynamic = activity * self.sm_coeff * mhz * spec.voltage(mhz) ** 2
        dynamic += self.hbm_j_per_byte * hbm_rate
        return _Interval(mhz, kernel_s, comm_s, dynamic)

    def run(self, clock_mhz: int) -> Measurement:
        """The graph at ``clock_mhz`` under the power limit (see the module docstring)."""
        free = self._execute(_Timeline(self, clock_mhz), 0, len(self.cost.program))
        if free.now <= self.spec.power_window_s:
            if free.average_power_w() <= self.spec.tdp_w:
                return free.measurement()
            if not self.switches:  # then a cap c is the same graph run at c
                return self._limited_without_switches(clock_mhz)
        return self._limited(clock_mhz, free.starts)

    def _execute(self, tl: _Timeline, start: int, end: int) -> _Timeline:
        for index in range(start, end):
            tl.starts.append(tl.now)
            step, i = self.cost.program[index]
            if step is Step.COMPUTE:
                tl.compute(i)
            elif step is Step.ISSUE:
                tl.issue(i)
            elif step is Step.WAIT:
                tl.wait(i)
            else:
                tl.set_clock(i)
        if end == len(self.cost.program):
            tl.drain()
        return tl

    def _limited_without_switches(self, clock_mhz: int) -> Measurement:
        """The highest clock <= ``clock_mhz`` whose run fits the limit, reported as run at
        ``clock_mhz`` (the firmware throttled it; nobody set that clock)."""
        fits = self._highest(self.clocks.index(clock_mhz), lambda c: self._free_run(c))
        run = self._free_run(fits)
        return run.measurement(requested=clock_mhz, limited_mhz=fits)

    def _free_run(self, mhz: int) -> _Timeline:
        if mhz not in self._runs:
            self._runs[mhz] = self._execute(_Timeline(self, mhz), 0, len(self.cost.program))
        return self._runs[mhz]

    def _highest(self, top: int, trial: Callable[[int], _Timeline]) -> int:
        """Bisect ``self.clocks[:top + 1]`` for the highest clock whose trial fits the limit
        (power grows with the clock); the lowest clock if none does."""
        lo, hi = 0, top
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if trial(self.clocks[mid]).average_power_w() <= self.spec.tdp_w:
                lo = mid
            else:
                hi = mid - 1
        return self.clocks[lo]

    def _limited(self, clock_mhz: int, starts: list[float]) -> Measurement:
        """Window by window: each stretch of about ``power_window_s`` (cut at program steps
        of the unlimited run) gets the highest cap under which its average power fits."""
        window = self.spec.power_window_s
        program = len(self.cost.program)
        cuts = [0]
        for index, t in enumerate(starts):
            if t - starts[cuts[-1]] >= window:
                cuts.append(index)
        cuts.append(program)
        tl = _Timeline(self, clock_mhz)
        lowest = math.inf
        top = len(self.clocks) - 1
        for start, end in itertools.pairwise(cuts):
            before = tl

            def trial(cap: int, before: _Timeline = before, start: int = start, end: int = end):
                return self._execute(before.stretch(cap), start, end)

            attempt = trial(self.clocks[top])
            if attempt.average_power_w() > self.spec.tdp_w:
                cap = self._highest(top, trial)
                attempt = trial(cap)
                lowest = min(lowest, cap)
            tl = attempt
        return tl.measurement(limited_mhz=0 if lowest == math.inf else int(lowest))


class _Timeline:
    """The fluid two-stream simulation of one graph execution at one clock."""

    def __init__(self, ev: _Evaluator, clock_mhz: int) -> None:
        self.ev = ev
        self.requested = clock_mhz
        self.mhz = clock_mhz
        self.cap: float = math.inf  # the power limit's clock for the current stretch
        self.queue: deque[int] = deque()
        self.active: int | None = None
        self.left = 0.0  # fraction of the active collective still to run
        self.done: set[int] = set()
        self.now = 0.0
        self.compute_s = self.comm_s = self.overlap_s = self.exposed_s = 0.0
        self.switch_s = 0.0
        self.switches = 0
        self.last_switch: float | None = None
        self.dynamic_j = 0.0
        self.clock_s = 0.0  # integral of the effective clock over compute time
        self.starts: list[float] = []  # the time each program step began
        self.stretch_at = (0.0, 0.0)  # (now, dynamic_j) where the current stretch began

    def stretch(self, cap: int) -> _Timeline:
        """A copy that continues from here with the power limit's clock ``cap``."""
        tl = copy.copy(self)
        tl.queue, tl.done, tl.starts = deque(self.queue), set(self.done), list(self.starts)
        tl.cap = cap
        tl.stretch_at = (self.now, self.dynamic_j)
        return tl

    def average_power_w(self) -> float:
        """Average power of the current stretch (all of it for an unlimited run)."""
        t0, j0 = self.stretch_at
        dt = self.now - t0
        if dt <= 0.0:
            return self.ev.spec.static_power_w
        return self.ev.spec.static_power_w + (self.dynamic_j - j0) / dt

    def interval(self, kernel: int | None) -> _Interval:
        return self.ev.rates(kernel, self.active, min(self.mhz, self.cap))

    def issue(self, c: int) -> None:
        if self.ev.cost.collectives[c].group_size <= 1:
            self.done.add(c)
            return
        self.queue.append(c)
        self._start_next()

    def _start_next(self) -> None:
        if self.active is None and self.queue:
            self.active, self.left = self.queue.popleft(), 1.0

    def _spend(self, dt: float, iv: _Interval, computing: bool, comm_finishes: bool) -> None:
        self.now += dt
        self.dynamic_j += iv.dynamic_w * dt
        if computing:
            self.compute_s += dt
            self.clock_s += iv.mhz * dt
        if self.active is None:
            return
        self.comm_s += dt
        if computing:
            self.overlap_s += dt
        else:
            self.exposed_s += dt
        if comm_finishes:
            self.done.add(self.active)
            self.active = None
            self._start_next()
        else:
            self.left -= dt / iv.comm_s

    def compute(self, k: int) -> None:
        left = 1.0
        while left > 0.0:
            iv = self.interval(k)
            dt_kernel = left * iv.kernel_s
            dt_comm = self.left * iv.comm_s if self.active is not None else math.inf
            if dt_comm < dt_kernel:
                left -= dt_comm / iv.kernel_s
                self._spend(dt_comm, iv, computing=True, comm_finishes=True)
            else:
                left = 0.0
                self._spend(dt_kernel, iv, computing=True, comm_finishes=dt_comm == dt_kernel)

    def _idle(self, seconds: float) -> None:
        """The compute stream does nothing for ``seconds`` (inf: until the comm queue drains)."""
        while seconds > 0.0 and self.active is not None:
            iv = self.interval(None)
            dt_comm = self.left * iv.comm_s
            finishes = dt_comm <= seconds
            dt = dt_comm if finishes else seconds
            self._spend(dt, iv, computing=False, comm_finishes=finishes)
            seconds -= dt
        if math.isfinite(seconds) and seconds > 0.0:
            self.now += seconds

    def wait(self, c: int) -> None:
        while c not in self.done and self.active is not None:
            iv = self.interval(None)
            self._spend(self.left * iv.comm_s, iv, computing=False, comm_finishes=True)

    def drain(self) -> None:
        self._idle(math.inf)

    def set_clock(self, mhz: int) -> None:
        spec = self.ev.spec
        # The measurement stands in for the default clock (see the module docstring).
        target = self.requested if mhz == DEFAULT_CLOCK_MHZ else mhz
        _check_clock(spec, target)
        if target == self.mhz:
            return
        since = math.inf if self.last_switch is None else self.now - self.last_switch
        if since < spec.min_switch_interval_s:
            raise ClockSwitchIntervalError(spec.name, since, spec.min_switch_interval_s)
        self._idle(spec.clock_switch_s)
        self.switch_s += spec.clock_switch_s
        self.switches += 1
        self.mhz = target
        self.last_switch = self.now

    def measurement(self, requested: int | None = None, limited_mhz: int = 0) -> Measurement:
        """``requested``: the clock to report (default: the one this ran at);
        ``limited_mhz``: the lowest clock the power limit imposed (0: none)."""
        spec = self.ev.spec
        static_j = spec.static_power_w * self.now
        return Measurement(
            time_s=self.now,
            energy_j=static_j + self.dynamic_j,
            static_power_w=spec.static_power_w,
            clock_mhz=self.requested if requested is None else requested,
            method="simulated",
            resources=self.ev.resources,
            model_version=f"{spec.model_version} {spec.name}",  # SimulatedGPU.model_version
            details={
                "power_limited_mhz": float(limited_mhz),
                "compute_s": self.compute_s,
                "comm_s": self.comm_s,
                "overlap_s": self.overlap_s,
                "exposed_comm_s": self.exposed_s,
                "switch_s": self.switch_s,
                "clock_switches": float(self.switches),
                "static_j": static_j,
                "dynamic_j": self.dynamic_j,
                "effective_clock_mhz": self.clock_s / self.compute_s if self.compute_s else 0.0,
            },
        )


def _check_clock(spec: GPUSpec, mhz: int) -> None:
    supported = spec.supported_clocks()
    if mhz not in supported:
        raise UnsupportedClockError(spec.name, mhz, supported)


def _is_sm_count(value: object, sm_count: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value < sm_count


# ---------------------------------------------------------------------------------------


class SimulatedGPU(Device):
    """A :class:`Device` whose measurements come from the model above (no hardware)."""

    deterministic = True
    models_resources = True
    costs_graphs = True

    def __init__(self, spec: GPUSpec | str, table: OpTable = OP_TABLE) -> None:
        self.spec = load_preset(spec) if isinstance(spec, str) else spec
        self.table = table  # the op facts it costs graphs by (``graph_cost``)
        self.name = self.spec.name
        self._controller = RecordingClockController()

    @property
    def model_version(self) -> str:
        return f"{self.spec.model_version} {self.spec.name}"

    def supported_clocks(self) -> tuple[int, ...]:
        return self.spec.supported_clocks()

    def search_clocks(self) -> tuple[int, ...]:
        return self.spec.search_clocks()

    @property
    def static_power_w(self) -> float:
        """Power while blocked in a collective (the method's P_static)."""
        return self.spec.static_power_w

    @property
    def idle_power_w(self) -> float:
        """Bare idle power (no job); below ``static_power_w``, and never in a timeline."""
        return self.spec.idle_power_w

    def clock_controller(self) -> RecordingClockController:
        """Records the switches a plan makes; :meth:`switch_overhead` prices them. It
        stands for no GPU of this process (``controls_clocks`` is False)."""
        return self._controller

    def measure(
        self, workload: Workload, clock_mhz: int, *, resources: Resources | None = None
    ) -> Measurement:
        return self.sweep(workload, (clock_mhz,), resources=resources)[clock_mhz]

    def estimate(self, gm: torch.fx.GraphModule, world_size: int = 1) -> Measurement:
        workload = Workload("estimate", gm, world_size=world_size)
        return self.measure(workload, self.search_clocks()[0])

    def estimate_at(
        self, gm: torch.fx.GraphModule, clocks: Sequence[int], world_size: int = 1
    ) -> dict[int, Measurement]:
        return self.sweep(Workload("estimate", gm, world_size=world_size), clocks)

    @property
    def clock_switch_s(self) -> float:
        return self.spec.clock_switch_s

    @property
    def power_limit_w(self) -> float:
        return self.spec.tdp_w

    def sweep(
        self,
        workload: Workload | GraphCost,
        clocks: Iterable[int] | None = None,
        *,
        resources: Resources | None = None,
    ) -> dict[int, Measurement]:
        """Measure at many clocks (default: the search clocks), costing the graph once."""
        clocks = tuple(self.search_clocks() if clocks is None else clocks)
        for mhz in clocks:
            _check_clock(self.spec, mhz)
        cost = workload if isinstance(workload, GraphCost) else self._cost(workload)
        evaluator = _Evaluator(self.spec, cost, self._caps(cost, resources or {}))
        return {mhz: evaluator.run(mhz) for mhz in clocks}

    def isolated_kernel_s(
        self, workload: Workload | GraphCost, clock_mhz: int
    ) -> tuple[float, ...]:
        """Each of the graph's kernels (``GraphCost.kernels``, in order) timed alone at
        ``clock_mhz``: every SM and all of HBM its own, no collective running, launch
        overhead included, the power limit not applied (pass the clock it imposed,
        ``details["power_limited_mhz"]``). What a timeline's compute time exceeds their sum
        by is what concurrent collectives slowed the compute (a breakdown's contention)."""
        _check_clock(self.spec, clock_mhz)
        cost = workload if isinstance(workload, GraphCost) else self._cost(workload)
        evaluator = _Evaluator(self.spec, cost, {})
        return tuple(evaluator.rates(i, None, clock_mhz).kernel_s
                     for i in range(len(cost.kernels)))

    def _caps(self, cost: GraphCost, resources: Resources) -> dict[str, int]:
        """The caps given (None: default, dropped), each naming a collective of the graph
        and leaving compute at least one SM."""
        names = [c.name for c in cost.collectives]
        for name, sms in resources.items():
            if name not in names:
                raise UnsupportedMeasurementError(
                    self.name,
                    f"resources[{name!r}]",
                    f"{name!r} issues no collective of the graph; its collectives are "
                    f"{', '.join(names) or 'none'}",
                )
            if sms is not None and not _is_sm_count(sms, self.spec.sm_count):
                raise UnsupportedMeasurementError(
                    self.name,
                    f"resources[{name!r}]={sms!r}",
                    f"an SM cap must be an integer in 1..{self.spec.sm_count - 1}",
                )
        return {name: sms for name, sms in resources.items() if sms is not None}

    def _cost(self, workload: Workload) -> GraphCost:
        if workload.gm is None:
            raise UnmeasurableWorkloadError(
                workload.name,
                "graph",
                "the simulated GPU costs workload.gm (with node.meta['val'])",
            )
        return graph_cost(workload.gm, workload.world_size, table=self.table)

    def switch_overhead(
        self, switches: Sequence[ClockSwitch], start_mhz: int | None = None
    ) -> tuple[float, float]:
        """(seconds, joules) of a recorded switch sequence: each change of clock stalls the
        GPU ``clock_switch_s`` at static power. ``start_mhz``: the clock before the first."""
        current = self.spec.max_clock_mhz if start_mhz is None else start_mhz
        changes = 0
        for switch in switches:
            mhz = self.spec.max_clock_mhz if switch.mhz == DEFAULT_CLOCK_MHZ else switch.mhz
            changes += mhz != current
            current = mhz
        seconds = changes * self.spec.clock_switch_s
        return seconds, seconds * self.spec.static_power_w
