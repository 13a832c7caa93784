"""Structure of the forward and backward graphs of a tensor-parallel Llama (fake process group)."""

import types
from collections import Counter

import pytest
import torch
from conftest import analysed, aot_graphs, tp_llama

LAYERS = 4


def _analyses(model, batch=4, seq=16):
    """The forward and backward analyses of ``model`` on a batch of token ids."""
    (_, fw), (_, bw) = analysed(model, torch.randint(0, 256, (batch, seq)))
    assert (fw.kind, bw.kind) == ("forward", "backward")
    return fw, bw


def _kinds(report):
    return Counter(c.kind for c in report.collectives)


def _slot_kinds(partition):
    return [s.kind for s in partition.slots]


def _per_layer(partitions, first, per_layer):
    return [
        tuple(p.key for p in partitions[first + per_layer * i : first + per_layer * (i + 1)])
        for i in range(LAYERS)
    ]


def test_tensor_parallel_llama(fake_pg):
    fw, bw = _analyses(tp_llama(LAYERS))
    # Embedding (row-wise) and every attention / MLP output projection all-reduce; the
    # column-wise output layer gathers the vocabulary shards.
    assert _kinds(fw) == {"all_reduce": 2 * LAYERS + 1, "all_gather": 1}
    # Backward: the input gradient of each column-wise linear (q, k, v, w1, w3, output)
    # is a partial sum that must be all-reduced.
    assert _kinds(bw) == {"all_reduce": 5 * LAYERS + 1}
    assert len(fw.partitioning.partitions) == len(fw.collectives) and len(
        bw.partitioning.partitions
    ) == len(bw.collectives)

    attention, mlp = fw.partitioning.partitions[3], fw.partitioning.partitions[4]  # layer 1
    assert _slot_kinds(attention) == [
        "memory", "matmul", "matmul", "matmul", "memory", "attention", "matmul"
    ]
    assert _slot_kinds(mlp) == ["memory", "matmul", "matmul", "memory", "matmul"]
    assert [s.label for s in attention.slots][5] == "attn"

    layers = _per_layer(fw.partitioning.partitions, 1, 2)
    assert len({keys[1] for keys in layers}) == 1, "MLP partitions of all layers share a key"
    assert len({keys[0] for keys in layers[1:]}) == 1, (
        "attention partitions of layers >= 1 share a key"
    )
    assert layers[0][0] != layers[1][0], "layer 0's attention has no residual add: its own key"

    # Backward runs the layers in reverse, five partitions each after the output layer's.
    bw_layers = _per_layer(bw.partitioning.partitions, 1, 5)
    assert len(set(bw_layers[1:-1])) == 1, "inner layers' backward partitions share keys"
    assert any(
        s.kind == "attention" and s.label == "attn-bwd"
        for p in bw.partitioning.partitions
        for s in p.slots
    )
    assert len({p.key for p in bw.partitioning.partitions}) < len(bw.partitioning.partitions)


def test_tensor_and_sequence_parallel_llama(fake_pg):
    fw, bw = _analyses(tp_llama(LAYERS, sequence_parallel=True))
    # Sequence parallel turns each all-reduce into a reduce-scatter, and each block input
    # is all-gathered; the output layer gathers both its input and its vocabulary shards.
    assert _kinds(fw) == {"reduce_scatter": 2 * LAYERS + 1, "all_gather": 2 * LAYERS + 2}
    assert _kinds(bw) == {"reduce_scatter": 2 * LAYERS + 1, "all_gather": 2 * LAYERS + 1}
    assert len(fw.partitioning.partitions) == len(fw.collectives)

    layers = _per_layer(fw.partitioning.partitions, 1, 4)
    assert len(set(layers[1:])) == 1
    # layer 1: norm -> all-gather; attention -> reduce-scatter
    gather, scatter = fw.partitioning.partitions[5], fw.partitioning.partitions[6]
    assert (gather.collective.kind, scatter.collective.kind) == ("all_gather", "reduce_scatter")
    assert _slot_kinds(gather) == ["memory"]
    assert "attention" in _slot_kinds(scatter)


def test_keys_distinguish_shapes(fake_pg):
    small, _ = _analyses(tp_llama(2), seq=16)
    large, _ = _analyses(tp_llama(2), seq=32)
    assert small.key != large.key and small.shape_free_key == large.shape_free_key
    assert {p.key for p in small.partitioning.partitions}.isdisjoint(
        {p.key for p in large.partitioning.partitions}
    )


@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_every_compute_node_is_in_exactly_one_segment(fake_pg, kind):
    from kareus.passes.collectives import find_collectives, is_collective, is_wait
    from kareus.passes.partition import partition_graph

    graphs = aot_graphs(tp_llama(2), torch.randint(0, 256, (4, 16)))
    graph = graphs[0 if kind == "forward" else 1].gm.graph
    colls = find_collectives(graph)
    result = partition_graph(graph, colls)
    placed = [n for seg in result.segments for n in seg]
    compute = [
        n for n in graph.nodes
        if n.op == "call_function" and not is_collective(n) and not is_wait(n)
    ]
    assert sorted(placed, key=str) == sorted(compute, key=str)
    assert len(result.segments) == len(colls) + 1
    for part in result.partitions:
        # canonical order is topological within the partition
        seen = set()
        members = set(part.nodes)
        for node in part.nodes:
            assert all(i in seen for i in node.all_input_nodes if i in members)
            seen.add(node)
        # the collective's input is produced inside its partition
        assert part.collective.node.all_input_nodes[0] in members


def _calling(target) -> torch.fx.Graph:
    graph = torch.fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    graph.output(graph.call_function(target, ((a, b),)))
    return graph


def test_keys_name_python_function_targets_not_their_address():
    # torch.sym_sum sums the token counts of an MoE's all-to-all; as a Python function its
    # str holds its address, which differs between the ranks' processes. A copy of it
    # (same module and name, another address) stands for another rank's.
    from kareus.passes.ops import OP_TABLE
    from kareus.passes.partition import graph_hash

    other_rank = types.FunctionType(
        torch.sym_sum.__code__, torch.sym_sum.__globals__, torch.sym_sum.__name__
    )
    other_rank.__qualname__ = torch.sym_sum.__qualname__
    assert str(other_rank) != str(torch.sym_sum)
    for shapes in (True, False):
        assert graph_hash(_calling(torch.sym_sum), OP_TABLE, shapes=shapes) == graph_hash(
            _calling(other_rank), OP_TABLE, shapes=shapes
        )
