"""What the analysis knows about process-group backends, by their kind ("nccl", "gloo", ...).

The analysis is pure, so it never asks ``torch.distributed``: the caller names the backend
kind of the graph's process group (``analyse(..., backend=...)``; the compiler backend
reads it with ``runtime.communicators.backend_of``). None, a graph analysed offline, has
no resource knob and nothing exclusive.
"""

from __future__ import annotations

from types import MappingProxyType

# The method's search ranges (REFERENCE.md section 1): thread blocks given to all-reduce
# 3..30 step 3, to all-gather / reduce-scatter 1..20. Only NCCL can cap a collective's
# CTAs (``runtime.communicators.nccl_capped_group``).
_CTA_CHOICES = MappingProxyType({
    "all_reduce": tuple(range(3, 31, 3)),
    "all_gather": tuple(range(1, 21)),
    "reduce_scatter": tuple(range(1, 21)),
})

# Collective kinds of which a backend cannot have two in flight on one group. torch 2.11-2.14
# with gloo: two or more functional all-gathers (``allgather_into_tensor_coalesced``) in
# flight on one group corrupt the heap (``malloc(): unaligned fastbin chunk detected``),
# reproduced without kareus by issuing 2-4 of them before waiting; reduce-scatters and
# ``dist.all_gather_into_tensor(async_op=True)`` are fine.
_EXCLUSIVE_KINDS = MappingProxyType({"gloo": frozenset({"all_gather"})})


def exclusive_kinds(backend: str | None) -> frozenset[str]:
    """Kinds of collective that must not overlap one another on a group of ``backend``."""
    return _EXCLUSIVE_KINDS.get(backend or "", frozenset())


def resource_choices(kind: str, backend: str | None) -> tuple[int | None, ...]:
    """CTA caps worth searching for a collective of ``kind`` (None: the library's default)."""
    if backend != "nccl":
        return (None,)
    return (None, *_CTA_CHOICES.get(kind, ()))
