"""The nanobatch rewrite on one process (fake process group): schedule, fallbacks, memory."""

import random
import re

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from conftest import tp_llama
from torch._inductor.utils import run_and_get_code
from torch.fx.experimental.proxy_tensor import make_fx

import kareus
import kareus.backend

aten = torch.ops.aten
from kareus.passes.memory import peak_memory_bytes
from kareus.passes.nanobatch import Schedule, nanobatch_graph
from kareus.passes.ops import OP_TABLE
from kareus.passes.partition import partition_graph
from kareus.passes.placement import Split, propagate
from kareus.passes.variants import Variant


@pytest.fixture(autouse=True)
def default_chooser():
    yield
    kareus.backend.set_variant_chooser(None)


def _choose(partition: int, slot: int) -> None:
    def chooser(label, space, k):
        slots = list(space.default(k).slots)
        if label.endswith("forward"):
            slots[partition] = slot
        return Variant(k, tuple(slots), space.default(k).resources)

    kareus.backend.set_variant_chooser(chooser)


def _events(code: str) -> list[tuple[str, str | None]]:
    """Collective issues and waits (with their buffer) and matmuls, in the order Inductor runs them."""
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
    _choose(MLP, slot)
    model = torch.compile(tp_llama(2), backend="kareus", options={"nanobatches": 2})
    _, (code,) = run_and_get_code(model, torch.randint(0, 256, (4, 16)))
    report = kareus.graph_reports()[0]
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


def _run(model, x, nanobatches, lowering="eager", seed=0):
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="kareus", options={"nanobatches": nanobatches, "lowering": lowering})
    torch.manual_seed(seed)
    out = compiled(x)
    out.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return out, grads


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
@pytest.mark.parametrize("norm", [False, True], ids=["plain", "layernorm"])
def test_rewritten_block_matches_unrewritten(fake_pg, lowering, norm):
    torch.manual_seed(0)
    model, x = AllReduceMLP(before=torch.nn.LayerNorm(16) if norm else None), torch.randn(4, 6, 8)
    ref_out, ref_grads = _run(model, x, 1, lowering)
    kareus.clear_graph_reports()
    out, grads = _run(model, x, 4, lowering)
    assert [r.nanobatches for r in kareus.graph_reports()] == [4, 4]
    torch.testing.assert_close(out, ref_out)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)


def _fallback(model, x, k=2):
    ref_out, ref_grads = _run(model, x, 1)
    kareus.clear_graph_reports()
    out, grads = _run(model, x, k)
    torch.testing.assert_close(out, ref_out)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)
    return kareus.graph_reports()


def test_batch_not_divisible_runs_unrewritten(fake_pg):
    torch.manual_seed(0)
    forward, backward = _fallback(AllReduceMLP(), torch.randn(3, 8))
    assert (forward.nanobatches, backward.nanobatches) == (1, 1)
    assert "size 3 does not divide into 2 nanobatches" in forward.fallback_reason
    assert 2 in forward.variants.infeasible and forward.variants.nanobatches == (1,)


def test_op_without_rule_ends_the_split_region(fake_pg):
    torch.manual_seed(0)
    model = AllReduceMLP(before=lambda h: torch.flip(h, dims=[0]))  # mixes the batch
    forward, _ = _fallback(model, torch.randn(4, 8))
    assert forward.nanobatches == 1
    assert "no collective stays split" in forward.fallback_reason
    assert "no placement rule for prims.rev" in forward.fallback_reason
    assert any(b.reason.startswith("no placement rule for prims.rev") for b in forward.barriers)


def test_random_op_after_the_collective_keeps_the_random_stream(fake_pg):
    torch.manual_seed(0)
    model = AllReduceMLP(after=lambda h: F.dropout(h, 0.5, training=True))
    forward, backward = _fallback(model, torch.randn(4, 8), k=2)
    # The mask is drawn once for the whole batch, then sliced per nanobatch.
    assert (forward.nanobatches, backward.nanobatches) == (2, 2), forward.fallback_reason
    assert forward.barriers == ()


def test_graph_without_collectives_is_not_rewritten(fake_pg):
    torch.manual_seed(0)
    forward, backward = _fallback(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()), torch.randn(4, 8))
    assert forward.nanobatches == 1
    assert forward.fallback_reason.startswith("no collective stays split")
    assert forward.partitions == ()


def test_memory_of_two_nanobatches(fake_pg):
    """Peak memory grows only by what the extra in-flight buffers explain."""
    peaks = {}
    payload = 0
    real_lower = kareus.backend.lower
    for k in (1, 2):
        torch._dynamo.reset()
        kareus.clear_graph_reports()
        graphs = []

        def spy(gm, *args, **kwargs):
            graphs.append(peak_memory_bytes(gm.graph))
            return real_lower(gm, *args, **kwargs)

        kareus.backend.lower = spy
        try:
            model = torch.compile(tp_llama(2), backend="kareus", options={"nanobatches": k, "lowering": "eager"})
            model(torch.randint(0, 256, (8, 64))).sum().backward()
        finally:
            kareus.backend.lower = real_lower
        peaks[k] = graphs
        payload = max(c.payload_bytes for r in kareus.graph_reports() for c in r.collectives)
    ratios = [b / a for a, b in zip(peaks[1], peaks[2])]
    print(f"peak memory k=2 / k=1: forward {ratios[0]:.3f}, backward {ratios[1]:.3f}")
    for one, two in zip(peaks[1], peaks[2]):
        # the next nanobatch's collective in flight, and a join's copy of one value
        assert two <= one + 2 * payload


def test_variant_space_is_enumerable(fake_pg):
    model = torch.compile(tp_llama(1), backend="kareus", options={"lowering": "eager"})
    model(torch.randint(0, 256, (4, 16)))
    (report,) = kareus.graph_reports()
    space = report.variants
    assert space.nanobatches == (1, 2, 4) and report.nanobatches == 1
    assert all(p.resources == (None,) for p in space.partitions)  # gloo / fake: no CTA knob
    assert [p.launch_slots for p in space.partitions] == [len(p.slots) + 1 for p in report.partitions]
    variants = list(space)
    assert len(variants) == space.size() == len(set(variants))
    assert variants[0] == Variant(1, (0,) * len(space.partitions), (None,) * len(space.partitions))
    drawn = space.sample(random.Random(0), 4)
    assert space.schedule(drawn).slots == drawn.slots
    with pytest.raises(ValueError, match="slot 99"):
        space.schedule(Variant(2, (99,) * len(space.partitions), drawn.resources))
    with pytest.raises(ValueError, match="communication resource caps need NCCL"):
        from kareus.runtime.communicators import capped_group

        capped_group(dist.group.WORLD.group_name, 8)


def test_split_inputs_of_the_caller_are_never_written(fake_pg):
    """Token ids in a padded (non-dense) tensor: Inductor must not reinplace into them."""
    model = torch.compile(tp_llama(2), backend="kareus", options={"nanobatches": 4})
    tokens = torch.randint(0, 256, (4, 17))[:, :-1]
    before = tokens.clone()
    model(tokens)
    assert kareus.graph_reports()[0].nanobatches == 4
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
    placements = propagate(gm.graph, {x: Split(0)}, 2, OP_TABLE.without_rule(attention))
    assert [b.reason for b in placements.barriers] == [f"no placement rule for {attention}"]
    rewritten = nanobatch_graph(gm, partition_graph(gm.graph, []), [], placements, Schedule(2, (), ()), inputs)
    (joined,) = rewritten.graph.find_nodes(op="call_function", target=attention)
    assert [a.meta["val"].stride(-1) for a in joined.args[:3]] == [1, 1, 1]
    torch.testing.assert_close(rewritten(*inputs), gm(*inputs))


def test_dynamic_batch_sizes_compile_once_and_say_why_they_are_not_split(fake_pg):
    """Placement must not specialise symbolic sizes (one graph for every batch size, as
    with Inductor), and the report says why the graph runs unrewritten."""
    torch.manual_seed(0)
    model = AllReduceMLP()
    compiled = torch.compile(model, backend="kareus", dynamic=True, options={"nanobatches": 2, "lowering": "eager"})
    for batch in (2, 3, 5, 8, 12):
        x = torch.randn(batch, 8)
        torch.testing.assert_close(compiled(x), model(x))
    (forward,) = [r for r in kareus.graph_reports() if r.kind == "forward"]
    assert forward.nanobatches == 1 and "symbolic sizes" in forward.fallback_reason


def _forward_graph(model, x):
    """The forward graph AOT autograd hands kareus, and its example inputs."""
    captured = []
    real_lower = kareus.backend.lower

    def spy(gm, inputs, *args, **kwargs):
        captured.append((gm, inputs))
        return real_lower(gm, inputs, *args, **kwargs)

    kareus.backend.lower = spy
    try:
        torch.compile(model, backend="kareus", options={"lowering": "eager"})(x)
    finally:
        kareus.backend.lower = real_lower
    return captured[0]


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
    from kareus.passes.collectives import find_collectives
    from kareus.passes.interface import forward_inputs

    gm, inputs = _forward_graph(tp_llama(2, sequence_parallel=True), torch.randint(0, 256, (4, 16)))
    collectives = find_collectives(gm.graph)
    placements = propagate(gm.graph, forward_inputs(gm.graph, range(1, len(inputs))), 4, OP_TABLE)
    schedule = Schedule(4, (0,) * len(collectives), (None,) * len(collectives))
    graphs = {
        name: nanobatch_graph(
            gm, partition_graph(gm.graph, collectives), collectives, placements, schedule, inputs, exclusive
        ).graph
        for name, exclusive in [("free", lambda g: frozenset()), ("gloo", lambda g: frozenset({"all_gather"}))]
    }
    assert _most_all_gathers_in_flight(graphs["free"]) > 1
    assert _most_all_gathers_in_flight(graphs["gloo"]) == 1
