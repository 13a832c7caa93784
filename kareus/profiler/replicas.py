"""Data-parallel replicas sharing a graph's profiling through the store.

Every data-parallel replica compiles the same graphs, so each would measure the same
variants on its own GPUs. A replica pool instead splits the work into *slices* (a graph's
partition searches dealt by :func:`deal`, balanced by each search's most evaluations; a
whole graph's batches one clock each), which the replicas' teams claim through an atomic
count in the store. Each slice's outcome is posted once (first writer wins:
``compare_set``) and every replica adopts the posts of the slices it did not claim. A job
with N replicas so measures about 1/N of the work per team; the ranks of one team (one
tensor-parallel group) still measure together, since every variant holds their collective.

No collective, and no replica waits on another for long: a slice whose owner failed (it
marks the slice released) or that is not posted within ``timeout_s`` of the wait's start
is taken over and measured here, and whichever post comes first stands for every replica.
A replica that arrives late finds the slices claimed or posted and waits for, or adopts,
them. A replica is recognised by content, not by rank: the pool's key digests what is
measured (:func:`digest`), so only replicas measuring the same on the same GPU model meet,
and a later compile of the same in the job adopts what the first posted.

How many slices: one per team that could hold the graph, the world's size over the team's
(a rank-invariant upper bound on the replicas). Where fewer replicas come (pipeline stages
hold different graphs), a replica claims more than one: searches claim the rest once their
first pass is done (``search.lockstep(more=...)``), so they still share rounds.
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

from kareus.errors import KareusError
from kareus.profiler.exchange import store_text
from kareus.profiler.interrupt import check

log = logging.getLogger("kareus")

_MAX_POLL_S = 0.05

RunSlice = Callable[[Sequence[int]], str]
"""Measures a slice (the indices of its searches, or batches) here; its outcome as the text
every replica adopts (``exchange.outcomes_json``)."""


@dataclass(frozen=True)
class Slice:
    """Some of the work (searches' or batches' indices), and the outcome that stands for
    it on every replica."""

    indices: tuple[int, ...]
    posted: str
    here: bool
    """Searched here, and this replica's post stands (else ``posted`` is to be adopted)."""


class ReplicaSlicesError(KareusError, ValueError):
    """Work dealt into fewer than one slice."""


def deal(weights: Sequence[float], slices: int) -> list[list[int]]:
    """Indices of ``weights`` dealt into at most ``slices`` non-empty slices of about equal
    weight: the heaviest first, each to the lightest slice so far (longest processing time
    first); each slice's indices ascending, the slices in order of their first index."""
    if slices < 1:
        raise ReplicaSlicesError(f"need at least one slice, not {slices}")
    loads = [0.0] * min(slices, len(weights))
    dealt: list[list[int]] = [[] for _ in loads]
    for i in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        lightest = min(range(len(loads)), key=lambda s: (loads[s], s))
        loads[lightest] += weights[i]
        dealt[lightest].append(i)
    return sorted((sorted(part) for part in dealt), key=lambda part: part[0])


def digest(parts: Sequence[str]) -> str:
    """A rank-invariant name from ``parts``: a pool's from what its searches are (each
    search's profile key and settings), a team's from its graphs' compile keys."""
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


@dataclass
class Pool:
    """The replicas of one piece of profiling, meeting under ``key`` in ``store``."""

    key: str
    slots: int
    """Slices to deal searches into: the teams that could hold them."""
    timeout_s: float
    store: dist.Store | None = None
    stop: threading.Event | None = None
    _claimed: int = 0  # alone (no store): the slices claimed so far

    @classmethod
    def of(cls, name: str, team_size: int, timeout_s: float,
           stop: threading.Event | None = None) -> Pool:
        """The pool of the work named ``name`` (:func:`digest`) for a team of ``team_size``
        ranks: alone (one slot, no store) without torch.distributed, under the fake
        backend, or where the team is the whole world."""
        if not dist.is_initialized() or dist.get_backend() == "fake":
            return cls(name, 1, timeout_s, stop=stop)
        slots = max(1, dist.get_world_size() // max(1, team_size))
        store = _get_default_store() if slots > 1 else None
        return cls(f"kareus/replicas/{name}", slots, timeout_s, store, stop)

    def claim(self, parts: int, every: bool = False) -> list[int]:
        """Slices of ``parts`` claimed for this replica: the next unclaimed one, or
        ``every`` one left; none where all are claimed."""
        count = parts if every else 1
        if self.store is None:
            self._claimed += count
            end = self._claimed
        else:
            end = int(self.store.add(f"{self.key}/claimed", count))
        return list(range(end - count, min(end, parts)))

    def post(self, j: int, indices: Sequence[int], text: str) -> Slice:
        """Slice ``j``'s outcome measured here, posted; the first post stands."""
        if self.store is None:
            return Slice(tuple(indices), text, True)
        first = store_text(self.store.compare_set(f"{self.key}/slice/{j}", "", text))
        return Slice(tuple(indices), first, first == text)

    def release(self, slices: Sequence[int]) -> None:
        """``slices`` will not be posted from here (measuring them failed): the others
        take them over at once."""
        if self.store is not None:
            for j in slices:
                self.store.set(f"{self.key}/slice/{j}/released", "1")

    def rest(self, parts: Sequence[Sequence[int]], done: dict[int, Slice], run: RunSlice
             ) -> list[Slice]:
        """Every slice of ``parts``: those ``done`` here, and the others as posted, or
        measured here through ``run`` where one is released or not posted in time."""
        deadline = time.monotonic() + self.timeout_s
        for j, part in enumerate(parts):
            if j in done:
                continue
            posted = self._wait(j, deadline)
            if posted is None:
                log.warning("kareus: replica slice %d of %s not posted within %g s; "
                            "measuring it here", j, self.key, self.timeout_s)
                done[j] = self.measure(j, part, run)
            else:
                done[j] = Slice(tuple(part), posted, False)
        return [done[j] for j in range(len(parts))]

    def measure(self, j: int, part: Sequence[int], run: RunSlice) -> Slice:
        """Slice ``j`` measured here through ``run`` and posted (released where it fails)."""
        try:
            text = run(part)
        except BaseException:
            self.release([j])
            raise
        return self.post(j, part, text)

    def share(self, parts: Sequence[Sequence[int]], run: RunSlice) -> list[Slice]:
        """Every slice of ``parts`` measured once across the replicas, a slice at a time
        here (claimed, ``run``, posted) while any is left: a work queue; then the rest
        (:meth:`rest`). Each slice with the post that stands for it."""
        done: dict[int, Slice] = {}
        while claimed := self.claim(len(parts)):
            (j,) = claimed
            done[j] = self.measure(j, parts[j], run)
        return self.rest(parts, done, run)

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
        return store_text(self.store.get(posted))

