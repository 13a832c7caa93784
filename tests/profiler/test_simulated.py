"""The simulated GPU: physics of the model, fidelity to published data, and speed."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing._internal.distributed.fake_pg import FakeStore

from kareus.runtime.clock import ClockSwitch
from kareus.profiler.devices import Measurement, SimulatedGPU, Workload, preset_names
from kareus.profiler.devices.calibration import POINTS, DataPoint
from kareus.profiler.devices.simulated import Step, graph_cost

c10d = torch.ops._c10d_functional
A100 = "sim:a100-sxm4-40gb"
GiB = 1 << 30


@pytest.fixture(scope="module", autouse=True)
def group() -> Iterator[str]:
    """A single-process fake 8-rank world, so collectives trace and resolve their group."""
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    yield dist.group.WORLD.group_name
    dist.destroy_process_group()


def trace(fn: Callable, *shapes: tuple[int, ...], dtype=torch.bfloat16) -> torch.fx.GraphModule:
    """``fn`` traced to an aten graph over fake tensors (nothing is allocated)."""
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


def test_overlap_shortens_the_timeline_and_raises_average_power(group):
    shapes = ((8192, 8192), (8192, 8192))
    overlapped = run(beside(group, GiB, torch.mm, *shapes))
    sequential = run(beside(group, GiB, torch.mm, *shapes, overlap=False))
    assert overlapped.time_s < sequential.time_s
    assert overlapped.average_power_w > sequential.average_power_w
    assert overlapped.details["overlap_s"] > 0
    assert sequential.details["overlap_s"] == 0
    assert sequential.details["exposed_comm_s"] == pytest.approx(sequential.details["comm_s"])


def test_more_comm_sms_speed_the_collective_and_slow_concurrent_compute(group):
    alone = collective("all_reduce", GiB, group)
    assert run(alone, comm_sms=24).time_s < run(alone, comm_sms=8).time_s
    # A GEMM much shorter than the collective runs entirely beside it.
    both = beside(group, GiB, torch.mm, (4096, 4096), (4096, 4096))
    assert run(both, comm_sms=24).details["compute_s"] > run(both, comm_sms=8).details["compute_s"]


def test_measurement_accounts_energy_and_reports_the_protocol():
    m = run(gemm(4096))
    assert m.method == "simulated" and m.clock_mhz == 1410 and m.comm_sms == 24
    assert m.energy_j == pytest.approx(m.details["static_j"] + m.details["dynamic_j"])
    assert m.effective_energy_j == pytest.approx(m.details["dynamic_j"])
    assert m.time_s == pytest.approx(m.details["compute_s"])


def test_sweep_equals_measure_at_each_clock():
    gpu, work = SimulatedGPU(A100), Workload("gemm", gemm(2048))
    sweep = gpu.sweep(work)
    assert tuple(sweep) == gpu.search_clocks()
    for mhz in (1410, 1110, 900):
        assert sweep[mhz] == gpu.measure(work, mhz)


def test_rejects_unsupported_clocks_and_sm_counts():
    gpu, work = SimulatedGPU(A100), Workload("gemm", gemm(256))
    with pytest.raises(ValueError, match=r"1411 MHz.*210\.\.1410 MHz in 15 MHz steps"):
        gpu.measure(work, 1411)
    for sms in (0, 108, 2.5):
        with pytest.raises(ValueError, match=r"comm_sms must be an integer in 1\.\.107"):
            gpu.measure(work, 1410, comm_sms=sms)
    with pytest.raises(ValueError, match="has no graph"):
        gpu.measure(Workload("nothing"), 1410)


# --- graph costing --------------------------------------------------------------------------


def test_views_are_free_and_bytes_count_reads_and_writes():
    def fn(a):
        return (a.view(-1) * 2).view(64, 64).t().unsqueeze(0).expand(3, 64, 64) + 1

    cost = graph_cost(trace(fn, (64, 64)))
    tile = 64 * 64 * 2  # bf16
    # mul reads and writes a tile; add reads the broadcast tile once and writes three.
    assert [k.bytes for k in cost.kernels] == [2 * tile, tile + 3 * tile]
    assert [k.flops for k in cost.kernels] == [0, 0]


def test_matmul_flops_and_dtype_rate():
    bf16 = graph_cost(gemm(256)).kernels[0]
    fp32 = graph_cost(trace(torch.mm, (256, 256), (256, 256), dtype=torch.float32)).kernels[0]
    assert bf16.flops == 2 * 256**3
    assert fp32.flops == 2 * bf16.flops  # TF32 tensor cores run at half the bf16 rate


def test_causal_attention_counts_half_the_flops():
    def attention(causal):
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    shape = (1, 4, 256, 64)
    full, causal = (
        graph_cost(trace(attention(c), shape, shape, shape)).kernels for c in (False, True)
    )
    assert [k.flops for k in causal] == [f.flops / 2 for f in full]
    assert full[0].flops == 4 * 256 * 256 * 64 * 4


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
    from kareus.runtime.ops import set_clock

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


def test_switches_finer_than_the_device_allows_are_refused(set_clock):
    gm = trace(lambda a, b: torch.mm(torch.mm(a, b), b), (8192, 8192), (8192, 8192))
    with pytest.raises(ValueError, match="ms apart"):
        run(with_clocks(gm, set_clock, (0, 1200), (1, 0)))
    with pytest.raises(ValueError, match="does not support an SM clock of 1201"):
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


def simulate(point: DataPoint, group: str) -> float:
    """The simulator's value of ``point.quantity`` (see calibration.QUANTITIES)."""
    gpu = SimulatedGPU(point.preset)
    default = gpu.search_clocks()[0]

    def measure(gm, clock=default):
        return gpu.measure(Workload(point.quantity, gm, world_size=8), clock)

    q, size = point.quantity, point.size_bytes
    if q.startswith("gemm_"):
        m = measure(gemm())
        return {
            "gemm_tflops": 2 * 8192**3 / m.time_s / 1e12,
            "gemm_clock_mhz": m.details["effective_clock_mhz"],
            "gemm_power_w": m.average_power_w,
        }[q]
    if q == "copy_tbps":
        return 2 * GiB / measure(copy()).time_s / 1e12
    if q == "all_reduce_us":
        return measure(collective("all_reduce", size, group)).time_s * 1e6
    if q.endswith("_busbw_gbps"):
        kind = q.removesuffix("_busbw_gbps")
        factor = 2 * 7 / 8 if kind == "all_reduce" else 7 / 8
        return size * factor / measure(collective(kind, size, group)).time_s / 1e9
    if q == "static_power_w":
        return gpu.static_power_w
    if q == "blocked_power_w":
        return measure(collective("all_reduce", 32 << 10, group)).average_power_w
    if q == "memory_clock_saving":
        sweep = gpu.sweep(Workload("copy", copy()), gpu.supported_clocks())
        return 1 - min(m.energy_j for m in sweep.values()) / sweep[default].energy_j
    if q == "overlap_compute_slowdown":
        both = measure(beside(group, GiB, torch.mm, (8192, 8192), (8192, 8192)))
        return both.details["compute_s"] / measure(gemm()).time_s - 1
    if q == "overlap_comm_slowdown":
        # HBM-bound copies (longer than the collective) beside a 256 MiB all-reduce.
        clones = beside(group, 256 << 20, lambda *xs: [x.clone() for x in xs], *[(GiB // 2,)] * 4)
        alone = measure(collective("all_reduce", 256 << 20, group)).time_s
        return measure(clones).details["comm_s"] / alone - 1
    raise AssertionError(f"no simulation for {q}")


@pytest.mark.parametrize(
    "point", POINTS, ids=[f"{p.preset[4:]}-{p.quantity}-{p.size_bytes or p.value}" for p in POINTS]
)
def test_fidelity_to_published_data(point, group):
    value = simulate(point, group)
    assert point.low <= value <= point.high, (
        f"{point.preset} {point.quantity}: simulated {value:.4g}, published {point.value:.4g} "
        f"(band {point.low:.4g}..{point.high:.4g}; {point.source})"
    )


# --- speed on a real model graph ------------------------------------------------------------


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


def test_llama_3b_tp8_layer_at_all_search_clocks_well_under_a_second(llama_layer_graphs):
    gpu = SimulatedGPU(A100)
    start = time.perf_counter()
    works = [Workload(f"graph{i}", gm, world_size=8) for i, gm in enumerate(llama_layer_graphs)]
    results = [gpu.sweep(work) for work in works]
    elapsed = time.perf_counter() - start
    print(f"\nLlama-3.2-3B-sized TP8 layer fw+bw, 18 clocks: {elapsed * 1e3:.0f} ms")
    assert elapsed < 1.0
    for sweep, gm in zip(results, llama_layer_graphs, strict=True):
        assert len(sweep) == 18
        cost = graph_cost(gm, world_size=8)
        assert cost.collectives and all(c.group_size == 8 for c in cost.collectives)
        fastest = sweep[1410]
        assert fastest.details["comm_s"] > 0 and fastest.details["compute_s"] > 0
        assert min(m.time_s for m in sweep.values()) == fastest.time_s
