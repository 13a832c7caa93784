"""The variant space of a graph: nanobatch counts, per-partition launch slots and resources.

A variant is one point: ``k`` nanobatches, for every partition the slot at which the
other nanobatch's collective is issued and the CTA cap of that collective. Any point can
be materialised as the whole rewritten graph (``nanobatch.nanobatch_graph``) or as one
partition alone (``profiler.workloads.partition_workload``) for isolated profiling.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.fx

from kareus.runtime.communicators import capped_group, resource_choices
from kareus.passes.nanobatch import Schedule
from kareus.passes.partition import GraphPartitioning
from kareus.passes.placement import PlacementResult, per_nanobatch

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
