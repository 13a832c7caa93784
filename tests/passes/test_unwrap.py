"""Collectives hidden in custom ops are opened into functional collectives and split.

torch's context parallelism (the all-gather plan, ``context_parallel_llama``) gathers K and
V inside ``cplib::flex_cp_allgather`` and reduce-scatters their gradients inside its
backward op. Opened, the forward carries two all-gathers per attention and the backward
two reduce-scatters, and every one of them splits into nanobatches: the gathered K and V
are saved for the backward under their own names, so the backward receives them split.
"""

import torch
from conftest import aot_graphs
from torch.testing import FileCheck

from kareus.codegen.apply import apply
from kareus.models.llama import (
    Llama,
    LlamaConfig,
    context_parallel_inputs,
    context_parallel_llama,
)
from kareus.passes.analyse import analyse
from kareus.passes.decide import Policy, decide
from kareus.passes.placement import Split, per_nanobatch
from kareus.passes.unwrap import Unwrapped, opened_notes, unwrap_collectives

AG = "torch.ops._c10d_functional.all_gather_into_tensor.default"
RS = "torch.ops._c10d_functional.reduce_scatter_tensor.default"


def _cp_graphs(n_layers: int = 1):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    model = context_parallel_llama(Llama(LlamaConfig(n_layers=n_layers, n_kv_heads=2)), mesh)
    tokens = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(1))
    local, positions = context_parallel_inputs(mesh, tokens)
    return aot_graphs(model, local, positions)


def test_context_parallel_gathers_open_into_collectives_that_split(fake_pg):
    graphs = _cp_graphs(n_layers=2)
    assert [g.kind for g in graphs] == ["forward", "backward"]
    forward = None
    for g, op, collective in zip(graphs, ("cplib::flex_cp_allgather",
                                          "cplib::flex_cp_allgather_backward"), (AG, RS)):
        FileCheck().check_count(op.replace("::", "."), 2, exactly=True).run(g.gm.code)
        opened = unwrap_collectives(g.gm)
        assert [u.op for u in opened] == [op, op]
        assert all(u.collectives == 2 for u in opened)
        FileCheck().check_not("cplib").run(g.gm.code)
        FileCheck().check_count(collective, 4, exactly=True).run(g.gm.code)
        analysis = analyse(g.gm, g.inputs, g.kind, forward, backend="fake",
                           static_input_idxs=g.static_input_idxs, label=g.kind)
        forward = analysis.interfaces if g.kind == "forward" else forward
        placed = analysis.placements_at(2)
        assert placed.barriers == (), (g.kind, placed.barriers)
        assert all(per_nanobatch(placed.placements[c.node]) for c in analysis.collectives)
        decision = decide(analysis, Policy(2))
        assert decision.choice.nanobatches == 2, (g.kind, decision.fallback)
        FileCheck().check_count(collective, 8, exactly=True).run(
            apply(g.gm, analysis, decision.choice).code)


def test_gathered_keys_keep_their_names_for_the_backward(fake_pg):
    forward, backward = _cp_graphs()
    saved = {n.name for n in backward.gm.graph.find_nodes(op="placeholder")}
    (op,) = (n for n in forward.gm.graph.nodes if "flex_cp_allgather" in str(n.target))
    items = {n.name for n in op.users}
    assert len(items) == 2 and items <= saved
    unwrap_collectives(forward.gm)
    gathered = [n for n in forward.gm.graph.nodes if n.name in items]
    assert [n.target for n in gathered] == [torch.ops.aten.cat.default] * 2
    analysis = analyse(forward.gm, forward.inputs, "forward",
                       static_input_idxs=forward.static_input_idxs)
    assert all(analysis.interfaces[2].placements[n.name] == Split(0) for n in gathered)


def test_ops_outside_the_table_and_tuples_used_whole_are_left_alone(fake_pg):
    forward, _ = _cp_graphs()
    before = forward.gm.code
    assert unwrap_collectives(forward.gm, table={}) == []
    assert forward.gm.code == before
    node = next(n for n in forward.gm.graph.nodes if "flex_cp_allgather" in str(n.target))
    with forward.gm.graph.inserting_after(node):
        whole = forward.gm.graph.call_function(tuple, (node,))  # the tuple used whole
    (output,) = forward.gm.graph.find_nodes(op="output")
    output.args = ((*output.args[0], whole),)
    assert unwrap_collectives(forward.gm) == []


def test_opened_ops_are_noted_per_op():
    done = [Unwrapped("a", "cplib::flex_cp_allgather", 2),
            Unwrapped("b", "cplib::flex_cp_allgather", 2)]
    assert opened_notes(done) == (
        "2 cplib::flex_cp_allgather opened into their 4 functional collectives",)
    assert opened_notes([]) == ()
