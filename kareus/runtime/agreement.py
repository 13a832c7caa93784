"""Make the ranks of a graph's collectives agree on a compile-time decision, without collectives.

Ranks that run different collectives (one rewrote a graph into nanobatches, another did not,
or chose another variant) hang at run time, so before a decision takes effect the ranks that
take part in the graph's collectives compare it. They do it while compiling, and ranks compile
lazily: they may compile different graphs, or different numbers of them (graph breaks,
recompiles on data-dependent shapes), in different orders. A collective at compile time would
then pair unrelated calls or wait forever, so the comparison goes through the default process
group's key-value store instead, under keys private to one graph and one set of ranks::

    kareus/agree/<graph_key>/<participants>/rank/<r>         rank r's decision: "<digest> <repr>"
    kareus/agree/<graph_key>/<participants>/rank/<r>/parts   a labelled decision's parts (JSON)
    kareus/agree/<graph_key>/<participants>/verdict          the outcome, written once

1. If the verdict exists, adopt it and return: a repeated compile of the graph, or a rank that
   arrives after the others gave up, needs nobody else.
2. Publish this rank's entry.
   A rank whose decision is the fallback itself (``falls_back``: the graph unrewritten,
   nothing profiled) runs it whatever the verdict, so it waits for nobody: it settles the
   verdict as ``disagree`` at once (step 4's ``compare_set``) and returns; the others then
   stop waiting for it too. This is what keeps graphs whose shapes differ across ranks
   (MoE routing, a recompile on one rank only) from waiting: every rank of such a graph
   that would not rewrite it lets the others go.
3. Poll (``store.check``, which never blocks; sleeps of at most 50 ms) until every participant's
   entry exists, the verdict exists, or ``timeout_s`` has passed. A wait of over a second is
   logged (what waits, for which ranks, until when).
4. Propose an outcome: ``agree:<digest>`` when all entries carry the same digest,
   ``disagree:<reason>`` when they differ, ``timeout:<reason>`` naming the ranks whose entries
   were missing. Settle it with one ``store.compare_set(verdict, "", proposal)``: it writes the
   proposal only where the key is absent and returns the key's value either way, so the first
   writer wins and every rank that gets a verdict gets the same one; the verdict never changes.
   (A verdict that exists before step 3 ends is adopted as it is.)

Why it cannot deadlock: no step waits on another rank except the poll of step 3, which ends at
the deadline; every store operation used returns at once (``check``, ``set``, ``compare_set``,
and ``get`` only of a key known to exist). A rank waits at most ``timeout_s`` plus the store's
round trips, whatever the other ranks do, including never calling at all.

Why every rank acts the same: a rank runs the decision only on an ``agree`` verdict, and
``agree`` is proposed only by a rank that saw every participant's entry carry the same digest;
each rank publishes its entry once per graph (later calls stop at step 1), so the entries it
saw are the ones every participant acts on; a rank that settles ``disagree`` for its own
fallback runs the fallback, as does every rank adopting that verdict. A late rank adopts the
sticky ``timeout`` and falls back like the others. The one case that cannot be repaired is a
rank that compiles the same ``graph_key`` again with another decision after an ``agree``: it
falls back, the others run the agreed decision; it is logged as an error (include in
``graph_key`` whatever should start a fresh agreement).

Decisions are compared by the SHA-256 of their pickle (protocol 4), not their ``repr``: two
different values never share a pickle, while a ``repr`` may leave out fields or print equal
text for different values, and a false agreement is a hang where a false disagreement is only
a fallback. (A pickle can differ for equal values, e.g. sets of strings under per-process hash
seeds; that errs on the safe side.) The ``repr`` travels along only to explain a disagreement.
A decision given as a mapping of labelled parts (what is searched, under which settings, ...)
also publishes each part's digest and ``repr``, before its entry, so that a disagreement names
the parts that differ ("ranks decided differently in graph (rank 0 ..., rank 1 ...)") rather
than two truncated ``repr``s of the whole.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import math
import pickle
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch.distributed as dist
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.distributed_c10d import _get_default_store, _resolve_process_group

from kareus.errors import KareusError

log = logging.getLogger("kareus")

_MAX_POLL_S = 0.05
_TELL_AFTER_S = 1.0  # a wait longer than this is logged: a silent one looks like a hang
_REPR_CHARS = 200
_PART_REPR_CHARS = 80


class NegativeTimeoutError(KareusError, ValueError):
    """An agreement was given a negative time to wait for the other ranks."""


class RankNotInGroupsError(KareusError, ValueError):
    """This rank was asked to agree in groups it is no member of."""


class UnreadableVerdictError(KareusError, RuntimeError):
    """The verdict in the store is none this kareus writes: another version, or another
    job's keys."""


@dataclass(frozen=True)
class Verdict:
    """The ranks' outcome for one graph; ``bool(verdict)`` is ``verdict.agreed``."""

    agreed: bool
    """True: every participant proposed the same decision; run it."""
    reason: str | None
    """Why not (None when agreed)."""
    timed_out: bool = False
    """Not agreed because a participant did not come in time (else it decided otherwise)."""

    def __bool__(self) -> bool:
        return self.agreed


def agree(
    graph_key: str,
    decision: object,
    group_names: Iterable[str],
    *,
    timeout_s: float,
    store: dist.Store | None = None,
    falls_back: bool = False,
) -> Verdict:
    """Whether every rank of the groups ``group_names`` took ``decision`` for ``graph_key``.

    ``falls_back``: ``decision`` is what this rank does without an agreement (the graph
    unrewritten, nothing profiled): it needs no confirmation, so this rank publishes it and
    settles the verdict as a disagreement at once, and no participant waits for another
    (see the module docstring). Ranks whose graphs legitimately differ (data-dependent
    sizes, an extra compile) then wait only where one of them would rewrite.

    ``graph_key`` must be identical on every rank for the same graph (a structural hash);
    ``decision`` must be picklable; a mapping's keys label its parts in a disagreement's
    reason. The participants are the global ranks the groups span (``spanned_ranks``: on
    a grid, its plane); groups of the fake backend and a single participant agree
    trivially, without store traffic. ``store`` defaults to the default process group's
    store; without a default process group (one process, no torch.distributed) there is
    no other rank and the verdict is ``agree``. Returns within about ``timeout_s``; every
    participant that returns gets the same verdict (see the module docstring). Store errors
    propagate.
    """
    if timeout_s < 0:
        raise NegativeTimeoutError(f"timeout_s must be >= 0, got {timeout_s}")
    if not dist.is_initialized():  # one process without torch.distributed: nobody to ask
        return Verdict(True, None)
    # Called while compiling, under the compiler's fake-tensor mode: nothing here creates
    # tensors, and leaving the mode keeps it that way should the store or pickle ever do.
    with unset_fake_temporarily():
        groups = []
        for name in sorted(set(group_names)):
            group = _resolve_process_group(name)
            if dist.get_backend(group) != "fake":
                groups.append(dist.get_process_group_ranks(group))
        rank = dist.get_rank()
        if any(rank not in ranks for ranks in groups):
            raise RankNotInGroupsError(
                f"rank {rank} is not in the groups {sorted(set(group_names))}"
            )
        participants = spanned_ranks(rank, groups, dist.get_world_size())
        if len(participants) <= 1:
            return Verdict(True, None)
        store = _get_default_store() if store is None else store
        prefix = f"kareus/agree/{graph_key}/{','.join(map(str, sorted(participants)))}"
        parts = _parts(decision) if isinstance(decision, Mapping) else None
        return _settle(store, prefix, rank, sorted(participants), _entry(decision), parts,
                       timeout_s, falls_back)


def spanned_ranks(rank: int, groups: Iterable[Iterable[int]], world_size: int) -> set[int]:
    """The ranks that must agree with ``rank`` on a graph with collectives over ``groups``
    (each holding ``rank``), alike on every one of them.

    The union of one rank's groups is not that: on a CP x TP mesh rank 0's groups are
    {0, 1} and {0, 2}, rank 3's {2, 3} and {1, 3}, and each would wait for a different set.
    Groups that are lines through ``rank`` of a grid of ranks (a device mesh's dims) span
    its plane: every sum of one offset from each group, the same set from any rank in it.
    That is taken where the sums are all distinct (the lines are independent); otherwise
    (nested or irregular groups) the union.
    """
    groups = [sorted(set(g)) for g in groups]
    union = {rank}.union(*groups)
    if len(groups) <= 1:
        return union
    spanned = {rank}
    for members in groups:
        spanned = {r + m - rank for r in spanned for m in members}
    distinct = len(spanned) == math.prod(len(g) for g in groups)
    in_world = min(spanned) >= 0 and max(spanned) < world_size
    return spanned if distinct and in_world else union


def _digest(value: object) -> str:
    return hashlib.sha256(pickle.dumps(value, protocol=4)).hexdigest()


def _short(value: object, chars: int) -> str:
    text = repr(value)
    return text if len(text) <= chars else text[: chars - 3] + "..."


def _entry(decision: object) -> str:
    return f"{_digest(decision)} {_short(decision, _REPR_CHARS)}"


def _parts(decision: Mapping[str, object]) -> str:
    """Each labelled part's digest and ``repr``, for a disagreement to name what differs."""
    return json.dumps({str(label): [_digest(value), _short(value, _PART_REPR_CHARS)]
                       for label, value in decision.items()})


def _settle(
    store: dist.Store, prefix: str, rank: int, participants: list[int], entry: str,
    parts: str | None, timeout_s: float, falls_back: bool,
) -> Verdict:
    verdict_key = f"{prefix}/verdict"
    digest = entry.split(" ", 1)[0]
    if store.check([verdict_key]):
        return _adopt(store.get(verdict_key), digest, prefix, sticky=True)

    if parts is not None:  # before the entry: whoever sees the entry finds them
        store.set(f"{prefix}/rank/{rank}/parts", parts)
    store.set(f"{prefix}/rank/{rank}", entry)
    if falls_back:
        proposal = f"disagree:rank {rank} falls back ({entry.partition(' ')[2]})"
        return _adopt(store.compare_set(verdict_key, "", proposal), digest, prefix,
                      sticky=False, quiet=True)
    others = [f"{prefix}/rank/{r}" for r in participants if r != rank]
    deadline = time.monotonic() + timeout_s
    pause, told = 0.001, False
    while True:
        if store.check([verdict_key]):
            return _adopt(store.get(verdict_key), digest, prefix, sticky=False)
        if store.check(others):
            proposal = _compare(store, prefix, participants)
            break
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            missing = _missing(store, prefix, participants, rank)
            if not missing:  # arrived since the last check
                continue
            proposal = f"timeout:rank(s) {missing} did not arrive within {timeout_s:g} s"
            break
        if not told and timeout_s - remaining > _TELL_AFTER_S:
            log.warning("kareus: %s waits for rank(s) %s to confirm its decision, at most "
                        "%.1f s more (agreement_timeout_s); it then runs unrewritten",
                        prefix, _missing(store, prefix, participants, rank), remaining)
            told = True
        time.sleep(min(pause, remaining))
        pause = min(2 * pause, _MAX_POLL_S)
    # Absent key and expected "": writes the proposal and returns it; present: returns its value.
    return _adopt(store.compare_set(verdict_key, "", proposal), digest, prefix, sticky=False)


def _missing(store: dist.Store, prefix: str, participants: list[int], rank: int) -> list[int]:
    """The other participants whose entries are not there yet."""
    return [r for r in participants if r != rank and not store.check([f"{prefix}/rank/{r}"])]


def _compare(store: dist.Store, prefix: str, participants: list[int]) -> str:
    entries = {r: _text(store.get(f"{prefix}/rank/{r}")) for r in participants}
    digests = {e.split(" ", 1)[0] for e in entries.values()}
    if len(digests) == 1:
        return f"agree:{digests.pop()}"
    differing = _differing_parts(store, prefix, participants)
    if differing:
        detail = "; ".join(
            f"{label} (" + ", ".join(f"rank {r} {text}" for r, text in texts.items()) + ")"
            for label, texts in differing.items()
        )
        return f"disagree:ranks decided differently in {detail}"
    parts = {r: e.partition(" ") for r, e in entries.items()}
    detail = ", ".join(f"rank {r} {text} (digest {d[:8]})" for r, (d, _, text) in parts.items())
    return f"disagree:ranks decided differently: {detail}"


def _differing_parts(
    store: dist.Store, prefix: str, participants: list[int]
) -> dict[str, dict[int, str]]:
    """The labelled parts whose digests differ across the participants, with each rank's
    ``repr`` of them; empty where a participant's decision has no labelled parts (its
    parts go in before its entry, so they are there for every rank with an entry) or the
    labels differ."""
    keys = [f"{prefix}/rank/{r}/parts" for r in participants]
    if not store.check(keys):
        return {}
    parts = {r: json.loads(_text(store.get(k))) for r, k in zip(participants, keys, strict=True)}
    labels = list(parts[participants[0]])
    if any(list(p) != labels for p in parts.values()):
        return {}
    return {
        label: {r: p[label][1] for r, p in parts.items()}
        for label in labels if len({p[label][0] for p in parts.values()}) > 1
    }


def _adopt(
    value: bytes | str, digest: str, prefix: str, *, sticky: bool, quiet: bool = False
) -> Verdict:
    kind, _, payload = _text(value).partition(":")
    if kind == "agree":
        if payload == digest:
            return Verdict(True, None)
        reason = (
            f"this rank's decision (digest {digest[:8]}) differs from the one the ranks agreed on "
            f"earlier (digest {payload[:8]}) under {prefix}; the others run that one, this rank "
            "falls back, and the ranks can no longer be made consistent"
        )
        log.error("%s", reason)
        return Verdict(False, reason)
    if kind not in ("disagree", "timeout"):
        raise UnreadableVerdictError(f"unreadable verdict {value!r} under {prefix}")
    (log.debug if quiet else log.info)(
        "%s: %s%s; falling back", prefix, payload, " (verdict reused)" if sticky else "")
    return Verdict(False, payload, timed_out=kind == "timeout")


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else value


def group_size(group_name: str) -> int:
    """How many ranks the process group named ``group_name`` has."""
    return dist.get_world_size(_resolve_process_group(group_name))


@dataclass(frozen=True)
class Gathered:
    """What ``gather`` found: every name's value, or ``missing`` the names that never came."""

    values: dict[str, str]
    missing: tuple[str, ...] = ()


def gather(
    prefix: str,
    posts: dict[str, str],
    names: Iterable[str],
    *,
    timeout_s: float,
    what: str,
    store: dist.Store | None = None,
) -> Gathered:
    """Post this rank's ``posts`` (name -> text) under ``prefix`` and collect the values of
    ``names`` (posted by any rank), waiting at most ``timeout_s`` for those not there yet.

    The first post of a name wins (``compare_set``), so every rank reads the same value.
    Like ``agree`` it never blocks on another rank past its deadline; a wait is logged with
    what it waits for (``what``) and its deadline. The ranks need not all get the same
    outcome (one may see the last post a moment before the others' deadlines): act on it
    only through an ``agree``.
    """
    if timeout_s < 0:
        raise NegativeTimeoutError(f"timeout_s must be >= 0, got {timeout_s}")
    store = _get_default_store() if store is None else store
    for name, value in posts.items():
        store.compare_set(f"{prefix}/{name}", "", value)
    wanted = list(dict.fromkeys(names))
    keys = [f"{prefix}/{n}" for n in wanted]
    deadline = time.monotonic() + timeout_s
    pause, told = 0.001, False
    while not store.check(keys):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            missing = tuple(n for n, k in zip(wanted, keys) if not store.check([k]))
            if missing:
                return Gathered({}, missing)
            break
        if not told and timeout_s - remaining > 1.0:
            absent = [n for n, k in zip(wanted, keys) if not store.check([k])]
            log.warning("kareus: waiting for %s (%s), at most %.0f s more", what,
                        ", ".join(absent), remaining)
            told = True
        time.sleep(min(pause, remaining))
        pause = min(2 * pause, _MAX_POLL_S)
    return Gathered({n: _text(store.get(k)) for n, k in zip(wanted, keys)})


class CompileCounter:
    """How often this process compiled each graph: the n-th compile of a graph on one rank
    pairs with the n-th on the others (a program compiled twice with other options agrees
    afresh; a rank that compiled a graph once more than the others times out there, and its
    peers then fall back too, at the same compile)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: collections.Counter[str] = collections.Counter()

    def key(self, graph: str) -> str:
        """The agreement key of this compile of ``graph`` (a rank-invariant hash)."""
        with self._lock:
            self._counts[graph] += 1
            return f"{graph}.{self._counts[graph]}"
