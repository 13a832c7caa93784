"""The simulated GPU: physics of the model, per-collective resources, fidelity to published
data."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from calibration import POINTS, DataPoint
from conftest import init_fake_pg
from probes import predict
from sim_graphs import GiB, all_reduces, beside, c10d, collective, copy, gemm, trace
from torch._subclasses.fake_tensor import FakeTensorMode

from kareus.devices import Measurement, SimulatedGPU, Workload, preset_names
from kareus.devices.base import ClockSwitch
from kareus.devices.errors import UnsupportedClockError
from kareus.devices.sim import model as simulated
from kareus.devices.sim.model import KernelClass, Step, graph_cost
from kareus.devices.sim.presets import MODEL_VERSION

A100 = "sim:a100-sxm4-40gb"


@pytest.fixture(scope="module", autouse=True)
def group() -> Iterator[str]:
    """A single-process fake 8-rank world, so collectives trace and resolve their group."""
    init_fake_pg(8)
    yield dist.group.WORLD.group_name
    dist.destroy_process_group()


def run(
    gm: torch.fx.GraphModule, preset: str = A100, clock: int | None = None, **kw
) -> Measurement:
    gpu = SimulatedGPU(preset)
    return gpu.measure(Workload("w", gm, world_size=8), clock or gpu.search_clocks()[0], **kw)


# --- physics --------------------------------------------------------------------------------


def test_compute_bound_time_scales_with_the_clock():
    gpu = SimulatedGPU(A100)
    m = gpu.sweep(Workload("gemm", gemm(4096)), (1200, 900))  # both below the power cap
    assert m[900].time_s / m[1200].time_s == pytest.approx(1200 / 900, rel=0.01)


def test_memory_bound_time_is_nearly_flat():
    gpu = SimulatedGPU(A100)
    m = gpu.sweep(Workload("copy", copy()), (1410, 900))
    assert 1.0 < m[900].time_s / m[1410].time_s < 1.1


@pytest.mark.parametrize("preset", preset_names())
def test_compute_bound_energy_has_an_interior_minimum(preset):
    gpu = SimulatedGPU(preset)
    sweep = gpu.sweep(Workload("gemm", gemm()))
    energies = [m.energy_j for m in sweep.values()]
    best = energies.index(min(energies))
    assert 0 < best < len(energies) - 1
    assert min(energies) < min(energies[0], energies[-1])


def test_power_cap_lowers_the_clock_of_a_gemm():
    m = run(gemm())
    assert m.average_power_w <= 400.0
    assert m.details["effective_clock_mhz"] < 1410
    assert m.details["power_limited_mhz"] == m.details["effective_clock_mhz"]
    assert m.clock_mhz == 1410  # the firmware throttled; nobody set another clock


def gemm_then_copies(copies: int) -> torch.fx.GraphModule:
    """A GEMM that alone draws more than the TDP, then ``copies`` low-power 1 GiB copies."""
    return trace(
        lambda a, b, x: [torch.mm(a, b), *(x.clone() for _ in range(copies))],
        (8192, 8192), (8192, 8192), (GiB // 2,),
    )


def test_the_power_limit_holds_an_average_not_each_kernel():
    # The copies pull the graph's average power under 400 W: the GEMM keeps 1410 MHz,
    # where a per-kernel cap would throttle it as if it ran alone.
    m = run(gemm_then_copies(4))
    assert m.average_power_w < 400.0 and m.details["power_limited_mhz"] == 0
    assert m.details["effective_clock_mhz"] == pytest.approx(1410)
    assert run(gemm()).details["effective_clock_mhz"] < 1410


def test_a_graph_longer_than_the_window_is_limited_window_by_window():
    spec = SimulatedGPU(A100).spec
    graph = Workload("w", gemm_then_copies(4))
    whole = SimulatedGPU(dataclasses.replace(spec, name="w", power_window_s=1.0))
    assert whole.measure(graph, 1410).details["power_limited_mhz"] == 0
    # A window shorter than the GEMM: the GEMM's own stretch must fit the limit.
    short = SimulatedGPU(dataclasses.replace(spec, name="s", power_window_s=1e-3))
    limited = short.measure(graph, 1410)
    assert 0 < limited.details["power_limited_mhz"] < 1410
    assert limited.time_s > whole.measure(graph, 1410).time_s


def test_a_lower_power_limit_throttles_instead_of_rescaling():
    spec = SimulatedGPU(A100).spec
    capped = SimulatedGPU(dataclasses.replace(spec, name="a100-300w", tdp_w=300.0))
    assert capped.spec.sm_power_coeff == spec.sm_power_coeff
    full, low = run(gemm()), capped.measure(Workload("g", gemm()), 1410)
    assert low.average_power_w <= 300.0 < full.average_power_w
    assert low.time_s > 1.1 * full.time_s
    # Work that stays under both limits is unchanged.
    assert capped.measure(Workload("c", copy()), 1410).time_s == run(copy()).time_s


def test_a_gemm_beside_a_collective_pays_for_whole_waves(group):
    # 132 output tiles of 128 x 256: one wave on H100's 132 SMs, two on the 108 left
    # beside NCCL's 24 CTAs (NVIDIA developer forum 339078: the tail nearly doubles it).
    # At a clock under the power limit, so that both run at it.
    shapes = ((12 * 128, 8192), (8192, 11 * 256))
    alone = run(trace(torch.mm, *shapes), preset="sim:h100-sxm", clock=1215)
    both = run(beside(group, GiB, torch.mm, *shapes), preset="sim:h100-sxm", clock=1215)
    assert both.details["compute_s"] / alone.time_s == pytest.approx(2.0, rel=0.02)


def test_attention_runs_at_its_own_efficiency():
    from probes import attention

    gpu = SimulatedGPU(A100)
    spec = gpu.spec
    fwd = graph_cost(attention(8, 2048, 16, 128)).kernels
    assert [k.kind for k in fwd] == [KernelClass.ATTENTION_FWD]
    seconds = gpu.measure(Workload("a", attention(8, 2048, 16, 128)), 1410).time_s
    achieved = fwd[0].flops / seconds / (spec.flop_per_clk * 1410e6)
    assert achieved == pytest.approx(spec.attention_fwd_efficiency, rel=0.02)
    both = graph_cost(attention(8, 2048, 16, 128, backward=True)).kernels
    assert KernelClass.ATTENTION_BWD in [k.kind for k in both]


def test_hbm_bandwidth_follows_the_read_share():
    from probes import read, triad, write

    gpu = SimulatedGPU("sim:h200")

    def tbps(gm, nbytes):
        return nbytes / gpu.measure(Workload("m", gm), 1980).time_s / 1e12

    copy_tbps = tbps(copy(2 * GiB), 4 * GiB)
    assert copy_tbps == pytest.approx(4.255, rel=0.01)  # the input it was set from
    assert tbps(write(2 * GiB), 2 * GiB) < tbps(read(2 * GiB), 2 * GiB) < copy_tbps
    assert tbps(triad(GiB), 3 * GiB) == pytest.approx(4.07, rel=0.02)  # not an input


def test_idle_is_below_the_blocked_static_power_and_measurements_name_the_model():
    for name in preset_names():
        gpu = SimulatedGPU(name)
        assert 0 < gpu.idle_power_w < gpu.static_power_w
    m = run(gemm())
    assert m.model_version == f"{MODEL_VERSION} {A100}"


def test_overlap_shortens_the_timeline_and_raises_average_power(group):
    shapes = ((8192, 8192), (8192, 8192))
    overlapped = run(beside(group, GiB, torch.mm, *shapes))
    sequential = run(beside(group, GiB, torch.mm, *shapes, overlap=False))
    assert overlapped.time_s < sequential.time_s
    assert overlapped.average_power_w > sequential.average_power_w
    assert overlapped.details["overlap_s"] > 0
    assert sequential.details["overlap_s"] == 0
    assert sequential.details["exposed_comm_s"] == pytest.approx(sequential.details["comm_s"])


def names(gm: torch.fx.GraphModule) -> list[str]:
    """The issuing nodes of ``gm``'s collectives, in issue order."""
    return [c.name for c in graph_cost(gm, world_size=8).collectives]


def test_more_comm_sms_speed_the_collective_and_slow_concurrent_compute(group):
    alone = collective("all_reduce", GiB, group)
    (name,) = names(alone)
    assert run(alone, resources={name: 24}).time_s < run(alone, resources={name: 8}).time_s
    # A GEMM much shorter than the collective runs entirely beside it.
    both = beside(group, GiB, torch.mm, (4096, 4096), (4096, 4096))
    (name,) = names(both)
    wide, narrow = (run(both, resources={name: sms}) for sms in (24, 8))
    assert wide.details["compute_s"] > narrow.details["compute_s"]


def test_each_collective_runs_on_its_own_cap(group):
    """Back-to-back all-reduces take the sum of their times alone, each at its own cap."""
    big, small = GiB, 64 << 20
    gm = all_reduces(group, big, small)
    first, second = names(gm)
    (alone,) = names(collective("all_reduce", big, group))

    def alone_s(size: int, sms: int | None = None) -> float:
        return run(collective("all_reduce", size, group), resources={alone: sms}).time_s

    default = run(gm)
    assert run(gm, resources={}) == default == run(gm, resources={first: None, second: None})
    assert default.time_s == pytest.approx(alone_s(big) + alone_s(small))
    capped_first = run(gm, resources={first: 8})
    capped_second = run(gm, resources={second: 8})
    assert capped_first.time_s == pytest.approx(alone_s(big, 8) + alone_s(small))
    assert capped_second.time_s == pytest.approx(alone_s(big) + alone_s(small, 8))
    assert capped_first.time_s - default.time_s > capped_second.time_s - default.time_s > 0
    assert capped_first.energy_j != capped_second.energy_j


def test_measurement_names_its_caps_and_measures_again_under_them(group):
    gm = all_reduces(group, GiB, 64 << 20)
    first, second = names(gm)
    m = run(gm, resources={second: 12, first: None})
    assert m.resources == ((second, 12),)
    assert run(gm, resources=dict(m.resources)) == m
    assert run(gm).resources == ()


def test_measurement_accounts_energy_and_reports_the_requested_clock():
    m = run(gemm(4096))
    # The power cap lowers the clock the GEMM runs at; the record keeps the one asked for.
    assert m.details["effective_clock_mhz"] < m.clock_mhz == 1410
    assert m.energy_j == pytest.approx(m.details["static_j"] + m.details["dynamic_j"])
    assert m.effective_energy_j == pytest.approx(m.details["dynamic_j"])
    assert m.time_s == pytest.approx(m.details["compute_s"])


def test_sweep_equals_measure_at_each_clock_and_costs_the_graph_once(monkeypatch):
    gpu, work = SimulatedGPU(A100), Workload("gemm", gemm(2048))
    costed = []

    def counting_cost(gm, world_size=1, **kwargs):
        costed.append(gm)
        return graph_cost(gm, world_size, **kwargs)

    monkeypatch.setattr(simulated, "graph_cost", counting_cost)
    sweep = gpu.sweep(work)
    assert tuple(sweep) == gpu.search_clocks() and len(costed) == 1
    for mhz in (1410, 1110, 900):
        assert sweep[mhz] == gpu.measure(work, mhz)


def test_isolated_kernel_times_are_each_kernel_timed_alone(group):
    """What a breakdown subtracts from the timeline's compute time: each kernel's timeline
    with nothing else in the graph, not its time beside the all-reduce it overlaps here."""
    gpu = SimulatedGPU(A100)
    gm = beside(group, GiB, lambda a, b: torch.mm(a, b).relu(), (4096, 4096), (4096, 4096))
    cost = graph_cost(gm, world_size=8)
    isolated = gpu.isolated_kernel_s(cost, 900)  # under the power limit
    assert [k.kind for k in cost.kernels] == [KernelClass.GEMM, KernelClass.MEMORY]
    assert len(isolated) == len(cost.kernels)
    for kernel, seconds in zip(cost.kernels, isolated, strict=True):
        alone = gpu.sweep(simulated.GraphCost((kernel,), (), ((Step.COMPUTE, 0),)), (900,))
        assert alone[900].details["power_limited_mhz"] == 0
        assert seconds == pytest.approx(alone[900].time_s, rel=1e-12)
    beside_comm = gpu.sweep(cost, (900,))[900].details["compute_s"]
    assert beside_comm > sum(isolated) * 1.05  # the GEMM lost SMs to the all-reduce
    assert gpu.isolated_kernel_s(Workload("w", gm, world_size=8), 900) == isolated


def test_estimate_is_the_measurement_at_the_default_clock(group):
    gpu, gm = SimulatedGPU(A100), beside(group, GiB, torch.mm, (4096, 4096), (4096, 4096))
    assert gpu.estimate(gm, 8) == gpu.measure(Workload("any", gm, world_size=8), 1410)
    # world_size sizes a group the graph does not resolve; by default a group of one.
    for node in gm.graph.find_nodes(op="call_function", target=c10d.all_reduce.default):
        node.update_arg(2, "no-such-group")
    assert gpu.estimate(gm, 8).details["comm_s"] > 0 == gpu.estimate(gm).details["comm_s"]


def test_a_workload_without_a_graph_cannot_be_costed():
    with pytest.raises(ValueError, match="has no graph"):
        SimulatedGPU(A100).measure(Workload("nothing"), 1410)


# --- graph costing --------------------------------------------------------------------------


def test_views_are_free_and_bytes_count_reads_and_writes():
    def fn(a):
        return (a.view(-1) * 2).view(64, 64).t().unsqueeze(0).expand(3, 64, 64) + 1

    cost = graph_cost(trace(fn, (64, 64)), fuse=False)
    tile = 64 * 64 * 2  # bf16
    # mul reads and writes a tile; add reads the broadcast tile once and writes three.
    assert [k.bytes for k in cost.kernels] == [2 * tile, tile + 3 * tile]
    assert [k.flops for k in cost.kernels] == [0, 0]
    # Fused (Inductor's lowering): the input is read once and only the result written.
    (fused,) = graph_cost(trace(fn, (64, 64))).kernels
    assert (fused.read_bytes, fused.write_bytes) == (tile, 3 * tile)


def test_fusion_stops_at_heavy_kernels_and_keeps_what_escapes():
    def fn(a, b):
        h = torch.relu(a) * 2  # fused; relu's output does not escape, mul's feeds mm
        return torch.mm(h, b).sigmoid() + h.sum()  # h is read again after the mm

    cost = graph_cost(trace(fn, (256, 256), (256, 256)))
    tile = 256 * 256 * 2
    assert [k.kind for k in cost.kernels] == [
        KernelClass.MEMORY, KernelClass.GEMM, KernelClass.MEMORY
    ]
    before, _, after = cost.kernels
    assert (before.read_bytes, before.write_bytes) == (tile, tile)
    # sigmoid, sum and add: reads mm's output and h; writes the result only.
    assert (after.read_bytes, after.write_bytes) == (2 * tile, tile)


def test_a_concatenation_copies_only_what_inductor_copies():
    """Matmuls and generated kernels write straight into the output's slices (nothing to
    copy: no kernel); an attention output, a graph input or a view is copied (read and
    written). tests/devices/test_inductor_cat.py checks these against Inductor."""
    shape, tile = (256, 256), 256 * 256 * 2
    joined = graph_cost(trace(lambda a, b, c: torch.cat([a @ b, c @ b]), shape, shape, shape))
    assert [k.kind for k in joined.kernels] == [KernelClass.GEMM] * 2
    gpu = SimulatedGPU(A100)
    alone = graph_cost(trace(lambda a, b, c: (a @ b, c @ b), shape, shape, shape))
    assert gpu.sweep(joined, (1410,)) == gpu.sweep(alone, (1410,))

    def attention(q, k, v):
        return torch.cat([F.scaled_dot_product_attention(q, k, v), q.sin()], 2)

    qkv = (1, 4, 256, 64)
    copy = graph_cost(trace(attention, qkv, qkv, qkv)).kernels[-1]
    # the attention output copied (read and written); sin reads q and writes its slice
    assert (copy.read_bytes, copy.write_bytes) == (2 * tile, 2 * tile)

    def mixed(a, b, x):
        return torch.cat([a @ b, x.sin(), x.t()])

    fused = graph_cost(trace(mixed, shape, shape, shape)).kernels[-1]
    assert (fused.read_bytes, fused.write_bytes) == (tile, 2 * tile)  # x once; sin, x.t()
    (pieces,) = graph_cost(trace(lambda x: torch.cat(x.split(64, 1)[::-1], 1), shape)).kernels
    assert (pieces.read_bytes, pieces.write_bytes) == (tile, tile)  # every piece of x
    eager = graph_cost(trace(mixed, shape, shape, shape), fuse=False).kernels[-1]
    assert (eager.read_bytes, eager.write_bytes) == (3 * tile, 3 * tile)  # aten.cat copies


def test_a_concatenation_read_by_the_kernels_it_fuses_with_reads_its_matmul_input():
    """A matmul written into the slice is read by the pointwise kernel that uses the
    concatenation (as Inductor's pointwise cat on CUDA reads it)."""
    def fn(a, b, x):
        return torch.cat([a @ b, x.sin()]) * 2

    cost = graph_cost(trace(fn, (256, 256), (256, 256), (256, 256)))
    tile = 256 * 256 * 2
    fused = cost.kernels[-1]
    assert (fused.read_bytes, fused.write_bytes) == (2 * tile, 2 * tile)


def test_matmul_flops_and_dtype_rate():
    bf16 = graph_cost(gemm(256)).kernels[0]
    fp32_graph = trace(torch.mm, (256, 256), (256, 256), dtype=torch.float32)
    assert bf16.flops == 2 * 256**3 and bf16.kind is KernelClass.GEMM
    assert bf16.grid == (1, 256, 256, 256)
    tf32 = graph_cost(fp32_graph, tf32=True).kernels[0]
    assert tf32.flops == 2 * bf16.flops and tf32.kind is KernelClass.GEMM  # half the rate
    plain = graph_cost(fp32_graph, tf32=False).kernels[0]
    assert plain.flops == bf16.flops and plain.kind is KernelClass.FP32_GEMM


def test_fp32_matmuls_follow_pytorchs_tf32_setting():
    fp32_graph = trace(torch.mm, (4096, 4096), (4096, 4096), dtype=torch.float32)
    gpu = SimulatedGPU(A100)
    times = {}
    saved = torch.backends.cuda.matmul.allow_tf32
    try:
        for allowed in (False, True):
            torch.backends.cuda.matmul.allow_tf32 = allowed
            times[allowed] = gpu.measure(Workload("mm", fp32_graph), 1410).time_s
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    # CUDA cores (19.5 TFLOP/s peak) against TF32 tensor cores (156).
    assert times[False] / times[True] > 5


def test_fills_read_nothing():
    cost = graph_cost(trace(torch.zeros_like, (1024,)))
    assert (cost.kernels[0].read_bytes, cost.kernels[0].write_bytes) == (0, 2048)


def test_causal_attention_counts_half_the_flops():
    def attention(causal):
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    shape = (1, 4, 256, 64)
    full, causal = (
        graph_cost(trace(attention(c), shape, shape, shape)).kernels for c in (False, True)
    )
    assert [k.flops for k in causal] == [f.flops / 2 for f in full]
    assert full[0].flops == 4 * 256 * 256 * 64 * 4


def test_grouped_query_attention_counts_the_work_of_every_query_head():
    # torch 2.11's flop formulas take keys and values of the queries' heads only: the model
    # widens grouped-query attention's before counting (2.13's formulas count the same).
    def attention(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    grouped = trace(attention, (1, 8, 256, 64), (1, 2, 256, 64), (1, 2, 256, 64))
    node = next(n for n in grouped.graph.nodes if "attention" in str(n.target))
    args = simulated._query_heads(node, tuple(a.meta["val"] for a in node.args[:3]))
    assert [tuple(a.shape) for a in args] == [(1, 8, 256, 64)] * 3
    (kernel,) = graph_cost(grouped).kernels
    assert kernel.flops == 4 * 256 * 256 * 64 * 8

    def backward(q, k, v):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        with torch.enable_grad():
            return torch.autograd.grad(attention(q, k, v).sum(), (q, k, v))

    both = graph_cost(trace(backward, (1, 8, 256, 64), (1, 2, 256, 64), (1, 2, 256, 64)))
    bwd = next(k for k in both.kernels if k.kind is KernelClass.ATTENTION_BWD)
    assert bwd.grid == (8, 256)  # FlashAttention-2 launches key blocks of every query head


def gqa_backward(batch: int, heads: int, kv_heads: int, seq: int) -> torch.fx.GraphModule:
    """The attention backward of grouped-query attention (a given output gradient)."""

    def backward(q, k, v, grad):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        with torch.enable_grad():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            return torch.autograd.grad(out, (q, k, v), grad)

    q, kv = (batch, heads, seq, 128), (batch, kv_heads, seq, 128)
    return trace(backward, q, kv, kv, q)


def test_grouped_query_attention_backward_runs_as_flash_attention_2_launches_it():
    """FlashAttention-2's mha_bwd runs the grouped-query backward over every query head,
    dk and dv per query head, then sums each group of them (two reductions): the kernel
    takes as long as multi-head attention's with as many key/value heads as query heads."""
    gpu = SimulatedGPU("sim:h200")
    grouped, full = (graph_cost(gqa_backward(1, 8, kv, 1024)) for kv in (1, 8))
    kernel = {c: next(k for k in cost.kernels if k.kind is KernelClass.ATTENTION_BWD)
              for c, cost in (("grouped", grouped), ("full", full))}
    assert kernel["grouped"].grid == kernel["full"].grid == (8, 1024)
    assert kernel["grouped"].write_bytes == kernel["full"].write_bytes  # dk, dv expanded
    dkv = 1024 * 128 * 2  # one key/value head's dk (dv) in bf16
    sums = [k for k in grouped.kernels if k.name.endswith(("sum_dk", "sum_dv"))]
    assert [(k.read_bytes, k.write_bytes) for k in sums] == [(8 * dkv, dkv)] * 2
    assert not any(k.name.endswith("sum_dk") for k in full.kernels)

    def seconds(cost, which):
        evaluator = simulated._Evaluator(gpu.spec, cost, {})
        return evaluator.rates(cost.kernels.index(kernel[which]), None, 1980).kernel_s

    # 8 query heads x 8 key blocks: 64 CTAs, one wave on 132 SMs (the key/value head's 8
    # CTAs alone would take 8 times as long)
    assert seconds(grouped, "grouped") == seconds(full, "full")


def test_collective_group_sizes(group):
    gathered = graph_cost(collective("all_gather", 8 << 20, group), world_size=2)
    assert gathered.collectives[0].group_size == 8  # the op's own group_size argument
    reduced = collective("all_reduce", 8 << 20, group)
    assert graph_cost(reduced, world_size=2).collectives[0].group_size == 8  # resolved group
    for node in reduced.graph.find_nodes(op="call_function", target=c10d.all_reduce.default):
        node.update_arg(2, "no-such-group")
    (c,) = graph_cost(reduced, world_size=2).collectives
    assert (c.kind, c.group_size, c.bus_bytes, c.steps) == ("all_reduce", 2, 8 << 20, 2)
    assert graph_cost(reduced, world_size=1).collectives[0].bus_bytes == 0  # nothing to send


def test_program_follows_issue_and_wait_order(group):
    cost = graph_cost(beside(group, 1 << 20, torch.mm, (64, 64), (64, 64)))
    assert [s for s, _ in cost.program] == [Step.ISSUE, Step.COMPUTE, Step.WAIT]


def test_unsupported_collective_is_named(group):
    gm = trace(lambda a: c10d.wait_tensor(c10d.broadcast(a, 0, group)), (64,))
    with pytest.raises(ValueError, match="broadcast"):
        graph_cost(gm)


# --- clock switching ------------------------------------------------------------------------


@pytest.fixture
def set_clock() -> torch._ops.OpOverload:
    from kareus.passes.ops import SET_CLOCK as set_clock

    return set_clock


def with_clocks(gm: torch.fx.GraphModule, op, *mhz_before_node: tuple[int, int]):
    """Insert set_clock(mhz) before the n-th call_function node for each (n, mhz)."""
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    for index, mhz in mhz_before_node:
        with gm.graph.inserting_before(calls[index]):
            gm.graph.call_function(op, kwargs={"graph": "g", "mhz": mhz})
    return gm


def test_clock_switch_in_the_graph_is_charged(set_clock):
    plain = run(gemm(), clock=1410)
    switched = run(with_clocks(gemm(), set_clock, (0, 1200)), clock=1410)
    same = run(with_clocks(gemm(), set_clock, (0, 1410)), clock=1410)
    assert same == plain
    assert switched.details["clock_switches"] == 1
    assert switched.details["switch_s"] == pytest.approx(0.015)
    assert switched.time_s == pytest.approx(run(gemm(), clock=1200).time_s + 0.015)


def test_a_default_clock_node_runs_at_the_measured_clock(set_clock):
    """kareus graphs start with set_clock(graph, 0): 0 keeps the clock the measurement set."""
    plain, default = run(gemm(), clock=1200), run(gemm(), clock=1410)
    kareus = run(with_clocks(gemm(), set_clock, (0, 0)), clock=1200)
    assert (kareus.time_s, kareus.energy_j) == (plain.time_s, plain.energy_j)
    assert kareus.details["clock_switches"] == kareus.details["switch_s"] == 0
    assert kareus.time_s != default.time_s and kareus.energy_j != default.energy_j
    # At the default clock the node changes nothing either.
    assert run(with_clocks(gemm(), set_clock, (0, 0)), clock=1410) == default


def test_a_requested_clock_node_composes_with_the_measured_clock(set_clock):
    """set_clock(graph, f) switches to f, stalling only if the measurement set another clock."""
    gpu = SimulatedGPU(A100)
    plain = run(gemm(), clock=1200)
    at_f = run(with_clocks(gemm(), set_clock, (0, 1200)), clock=1200)
    assert at_f.details["clock_switches"] == at_f.details["switch_s"] == 0
    assert (at_f.time_s, at_f.energy_j) == (plain.time_s, plain.energy_j)
    for measured in (1410, 1005):
        other = run(with_clocks(gemm(), set_clock, (0, 1200)), clock=measured)
        stall = gpu.spec.clock_switch_s
        assert other.details["clock_switches"] == 1
        assert other.details["switch_s"] == pytest.approx(stall)
        assert other.time_s == pytest.approx(plain.time_s + stall)
        assert other.energy_j == pytest.approx(plain.energy_j + stall * gpu.static_power_w)
        assert other.details["effective_clock_mhz"] == pytest.approx(
            plain.details["effective_clock_mhz"]
        )


def test_a_default_clock_node_returns_to_the_measured_clock(set_clock):
    """After a switch to f, set_clock(graph, 0) returns to the measured clock, not the maximum."""
    spec = dataclasses.replace(SimulatedGPU(A100).spec, min_switch_interval_s=0.0)
    gpu = SimulatedGPU(spec)
    gm = trace(lambda a, b: torch.mm(torch.mm(a, b), b), (8192, 8192), (8192, 8192))
    workload = Workload("w", with_clocks(gm, set_clock, (0, 1200), (1, 0)), world_size=8)
    back = gpu.measure(workload, 1005)
    assert back.details["clock_switches"] == 2
    half = run(gemm(), clock=1200).time_s + run(gemm(), clock=1005).time_s
    assert back.time_s == pytest.approx(half + 2 * spec.clock_switch_s)


def test_switches_finer_than_the_device_allows_are_refused(set_clock):
    gm = trace(lambda a, b: torch.mm(torch.mm(a, b), b), (8192, 8192), (8192, 8192))
    with pytest.raises(ValueError, match="ms apart"):
        run(with_clocks(gm, set_clock, (0, 1200), (1, 0)))
    with pytest.raises(UnsupportedClockError, match="1201 MHz is not a supported SM clock"):
        run(with_clocks(gemm(), set_clock, (0, 1201)))


def test_recorded_switches_are_priced():
    gpu = SimulatedGPU(A100)
    controller = gpu.clock_controller()
    assert gpu.clock_controller() is controller
    for graph, mhz in (("fw", 1200), ("bw", 1200), ("fw", 0)):
        controller.set_clock(graph, mhz)
    seconds, joules = gpu.switch_overhead(controller.switches)
    assert seconds == pytest.approx(2 * 0.015)
    assert joules == pytest.approx(seconds * 85.0)
    assert gpu.switch_overhead([ClockSwitch(0, "fw", 1200)], start_mhz=1200) == (0.0, 0.0)


# --- fidelity -------------------------------------------------------------------------------


def _point_param(point: DataPoint) -> object:
    """Inputs are regression checks, the others fidelity evidence; a known miss is
    computed and reported ("explained"), never asserted."""
    mark = pytest.mark.regression if point.role == "input" else pytest.mark.fidelity
    label = f"{point.label}-explained" if point.known_miss else point.label
    return pytest.param(point, marks=mark, id=label)


@pytest.mark.parametrize("point", [_point_param(p) for p in POINTS])
def test_fidelity_to_published_data(point):
    value = predict(point)
    if point.known_miss:
        return
    low, high = point.band
    assert point.passes(value), (
        f"{point.preset} {point.quantity} ({point.role}): predicted {value:.4g}, published "
        f"{point.value:.4g}, error {point.error(value):+.3g}, band {low:.4g}..{high:.4g} "
        f"({point.source})"
    )


# --- a real model graph ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_layer_graphs(group) -> list[torch.fx.GraphModule]:
    """Forward and backward graphs of a Llama-3.2-3B-sized layer under TP8, bf16, traced over
    fake tensors (MHA stand-in for GQA: dim 3072, 24 heads, FFN 8192, mbs 8, seq 4096)."""
    from functorch.compile import make_boxed_func
    from torch._inductor.compile_fx import compile_fx
    from torch.distributed.device_mesh import init_device_mesh

    from kareus.models.llama import Llama, LlamaConfig, parallelize_llama

    graphs: list[torch.fx.GraphModule] = []

    def capture(gm, inputs, **kwargs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    cfg = LlamaConfig(dim=3072, n_layers=1, n_heads=24, ffn_dim=8192, max_seq_len=4096)
    torch._dynamo.reset()
    default_dtype = torch.get_default_dtype()
    mesh = init_device_mesh("cpu", (8,))  # outside fake mode: it reads its rank map
    try:
        with FakeTensorMode():
            torch.set_default_dtype(torch.bfloat16)  # Module.to cannot swap fake parameters
            model = Llama(cfg)
            model.rope_cos, model.rope_sin = model.rope_cos.bfloat16(), model.rope_sin.bfloat16()
            parallelize_llama(model, mesh)
            compiled = torch.compile(
                model, backend=lambda gm, inputs: compile_fx(gm, inputs, inner_compile=capture)
            )
            compiled(torch.zeros(8, 4096, dtype=torch.long)).float().sum().backward()
    finally:
        torch.set_default_dtype(default_dtype)
        torch._dynamo.reset()
    assert len(graphs) == 2
    return graphs


def test_llama_3b_tp8_layer_at_all_search_clocks(llama_layer_graphs):
    gpu = SimulatedGPU(A100)
    works = [Workload(f"graph{i}", gm, world_size=8) for i, gm in enumerate(llama_layer_graphs)]
    results = [gpu.sweep(work) for work in works]
    for sweep, gm in zip(results, llama_layer_graphs, strict=True):
        assert len(sweep) == 18
        cost = graph_cost(gm, world_size=8)
        assert cost.collectives and all(c.group_size == 8 for c in cost.collectives)
        fastest = sweep[1410]
        assert fastest.details["comm_s"] > 0 and fastest.details["compute_s"] > 0
        assert min(m.time_s for m in sweep.values()) == fastest.time_s
