"""The overlap breakdown (benchmarks/overlap_breakdown.py) on a tiny workload: the accounting
closes (baseline - hidden + overheads + contention is the plan's time) for the plan and
for every graph rewritten into two nanobatches, and each overhead lands where the
rewrite's roles say: joins, cuts, and each kernel class's efficiency."""

from __future__ import annotations

import overlap_breakdown as ob
import pytest
import torch
from probes import GiB, beside, fake_world, trace

from kareus.codegen.nanobatch import ROLE
from kareus.devices import SimulatedGPU
from kareus.devices.sim.model import KernelClass, graph_cost
from kareus.models.llama import LlamaConfig
from kareus.offline.trace import fake_group
from kareus.offline.workload import Workload
from kareus.passes.decide import Choice

MODEL = LlamaConfig(dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128, n_layers=3, max_seq_len=64)
TINY = Workload(MODEL, "tiny", tp=2, pp=2, microbatches=2, microbatch_size=2, seq=16,
                recompute="full")
DEVICE = "sim:a100-sxm4-40gb"


@pytest.fixture(scope="module")
def broken(tmp_path_factory):
    """The tiny workload's plan broken down, and the same microbatch with every graph
    that can be rewritten at two nanobatches (its default variant, default clock)."""
    gpu = SimulatedGPU(DEVICE)
    with fake_group(TINY.tp):
        plan, graphs = ob.traced_and_planned(TINY, DEVICE, tmp_path_factory.mktemp("store"))
        planned = ob.break_down(TINY, plan, graphs, gpu)
        split = {(g.entry.instruction, g.entry.graph.label): o.choice
                 for g in planned.graphs for o in g.entry.graph.nanobatched
                 if o.choice.nanobatches == 2 and o.choice.clock_mhz == 0}
        rewritten = ob.break_down(TINY, plan, graphs, gpu, choices=split)
        block = next(g for g in rewritten.graphs if g.entry.graph.label == "block/backward")
        key = block.entry.graph.graph_hash
        backward = (graphs.graph(key, block.entry.choice), graphs.graph(key, Choice(1)))
    return planned, rewritten, backward, gpu


def close(a: float, b: float) -> bool:
    return a == pytest.approx(b, rel=1e-9, abs=1e-15)


def test_the_accounting_closes_for_the_plan_and_for_every_rewrite(broken):
    planned, rewritten, _, _ = broken
    assert any(g.entry.choice.nanobatches == 2 for g in rewritten.graphs)
    for result in (planned, rewritten):
        assert result.disagreements() == []  # what the planner costs, materialised again
        for part in (*(g.breakdown for g in result.graphs), result.total):
            assert close(part.accounted_s, part.plan_s)
            assert close(part.residual_s, 0.0)
            assert close(part.baseline_contention_s, 0.0)
    total = rewritten.total
    assert total.hidden_s > 0 and total.plan_exposed_s < total.baseline_exposed_s
    assert close(total.plan_s, sum(g.per_microbatch.plan_s for g in rewritten.graphs))


def test_the_critical_stage_is_the_slowest_microbatch_and_the_middle_one_is_steady(broken):
    planned, *_ = broken
    assert planned.microbatch == 1
    slowest = max(planned.stages, key=lambda s: s.forward_s + s.backward_s)
    assert planned.critical == slowest.stage
    assert planned.microbatch in planned.same


def test_each_overhead_source_is_attributed(broken):
    """Block backward at two nanobatches (recomputing its forward): its partial weight
    gradients are summed (role "sum", a join), its GEMMs, attention and memory-bound
    kernels run per nanobatch (efficiency by class, launches apart)."""
    _, rewritten, (backward, baseline), gpu = broken
    block = next(g for g in rewritten.graphs if g.entry.graph.label == "block/backward")
    b = block.breakdown
    cost = graph_cost(backward, TINY.tp)
    isolated = gpu.isolated_kernel_s(cost, block.plan_mhz)
    roles = {n.name: n.meta.get(ROLE) for n in backward.graph.nodes}
    sums = sum(s for k, s in zip(cost.kernels, isolated, strict=True)
               if roles.get(k.name) == "sum")
    assert sums > 0 and b.joins_s >= sums  # a kernel of a join alone is all the join's
    for kind in (KernelClass.GEMM, KernelClass.ATTENTION_FWD, KernelClass.ATTENTION_BWD,
                 KernelClass.MEMORY):
        assert b.efficiency_s[kind.value] != 0  # smaller GEMMs and tiles per nanobatch
    assert b.launches_s > 0  # about twice the kernels
    # Nothing counted twice or left out: the sources add up to the kernel time added.
    base = gpu.isolated_kernel_s(graph_cost(baseline, TINY.tp), block.plan_mhz)
    assert close(b.joins_s + b.cuts_s + sum(b.efficiency_s.values()) + b.launches_s,
                 sum(isolated) - sum(base))


# --- the split of fused runs, on a graph with roles set by hand -----------------------------


def roled(roles: dict[object, str]) -> torch.fx.GraphModule:
    """A dense copy of ``a`` (a cut), a GEMM on it, then a ReLU and an add of ``b`` fused
    into one memory-bound run, each node given the role ``roles`` maps its op to."""
    gm = trace(lambda a, w, b: torch.relu(torch.mm(a.clone(), w)) + b,
               (4096, 4096), (4096, 4096), (4096, 4096))
    for node in gm.graph.nodes:
        if node.op == "call_function":
            node.meta[ROLE] = roles[node.target.overloadpacket]
    return gm


ATEN = torch.ops.aten
ROLES = {ATEN.clone: "dense", ATEN.mm: "piece", ATEN.relu: "piece", ATEN.add: "sum"}


def test_kernels_go_to_their_roles_source_and_mixed_runs_compute_first():
    gpu = SimulatedGPU(DEVICE)
    gm = roled(ROLES)
    run = ob.timed(gpu, gm, 1410, 1)
    assert [k.kind for k in run.cost.kernels] == [KernelClass.MEMORY, KernelClass.GEMM,
                                                  KernelClass.MEMORY]
    assert run.ran_mhz < 1410  # the GEMM draws more than the TDP: timed at the limit's clock
    assert run.isolated_s == gpu.isolated_kernel_s(run.cost, run.ran_mhz)
    copy, mm, fused = run.isolated_s
    parts = ob.shares(gpu, gm, run, 1, rewritten=True)
    by_source = {s: sum(p.seconds for p in parts if p.source == s)
                 for s in ("compute", "joins", "cuts")}
    assert close(by_source["cuts"], copy)
    unfused = dict(zip((k.name for k in graph_cost(gm, fuse=False).kernels),
                       gpu.isolated_kernel_s(graph_cost(gm, fuse=False), run.ran_mhz),
                       strict=True))
    relu = next(t for name, t in unfused.items() if name.startswith("relu"))
    # The run reads the GEMM's output and b and writes its sum: the add costs it what the
    # ReLU alone would not (reading b), about a third.
    assert relu < fused
    assert close(by_source["compute"], mm + relu)
    assert close(by_source["joins"], fused - relu) and by_source["joins"] > 0.2 * fused
    assert close(sum(by_source.values()), sum(run.isolated_s))
    assert [p.launches for p in parts] == [0, 1, 1, 0]  # the cut's launch is the cut's
    assert [p.split for p in parts] == [False, False, True, True]


def test_an_unrewritten_graph_is_all_compute_and_an_unknown_role_is_refused():
    gpu = SimulatedGPU(DEVICE)
    gm = roled(ROLES)
    run = ob.timed(gpu, gm, 1410, 1)
    assert {p.source for p in ob.shares(gpu, gm, run, 1, rewritten=False)} == {"compute"}
    strange = roled({**ROLES, ATEN.clone: "stranger"})
    with pytest.raises(ob.BreakdownError, match="'stranger'"):
        ob.shares(gpu, strange, ob.timed(gpu, strange, 1410, 1), 1, rewritten=True)


def test_contention_is_compute_slowed_by_a_concurrent_collective():
    """The tiny workload's kernels sit at the kernel floor, which fewer SMs do not slow: here
    a GEMM runs beside an all-reduce, and then after it."""
    gpu = SimulatedGPU(DEVICE)
    with fake_world() as group:
        shapes = ((4096, 4096), (4096, 4096))
        overlapped = ob.timed(gpu, beside(group, GiB, torch.mm, *shapes), 1410, 8)
        sequential = ob.timed(gpu, beside(group, GiB, torch.mm, *shapes, overlap=False),
                              1410, 8)
    assert overlapped.isolated_s == sequential.isolated_s
    assert overlapped.contention_s > 0.05 * sum(overlapped.isolated_s)
    assert close(overlapped.contention_s, overlapped.compute_s - sum(overlapped.isolated_s))
    assert close(sequential.contention_s, 0.0)
