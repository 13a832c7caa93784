"""The three stages on their own: analyse is pure and keyed by structure, decide checks
what a policy asks, apply rewrites and clocks a copy (fake process group, no backend)."""

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from conftest import analysed, aot_graphs, tp_llama
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing import FileCheck

from kareus import KareusError, ReasonKind
from kareus.codegen.apply import apply
from kareus.passes.analyse import analyse
from kareus.passes.decide import Choice, Decision, DecisionError, Policy, decide
from kareus.passes.variants import Variant

TOKENS = (4, 16)


@pytest.fixture
def forward(fake_pg):
    ((g, a),) = analysed(tp_llama(2), torch.randint(0, 256, TOKENS), backward=False)
    return g, a


def test_analyse_is_pure_and_its_key_is_the_structure(fake_pg):
    graphs = aot_graphs(tp_llama(2), torch.randint(0, 256, TOKENS), backward=False)
    again = aot_graphs(tp_llama(2), torch.randint(0, 256, TOKENS), backward=False)
    (g,), (h,) = graphs, again
    before = g.gm.code
    groups = torch.distributed.distributed_c10d._world.group_count
    first = analyse(g.gm, g.inputs, "forward", static_input_idxs=g.static_input_idxs)
    assert g.gm.code == before and dist.distributed_c10d._world.group_count == groups
    second = analyse(h.gm, h.inputs, "forward", static_input_idxs=h.static_input_idxs)
    # another trace of the same program: same identity, whatever its node names
    assert first.key == second.key and first.shape_free_key == second.shape_free_key
    longer = aot_graphs(tp_llama(2), torch.randint(0, 256, (4, 32)), backward=False)[0]
    third = analyse(longer.gm, longer.inputs, "forward", static_input_idxs=longer.static_input_idxs)
    assert third.key != first.key and third.shape_free_key == first.shape_free_key


def test_each_count_gets_its_own_placements_and_choices(fake_pg):
    # 6 samples split in 2 but not in 4
    ((_, fw), (_, bw)) = analysed(tp_llama(2), torch.randint(0, 256, (6, 16)))
    for a in (fw, bw):
        assert a.space.nanobatches == (1, 2) and set(a.space.choices) == {2}
        assert a.space.infeasible[4].kind is ReasonKind.NOT_DIVISIBLE
        assert set(a.placements) == {2, 4}
    assert set(fw.interfaces) == {2, 4} and bw.interfaces == {}
    with pytest.raises(KareusError, match="4 nanobatches do not apply: .*does not divide"):
        fw.space.partitions(4)
    assert decide(fw, Policy(4)).reason.kind is ReasonKind.NOT_DIVISIBLE


def test_decide_checks_what_the_policy_returns(forward):
    _, a = forward
    n = len(a.partitioning.partitions)
    assert decide(a, Policy(1)) == Decision(1, Choice(1, 0))
    assert decide(a, Policy(2)).variant == Variant(2, (0,) * n, (None,) * n)
    bad = [
        (lambda a, k: Variant(4, (0,) * n, (None,) * n), "2 nanobatches were asked for"),
        (
            lambda a, k: Variant(2, (0,) * (n - 1), (None,) * (n - 1)),
            f"the graph has {n} partitions",
        ),
        (lambda a, k: Variant(2, (0,) * (n - 1) + (99,), (None,) * n), "slot 99 outside"),
        (lambda a, k: Variant(2, (0,) * n, (8,) * n), "resources 8 outside its choices"),
        (lambda a, k: "earliest", "expected a Variant, got str"),
    ]
    for chooser, message in bad:
        with pytest.raises(DecisionError, match=message):
            decide(a, Policy(2, chooser))
    with pytest.raises(DecisionError, match="nanobatches must be one of"):
        Policy(3)


def test_apply_clocks_a_copy_and_leaves_the_analysed_graph(forward):
    g, a = forward
    before = g.gm.code
    plain = apply(g.gm, a, decide(a, Policy(clock_mhz=1410)).choice)
    assert g.gm.code == before
    FileCheck().check("torch.ops.kareus.set_clock.default('forward', 1410)").check(
        "torch.ops.aten.embedding"
    ).run(plain.code)
    FileCheck().check_count("_c10d_functional.all_reduce.default", 5, exactly=True).run(plain.code)


def test_apply_issues_each_nanobatch_collective_at_its_slot(forward):
    g, a = forward
    mlp = 4
    slots = [0] * len(a.partitioning.partitions)
    for slot in (0, a.space.partitions(2)[mlp].launch_slots - 1):
        slots[mlp] = slot
        out = apply(
            g.gm,
            a,
            decide(a, Policy(2, lambda a, k: Variant(2, tuple(slots), (None,) * len(slots))))
            .choice,
        )
        FileCheck().check_count("_c10d_functional.all_reduce.default", 10, exactly=True).run(
            out.code
        )
        mms = [n for n in out.graph.nodes if n.target is torch.ops.aten.mm.default]
        reduces = [
            n for n in out.graph.nodes
            if n.target is torch.ops._c10d_functional.all_reduce.default
        ]
        order = {n: i for i, n in enumerate(out.graph.nodes)}
        # nanobatch 0's MLP all-reduce, then nanobatch 1's MLP matmuls: all three after it
        # at slot 0, none after it at the last slot (issued after the compute)
        nb0 = reduces[2 * mlp]
        after = [m for m in mms if order[nb0] < order[m] < order[reduces[2 * mlp + 1]]]
        assert len(after) == (3 if slot == 0 else 0)


def test_apply_issues_on_the_groups_the_runtime_gives(forward):
    g, a = forward
    decision = decide(a, Policy(2))
    groups = [None] * len(decision.variant.slots)
    groups[1] = "capped-group"
    out = apply(g.gm, a, decision.choice, groups=groups)
    FileCheck().check_count("'capped-group'", 2, exactly=True).run(out.code)
    # the cached k-way graph serves the next variant without touching the first
    assert "capped-group" not in apply(g.gm, a, decision.choice).code


def test_the_key_tells_group_sizes_apart():
    from conftest import init_fake_pg

    def block(x, w):
        return funcol.all_reduce(x @ w, "sum", dist.group.WORLD).relu()

    keys = []
    for world in (2, 4):
        init_fake_pg(world)
        inputs = (torch.randn(4, 8), torch.randn(8, 8))
        keys.append(analyse(make_fx(block)(*inputs), inputs, "forward").key)
    dist.destroy_process_group()
    assert keys[0] != keys[1]
