"""The variant space of a graph: nanobatch counts, per-partition launch slots and resources.

A variant is one point: ``k`` nanobatches, for every partition the slot at which the
other nanobatch's collective is issued and the CTA cap of that collective. Which
partitions can overlap depends on ``k`` (a split region may end earlier with more
nanobatches), so the choices are kept per count. Any point can be materialised as the
whole rewritten graph (``codegen.apply``) or as one partition alone
(``codegen.nanobatch.isolated_partition``) for isolated profiling. The resources a
collective can be given depend on its group's backend (``passes.backends``).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from kareus.errors import KareusError
from kareus.passes.backends import resource_choices
from kareus.passes.partition import GraphPartitioning
from kareus.passes.placement import PlacementResult, per_nanobatch
from kareus.passes.reasons import Reason

NANOBATCH_COUNTS = (1, 2, 4)


class VariantError(KareusError, ValueError):
    """A variant that is not a point of its graph's space."""


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
    infeasible: dict[int, Reason] = field(default_factory=dict)  # count -> why not
    choices: dict[int, tuple[PartitionChoices, ...]] = field(default_factory=dict)  # count > 1

    def partitions(self, k: int) -> tuple[PartitionChoices, ...]:
        """The per-partition choices with ``k`` nanobatches (none for k = 1)."""
        if k not in self.nanobatches:
            raise VariantError(f"{k} nanobatches do not apply: {self._why_not(k)}")
        return self.choices.get(k, ())

    def default(self, k: int) -> Variant:
        """Every collective at its earliest slot, on the library's default resources."""
        n = len(self.partitions(k))
        return Variant(k, (0,) * n, (None,) * n)

    def size(self) -> int:
        total = 0
        for k in self.nanobatches:
            per_k = 1
            for p in self.partitions(k):
                per_k *= p.launch_slots * len(p.resources)
            total += per_k
        return total

    def __iter__(self) -> Iterator[Variant]:
        for k in self.nanobatches:
            axes = [
                list(itertools.product(range(p.launch_slots), p.resources))
                for p in self.partitions(k)
            ]
            for combo in itertools.product(*axes):
                yield Variant(k, tuple(s for s, _ in combo), tuple(r for _, r in combo))

    def sample(self, rng: random.Random, k: int) -> Variant:
        parts = self.partitions(k)
        return Variant(
            k,
            tuple(rng.randrange(p.launch_slots) for p in parts),
            tuple(rng.choice(p.resources) for p in parts),
        )

    def check(self, variant: object) -> Variant:
        """``variant`` if it is a point of this space; a ``VariantError`` saying why not."""
        if not isinstance(variant, Variant):
            raise VariantError(f"expected a Variant, got {type(variant).__name__}: {variant!r}")
        parts = self.partitions(variant.nanobatches)
        if len(variant.slots) != len(parts) or len(variant.resources) != len(parts):
            raise VariantError(
                f"{variant} has {len(variant.slots)} slots and {len(variant.resources)} "
                f"resources; the graph has {len(parts)} partitions"
            )
        for p, slot, cap in zip(parts, variant.slots, variant.resources):
            if not (isinstance(slot, int) and 0 <= slot < p.launch_slots):
                raise VariantError(
                    f"partition {p.index}: slot {slot!r} outside 0..{p.launch_slots - 1}"
                )
            if cap not in p.resources:
                raise VariantError(
                    f"partition {p.index}: resources {cap!r} outside its choices {p.resources}"
                )
        return variant

    def _why_not(self, k: int) -> str:
        return str(self.infeasible[k]) if k in self.infeasible else "not a searched count"


def variant_space(
    partitioning: GraphPartitioning,
    placements: Mapping[int, PlacementResult],
    infeasible: Mapping[int, Reason],
    backend: str | None = None,
) -> VariantSpace:
    """The space of a graph from its placements per count ``k > 1``; ``backend``: the kind
    of its process group's backend, which says what resources a collective can be given."""
    counts = tuple(k for k in NANOBATCH_COUNTS if k not in infeasible)
    choices = {}
    for k in counts[1:]:
        place = placements[k].placements
        parts = []
        for p in partitioning.partitions:
            c = p.collective
            split = per_nanobatch(place[c.node])
            parts.append(
                PartitionChoices(
                    p.index,
                    p.key,
                    c.name,
                    c.group_name,
                    launch_slots=len(p.slots) + 1 if split else 1,
                    resources=resource_choices(c.kind, backend) if split else (None,),
                )
            )
        choices[k] = tuple(parts)
    return VariantSpace(counts, dict(infeasible), choices)
