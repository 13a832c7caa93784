"""Materialising many schedules of one rewrite (``NanobatchRewrite``): the graphs the
one-shot rewrite gives, computing what the original graphs compute, propagated once."""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.fx
from conftest import tp_llama
from one_shot import nanobatch_graph
from torch._guards import detect_fake_mode
from torch._inductor.compile_fx import compile_fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.testing import FileCheck
from torch.utils._pytree import tree_leaves

from kareus.codegen.nanobatch import NanobatchRewrite, Schedule
from kareus.passes.collectives import Collective, find_collectives
from kareus.passes.interface import backward_inputs, forward_inputs, record_forward
from kareus.passes.ops import OP_TABLE
from kareus.passes.partition import GraphPartitioning, partition_graph
from kareus.passes.placement import PlacementResult, per_nanobatch, propagate


@dataclass(frozen=True)
class AotGraph:
    """A graph as AOT autograd hands it to Inductor's inner compiler, and what it ran on."""

    gm: torch.fx.GraphModule
    example_inputs: tuple[Any, ...]  # fake, as Inductor passes them
    static_input_idxs: tuple[int, ...]
    runtime_inputs: list[Any]  # the real arguments of its first call


def _capture(model: torch.nn.Module, tokens: torch.Tensor) -> tuple[AotGraph, AotGraph]:
    """The forward and backward graphs of one training step, without the kareus backend."""
    graphs = []

    def capture(gm, example_inputs, **kwargs):
        runtime: list[Any] = []

        def run(args):  # boxed calling convention, as make_boxed_func
            runtime.extend(args)
            return gm(*args)

        run._boxed_call = True
        static = tuple(kwargs.get("static_input_idxs") or ())
        graphs.append(AotGraph(gm, tuple(example_inputs), static, runtime))
        return run

    backend = functools.partial(compile_fx, inner_compile=capture)
    torch.compile(model, backend=backend)(tokens).sum().backward()
    forward, backward = graphs
    return forward, backward


@dataclass(frozen=True)
class Case:
    """A captured graph with what its rewrite into ``k`` nanobatches needs."""

    name: str
    graph: AotGraph
    k: int
    partitioning: GraphPartitioning
    collectives: list[Collective]
    placements: PlacementResult

    @classmethod
    def of(cls, name: str, graph: AotGraph, k: int, inputs: dict) -> Case:
        collectives = find_collectives(graph.gm.graph)
        partitioning = partition_graph(graph.gm.graph, collectives)
        placements = propagate(graph.gm.graph, inputs, k, OP_TABLE)
        return cls(name, graph, k, partitioning, collectives, placements)

    def _args(self) -> tuple:
        return self.graph.gm, self.partitioning, self.collectives, self.placements

    def rewrite(self) -> NanobatchRewrite:
        return NanobatchRewrite(*self._args(), self.k, self.graph.example_inputs)

    def one_shot(self, schedule: Schedule) -> torch.fx.GraphModule:
        return nanobatch_graph(*self._args(), schedule, self.graph.example_inputs)

    def schedules(self, group: str, seed: int = 0) -> list[Schedule]:
        """Random launch slots per partition; the last issues one collective on ``group``."""
        rng = random.Random(seed)
        parts = self.partitioning.partitions
        choices = [  # a collective left whole has one place (as ``VariantSpace``)
            len(p.slots) + 1 if per_nanobatch(self.placements.placements[p.collective.node]) else 1
            for p in parts
        ]
        drawn = [tuple(rng.randrange(c) for c in choices) for _ in range(4)]
        other = rng.choice([i for i, c in enumerate(choices) if c > 1])
        groups = tuple(group if i == other else None for i in range(len(parts)))
        own = (None,) * len(parts)
        return [Schedule(self.k, slots, own) for slots in drawn[:-1]] + [
            Schedule(self.k, drawn[-1], groups)
        ]


def _cases(k: int) -> list[Case]:
    """The forward and backward graphs of a tensor-parallel Llama's step, placed for ``k``."""
    fw, bw = _capture(tp_llama(2), torch.randint(0, 256, (4, 16)))
    forward = Case.of("forward", fw, k, forward_inputs(fw.gm.graph, fw.static_input_idxs))
    interface = record_forward(fw.gm.graph, forward.placements)
    return [forward, Case.of("backward", bw, k, backward_inputs(bw.gm.graph, interface))]


def _metadata(gm: torch.fx.GraphModule) -> list[object]:
    """Every node's metadata keys and value as shape, stride, dtype and device."""

    def layout(val: object) -> object:
        if isinstance(val, torch.Tensor):
            return (tuple(val.shape), val.stride(), val.dtype, val.device)
        if isinstance(val, (list, tuple)):
            return tuple(layout(v) for v in val)
        return val

    return [(n.name, sorted(n.meta), layout(n.meta.get("val"))) for n in gm.graph.nodes]


@pytest.mark.parametrize("k", [2, 4])
def test_materialised_schedules_are_the_one_shot_rewrites(fake_pg, k):
    group = dist.new_group([0, 1]).group_name
    for case in _cases(k):
        rewrite = case.rewrite()
        mode = detect_fake_mode(case.graph.example_inputs)
        codes = []
        for schedule in case.schedules(group):
            cached, one_shot = rewrite.materialise(schedule), case.one_shot(schedule)
            assert cached.code == one_shot.code, (case.name, schedule)
            assert _metadata(cached) == _metadata(one_shot), (case.name, schedule)
            values = [v for n in cached.graph.nodes for v in tree_leaves(n.meta.get("val"))]
            assert all(v.fake_mode is mode for v in values if isinstance(v, torch.Tensor))
            codes.append(cached.code)
        assert len(set(codes)) > 1, f"{case.name}: the schedules drawn give one graph"
        # The last schedule issues one partition's collective on the group, per nanobatch.
        FileCheck().check_count(f", '{group}')", k, exactly=True).run(codes[-1])


@pytest.mark.parametrize("k", [2, 4])
def test_materialised_graphs_compute_what_the_original_does(fake_pg_numbers, k):
    """Collectives on a fake group return without communicating, in both graphs alike."""
    group = dist.new_group([0, 1]).group_name
    for case in _cases(k):
        rewrite = case.rewrite()
        inputs = case.graph.runtime_inputs
        expected = case.graph.gm(*inputs)
        for schedule in case.schedules(group, seed=1):
            outputs = rewrite.materialise(schedule)(*inputs)
            assert [type(o) for o in outputs] == [type(o) for o in expected]
            # Nanobatches sum matmul contributions in another order: float32 rounding.
            torch.testing.assert_close(_tensors(outputs), _tensors(expected), rtol=1e-5, atol=1e-4)


def _tensors(outputs: list[Any]) -> list[torch.Tensor]:
    """The tensors a graph returns (a forward also returns the device meshes it saves)."""
    return [o for o in outputs if isinstance(o, torch.Tensor)]


def test_only_nodes_not_seen_before_are_propagated(fake_pg, monkeypatch):
    propagated = []
    run_node = FakeTensorProp.run_node

    def counting(self, node):
        propagated.append(node.name)
        return run_node(self, node)

    monkeypatch.setattr(FakeTensorProp, "run_node", counting)
    case = _cases(2)[0]
    rewrite = case.rewrite()
    first, second = case.schedules(dist.group.WORLD.group_name)[:2]
    graph = rewrite.materialise(first)
    assert len(propagated) == len(graph.graph.nodes)

    propagated.clear()
    reference = _metadata(rewrite.materialise(second))
    assert propagated == []

    forgotten = next(i for i in rewrite.meta if i[0] == "piece" and i[2] == 1)
    del rewrite.meta[forgotten]
    assert _metadata(rewrite.materialise(second)) == reference
    assert len(propagated) == 1

    with pytest.raises(ValueError, match="a schedule of 4 nanobatches for a rewrite into 2"):
        rewrite.materialise(Schedule(4, first.slots, first.groups))
