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

import kareus
import kareus.backend
from kareus.passes.memory import peak_memory_bytes
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
    model = AllReduceMLP(before=lambda h: torch.cumsum(h, dim=0))  # mixes the batch
    forward, _ = _fallback(model, torch.randn(4, 8))
    assert forward.nanobatches == 1
    assert "no collective stays split" in forward.fallback_reason
    assert "no placement rule for aten.cumsum" in forward.fallback_reason
    assert any(b.reason.startswith("no placement rule for aten.cumsum") for b in forward.barriers)


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
        from kareus.codegen.comm_groups import capped_group

        capped_group(dist.group.WORLD.group_name, 8)


def test_split_inputs_of_the_caller_are_never_written(fake_pg):
    """Token ids in a padded (non-dense) tensor: Inductor must not reinplace into them."""
    model = torch.compile(tp_llama(2), backend="kareus", options={"nanobatches": 4})
    tokens = torch.randint(0, 256, (4, 17))[:, :-1]
    before = tokens.clone()
    model(tokens)
    assert kareus.graph_reports()[0].nanobatches == 4
    assert torch.equal(tokens, before)
