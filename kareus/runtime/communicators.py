"""Communication resources: collectives issued on sub-communicators with a cap on their CTAs.

NCCL runs a collective on CTAs (thread blocks, one SM each) that compute cannot use while
it runs; fewer CTAs slow the collective and speed the overlapped compute. NCCL fixes the
count per communicator, so a cap is realised by a sub-communicator of the same ranks
created with ``max_ctas``: one per distinct (group, cap), created once and reused, by the
group's ranks only, in the same order on each (``nccl_capped_group``). Other backends
(gloo) have no such knob: what each backend kind allows is analysis knowledge
(``passes.backends``); the analysis is told the kind of a graph's group (``graph_backend``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch.distributed as dist
import torch.fx
from torch.distributed.distributed_c10d import _resolve_process_group

from kareus.errors import KareusError
from kareus.passes.collectives import is_collective
from kareus.passes.schema import arguments


def backend_of(group_name: str) -> str | None:
    """The backend kind of process group ``group_name`` ("nccl", "gloo", "fake"); None
    for a group this process does not know (a graph planned offline)."""
    try:
        return dist.get_backend(_resolve_process_group(group_name))
    except RuntimeError:
        return None


def graph_backend(graph: torch.fx.Graph) -> str | None:
    """The backend kind of the group of ``graph``'s first collective, which ``analyse`` is
    told (None: the graph has none, or its group is not known here)."""
    first = next((n for n in graph.nodes if is_collective(n)), None)
    return None if first is None else backend_of(str(arguments(first)["group_name"]))


MakeGroup = Callable[[str, int], str]
"""(group name, CTA cap) -> the name of a new sub-communicator of that group's ranks
limited to the cap (``nccl_capped_group``)."""


def nccl_capped_group(group_name: str, max_ctas: int) -> str:
    """A new NCCL communicator of ``group_name``'s ranks that runs collectives on at most
    ``max_ctas`` CTAs. Only those ranks take part (``use_local_synchronization``): the other
    ranks may be compiling or profiling something else. They meet in the store, bounded by
    the default process-group timeout, under a name that counts this process's groups, so
    the group's ranks must create the same groups in the same order (they do: they decide
    and profile in lockstep)."""
    backend = backend_of(group_name)
    if backend != "nccl":
        raise CommunicatorError(
            f"communication resource caps need NCCL; group {group_name!r} uses {backend!r}, "
            "where a collective's resources cannot be capped"
        )
    group = _resolve_process_group(group_name)
    options = dist.ProcessGroupNCCL.Options()
    options.config.max_ctas = max_ctas
    sub = dist.new_group(
        dist.get_process_group_ranks(group), pg_options=options,
        use_local_synchronization=True, group_desc=f"kareus_{group_name}_ctas{max_ctas}",
    )
    return sub.group_name


class Communicators:
    """The capped sub-communicators of this process, created once per (group, cap).

    Creating one is a collective call on the group's ranks, so it happens only where they
    all create it in the same order: after they agreed on the variant that needs it, or
    while they measure a variant together.
    """

    def __init__(self, make_group: MakeGroup = nccl_capped_group) -> None:
        self._make_group = make_group
        self._lock = threading.Lock()
        self._capped: dict[tuple[str, int], str] = {}

    def capped(self, group_name: str, max_ctas: int) -> str:
        """The name of a sub-communicator of ``group_name``'s ranks limited to ``max_ctas`` CTAs."""
        key = (group_name, max_ctas)
        with self._lock:
            if key not in self._capped:
                self._capped[key] = self._make_group(group_name, max_ctas)
            return self._capped[key]


class CommunicatorError(KareusError):
    """A communication resource was asked of a backend that cannot provide it."""
