"""The nanobatch rewrite on one process (fake process group): schedule, fallbacks, memory."""

import random
import re
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from conftest import analysed, tp_llama
from memory import peak_memory_bytes
from one_shot import nanobatch_graph
from torch._inductor.utils import run_and_get_code
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing import FileCheck

from kareus import KareusBackend, ReasonKind
from kareus.codegen.apply import apply
from kareus.codegen.nanobatch import Schedule
from kareus.passes.decide import Policy, decide
from kareus.passes.ops import OP_TABLE
from kareus.passes.partition import partition_graph
from kareus.passes.placement import Split, propagate
from kareus.passes.variants import Variant
from kareus.runtime.communicators import CommunicatorError, Communicators

aten = torch.ops.aten


def _slot_in_forward(partition: int, slot: int):
    def chooser(analysis, k):
        slots = list(analysis.space.default(k).slots)
        if analysis.kind == "forward":
            slots[partition] = slot
        return Variant(k, tuple(slots), analysis.space.default(k).resources)

    return chooser


def _events(code: str) -> list[tuple[str, str | None]]:
    """Collective issues and waits (with their buffer) and matmuls, in the order Inductor
    runs them."""
    events = []
    for line in code[code.index("def call(") :].splitlines():
        m = re.search(r"_c10d_functional\.(\w+?)_?\.default\((\w+)", line)
        if m:
            events.append(("wait" if m.group(1) == "wait_tensor" else "issue", m.group(2)))
        elif "extern_kernels.mm(" in line or "extern_kernels.addmm(" in line:
            events.append(("mm", None))
    return events


MLP = 4  # forward partition of layer 1's MLP: norm | w1 | w3 | silu * mul | w2


@pytest.mark.parametrize("slot", [0, 2, 4, 5])
def test_inductor_code_issues_each_collective_at_its_slot(fake_pg, slot):
    backend = KareusBackend({"nanobatches": 2}, chooser=_slot_in_forward(MLP, slot))
    _, (code,) = run_and_get_code(
        torch.compile(tp_llama(2), backend=backend), torch.randint(0, 256, (4, 16))
    )
    report = backend.reports()[0]
    assert report.nanobatches == 2 and report.variant.slots[MLP] == slot
    slots = report.partitions[MLP].slots
    assert [s.kind for s in slots] == ["memory", "matmul", "matmul", "memory", "matmul"]

    events = _events(code)
    issues = [i for i, e in enumerate(events) if e[0] == "issue"]
    assert len(issues) == 2 * len(report.partitions)  # one collective per nanobatch
    nb0, nb1 = issues[2 * MLP], issues[2 * MLP + 1]
    wait_nb0 = events.index(("wait", events[nb0][1]), nb0)
    overlapped = sum(e[0] == "mm" for e in events[nb0:wait_nb0])
    # nanobatch 0's all-reduce is issued before the matmuls of nanobatch 1 from the slot
    # on, and waited only after them (where nanobatch 0's next segment starts).
    expected = sum(s.kind == "matmul" for s in slots[slot:])
    assert overlapped == expected == sum(e[0] == "mm" for e in events[nb0:nb1])
    assert wait_nb0 > nb1


class AllReduceMLP(torch.nn.Module):
    """Row-parallel-style block: the all-reduce sits between two batched matmuls."""

    def __init__(self, before=None, after=None):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)
        self.before, self.after = before or (lambda x: x), after or (lambda x: x)

    def forward(self, x):
        h = self.before(self.a(x))
        h = funcol.all_reduce(h, "sum", dist.group.WORLD)
        return self.b(self.after(torch.relu(h)))


def _run(model, x, nanobatches, lowering="eager", seed=0, **compile_kwargs):
    """Output, gradients and graph reports of ``model(x)`` compiled by a fresh kareus backend."""
    torch._dynamo.reset()
    # the rewrite as asked, nothing planned (a plan may keep a graph unrewritten)
    backend = KareusBackend({"nanobatches": nanobatches, "lowering": lowering, "profile": "off"})
    compiled = torch.compile(model, backend=backend, **compile_kwargs)
    torch.manual_seed(seed)
    out = compiled(x)
    out.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return out, grads, backend.reports()


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
@pytest.mark.parametrize("norm", [False, True], ids=["plain", "layernorm"])
def test_rewritten_block_matches_unrewritten(fake_pg, lowering, norm):
    torch.manual_seed(0)
    model, x = AllReduceMLP(before=torch.nn.LayerNorm(16) if norm else None), torch.randn(4, 6, 8)
    ref_out, ref_grads, _ = _run(model, x, 1, lowering)
    out, grads, reports = _run(model, x, 4, lowering)
    assert [r.nanobatches for r in reports] == [4, 4]
    torch.testing.assert_close(out, ref_out)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)


def _fallback(model, x, k=2):
    ref_out, ref_grads, _ = _run(model, x, 1)
    out, grads, reports = _run(model, x, k)
    torch.testing.assert_close(out, ref_out)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)
    return reports


def test_batch_not_divisible_runs_unrewritten(fake_pg):
    torch.manual_seed(0)
    forward, backward = _fallback(AllReduceMLP(), torch.randn(3, 8))
    assert (forward.nanobatches, backward.nanobatches) == (1, 1)
    assert forward.fallback.kind is ReasonKind.NOT_DIVISIBLE
    assert "size 3 does not divide into 2 nanobatches" in forward.fallback.detail
    assert (
        forward.variants.infeasible[2] == forward.fallback
        and forward.variants.nanobatches == (1,)
    )


def test_op_without_rule_ends_the_split_region(fake_pg):
    torch.manual_seed(0)
    model = AllReduceMLP(before=lambda h: torch.flip(h, dims=[0]))  # mixes the batch
    forward, _ = _fallback(model, torch.randn(4, 8))
    assert forward.nanobatches == 1
    assert forward.fallback.kind is ReasonKind.NO_SPLIT_COLLECTIVE
    (barrier,) = forward.barriers
    assert barrier.kind is ReasonKind.NO_RULE and barrier.node.startswith("rev")


def test_random_op_after_the_collective_keeps_the_random_stream(fake_pg):
    torch.manual_seed(0)
    model = AllReduceMLP(after=lambda h: F.dropout(h, 0.5, training=True))
    forward, backward = _fallback(model, torch.randn(4, 8), k=2)
    # The mask is drawn once for the whole batch, then sliced per nanobatch.
    assert (forward.nanobatches, backward.nanobatches) == (2, 2), forward.fallback
    assert forward.barriers == ()


def test_graph_without_collectives_is_not_rewritten(fake_pg):
    torch.manual_seed(0)
    forward, _ = _fallback(
        torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()), torch.randn(4, 8)
    )
    assert forward.nanobatches == 1
    assert forward.fallback.kind is ReasonKind.NO_SPLIT_COLLECTIVE
    assert forward.partitions == ()


def test_memory_of_two_nanobatches(fake_pg):
    """Peak memory grows only by what the extra in-flight buffers explain."""
    graphs = analysed(tp_llama(2), torch.randint(0, 256, (8, 64)))
    payload = max(c.payload_bytes for _, a in graphs for c in a.collectives)
    for g, a in graphs:
        one, two = (peak_memory_bytes(apply(g.gm, a, decide(a, Policy(k)).choice).graph)
                    for k in (1, 2))
        print(f"peak memory k=2 / k=1, {g.kind}: {two / one:.3f}")
        # the next nanobatch's collective in flight, and a join's copy of one value
        assert two <= one + 2 * payload


def test_variant_space_is_enumerable(fake_pg):
    ((_, a),) = analysed(tp_llama(1), torch.randint(0, 256, (4, 16)), backward=False)
    space = a.space
    assert space.nanobatches == (1, 2, 4) and set(space.choices) == {2, 4}
    parts = space.partitions(2)
    assert all(p.resources == (None,) for p in parts)  # gloo / fake: no CTA knob
    assert [p.launch_slots for p in parts] == [len(p.slots) + 1 for p in a.partitioning.partitions]
    variants = list(space)
    assert len(variants) == space.size() == len(set(variants))
    assert variants[0] == Variant(1, (), ())
    drawn = space.sample(random.Random(0), 4)
    assert space.check(drawn) is drawn


def test_resource_caps_need_nccl(fake_pg):
    with pytest.raises(CommunicatorError, match="communication resource caps need NCCL"):
        Communicators().capped(dist.group.WORLD.group_name, 8)


def test_split_inputs_of_the_caller_are_never_written(fake_pg):
    """Token ids in a padded (non-dense) tensor: Inductor must not reinplace into them."""
    backend = KareusBackend({"nanobatches": 4, "profile": "off"})
    tokens = torch.randint(0, 256, (4, 17))[:, :-1]
    before = tokens.clone()
    torch.compile(tp_llama(2), backend=backend)(tokens)
    assert backend.reports()[0].nanobatches == 4
    assert torch.equal(tokens, before)


def _gqa(x, wq, wkv):
    """Grouped-query attention as Hugging Face writes it: K/V expanded over heads (stride 0)."""
    b, s, _ = x.shape
    q = (x @ wq).view(b, s, 4, 4).transpose(1, 2)
    k, v = (x @ wkv).view(b, s, 2, 1, 4).unbind(2)
    k, v = (t.transpose(1, 2)[:, :, None].expand(b, 1, 4, s, 4).reshape(b, 4, s, 4) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_joined_broadcast_values_keep_a_unit_stride_last_dim():
    """Regression (HF Llama, GQA, eager lowering, k = 2 and 4 gave a wrong loss): attention
    running on the whole batch gets K/V joined from nanobatch pieces; the join put the
    stride-0 head dim innermost, and the CPU flash kernel read a last dim of stride 4."""
    inputs = (torch.randn(4, 8, 16), torch.randn(16, 16), torch.randn(16, 8))
    gm = make_fx(_gqa)(*inputs)
    attention = aten._scaled_dot_product_flash_attention_for_cpu.default
    x = next(iter(gm.graph.find_nodes(op="placeholder")))
    no_rule = replace(OP_TABLE.facts(attention), placement=None)
    placements = propagate(gm.graph, {x: Split(0)}, 2, OP_TABLE.with_entries({attention: no_rule}))
    assert [(b.kind, b.detail) for b in placements.barriers] == [
        (ReasonKind.NO_RULE, f"no placement rule for {attention}")
    ]
    rewritten = nanobatch_graph(
        gm, partition_graph(gm.graph, []), [], placements, Schedule(2, (), ()), inputs
    )
    (joined,) = rewritten.graph.find_nodes(op="call_function", target=attention)
    assert [a.meta["val"].stride(-1) for a in joined.args[:3]] == [1, 1, 1]
    torch.testing.assert_close(rewritten(*inputs), gm(*inputs))


@pytest.mark.parametrize("k", [2, 4])
def test_dynamic_batch_sizes_compile_once_split_unevenly_and_exactly(fake_pg_numbers, k):
    """A symbolic batch is cut in the graph at ``j * B // k`` (uneven where k does not
    divide it, empty pieces for batches under k after a compile at 5): one graph for every
    batch size, no guard on it (eager lowering), outputs and gradients those of the model,
    every collective split."""
    torch.manual_seed(0)
    model = AllReduceMLP()
    backend = KareusBackend({"nanobatches": k, "lowering": "eager", "profile": "off"})
    compiled = torch.compile(model, backend=backend, dynamic=True)
    torch._dynamo.utils.counters.clear()
    for batch in (5, 2, 3, 8, 13):
        x = torch.randn(batch, 8)
        out = compiled(x)
        out.square().sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        ref = model(x)
        ref.square().sum().backward()
        torch.testing.assert_close(out, ref)
        for g, p in zip(grads, model.parameters(), strict=True):
            torch.testing.assert_close(g, p.grad)
        model.zero_grad()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # no recompile
    forward, backward = backend.reports()
    for report in (forward, backward):
        assert report.nanobatches == k and report.fallback is None
        assert report.coverage.split == report.coverage.total == 1


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
def test_a_ragged_last_batch_keeps_the_split(fake_pg_numbers, lowering):
    """A smaller last batch (``drop_last=False``) makes Dynamo compile a dynamic graph that
    it then runs for every batch, full ones too: it was left unsplit, so every step after
    the first ragged batch lost the overlap."""
    torch.manual_seed(0)
    model = AllReduceMLP()
    backend = KareusBackend({"nanobatches": 2, "lowering": lowering, "profile": "off"})
    compiled = torch.compile(model, backend=backend)
    for batch in (8, 8, 5, 8):
        x = torch.randn(batch, 8)
        torch.testing.assert_close(compiled(x), model(x))
        compiled(x).sum().backward()
    reports = backend.reports()  # the static graph, then the dynamic one: both split
    assert sorted(r.kind for r in reports) == ["backward", "backward", "forward", "forward"]
    assert [r.nanobatches for r in reports] == [2, 2, 2, 2]


def test_a_dynamic_batch_of_a_sequence_parallel_llama_splits_like_a_static_one(fake_pg_numbers):
    """Blocked values of a symbolic batch (the sequence-parallel all-gathers, DTensor's
    split of them back into per-rank blocks) are cut block by block, sizes computed in
    the graph: every collective of the dynamic graphs stays split, and the model trains
    as eagerly."""
    model = tp_llama(2, sequence_parallel=True)
    backend = KareusBackend({"nanobatches": 2, "lowering": "eager", "profile": "off"})
    compiled = torch.compile(model, backend=backend)
    for batch in (4, 6, 10):  # static, then dynamic (6 and 10: one graph)
        tokens = torch.randint(0, 256, (batch, 16))
        grads = []
        for run in (compiled, model):
            out = run(tokens)
            out.float().square().mean().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
            model.zero_grad()
        torch.testing.assert_close(compiled(tokens), model(tokens))
        for g, ref in zip(*grads, strict=True):
            torch.testing.assert_close(g, ref)
    reports = backend.reports()
    assert len(reports) == 4  # a static forward and backward, a dynamic forward and backward
    for report in reports:
        assert report.nanobatches == 2
        assert report.coverage.split == report.coverage.total > 0


def _mlp(x, w1, w2):
    return funcol.all_reduce(torch.relu(x @ w1), "sum", dist.group.WORLD) @ w2


def test_a_symbolic_batch_is_cut_in_the_graph(fake_pg_numbers):
    """One rewrite of a symbolic graph serves every batch size: the cut is computed from
    the input's size in the graph (the sym_size, then j * B // k), not read at compile time."""
    from kareus.passes.analyse import analyse

    w1, w2 = torch.randn(8, 16), torch.randn(16, 8)
    gm = make_fx(_mlp, tracing_mode="symbolic")(torch.randn(4, 8), w1, w2)
    inputs = [n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")]
    analysis = analyse(gm, inputs, "inference", static_input_idxs=(1, 2))
    assert analysis.space.nanobatches == (1, 2, 4)
    rewritten = nanobatch_graph(
        gm, analysis.partitioning, analysis.collectives, analysis.placements[4],
        Schedule(4, (0,), (None,)), inputs,
    )
    FileCheck().check("sym_size").check("// 4").check_count(
        "_c10d_functional.all_reduce.default(", 4, exactly=True
    ).run(rewritten.code)
    for batch in (2, 3, 4, 7, 11):  # uneven pieces, and empty ones below 4 rows
        x = torch.randn(batch, 8)
        torch.testing.assert_close(rewritten(x, w1, w2), gm(x, w1, w2))
    # traced at a batch of 3, 4 nanobatches would compile an empty piece: not planned
    small = make_fx(_mlp, tracing_mode="symbolic")(torch.randn(3, 8), w1, w2)
    inputs = [n.meta["val"] for n in small.graph.find_nodes(op="placeholder")]
    analysis = analyse(small, inputs, "inference", static_input_idxs=(1, 2))
    assert analysis.space.nanobatches == (1, 2)
    assert analysis.space.infeasible[4].kind is ReasonKind.NOT_DIVISIBLE


def test_symbolic_split_dims_are_cut_alike_or_not_at_all(fake_pg):
    """Values split along two batch symbols cannot be cut alike: no count applies, and the
    reason says so. (From the inputs, only the first batch's symbol is split.)"""
    from kareus.passes.analyse import analyse, feasibility

    def fn(x, y, w):
        return _mlp(x, w, w.t()).sum(0) + _mlp(y, w, w.t()).sum(0)

    example = torch.randn(4, 8), torch.randn(6, 8), torch.randn(8, 8)
    gm = make_fx(fn, tracing_mode="symbolic")(*example)
    x, y, w = gm.graph.find_nodes(op="placeholder")
    analysis = analyse(gm, [n.meta["val"] for n in (x, y, w)], "inference", static_input_idxs=(2,))
    assert analysis.space.nanobatches == (1, 2, 4)
    assert analysis.placements[2].placements[x] == Split(0)
    assert analysis.placements[2].placements[y] != Split(0)
    both = propagate(gm.graph, {x: Split(0), y: Split(0)}, 2, OP_TABLE)
    why = feasibility(gm.graph, both, 2, analysis.collectives)
    assert why.kind is ReasonKind.SYMBOLIC_SHAPES and "one batch expression" in why.detail


def _most_all_gathers_in_flight(graph):
    in_flight, most = set(), 0
    for node in graph.nodes:
        if node.target is torch.ops._c10d_functional.all_gather_into_tensor.default:
            in_flight.add(node)
            most = max(most, len(in_flight))
        elif node.target is torch.ops._c10d_functional.wait_tensor.default:
            in_flight.discard(node.args[0])
    return most


def test_exclusive_collectives_are_never_two_in_flight(fake_pg):
    """gloo corrupts the heap with two all-gathers in flight on one group (torch 2.11-2.14):
    for such a backend each is waited before the next is issued."""
    from kareus.passes.analyse import analyse

    ((g, _),) = analysed(
        tp_llama(2, sequence_parallel=True), torch.randint(0, 256, (4, 16)), backward=False
    )
    graphs = {}
    for name, backend in [("free", "fake"), ("gloo", "gloo")]:
        a = analyse(
            g.gm, g.inputs, g.kind, backend=backend, static_input_idxs=g.static_input_idxs
        )
        graphs[name] = apply(g.gm, a, decide(a, Policy(4)).choice).graph
    assert _most_all_gathers_in_flight(graphs["free"]) > 1
    assert _most_all_gathers_in_flight(graphs["gloo"]) == 1
