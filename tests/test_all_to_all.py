"""All-to-alls split into nanobatches where every rank knows a nanobatch's share of them.

Sequence parallelism over heads (DeepSpeed-Ulysses's layout): each rank holds a shard of
the sequence; around attention one all-to-all trades it for a group of heads over the
whole sequence, another trades it back. The exchange moves blocks of the heads dim, so a
split of the batch travels with them and each nanobatch's all-to-all moves its own rows:
both all-to-alls split, forward and backward, and the step computes what it did.

An MoE's token exchange (an EP all-to-all of routed tokens) has split sizes that are token
counts: uneven and different on every rank. A nanobatch's share of it is a chunk of every
rank's block (``j * s // k`` of a block of ``s`` rows), which the block's sender and its
receiver cut alike from the size both know: the analysis lays the tokens out by
destination, the exchange out and back splits, and so does its backward. Ranks compile
such a graph at different steps (their counts differ), so it is split as its structure
says, not agreed on: a rank compiling a version the other never compiles neither waits
nor issues other collectives. Between the exchanges each nanobatch sorts the tokens it
received by expert and runs the grouped experts on them alone. Before them, a rank's part
of the replicated tokens is cut in blocks, so each nanobatch counts and exchanges its own.
Sizes read from tensor data in the graph itself (unbacked) end the split region with a
typed reason.
"""

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from conftest import analysed
from gloo import against_eager, leave, report, run_ranks, sequence_shards
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing import FileCheck

from kareus import ReasonKind
from kareus.backend import KareusBackend
from kareus.codegen.apply import apply
from kareus.passes.analyse import analyse
from kareus.passes.decide import Policy, decide
from kareus.passes.ops import OP_TABLE
from kareus.passes.placement import PARTIAL, REPLICATE, Split, propagate

A2A = "torch.ops._c10d_functional.all_to_all_single.default"


class UlyssesAttention(torch.nn.Module):
    """Causal self-attention on a sequence shard ``[batch, seq / P, dim]`` of P ranks."""

    def __init__(self, dim: int = 32, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (torch.nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):
        batch, shard, _ = x.shape
        # each rank: its head group over the whole sequence, [b, s, h/P, d] -> [b, h/P, s, d]
        q, k, v = (_exchange(p(x).view(batch, shard, self.heads, -1), 2, 1).transpose(1, 2)
                   for p in (self.q, self.k, self.v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        # back to its sequence shard with every head: [b, s/P, h, d]
        return x + self.o(_exchange(o.transpose(1, 2), 1, 2).reshape(batch, shard, -1))


def _exchange(t, scatter_dim, gather_dim):
    """``t`` with ``scatter_dim`` split over the ranks (rank ``p`` gets block ``p``) and
    ``gather_dim`` gathered from them, in rank order: one all-to-all of equal blocks."""
    ranks = dist.get_world_size()
    blocks = t.unflatten(scatter_dim, (ranks, -1)).movedim(scatter_dim, 0).contiguous()
    out = funcol.all_to_all_single_autograd(blocks, None, None, dist.group.WORLD)
    return out.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1)


def test_ulysses_all_to_alls_split_forward_and_backward(fake_pg):
    torch.manual_seed(0)
    graphs = analysed(UlyssesAttention(), torch.randn(4, 8, 32))
    assert [g.kind for g, _ in graphs] == ["forward", "backward"]
    for g, analysis in graphs:
        kinds = [c.kind for c in analysis.collectives]
        assert kinds == ["all_to_all"] * 4, (g.kind, kinds)  # q, k, v and back
        placed = analysis.placements_at(2).placements
        assert all(isinstance(placed[c.node], Split) for c in analysis.collectives), g.kind
        decision = decide(analysis, Policy(2))
        assert decision.choice.nanobatches == 2, (g.kind, decision.fallback)
        code = apply(g.gm, analysis, decision.choice).code
        FileCheck().check_count(A2A, 8, exactly=True).run(code)
        # a nanobatch's exchange moves its own rows: the sizes are the head blocks, per rank
        FileCheck().check(f"{A2A}(").check("[1, 1], [1, 1]").run(code)


def _moe_exchange(tokens, sent, received):
    """Routed tokens out to their experts' ranks and back: the exchange of an EP MoE."""
    routed = funcol.all_to_all_single(torch.relu(tokens), received, sent, dist.group.WORLD)
    return funcol.all_to_all_single(routed * 2, sent, received, dist.group.WORLD)


@pytest.mark.parametrize(
    "sent, received, kind",
    [
        # even blocks, but a nanobatch's rows are not its share of every rank's block
        ([4, 4], [4, 4], ReasonKind.ALONG_SPLIT_DIM),
        ([5, 3], [2, 6], ReasonKind.DATA_DEPENDENT_SIZES),
    ],
)
def test_token_exchange_with_rank_varying_counts_ends_the_split_region(
    fake_pg, sent, received, kind
):
    gm = make_fx(lambda x: _moe_exchange(x, sent, received))(torch.randn(8, 16))
    (x,) = gm.graph.find_nodes(op="placeholder")
    result = propagate(gm.graph, {x: Split(0)}, 2, OP_TABLE)
    (barrier,) = result.barriers
    assert barrier.node == "all_to_all_single"
    assert barrier.kind is kind, barrier
    # the same exchange of blocks that refine each rank's block splits
    blocked = make_fx(lambda x: _moe_exchange(torch.cat([x, -x]), [8, 8], [8, 8]))(
        torch.randn(8, 16)
    )
    (x,) = blocked.graph.find_nodes(op="placeholder")
    result = propagate(blocked.graph, {x: Split(0)}, 2, OP_TABLE)
    assert result.barriers == ()
    exchanged = blocked.graph.find_nodes(
        op="call_function", target=torch.ops._c10d_functional.all_to_all_single.default
    )
    assert [result.placements[n] for n in exchanged] == [Split(0, 2)] * 2


class RoutedExpert(torch.nn.Module):
    """An EP MoE's exchange with a per-token expert between: tokens out to their expert's
    rank in ``sent`` blocks (``received`` from each rank), back after the expert."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.w = torch.nn.Linear(dim, dim)

    def routing(self, tokens: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
        """What the model takes besides its tokens and sizes: nothing."""
        return ()

    def forward(self, tokens, sent, received):
        group = dist.group.WORLD
        routed = funcol.all_to_all_single_autograd(tokens, received, sent, group)
        return funcol.all_to_all_single_autograd(torch.relu(self.w(routed)), sent, received, group)


def test_tokens_laid_out_by_destination_exchange_a_chunk_of_every_block(fake_pg):
    # rank 0 of 2 sends 5 tokens to itself and 3 to rank 1, and receives 2 from rank 1
    graphs = analysed(RoutedExpert(), torch.randn(8, 16, requires_grad=True), [5, 3], [5, 2])
    assert [g.kind for g, _ in graphs] == ["forward", "backward"]
    for g, analysis in graphs:
        assert analysis.exchanged, g.kind
        placed = analysis.placements_at(2).placements
        (tokens, *_) = (n for n in g.gm.graph.find_nodes(op="placeholder")
                        if isinstance(placed[n], Split))
        assert placed[tokens].sizes in ((5, 3), (5, 2)), placed[tokens]  # by destination
        assert all(placed[c.node].sizes for c in analysis.collectives), g.kind
        decision = decide(analysis, Policy(2))
        assert decision.choice.nanobatches == 2, (g.kind, decision.fallback)
        code = apply(g.gm, analysis, decision.choice).code
        FileCheck().check_count(A2A, 4, exactly=True).run(code)
    # forward: out in chunks 0 then 1 of [5, 3] (2 + 1, 3 + 2 rows), back from [5, 2]
    forward, analysis = graphs[0]
    forward_code = apply(forward.gm, analysis, decide(analysis, Policy(2)).choice).code
    FileCheck().check(f"{A2A}(").check("[2, 1], [2, 1]").check(f"{A2A}(").check(
        "[3, 1], [3, 2]").run(forward_code)


def test_uneven_exchanges_are_split_only_by_their_blocks(fake_pg):
    # a split other than by destination would depend on sizes that differ by rank
    def fn(x, y):
        return _moe_exchange(x, [5, 3], [2, 6]), funcol.all_reduce(y * 2, "sum", dist.group.WORLD)

    gm = make_fx(fn)(torch.randn(8, 16), torch.randn(8, 4))
    analysis = analyse(gm, [torch.randn(8, 16), torch.randn(8, 4)], "forward", backend="fake")
    assert analysis.exchanged
    placed = analysis.placements_at(2).placements
    x, y = gm.graph.find_nodes(op="placeholder")
    assert placed[x] == Split(0, 2, (5, 3)) and placed[y] == REPLICATE


class RankRouter(torch.nn.Module):
    """What an EP MoE does on each rank before its dispatch (transformers' expert-parallel
    Mixtral): the rank takes its part of the replicated tokens (DTensor's Replicate ->
    Shard(0); its backward all-gathers the gradients), counts their tokens per expert's
    rank, and exchanges the counts."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.w = torch.nn.Linear(dim, dim)
        self.mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def forward(self, tokens, experts):
        n = dist.get_world_size()
        part, ids = (
            DTensor.from_local(t, self.mesh, [Replicate()], run_check=False)
            .redistribute(self.mesh, [Shard(0)]).to_local()
            for t in (tokens, experts)
        )
        counts = torch.zeros(n, dtype=torch.long).scatter_add(0, ids, torch.ones_like(ids))
        received = funcol.all_to_all_single(counts, [1] * n, [1] * n, dist.group.WORLD)
        return self.w(part), counts, received


def test_a_ranks_part_of_the_tokens_is_cut_in_blocks_and_its_counts_exchanged_per_nanobatch(
    fake_pg_numbers,
):
    # A contiguous half of the tokens is one rank's part: cut by parts (2 blocks), each
    # nanobatch holds a chunk of the part this rank keeps, counts its tokens (a partial
    # sum) and exchanges them; the backward all-gathers each nanobatch's gradients.
    torch.manual_seed(0)
    tokens, experts = torch.randn(8, 16, requires_grad=True), torch.randint(0, 2, (8,))
    graphs = analysed(RankRouter(), tokens, experts)
    assert [g.kind for g, _ in graphs] == ["forward", "backward"]
    (graph, forward), _ = graphs
    placed = forward.placements_at(2).placements
    inputs = [placed[n] for n in graph.gm.graph.find_nodes(op="placeholder")]
    assert inputs.count(Split(0, 2)) == 2, inputs  # the tokens and their experts, by part
    assert [placed[c.node] for c in forward.collectives] == [PARTIAL]
    for (g, analysis), kind in zip(graphs, ("all_to_all", "all_gather"), strict=True):
        assert [c.kind for c in analysis.collectives] == [kind]
        decision = decide(analysis, Policy(2))
        assert decision.choice.nanobatches == 2, (g.kind, decision.fallback)
        code = apply(g.gm, analysis, decision.choice).code
        FileCheck().check_count(f"_c10d_functional.{kind}", 2, exactly=True).run(code)
    model = RankRouter()
    backend = KareusBackend({"nanobatches": 2, "lowering": "eager", "profile": "off"})
    runs = []
    for run in (model, torch.compile(model, backend=backend)):
        x = tokens.detach().clone().requires_grad_()
        out, counts, received = run(x, experts)
        out.square().sum().backward()
        runs.append((out, counts, received, x.grad, *(p.grad.clone() for p in model.parameters())))
        model.zero_grad()
    for eager, rewritten in zip(*runs, strict=True):
        torch.testing.assert_close(rewritten, eager)
    assert [(r.kind, r.nanobatches) for r in backend.reports()] == [
        ("forward", 2), ("backward", 2)
    ]


def test_token_counts_computed_in_the_graph_end_the_split_region(fake_pg):
    def fn(tokens, counts):
        sent = counts.tolist()
        return _moe_exchange(tokens, sent, sent[::-1])

    gm = make_fx(fn, tracing_mode="symbolic")(torch.randn(8, 16), torch.tensor([3, 5]))
    tokens = next(iter(gm.graph.find_nodes(op="placeholder")))
    (barrier, *_) = propagate(gm.graph, {tokens: Split(0)}, 2, OP_TABLE).barriers
    assert barrier.kind is ReasonKind.DATA_DEPENDENT_SIZES
    assert "read from tensor data in the graph" in barrier.detail


def dense_attention(model, x, causal=True):
    """``model``'s attention without parallelism, on the whole sequence."""
    b, s, _ = x.shape
    q, k, v = (p(x).view(b, s, model.heads, -1).transpose(1, 2)
               for p in (model.q, model.k, model.v))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return x + model.o(o.transpose(1, 2).reshape(b, s, -1))


def _worker(rank, port, out_dir, lowering):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = UlyssesAttention()
        shards, x = sequence_shards(rank)
        ref, _, result = against_eager(model, x, lowering)
        with torch.no_grad():  # the layout itself: attention over the whole sequence, on one rank
            dense = dense_attention(model, torch.cat(shards, dim=1))[:, 8 * rank : 8 * (rank + 1)]
        report(out_dir, rank, {
            "layout_diff": (ref - dense).abs().max().item(),
            **result,
        })
    finally:
        dist.destroy_process_group()
    leave()


@pytest.mark.slow
@pytest.mark.parametrize("lowering", ["eager", "inductor"])
def test_ulysses_attention_split_into_nanobatches_is_exact_on_gloo(lowering):
    for result in run_ranks(_worker, lowering):
        assert result["layout_diff"] < 1e-5, result
        assert result["out_diff"] < 1e-5 and result["grad_diff"] < 1e-5, result
        assert result["graphs"] == [("forward", 2, 4, 4), ("backward", 2, 4, 4)], result


def test_partial_sums_and_splits_off_the_exchanged_dim_pass_any_sizes(fake_pg):
    # the exchange is linear and moves whole rows: uneven sizes are fine for these
    def fn(x):
        gram = funcol.all_to_all_single(x.t() @ x, [5, 3], [6, 2], dist.group.WORLD)
        columns = funcol.all_to_all_single(x.t().contiguous(), [5, 3], [6, 2], dist.group.WORLD)
        return gram, columns

    gm = make_fx(fn)(torch.randn(4, 8))
    (x,) = gm.graph.find_nodes(op="placeholder")
    result = propagate(gm.graph, {x: Split(0)}, 2, OP_TABLE)
    exchanged = gm.graph.find_nodes(
        op="call_function", target=torch.ops._c10d_functional.all_to_all_single.default
    )
    assert [result.placements[n] for n in exchanged] == [PARTIAL, Split(1)]
    assert result.barriers == ()


# Per step and rank: the blocks a rank sends (to rank 0, 1) and receives (from rank 0, 1).
# Step 0 compiles static sizes; later steps recompile with symbolic ones, and a count of 1
# (specialised by Dynamo) makes one rank compile a version the other never does.
_ROUTES = (
    (([5, 3], [5, 2]), ([2, 6], [3, 6])),
    (([4, 7], [4, 1]), ([1, 3], [7, 3])),
    (([6, 2], [6, 5]), ([5, 4], [2, 4])),
)


def _routed_worker(rank, port, out_dir, model_class):
    """``model_class()`` one step per route of ``_ROUTES``, eagerly and compiled (Inductor,
    2 nanobatches): each step's largest difference, and the graphs compiled."""
    if model_class is SortedExperts:
        import transformers.integrations.moe  # noqa: F401  (registers its grouped matmul)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = model_class()
        backend = KareusBackend({"nanobatches": 2, "lowering": "inductor", "profile": "off"})
        compiled = torch.compile(model, backend=backend)
        diffs = []
        for step, routes in enumerate(_ROUTES):
            sent, received = routes[rank]
            seed = torch.Generator().manual_seed(10 * step + rank)
            x = torch.randn(sum(sent), 16, generator=seed)
            routing = model.routing(sum(sent), seed)
            runs = []
            for run in (model, compiled):
                tokens = x.clone().requires_grad_()
                y = run(tokens, *routing, sent, received)
                y.square().mean().backward()
                grads = [p.grad.clone() for p in model.parameters()]
                runs.append([y.detach(), tokens.grad, *grads])
                model.zero_grad()
            diffs.append(max((a - b).abs().max().item() for a, b in zip(*runs, strict=True)))
        report(out_dir, rank, {
            "diffs": diffs,
            "graphs": [(r.kind, r.nanobatches, r.coverage.split, r.coverage.total)
                       for r in backend.reports()],
        })
    finally:
        dist.destroy_process_group()
    leave()


class SortedExperts(torch.nn.Module):
    """An EP MoE layer as transformers' grouped experts run it between the exchanges: the
    tokens (with their expert and gate) out to their experts' rank, sorted there by expert,
    one grouped matmul over the groups (``offs``: a histogram's running sum), gated, put back
    in the order they came (the sort's inverse) and sent back."""

    def __init__(self, experts: int = 2, dim: int = 16):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(experts, dim, dim) / dim**0.5)

    def routing(self, tokens: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
        """Each token's expert and gate."""
        experts = self.w.shape[0]
        return (torch.randint(0, experts, (tokens,), generator=generator),
                torch.rand(tokens, generator=generator))

    def forward(self, tokens, expert, gate, sent, received):
        group, experts = dist.group.WORLD, self.w.shape[0]
        routed = funcol.all_to_all_single_autograd(tokens, received, sent, group)
        ids = funcol.all_to_all_single(expert, received, sent, group)
        gates = funcol.all_to_all_single_autograd(gate, received, sent, group)
        ids, perm = torch.sort(ids)
        counts = torch.histc(ids.float(), bins=experts, min=0, max=experts - 1)
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        out = torch.ops.transformers.grouped_mm_fallback(routed[perm], self.w, offs=offs)
        out = torch.relu(out) * gates[perm].unsqueeze(-1)
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.size(0))
        return funcol.all_to_all_single_autograd(out[inverse], sent, received, group)


@pytest.mark.slow
def test_experts_sort_their_own_tokens_per_nanobatch_and_train_exactly_on_gloo():
    # Each nanobatch sorts the chunk of every block it received, runs the experts on it and
    # sends it back, while the other's exchange is in flight: every all-to-all of every
    # forward version (static, then symbolic sizes) splits; in the backward the exchange
    # back of the gradients (the experts' backward, computed once, sits between the two).
    pytest.importorskip("transformers.integrations.moe")
    for result in run_ranks(_routed_worker, SortedExperts):
        assert max(result["diffs"]) < 1e-5, result
        kinds = [g[0] for g in result["graphs"]]
        assert kinds.count("forward") >= 2, result  # recompiled for symbolic sizes
        assert all(g[1] == 2 and g[2] == (g[3] if g[0] == "forward" else 1)
                   for g in result["graphs"]), result


@pytest.mark.slow
def test_routed_tokens_split_exactly_on_gloo_whatever_each_rank_recompiles():
    results = run_ranks(_routed_worker, RoutedExpert)
    for result in results:
        assert max(result["diffs"]) < 1e-5, result
        # every version split, forward and backward: no rank waited or fell back alone
        assert result["graphs"] and all(g[1:] == (2, 2, 2) for g in result["graphs"]), result
    # the ranks compiled different numbers of versions, and still exchanged alike
    assert len({len(r["graphs"]) for r in results}) == 2, results
