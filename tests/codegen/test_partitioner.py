"""kareus's partitioner: saved values handed to the backward in pieces, checkpointed DTensor
blocks that compile, recompute that keeps its attention (fake process group)."""

import pytest
import torch
from conftest import tp_llama
from torch.testing import FileCheck
from torch.utils.checkpoint import checkpoint

import kareus.backend as backend_module
from kareus import KareusBackend
from kareus.codegen import partitioner
from kareus.codegen.nanobatch import ROLE
from kareus.passes.placement import Piece

aten = torch.ops.aten


class Blocks(torch.nn.Module):
    """A TP Llama's blocks on a hidden state, each checkpointed (Megatron's full
    recomputation, torchtitan's ``checkpoint_wrapper``) or not."""

    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.model, self.checkpointed = tp_llama(2), checkpointed

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        m = self.model
        for layer in m.layers:
            if self.checkpointed:
                h = checkpoint(layer, h, m.rope_cos, m.rope_sin, use_reentrant=False)
            else:
                h = layer(h, m.rope_cos, m.rope_sin)
        return h


def _step(module, x):
    h = x.clone().requires_grad_(True)
    out = module(h)
    out.square().sum().backward()
    grads = [getattr(p.grad, "to_local", p.grad.clone)().clone()
             for p in module.parameters() if p.grad is not None]
    module.zero_grad()
    return out.detach(), h.grad, grads


def _compiled(module, monkeypatch, options):
    """``module`` compiled by a kareus backend of ``options``; the graphs it lowers."""
    torch._dynamo.reset()
    lowered = []

    def keep(gm, inputs, lowering, **kwargs):
        lowered.append(gm)
        return real_lower(gm, inputs, lowering, **kwargs)

    real_lower = backend_module.lower
    monkeypatch.setattr(backend_module, "lower", keep)
    backend = KareusBackend({"profile": "off", **options})
    return torch.compile(module, backend=backend), backend, lowered


def _producers(gm: torch.fx.GraphModule, first: int) -> str:
    """One line per output from the ``first`` on (the saved values): what computes it."""
    (out,) = gm.graph.find_nodes(op="output")
    return "\n".join(
        f"saved {n.name} = {n.op} {getattr(n.target, '__name__', n.target)}"
        for n in out.args[0][first:] if isinstance(n, torch.fx.Node)
    )


@pytest.mark.parametrize("k, checkpointed", [(2, False), (4, True)],
                         ids=["saved-k2", "recomputed-k4"])
def test_saved_values_cross_to_the_backward_in_pieces_exactly(
    fake_pg_numbers, monkeypatch, k, checkpointed
):
    module, x = Blocks(checkpointed), torch.randn(4, 16, 64)
    ref = _step(module, x)
    compiled, backend, lowered = _compiled(module, monkeypatch,
                                           {"nanobatches": k, "lowering": "eager"})
    got = _step(compiled, x)
    for a, b in zip(got[:2], ref[:2]):
        torch.testing.assert_close(a, b)
    for a, b in zip(got[2], ref[2]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    forward, backward = backend.reports()
    assert (forward.nanobatches, backward.nanobatches) == (k, k)
    assert forward.fallback is None and backward.fallback is None
    # Every collective stays split: under recomputation the attention is recomputed as
    # itself, not behind the random-state wrapper its dropout tag would give it.
    for report in (forward, backward):
        assert report.coverage.split == report.coverage.total > 0, report.coverage

    rewritten_forward, rewritten_backward = lowered
    saved = _producers(rewritten_forward, 1)
    # The forward returns each nanobatch's piece of a saved value as it is: no
    # concatenation of saved values at its end.
    FileCheck().check("saved").check_not("cat").run(saved)
    pieces = [n for n in rewritten_backward.graph.find_nodes(op="placeholder")
              if "_piece" in n.name]
    assert pieces and len(pieces) % 2 == 0
    # ... and the backward takes them as they come: no piece is concatenated or sliced.
    for piece in pieces:
        assert all(u.target not in (aten.cat.default, aten.slice.Tensor) for u in piece.users)
    if checkpointed:  # only the blocks' inputs are saved, in pieces
        assert {p.name.rsplit("_piece", 1)[0] for p in pieces} == {"primals_3", "add_6"}
    # ... which the forward's analysis places as pieces of the batch, as its backward's
    (interfaces,) = backend._forwards.values()
    placed = [p for p in interfaces[k].placements.values() if isinstance(p, Piece)]
    assert {(p.index, p.count) for p in placed} == {(j, k) for j in range(k)}


def test_without_pieces_the_forward_joins_what_it_saves(fake_pg_numbers, monkeypatch):
    """What the test above rules out happens without the partitioner's cut."""
    monkeypatch.setattr(partitioner, "to_cut", lambda *args, **kwargs: [])
    compiled, _, lowered = _compiled(Blocks(False), monkeypatch,
                                     {"nanobatches": 2, "lowering": "eager"})
    _step(compiled, torch.randn(4, 16, 64))
    FileCheck().check("saved").check("cat").run(_producers(lowered[0], 1))


def test_a_checkpointed_dtensor_block_that_keeps_a_random_state_compiles_exactly(
    fake_pg_numbers, monkeypatch
):
    """torch 2.13's partitioner saves a recomputed random op's state (the attention's: it
    is tagged random for its dropout) after the device mesh the DTensor gradients need,
    and its runtime then reads the mesh as a tensor ("expected all
    tensors_saved_with_vc_check to be Tensors", with ``aot_eager`` too; 2.14.1 fixed it).
    kareus's partitioner drops the state of an op that draws nothing (attention without
    dropout: the tests above); where a state stays (here forced), it restores the order
    AOT autograd reads them in."""
    module, x = Blocks(True), torch.randn(4, 16, 64)
    monkeypatch.setattr(partitioner, "_draws_nothing", lambda *args: False)
    torch._dynamo.reset()
    out, dx, _ = _step(torch.compile(module, backend=KareusBackend({"profile": "off"})), x)
    for a, b in zip((out, dx), _step(module, x)):
        torch.testing.assert_close(a, b)


def _reader(node: torch.fx.Node) -> str:
    return "output" if node.op == "output" else "compute"


def _joins(gm: torch.fx.GraphModule) -> str:
    """One line per node the rewrite emitted to join nanobatch pieces, and who reads it."""
    joins = ("cat", "sum", "unsort")
    return "\n".join(
        f"join {n.name} -> {' '.join(sorted(_reader(u) for u in n.users))}"
        for n in gm.graph.nodes if n.meta.get(ROLE) in joins
    )


def test_blocks_compiled_as_one_graph_flow_between_blocks_without_a_join(fake_pg, monkeypatch):
    """A stage compiled as one region (two TP blocks here): the nanobatches pass from
    block to block as they are, joined only where the graph returns them; compiled per
    block, every block's end joins them."""
    compiled, _, lowered = _compiled(Blocks(True), monkeypatch,
                                     {"nanobatches": 2, "lowering": "eager"})
    _step(compiled, torch.randn(4, 16, 64))
    for gm in lowered:
        FileCheck().check_not("-> compute").run(_joins(gm))
    FileCheck().check("join").check("-> output").run(_joins(lowered[0]))  # the stage's output

    per_block, _, lowered = _compiled(tp_llama(2).layers[0], monkeypatch,
                                      {"nanobatches": 2, "lowering": "eager"})
    model = tp_llama(2)
    h = torch.randn(4, 16, 64, requires_grad=True)
    per_block(h, model.rope_cos, model.rope_sin).sum().backward()
    FileCheck().check("join").check("-> output").run(_joins(lowered[0]))
