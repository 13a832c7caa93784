"""Make sure the ranks of a group took the same compile-time decision.

Ranks that run different numbers of collectives (one rewrote a graph into nanobatches,
another fell back) or create different sub-communicators hang. Decisions are derived from
shapes and options that match across the ranks of a tensor-parallel group, but a rank
with different local shapes (uneven shards) could still decide differently; comparing
the decisions costs one small all-gather per compiled graph, and turns a would-be hang
into a consistent fallback.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch.distributed as dist
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.distributed_c10d import _resolve_process_group


def agree(decision: object, group_names: Iterable[str]) -> bool:
    """Whether every rank of each group (in sorted name order) made the same ``decision``.

    Every rank gets the same answer. Groups of the fake backend (single-process tests)
    and of a single rank agree trivially.
    """
    for name in sorted(set(group_names)):
        group = _resolve_process_group(name)
        if group.size() == 1 or dist.get_backend(group) == "fake":
            continue
        gathered: list[object] = [None] * group.size()
        # Called while compiling, under the compiler's fake-tensor mode: the exchange
        # needs real tensors.
        with unset_fake_temporarily():
            dist.all_gather_object(gathered, decision, group=group)
        if any(other != decision for other in gathered):
            return False
    return True
