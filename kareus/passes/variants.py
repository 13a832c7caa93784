"""The variant space of a graph: nanobatch counts, per-partition launch slots and resources.

A variant is one point: ``k`` nanobatches, for every partition the slot at which the
other nanobatch's collective is issued and the CTA cap of that collective. Any point can
be materialised as the whole rewritten graph (``nanobatch.nanobatch_graph``) or as one
partition alone (``partition_workload``) for isolated profiling.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from kareus.codegen.comm_groups import capped_group, resource_choices
from kareus.passes.nanobatch import Schedule, with_group
from kareus.passes.ops import resize_args
from kareus.passes.partition import GraphPartitioning, Partition
from kareus.passes.placement import NodePlacement, PlacementResult, Split, Whole, per_nanobatch
from kareus.profiler.devices.base import Workload

NANOBATCH_COUNTS = (1, 2, 4)


@dataclass(frozen=True)
class PartitionChoices:
    index: int
    key: str
    collective: str
    group_name: str
    launch_slots: int  # slots 0..launch_slots-1; the last issues after the compute
    resources: tuple[int | None, ...]  # CTA caps; (None,) where the backend has no such knob


@dataclass(frozen=True)
class Variant:
    nanobatches: int
    slots: tuple[int, ...]
    resources: tuple[int | None, ...]


@dataclass(frozen=True)
class VariantSpace:
    nanobatches: tuple[int, ...]  # the counts that apply (1 always does)
    infeasible: dict[int, str] = field(default_factory=dict)  # count -> why not
    partitions: tuple[PartitionChoices, ...] = ()

    def default(self, k: int) -> Variant:
        """Every collective at its earliest slot, on the library's default resources."""
        n = len(self.partitions)
        return Variant(k, (0,) * n, (None,) * n)

    def size(self) -> int:
        per_k = 1
        for p in self.partitions:
            per_k *= p.launch_slots * len(p.resources)
        return 1 + (len(self.nanobatches) - 1) * per_k

    def __iter__(self) -> Iterator[Variant]:
        yield self.default(1)
        axes = [
            list(itertools.product(range(p.launch_slots), p.resources)) for p in self.partitions
        ]
        for k in self.nanobatches[1:]:
            for combo in itertools.product(*axes):
                yield Variant(k, tuple(s for s, _ in combo), tuple(r for _, r in combo))

    def sample(self, rng: random.Random, k: int) -> Variant:
        return Variant(
            k,
            tuple(rng.randrange(p.launch_slots) for p in self.partitions),
            tuple(rng.choice(p.resources) for p in self.partitions),
        )

    def schedule(self, variant: Variant) -> Schedule:
        if variant.nanobatches not in self.nanobatches:
            raise ValueError(
                f"{variant.nanobatches} nanobatches do not apply: "
                f"{self.infeasible.get(variant.nanobatches, 'not a searched count')}"
            )
        for p, slot, cap in zip(self.partitions, variant.slots, variant.resources, strict=True):
            if not 0 <= slot < p.launch_slots or cap not in p.resources:
                raise ValueError(f"partition {p.index}: slot {slot} / resources {cap} outside its choices")
        groups = tuple(
            None if cap is None else capped_group(p.group_name, cap)
            for p, cap in zip(self.partitions, variant.resources)
        )
        return Schedule(variant.nanobatches, variant.slots, groups)


def variant_space(
    partitioning: GraphPartitioning, placements: PlacementResult, infeasible: dict[int, str]
) -> VariantSpace:
    counts = tuple(k for k in NANOBATCH_COUNTS if k not in infeasible)
    choices = []
    for p in partitioning.partitions:
        split = per_nanobatch(placements.placements[p.collective.node])
        choices.append(
            PartitionChoices(
                p.index,
                p.key,
                p.collective.name,
                p.collective.group_name,
                launch_slots=len(p.slots) + 1 if split else 1,
                resources=resource_choices(p.collective.kind, p.collective.group_name) if split else (None,),
            )
        )
    return VariantSpace(counts, dict(infeasible), tuple(choices))


def partition_workload(
    partition: Partition,
    placements: PlacementResult,
    k: int,
    slot: int,
    group_name: str | None = None,
    world_size: int = 1,
) -> Workload:
    """One partition alone, for isolated profiling: a nanobatch's compute of the segment
    with the other nanobatch's collective issued at ``slot`` and waited at the end, on
    random inputs of one nanobatch's shapes (run it where the collective's group exists).
    """
    place = placements.placements
    if not per_nanobatch(place[partition.collective.node]):
        raise ValueError(f"partition {partition.index}: its collective is not split into nanobatches")
    barriers = [n.name for n in partition.nodes if isinstance(place[n], Whole)]
    if barriers:
        raise ValueError(f"partition {partition.index}: {', '.join(barriers)} cannot run per nanobatch")
    members = set(partition.nodes)
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    inputs: list[torch.Tensor] = []

    def add_input(node: torch.fx.Node, name: str) -> torch.fx.Node:
        inputs.append(_random_like(node.meta["val"], place[node], k))
        return graph.placeholder(name)

    external = [i for n in partition.nodes for i in n.all_input_nodes if i not in members]
    for node in dict.fromkeys(external):
        env[node] = add_input(node, node.name)
    coll = partition.collective
    other = add_input(coll.node.all_input_nodes[0], "other_nanobatch_input")

    def issue() -> torch.fx.Node:
        args = torch.fx.node.map_arg(coll.node.args, lambda a: other)
        if group_name is not None:
            args = with_group(coll.node, args, group_name)
        return graph.call_function(coll.waits[0].target, (graph.call_function(coll.node.target, args),))

    waited = None
    for index, s in enumerate(partition.slots):
        if index == slot:
            waited = issue()
        for node in partition.nodes:
            if node.name in s.nodes:
                args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
                if per_nanobatch(place[node]):
                    args = resize_args(node, args, place[node], k)
                env[node] = graph.create_node(node.op, node.target, args, kwargs)
    if waited is None:
        waited = issue()
    sinks = [env[n] for n in partition.nodes if not any(u in members for u in n.users)]
    graph.output((waited, *sinks))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    FakeTensorProp(gm).propagate(*inputs)
    return Workload(
        f"partition {partition.index} ({partition.key}) k={k} slot={slot}",
        gm=gm,
        run=lambda: gm(*inputs),
        world_size=world_size,
    )


def _random_like(val: torch.Tensor, p: NodePlacement, k: int) -> torch.Tensor:
    shape = list(val.shape)
    if isinstance(p, Split):
        shape[p.dim] //= k
    if val.dtype.is_floating_point:
        return torch.randn(shape, dtype=val.dtype, device=val.device)
    return torch.zeros(shape, dtype=val.dtype, device=val.device)
