"""A team's searches (a graph's partition searches side by side, or a whole graph's
measuring), run by every rank of its group alike, without a collective.

A partition variant is measured on every rank of its collective's group at once (its
collective needs them all), and every rank must end with the same frontier, or the ranks
would later choose different variants and hang. So one rank leads: the lowest rank of the
group runs the search and, for each configuration it has to measure, posts an instruction;
every rank measures it and posts its own measurement; the leader reduces them (time max,
energy sum: ``measure.group_measurement``) and goes on. At the end it posts the whole
result of each of its searches, which the others adopt as it is. Everything travels
through the default process group's key-value store, under keys private to one team and
one set of ranks::

    <prefix>/<ranks>/step/<j>            the j-th instruction: "measure <config>" |
                                         "batch <configs at one clock>" |
                                         "done <each search's result or failure>"
    <prefix>/<ranks>/step/<j>/rank/<r>   rank r's measurement (a list, for a batch) for j
    <prefix>/<ranks>/abort               why the search was given up, written once

Why it cannot hang: every wait polls the store with ``check`` (which never blocks) until
its keys or the abort key exist, or ``timeout_s`` has passed since the wait began; a rank
that times out writes the abort key (first writer wins) and raises, and every other rank
sees it at its next poll and raises too. A rank that arrives after the leader finished
finds the result at once. What remains is a rank dying inside the collective of a
measurement itself: that is bounded by the process group's own timeout.

The prefix must name the team identically on every rank of the group and differently for
each team (``profile.py`` uses the graph's compile key and the process group's place among
the graph's). A group of one rank, or of the fake backend, needs no store: its rank
measures alone and its measurement stands for the whole (symmetric) group.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_store, _resolve_process_group

from kareus.devices.base import Measurement
from kareus.errors import KareusError
from kareus.profiler.interrupt import check
from kareus.profiler.measure import group_measurement
from kareus.profiler.search import Config, Point, SearchResult

log = logging.getLogger("kareus")

_MAX_POLL_S = 0.05

MeasureHere = Callable[[Any, Callable[[int], int] | None], Measurement]
"""Measures an instruction's configuration on this rank (a partition's ``search.Config``,
or what the team's ``decode`` makes of it); the second argument is how the ranks agree on
counts while measuring it together (``Workload.agree``; None alone)."""


MeasureBatchHere = Callable[[list[Any], Callable[[int], int] | None], list[Measurement]]
"""Measures a batch of configurations at one clock on this rank, together
(``measure.measure_batch``), one measurement each in their order."""


Outcome = tuple[SearchResult, dict[Any, Measurement]] | str
"""What the leader posts of one search at the end: its result with every measurement by
configuration, or why it failed."""


def _config(fields: dict[str, Any]) -> Hashable:
    return Config(**fields)


class ProfilingAborted(KareusError, RuntimeError):
    """The ranks of a group gave up a search together (a rank timed out or failed)."""


class UnreadableInstructionError(KareusError, RuntimeError):
    """The leader's instruction in the store is neither a measurement nor a result: another
    kareus version, or another job's keys."""


@dataclass(frozen=True)
class Team:
    """The ranks that measure one partition's variants together."""

    ranks: tuple[int, ...]  # global ranks, ascending; the first leads
    rank: int
    group_size: int
    prefix: str
    timeout_s: float
    store: dist.Store | None = None
    stop: threading.Event | None = None
    """Set (a signal): every wait gives up (``interrupt.ProfilingInterrupted``); the rank
    then aborts the search, so the others stop too."""
    decode: Callable[[dict[str, Any]], Hashable] = field(default=_config, compare=False)
    """What an instruction's configuration is, from its fields (``dataclasses.asdict`` of
    the one the leader posted): a partition's ``search.Config`` unless told otherwise."""

    @classmethod
    def of_group(
        cls, group_name: str, prefix: str, timeout_s: float, stop: threading.Event | None = None,
        decode: Callable[[dict[str, Any]], Hashable] = _config,
    ) -> Team:
        """The team of the process group ``group_name`` (alone for a fake or a one-rank
        group, or without torch.distributed)."""
        if not dist.is_initialized():
            return cls((0,), 0, 1, prefix, timeout_s, stop=stop, decode=decode)
        group = _resolve_process_group(group_name)
        size = dist.get_world_size(group)
        if dist.get_backend(group) == "fake" or size == 1:
            return cls((dist.get_rank(),), dist.get_rank(), size, prefix, timeout_s, stop=stop,
                       decode=decode)
        ranks = tuple(sorted(dist.get_process_group_ranks(group)))
        return cls(ranks, dist.get_rank(), size, prefix, timeout_s, _get_default_store(), stop,
                   decode)

    @classmethod
    def of_groups(
        cls, group_names: Sequence[str], prefix: str, timeout_s: float,
        stop: threading.Event | None = None,
        decode: Callable[[dict[str, Any]], Hashable] = _config,
    ) -> Team:
        """The team of every rank of the process groups ``group_names`` (a whole graph's
        collectives: it runs only where all of them run it); alone where each group is a
        fake or one-rank group, or where there is none (a graph without collectives runs on
        each rank alone)."""
        if not group_names:
            rank = dist.get_rank() if dist.is_initialized() else 0
            return cls((rank,), rank, 1, prefix, timeout_s, stop=stop, decode=decode)
        if len(group_names) == 1 or not dist.is_initialized():
            return cls.of_group(group_names[0], prefix, timeout_s, stop, decode)
        teams = [cls.of_group(name, prefix, timeout_s, stop, decode) for name in group_names]
        if all(t.alone for t in teams):
            return cls((dist.get_rank(),), dist.get_rank(), max(t.group_size for t in teams),
                       prefix, timeout_s, stop=stop, decode=decode)
        ranks = tuple(sorted({r for t in teams for r in t.ranks}))
        return cls(ranks, dist.get_rank(), len(ranks), prefix, timeout_s, _get_default_store(),
                   stop, decode)

    @property
    def alone(self) -> bool:
        return len(self.ranks) == 1

    @property
    def leads(self) -> bool:
        return self.rank == self.ranks[0]

    # -- the leader ------------------------------------------------------------------------

    def measure(self, step: int, config: Any, measure_here: MeasureHere) -> Measurement:
        """Instruction ``step``: every rank measures ``config``; the group's measurement."""
        if self.alone:
            return group_measurement([measure_here(config, None)], self.group_size)
        self._store.set(self._step(step), f"measure {json.dumps(asdict(config))}")
        mine = measure_here(config, self.agreement(step))
        others = [self._step(step) + f"/rank/{r}" for r in self.ranks[1:]]
        self._wait(others, f"the measurements of step {step} by ranks {list(self.ranks[1:])}")
        theirs = [_measurement(store_text(self._store.get(key))) for key in others]
        return group_measurement([mine, *theirs], self.group_size)

    def measure_batch(
        self, step: int, configs: Sequence[Any], measure_here: MeasureBatchHere
    ) -> list[Measurement]:
        """Instruction ``step``: every rank measures ``configs`` (one clock) together; the
        group's measurement of each, in their order."""
        if self.alone:
            return [group_measurement([m], self.group_size)
                    for m in measure_here(list(configs), None)]
        self._store.set(self._step(step), f"batch {json.dumps([asdict(c) for c in configs])}")
        mine = measure_here(list(configs), self.agreement(step))
        others = [self._step(step) + f"/rank/{r}" for r in self.ranks[1:]]
        self._wait(others, f"the measurements of step {step} by ranks {list(self.ranks[1:])}")
        theirs = [[_measurement(m) for m in json.loads(store_text(self._store.get(key)))]
                  for key in others]
        return [group_measurement([m, *(t[i] for t in theirs)], self.group_size)
                for i, m in enumerate(mine)]

    def finish(self, step: int, outcomes: Sequence[Outcome]) -> None:
        """Post the outcomes (a search's result and measurements, or why it failed, for
        each search the team ran) as instruction ``step``: the others adopt them."""
        if not self.alone:
            self._store.set(self._step(step), f"done {outcomes_json(outcomes)}")

    def abort(self, reason: str) -> None:
        if not self.alone:
            self._store.compare_set(self._abort, "", reason)

    # -- the others ------------------------------------------------------------------------

    def follow(
        self, measure_here: MeasureHere, measure_batch_here: MeasureBatchHere | None = None
    ) -> list[Outcome]:
        """Measure what the leader asks, until it posts the outcomes; return them.
        ``measure_batch_here`` measures the leader's batches (a leader that posts none
        needs none)."""
        step = 0
        while True:
            try:
                self._wait([self._step(step)], f"instruction {step} from rank {self.ranks[0]}")
            except BaseException as exc:  # interrupted: the leader must not wait for us
                if not isinstance(exc, ProfilingAborted):
                    self.abort(f"rank {self.rank} stopped: {type(exc).__name__}: {exc}")
                raise
            kind, _, payload = store_text(self._store.get(self._step(step))).partition(" ")
            if kind == "done":
                return read_outcomes(payload, self.decode)
            if kind not in ("measure", "batch") or (kind == "batch" and not measure_batch_here):
                raise UnreadableInstructionError(
                    f"unreadable instruction {kind!r} under {self._keys}"
                )
            try:
                if kind == "measure":
                    posted = _measurement_json(
                        measure_here(self.decode(json.loads(payload)), self.agreement(step)))
                else:
                    assert measure_batch_here is not None
                    batch = [self.decode(c) for c in json.loads(payload)]
                    posted = json.dumps([asdict(m) for m in
                                         measure_batch_here(batch, self.agreement(step))])
            except BaseException as exc:
                self.abort(f"rank {self.rank} failed to measure: {type(exc).__name__}: {exc}")
                raise
            self._store.set(self._step(step) + f"/rank/{self.rank}", posted)
            step += 1

    def agreement(self, step: int) -> Callable[[int], int]:
        """``Workload.agree`` for instruction ``step``: the n-th call on every rank posts
        this rank's count and returns the largest the ranks posted."""
        calls = itertools.count()

        def agree(count: int) -> int:
            key = f"{self._step(step)}/agree/{next(calls)}"
            self._store.set(f"{key}/rank/{self.rank}", str(int(count)))
            keys = [f"{key}/rank/{r}" for r in self.ranks]
            self._wait(keys, f"the ranks' counts at {key}")
            return max(int(store_text(self._store.get(k))) for k in keys)

        return agree

    # -- the store -------------------------------------------------------------------------

    @property
    def _store(self) -> dist.Store:
        assert self.store is not None, "a team of one rank uses no store"
        return self.store

    @property
    def _keys(self) -> str:
        """Under the prefix, the ranks: the groups of one partition (one per data-parallel
        replica) search side by side."""
        return f"{self.prefix}/{','.join(map(str, self.ranks))}"

    @property
    def _abort(self) -> str:
        return f"{self._keys}/abort"

    def _step(self, step: int) -> str:
        return f"{self._keys}/step/{step}"

    def _wait(self, keys: Sequence[str], what: str) -> None:
        """Until ``keys`` exist; raises ``ProfilingAborted`` on an abort or the deadline."""
        store = self._store
        deadline = time.monotonic() + self.timeout_s
        pause = 0.001
        while not store.check(list(keys)):
            check(self.stop)
            if store.check([self._abort]):
                raise ProfilingAborted(f"{self._keys}: {store_text(store.get(self._abort))}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                reason = f"rank {self.rank} waited {self.timeout_s:g} s for {what}"
                agreed = store_text(store.compare_set(self._abort, "", reason))
                raise ProfilingAborted(f"{self._keys}: {agreed}")
            time.sleep(min(pause, remaining))
            pause = min(2 * pause, _MAX_POLL_S)


def _measurement_json(m: Measurement) -> str:
    return json.dumps(asdict(m), sort_keys=True)


def _measurement(text: str | dict) -> Measurement:
    fields = json.loads(text) if isinstance(text, str) else text
    return Measurement(**{**fields, "resources": tuple(map(tuple, fields["resources"]))})


def outcomes_json(outcomes: Sequence[Outcome]) -> str:
    """Searches' outcomes as the text a team's leader (or a replica, ``replicas``) posts."""
    def one(outcome: Outcome) -> dict[str, Any]:
        if isinstance(outcome, str):
            return {"error": outcome}
        result, measured = outcome
        return {
            "stopped": result.stopped,
            "hypervolumes": result.hypervolumes,
            "rounds": result.rounds,
            "points": [[asdict(p.config), asdict(measured[p.config])] for p in result.points],
        }

    return json.dumps([one(outcome) for outcome in outcomes])


def read_outcomes(text: str, decode: Callable[[dict[str, Any]], Hashable]) -> list[Outcome]:
    """The outcomes :func:`outcomes_json` wrote, configurations made by ``decode``."""
    def one(data: dict[str, Any]) -> Outcome:
        if "error" in data:
            return data["error"]
        measured = {decode(c): _measurement(m) for c, m in data["points"]}
        points = [Point.of(config, m) for config, m in measured.items()]
        return (SearchResult(points, data["stopped"], data["hypervolumes"], data["rounds"]),
                measured)

    return [one(data) for data in json.loads(text)]


def store_text(value: bytes | str) -> str:
    """A store value as text (the store returns bytes)."""
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else value
