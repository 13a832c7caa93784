"""What the profiler measures: one partition of a graph alone, in one variant.

A partition's workload is the compute of its segment for one nanobatch with the other
nanobatch's collective issued at a launch slot, on random inputs of one nanobatch's shapes,
so that partitions sharing a key are measured once (REFERENCE.md section 1).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from kareus.codegen.nanobatch import sliced_operands, with_group
from kareus.devices.base import Workload
from kareus.passes.ops import resize_args
from kareus.passes.partition import Partition
from kareus.passes.placement import NodePlacement, PlacementResult, Split, Whole, per_nanobatch

aten = torch.ops.aten

Lower = Callable[[torch.fx.GraphModule, list[torch.Tensor]], Callable[[list[Any]], Any]]
"""Compiles a graph for its example inputs into a boxed callable (``codegen.lowering.lower``
with the lowering the training graphs get)."""


def partition_workload(
    partition: Partition,
    placements: PlacementResult,
    k: int,
    slot: int,
    group_name: str | None = None,
    world_size: int = 1,
    lower: Lower | None = None,
) -> Workload:
    """One partition alone, for isolated profiling: a nanobatch's compute of the segment
    with the other nanobatch's collective issued at ``slot`` and waited at the end, on
    random inputs of one nanobatch's shapes (run it where the collective's group exists).
    The graph's metadata comes from fake inputs; the real ones are made at the first run,
    so a model that only costs the graph never allocates them. ``lower`` compiles the
    variant (at its first run) as the training graph will run, so that a real GPU measures
    the kernels that will run; without it the variant runs op by op.
    """
    place = placements.placements
    if not per_nanobatch(place[partition.collective.node]):
        raise ValueError(
            f"partition {partition.index}: its collective is not split into nanobatches"
        )
    # As the rewrite runs them: nodes independent of the batch once, before the nanobatches'
    # compute; barriers (Whole) once per graph on joined values, so outside any one
    # nanobatch's compute: a barrier's value that the partition's compute uses comes in
    # whole, like a value from outside the partition, and is sliced where the rewrite
    # slices it.
    members = set(partition.nodes)
    barriers = {n for n in partition.nodes if isinstance(place[n], Whole)}
    computed = [n for n in partition.nodes if n not in barriers]
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    specs: list[tuple[torch.Tensor, NodePlacement]] = []

    def add_input(node: torch.fx.Node, name: str) -> torch.fx.Node:
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise TypeError(
                f"partition {partition.index}: its compute takes {node.name}, which is not a "
                f"tensor ({type(val).__name__})"
            )
        specs.append((val, place[node]))
        return graph.placeholder(name)

    needed = [i for n in computed for i in n.all_input_nodes if i not in members or i in barriers]
    for node in dict.fromkeys(needed):
        env[node] = add_input(node, node.name)
    coll = partition.collective
    other = add_input(coll.node.all_input_nodes[0], "other_nanobatch_input")
    slices: dict[tuple[torch.fx.Node, int], torch.fx.Node] = {}

    def operand(node: torch.fx.Node, dims: dict[torch.fx.Node, int]) -> torch.fx.Node:
        if node not in dims:
            return env[node]
        key = (node, dims[node])
        if key not in slices:
            size = node.meta["val"].shape[key[1]] // k
            slices[key] = graph.call_function(aten.slice.Tensor, (env[node], key[1], 0, size))
        return slices[key]

    def emit(node: torch.fx.Node) -> None:
        dims = sliced_operands(node, place)
        args, kwargs = torch.fx.node.map_arg(
            (node.args, node.kwargs), lambda a: operand(a, dims)
        )
        if per_nanobatch(place[node]):
            args = resize_args(node, args, place[node], k)
        env[node] = graph.create_node(node.op, node.target, args, kwargs)

    def issue() -> torch.fx.Node:
        args = torch.fx.node.map_arg(coll.node.args, lambda a: other)
        if group_name is not None:
            args = with_group(coll.node, args, group_name)
        return graph.call_function(coll.node.target, args)

    for node in computed:
        if not per_nanobatch(place[node]):
            emit(node)
    issued = None
    for index, s in enumerate(partition.slots):
        if index == slot:
            issued = issue()
        for node in computed:
            if node.name in s.nodes and per_nanobatch(place[node]):
                emit(node)
    if issued is None:
        issued = issue()
    waited = graph.call_function(coll.waits[0].target, (issued,))  # joined at the end
    emitted = set(computed)
    sinks = [env[n] for n in computed if not any(u in emitted for u in n.users)]
    graph.output((waited, *sinks))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    mode = FakeTensorMode()
    with mode:
        fake_inputs = [_random_like(val, p, k) for val, p in specs]
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fake_inputs)

    @functools.cache
    def inputs() -> list[torch.Tensor]:
        return [_random_like(val, p, k) for val, p in specs]

    @functools.cache
    def runner() -> Callable[[list[Any]], Any]:
        if lower is None:
            return lambda args: gm(*args)
        # Measured while a training graph compiles: this compile gets its own context
        # (fake mode, metadata), never the one of the graph around it.
        with torch._guards.tracing(None):
            return lower(gm, inputs())

    return Workload(
        f"partition {partition.index} ({partition.key}) k={k} slot={slot}",
        gm=gm,
        run=lambda: runner()(list(inputs())),  # a boxed callable may clear its list
        world_size=world_size,
    )


def _random_like(val: torch.Tensor, p: NodePlacement, k: int) -> torch.Tensor:
    """Random values laid out as ``val`` (its strides: the graph may view it in ways only
    that layout allows); one nanobatch of it where it is split, a slice as the rewrite
    takes one."""
    whole = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=val.device)
    if val.dtype.is_floating_point:
        whole.normal_()
    else:
        whole.zero_()
    if isinstance(p, Split):
        return whole.narrow(p.dim, 0, val.shape[p.dim] // k)
    return whole
