"""Tracing a workload's pipeline stages for one rank over fake tensors under a fake process
group, compiled per block: the stages' instructions (graphs in order, counted), identical
blocks traced once, each graph's frontier with its baseline, and the collectives of the
Megatron layout (fused projections, a vocab-parallel tail) against the torchtitan one."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from conftest import analysed

import kareus
from kareus.models.llama import LlamaConfig, fake_parallel_llama
from kareus.offline.trace import (
    StageGraphs,
    TraceError,
    _Regions,
    stage_graphs,
    trace_model,
    trace_stages,
)
from kareus.offline.workload import Workload
from kareus.passes.ops import DEFAULT_CLOCK_MHZ

MODEL = LlamaConfig(dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128, n_layers=3, max_seq_len=64)
TINY = Workload(MODEL, "tiny", tp=2, pp=2, microbatches=2, microbatch_size=2, seq=16)
DEVICE = "sim:a100-sxm4-40gb"
BUDGET = 3


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """The tiny workload traced once (the module's tests compose it); the reports of the
    graphs it compiled, and whether it left a process group behind. A module fixture is
    made before the autouse one that clears reports: the earlier module's are cleared here."""
    kareus.clear_graph_reports()
    result = trace_model(TINY, DEVICE, cache_dir=tmp_path_factory.mktemp("store"),
                         search_budget=BUDGET)
    return result, kareus.graph_reports(), dist.is_initialized()


def _labels(graphs):
    return [(g.label, n) for g, n in graphs]


def test_a_two_stage_workload_runs_embed_and_blocks_then_blocks_and_the_tail(traced):
    first, last = stage_graphs(TINY, traced[0])
    assert (first.layers, last.layers) == (range(2), range(2, 3))
    assert _labels(first.forward) == [("embed/forward", 1), ("block/forward", 2)]
    assert _labels(first.backward) == [("block/backward", 2), ("embed/backward", 1)]
    assert _labels(last.forward) == [("block/forward", 1), ("tail/forward", 1)]
    assert _labels(last.backward) == [("tail/backward", 1), ("block/backward", 1)]


def test_identical_blocks_are_traced_once(traced):
    """Two blocks ran, yet one forward and one backward graph were compiled for them: six
    graphs in all (a compile per layer would be eight, and refused)."""
    model, reports, _ = traced
    assert len(reports) == 6
    assert len({g.graph_hash for g in model.graphs}) == 6
    block_graphs = [r for r in reports if r.key in (model.block.forward.graph_hash,
                                                    model.block.backward.graph_hash)]
    assert sorted(r.kind for r in block_graphs) == ["backward", "forward"]


def test_a_block_dynamo_compiles_again_is_refused():
    class Planner:
        def __init__(self):
            self.graphs = [("forward", 0, None)]

        def frontiers(self):
            return self.graphs

    planner = Planner()
    regions = _Regions(planner)
    assert regions.new_forward("the first block") == 0
    planner.graphs.append(("forward", 1, None))
    with pytest.raises(TraceError, match="block 2 compiled a forward graph of its own"):
        regions.none_new("block 2")


def test_the_traced_process_group_is_gone_after_the_trace(traced):
    assert not traced[2]


def test_every_graph_has_a_frontier_holding_its_baseline(traced):
    model = traced[0]
    for graph in model.graphs:
        base = graph.baseline
        assert graph.points and base.time_s > 0 and base.effective_energy_j > 0
        # the unrewritten graph at the default clock is a frequency-only point, and
        # no frontier is worse than doing nothing
        at_default = [o for o in graph.frequency_only
                      if o.choice.clock_mhz == DEFAULT_CLOCK_MHZ]
        assert [(o.time_s, o.effective_energy_j) for o in at_default] == [
            (base.time_s, base.effective_energy_j)]
        assert min(o.time_s for o in graph.points) <= base.time_s
        assert min(o.effective_energy_j for o in graph.points) <= base.effective_energy_j
    # the block's graphs may be split in two nanobatches (the batch is 2), whether or not
    # that pays at this size (here it does not: every point runs them whole)
    block = {model.block.forward.graph_hash, model.block.backward.graph_hash}
    assert [r.variants.nanobatches for r in traced[1] if r.key in block] == [(1, 2), (1, 2)]


def test_a_stage_baseline_is_its_graphs_baselines_counted(traced):
    first = stage_graphs(TINY, traced[0])[0]
    block, embed = traced[0].block.forward.baseline, traced[0].embed.forward.baseline
    assert first.baseline("forward").time_s == pytest.approx(2 * block.time_s + embed.time_s)
    assert first.baseline("forward").effective_energy_j == pytest.approx(
        2 * block.effective_energy_j + embed.effective_energy_j)


def test_one_stage_holds_embedding_blocks_and_tail(traced):
    (stage,) = stage_graphs(dataclasses.replace(TINY, pp=1), traced[0])
    assert _labels(stage.forward) == [("embed/forward", 1), ("block/forward", 3),
                                      ("tail/forward", 1)]
    assert _labels(stage.backward) == [("tail/backward", 1), ("block/backward", 3),
                                       ("embed/backward", 1)]


def test_a_middle_stage_holds_blocks_only(traced):
    stages = stage_graphs(dataclasses.replace(TINY, pp=3, microbatches=3), traced[0])
    assert [s.layers for s in stages] == [range(1), range(1, 2), range(2, 3)]
    assert _labels(stages[1].forward) == [("block/forward", 1)]
    assert _labels(stages[1].backward) == [("block/backward", 1)]


@pytest.fixture(scope="module")
def recomputed(tmp_path_factory):
    """The tiny workload with full recomputation: every block checkpointed."""
    workload = dataclasses.replace(TINY, recompute="full")
    result = trace_model(workload, DEVICE, cache_dir=tmp_path_factory.mktemp("store"),
                         search_budget=BUDGET)
    return result, kareus.graph_reports()


def test_full_recompute_checkpoints_blocks_their_backward_recomputing_the_forward(
    traced, recomputed
):
    """Under ``torch.utils.checkpoint`` the block's backward graph runs its forward again
    (the attention's all-reduce too: the MLP's input needs it; the MLP's own all-reduce
    feeds nothing the backward reads, and AOT autograd does not recompute it), and the
    stages count each graph once per layer."""
    forward = _collectives(recomputed, "block", "forward")
    assert len(forward) == len(_collectives(traced, "block", "forward")) == 2
    assert len(_collectives(recomputed, "block", "backward")) == 1 + len(
        _collectives(traced, "block", "backward"))
    first, last = stage_graphs(dataclasses.replace(TINY, recompute="full"), recomputed[0])
    assert _labels(first.backward) == [("block/backward", 2), ("embed/backward", 1)]
    assert _labels(last.backward) == [("tail/backward", 1), ("block/backward", 1)]


def test_a_stage_compiled_as_one_region_is_one_graph_each_way(tmp_path):
    """Compiled per stage, each stage is one forward and one backward graph holding all
    its blocks (and the embedding or the tail), their collectives all split in two."""
    workload = dataclasses.replace(TINY, regions="stage", recompute="full")
    first, last = trace_stages(workload, DEVICE, cache_dir=tmp_path, search_budget=BUDGET)
    assert _labels(first.forward) == [("stage0/forward", 1)]
    assert _labels(last.backward) == [("stage1/backward", 1)]
    reports = {r.key: r for r in kareus.graph_reports()}
    stage0 = reports[first.forward[0][0].graph_hash]
    assert [c.kind for c in stage0.collectives] == ["all_reduce"] * 5  # embed + 2 blocks
    for graphs in (first.forward, first.backward, last.forward, last.backward):
        report = reports[graphs[0][0].graph_hash]
        assert report.coverage.split == report.coverage.total > 0, report.coverage
        assert 2 in report.variants.nanobatches


def test_a_block_fed_a_received_activation_is_the_same_graph(traced, fake_pg):
    """A later stage's first block takes an activation received from the stage before (a
    leaf that requires grad), not the embedding's output: the same graphs, so one trace
    serves every stage."""
    model = traced[0]
    cfg = dataclasses.replace(TINY.traced_model, n_layers=1)
    with fake_parallel_llama(cfg, 2) as llama:
        h = torch.empty(2, 16, cfg.dim, requires_grad=True)
        graphs = analysed(llama.layers[0], h, llama.rope_cos, llama.rope_sin, pieces=2)
    assert [a.key for _, a in graphs] == [model.block.forward.graph_hash,
                                          model.block.backward.graph_hash]


def test_sequence_parallel_stages_trace_in_an_existing_fake_group(fake_pg, tmp_path):
    workload = dataclasses.replace(TINY, sp=True)
    stages = trace_stages(workload, DEVICE, cache_dir=tmp_path, search_budget=BUDGET)
    assert all(isinstance(s, StageGraphs) for s in stages)
    assert _labels(stages[0].forward) == [("embed/forward", 1), ("block/forward", 2)]
    kinds = {c.kind for r in kareus.graph_reports() for c in r.collectives}
    assert {"all_gather", "reduce_scatter"} <= kinds
    assert dist.is_initialized() and dist.get_world_size() == 2  # the fixture's, kept


def test_a_process_group_of_another_size_is_refused(fake_pg, tmp_path):
    with pytest.raises(TraceError, match=r"\(fake, 2 ranks\) is not a fake one of tp=4"):
        trace_model(dataclasses.replace(TINY, tp=4, model=dataclasses.replace(
            MODEL, n_heads=4, n_kv_heads=4)), DEVICE, cache_dir=tmp_path)


MEGATRON = dataclasses.replace(TINY, layout="megatron",
                               model=dataclasses.replace(MODEL, qk_norm=True))


@pytest.fixture(scope="module")
def megatron_traced(tmp_path_factory):
    """The tiny workload, Qwen3's query/key norms on, traced in the Megatron layout."""
    result = trace_model(MEGATRON, DEVICE, cache_dir=tmp_path_factory.mktemp("store"),
                         search_budget=BUDGET)
    return result, kareus.graph_reports()


def _collectives(traced, piece: str, kind: str):
    model, reports = traced[0], traced[1]
    key = getattr(getattr(model, piece), kind).graph_hash
    return {r.key: r for r in reports}[key].collectives  # the process's reports, by graph


@pytest.mark.parametrize("kind, megatron, torchtitan", [
    ("forward", ["all_reduce"] * 2, ["all_reduce"] * 2),
    ("backward", ["all_reduce"] * 2, ["all_reduce"] * 5),
])
def test_a_megatron_layout_block_all_reduces_twice_each_way(
    traced, megatron_traced, kind, megatron, torchtitan
):
    """Fused QKV and gate-up: one input-gradient all-reduce per column-parallel projection
    (2), where torchtitan's separate q, k, v, gate and up projections take 5."""
    assert [c.kind for c in _collectives(megatron_traced, "block", kind)] == megatron
    assert [c.kind for c in _collectives(traced, "block", kind)] == torchtitan


def test_a_vocab_parallel_tail_gathers_no_logits(traced, megatron_traced):
    """The Megatron layout's tail leaves the logits sharded on the vocabulary: its loss
    all-reduces a value per token (the max, the sum of exponentials, the target's logit),
    where the torchtitan layout's all-gathers every token's logits."""
    tokens = TINY.microbatch_size * TINY.seq
    vocab_parallel = _collectives(megatron_traced, "tail", "forward")
    assert [c.kind for c in vocab_parallel] == ["all_reduce"] * 3
    assert all(c.payload_bytes == 4 * tokens for c in vocab_parallel)  # fp32 per token
    (gather,) = _collectives(traced, "tail", "forward")
    assert gather.kind == "all_gather" and gather.payload_bytes == 2 * tokens * MODEL.vocab_size
    # the output projection's input gradient, as before
    assert [c.kind for c in _collectives(megatron_traced, "tail", "backward")] == ["all_reduce"]


def test_the_first_stage_holds_the_layers_given(traced):
    first, last = stage_graphs(dataclasses.replace(TINY, first_stage_layers=1), traced[0])
    assert (first.layers, last.layers) == (range(1), range(1, 3))
    assert _labels(first.forward) == [("embed/forward", 1), ("block/forward", 1)]
    assert _labels(last.forward) == [("block/forward", 2), ("tail/forward", 1)]
