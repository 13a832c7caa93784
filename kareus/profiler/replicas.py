"""Data-parallel replicas sharing a graph's partition searches through the store.

Every data-parallel replica compiles the same graphs, so each would search the same
partitions on its own GPUs. A replica pool instead deals a schedule's searches into
*slices* (:func:`deal`, balanced by each search's most evaluations), and each replica's
team claims slices one at a time (an atomic count in the store), runs its claims, and posts
each slice's outcomes once (first writer wins: ``compare_set``). Once no slice is left to
claim it adopts the others' posts. A job with N replicas so measures about 1/N of the
searches per team; the ranks of one team (one tensor-parallel group) still measure
together, since every variant holds their collective.

No collective, and no replica waits on another for long: a slice whose owner failed
(it marks the slice released) or that is not posted within ``timeout_s`` of the wait's
start is taken over and searched here, and whichever post comes first stands for every
replica. A replica that arrives late finds the slices claimed or posted and waits for, or
adopts, them. A replica is recognised by content, not by rank: the pool's key digests
every search's profile key and settings (``Pool.digest``), so only replicas holding the
same searches on the same GPU model meet, and a later compile of the same searches in
the job adopts what the first posted.

How many slices: one per team that could hold the graph, the world's size over the team's
(a rank-invariant upper bound on the replicas: with pipeline stages, the replicas of one
stage claim several slices each rather than waiting on stages that never come).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_store

from kareus.profiler.interrupt import check

log = logging.getLogger("kareus")

_MAX_POLL_S = 0.05

RunSlice = Callable[[Sequence[int]], str]
"""Searches the given searches (their indices in the schedule) here; their outcomes as the
text every replica adopts (``exchange.outcomes_json``)."""


@dataclass(frozen=True)
class Slice:
    """Some of the searches, and the outcome that stands for them on every replica."""

    indices: tuple[int, ...]
    posted: str
    here: bool
    """Searched here, and this replica's post stands (else ``posted`` is to be adopted)."""


def deal(weights: Sequence[float], slices: int) -> list[list[int]]:
    """Indices of ``weights`` dealt into at most ``slices`` non-empty slices of about equal
    weight: the heaviest first, each to the lightest slice so far (longest processing time
    first); each slice's indices ascending, the slices in order of their first index."""
    if slices < 1:
        raise ValueError(f"need at least one slice, not {slices}")
    loads = [0.0] * min(slices, len(weights))
    dealt: list[list[int]] = [[] for _ in loads]
    for i in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        lightest = min(range(len(loads)), key=lambda s: (loads[s], s))
        loads[lightest] += weights[i]
        dealt[lightest].append(i)
    return sorted((sorted(part) for part in dealt), key=lambda part: part[0])


def digest(parts: Sequence[str]) -> str:
    """A pool's name from what its searches are (each search's profile key and settings)."""
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


@dataclass
class Pool:
    """The replicas of one schedule of searches, meeting under ``key`` in ``store``."""

    key: str
    slots: int
    """Slices to deal the searches into: the teams that could hold them."""
    timeout_s: float
    store: dist.Store | None = None
    stop: threading.Event | None = None
    ran: tuple[int, ...] = ()
    """The slices searched here whose post stands (for reports and tests)."""

    @classmethod
    def of(cls, name: str, team_size: int, timeout_s: float,
           stop: threading.Event | None = None) -> Pool:
        """The pool of the searches named ``name`` (:func:`digest`) for a team of
        ``team_size`` ranks: alone (one slice) without torch.distributed, under the fake
        backend, or where the team is the whole world."""
        if not dist.is_initialized() or dist.get_backend() == "fake":
            return cls(name, 1, timeout_s, stop=stop)
        slots = max(1, dist.get_world_size() // max(1, team_size))
        store = _get_default_store() if slots > 1 else None
        return cls(f"kareus/replicas/{name}", slots, timeout_s, store, stop)

    def share(self, weights: Sequence[float], run: RunSlice) -> list[Slice]:
        """Search every search (``weights``: their costs, to balance the slices) once across
        the replicas, the slices claimed here through ``run``; every slice, with the post
        that stands for it."""
        parts = [tuple(part) for part in deal(weights, self.slots)] if weights else []
        if self.store is None:
            self.ran = tuple(range(len(parts)))
            return [Slice(part, run(part), True) for part in parts]
        done: dict[int, Slice] = {}
        while (j := int(self.store.add(f"{self.key}/claimed", 1)) - 1) < len(parts):
            done[j] = self._search(j, parts[j], run)
        deadline = time.monotonic() + self.timeout_s
        for j, part in enumerate(parts):
            if j in done:
                continue
            posted = self._wait(j, deadline)
            if posted is None:
                log.warning("kareus: replica slice %d of %s not posted within %g s; "
                            "searching it here", j, self.key, self.timeout_s)
                done[j] = self._search(j, part, run)
            else:
                done[j] = Slice(part, posted, False)
        self.ran = tuple(j for j in sorted(done) if done[j].here)
        return [done[j] for j in range(len(parts))]

    def _search(self, j: int, part: tuple[int, ...], run: RunSlice) -> Slice:
        """Slice ``j`` searched here and posted; the first post stands."""
        assert self.store is not None
        try:
            text = run(part)
        except BaseException:
            self.store.set(f"{self.key}/slice/{j}/released", "1")  # the others take it over
            raise
        first = _text(self.store.compare_set(f"{self.key}/slice/{j}", "", text))
        return Slice(part, first, first == text)

    def _wait(self, j: int, deadline: float) -> str | None:
        """Slice ``j``'s post; None where its owner released it or ``deadline`` passed."""
        assert self.store is not None
        posted, released = f"{self.key}/slice/{j}", f"{self.key}/slice/{j}/released"
        pause = 0.001
        while not self.store.check([posted]):
            check(self.stop)
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self.store.check([released]):
                return None
            time.sleep(min(pause, remaining))
            pause = min(2 * pause, _MAX_POLL_S)
        return _text(self.store.get(posted))


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else value
