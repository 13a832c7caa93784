"""Ranks agree on compile-time decisions through the store, never hanging.

The multi-process tests share one session of 2 gloo ranks (``gloo.start_ranks``): the
scenarios run one after another, separated by a store barrier, each under its own graph
key, and every test checks the results of one scenario.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import socket
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from gloo import start_ranks
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.distributed_c10d import _get_default_store

from kareus.runtime.agreement import Verdict, agree, spanned_ranks

SESSION_LIMIT_S = 60.0


class _Recording:
    """A store that records the operations called on it, forwarding them to ``inner`` if any."""

    def __init__(self, inner: dist.Store | None = None) -> None:
        self.inner = inner
        self.calls: list[str] = []

    def __getattr__(self, name: str):
        if name not in ("check", "get", "set", "compare_set", "wait", "add", "multi_get"):
            raise AttributeError(name)

        def call(*args):
            self.calls.append(name)
            if self.inner is None:
                raise AssertionError(f"store.{name} called")
            return getattr(self.inner, name)(*args)

        return call


def _barrier(store: dist.Store, name: str) -> None:
    """Both ranks reach ``name`` (through the store, bounded) before either goes on."""
    store.add(f"test/barrier/{name}", 1)
    deadline = time.monotonic() + 20
    while int(store.get(f"test/barrier/{name}")) < 2:
        assert time.monotonic() < deadline, f"barrier {name} timed out"
        time.sleep(0.005)


def _outcome(fn, *args, **kwargs) -> dict:
    verdict: Verdict = fn(*args, **kwargs)
    return {"agreed": verdict.agreed, "reason": verdict.reason}


def _session(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    store = _get_default_store()
    world = [dist.group.WORLD.group_name]
    records: list[tuple[str, str]] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append((record.levelname, record.getMessage()))

    logger = logging.getLogger("kareus")
    logger.setLevel(logging.INFO)
    logger.addHandler(Capture())

    def same() -> dict:
        with FakeTensorMode():  # as inside torch.compile's backend
            return _outcome(agree, "same", ("r0/forward", 2, (0, 1)), world, timeout_s=3)

    def different() -> dict:
        k = 2 if rank == 0 else 1
        return _outcome(agree, "different", ("r0/forward", k), world + world, timeout_s=3)

    def labelled() -> dict:  # the graph's shapes differ across the ranks, the rest does not
        decision = {"graph": f"hash-{rank}", "counts searched": (2, 4), "budget": None}
        return _outcome(agree, "labelled", decision, world, timeout_s=3)

    def slow() -> dict:
        if rank == 1:
            time.sleep(1.5)
        return _outcome(agree, "slow", ("r0/forward", 2), world, timeout_s=10)

    def extra() -> dict:
        result = {}
        if rank == 1:  # a graph rank 0 never compiles
            result["extra"] = _outcome(agree, "extra", ("r7/backward", 2), world, timeout_s=1)
        result["next"] = _outcome(agree, "after-extra", ("r8/forward", 2), world, timeout_s=5)
        return result

    def late() -> dict:
        if rank == 0:
            result = _outcome(agree, "late", ("r0/forward", 2), world, timeout_s=1)
            store.set("test/late/rank0-done", "1")
            return result
        store.wait(["test/late/rank0-done"], timedelta(seconds=10))
        recording = _Recording(store)
        result = _outcome(agree, "late", ("r0/forward", 2), world, timeout_s=3, store=recording)
        return {**result, "store_calls": recording.calls}

    def repeat() -> dict:
        result = {"first": _outcome(agree, "repeat", ("r0/forward", 2), world, timeout_s=3)}
        if rank == 0:
            again = _Recording(store)
            result["again"] = _outcome(
                agree, "repeat", ("r0/forward", 2), world, timeout_s=3, store=again
            )
            result["again"]["store_calls"] = again.calls
            result["changed"] = _outcome(agree, "repeat", ("r0/forward", 4), world, timeout_s=3)
        return result

    def fallback() -> dict:
        if rank == 0:  # would rewrite, and comes 2 s after rank 1, which runs it unrewritten
            time.sleep(2.0)
        started = time.monotonic()
        result = _outcome(agree, "fallback", ("r0/forward", 2 - rank), world, timeout_s=30,
                          falls_back=rank == 1)
        return {**result, "elapsed_s": time.monotonic() - started}

    def told() -> dict:
        if rank == 1:  # never comes
            return {}
        return _outcome(agree, "told", ("r0/forward", 2), world, timeout_s=1.5)

    results = {}
    try:
        for scenario in (same, different, labelled, slow, extra, late, repeat, fallback, told):
            _barrier(store, scenario.__name__)
            del records[:]
            try:
                results[scenario.__name__] = scenario()
            except Exception as exc:  # noqa: BLE001 - reported by the test of that scenario
                results[scenario.__name__] = {"error": repr(exc)}
            results[scenario.__name__ + "_logs"] = list(records)
        _barrier(store, "end")
    finally:
        Path(out, f"{rank}.json").write_text(json.dumps(results))
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def session() -> list[dict]:
    """Each rank's results per scenario; the session is killed after SESSION_LIMIT_S."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        context = start_ranks(_session, (port, out), join=False)
        deadline = time.monotonic() + SESSION_LIMIT_S
        while not context.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                for process in context.processes:
                    process.kill()
                pytest.fail(f"the 2-rank session did not end within {SESSION_LIMIT_S} s (a hang)")
        return [json.loads(Path(out, f"{r}.json").read_text()) for r in range(2)]


def _scenario(session: list[dict], name: str) -> list[dict]:
    results = [ranks[name] for ranks in session]
    assert all("error" not in r for r in results), results
    return results


def test_same_decision_agrees_on_every_rank(session):
    for r in _scenario(session, "same"):
        assert r["agreed"] and r["reason"] is None


def test_different_decisions_fall_back_on_every_rank_with_one_reason(session):
    r0, r1 = _scenario(session, "different")
    assert not r0["agreed"] and not r1["agreed"]
    assert r0["reason"] == r1["reason"]
    assert r0["reason"].startswith("ranks decided differently: rank 0 ('r0/forward', 2)")
    assert "rank 1 ('r0/forward', 1)" in r0["reason"]
    for logs in (session[0]["different_logs"], session[1]["different_logs"]):
        assert any(level == "INFO" and r0["reason"] in msg for level, msg in logs), logs


def test_a_disagreement_on_labelled_parts_names_the_parts_that_differ(session):
    r0, r1 = _scenario(session, "labelled")
    assert not r0["agreed"] and r0["reason"] == r1["reason"]
    assert r0["reason"] == ("ranks decided differently in graph (rank 0 'hash-0', "
                            "rank 1 'hash-1')")


def test_a_slow_rank_is_waited_for(session):
    r0, r1 = _scenario(session, "slow")
    assert r0["agreed"] and r1["agreed"]


def test_a_graph_only_one_rank_compiles_times_out_and_the_next_agrees(session):
    r0, r1 = _scenario(session, "extra")
    extra = r1["extra"]
    assert not extra["agreed"]
    assert extra["reason"] == "rank(s) [0] did not arrive within 1 s"
    assert r0["next"]["agreed"] and r1["next"]["agreed"]


def test_a_late_rank_adopts_the_timeout_at_once(session):
    r0, r1 = _scenario(session, "late")
    assert not r0["agreed"] and r0["reason"] == "rank(s) [1] did not arrive within 1 s"
    assert (r1["agreed"], r1["reason"]) == (False, r0["reason"])
    # it read the verdict and started no round of its own (no entry published, no wait)
    assert set(r1["store_calls"]) <= {"check", "get"}, r1


def test_a_repeated_decision_reuses_the_verdict(session):
    r0, r1 = _scenario(session, "repeat")
    assert r0["first"]["agreed"] and r1["first"]["agreed"]
    again = r0["again"]
    assert again["agreed"], again  # rank 1 never calls again: the verdict alone decides
    assert set(again["store_calls"]) <= {"check", "get"}, again
    changed = r0["changed"]
    assert not changed["agreed"]
    assert "differs from the one the ranks agreed on earlier" in changed["reason"]
    assert ["ERROR", changed["reason"]] in session[0]["repeat_logs"]  # JSON: lists


def test_fake_and_single_rank_groups_agree_without_the_store(fake_pg):
    store = _Recording()  # fails on any use, as does the fake group's FakeStore
    assert agree("g", object(), [dist.group.WORLD.group_name], timeout_s=1, store=store)
    assert agree("g", object(), [dist.group.WORLD.group_name], timeout_s=1).agreed
    assert agree("g", "anything", [], timeout_s=1, store=store) == Verdict(True, None)
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    assert agree("g", object(), [dist.group.WORLD.group_name], timeout_s=1, store=store)
    assert store.calls == []
    # the fixture destroys the group


_STORES = {
    "HashStore": lambda tmp: dist.HashStore(),
    "FileStore": lambda tmp: dist.FileStore(os.fspath(tmp / "store"), 1),
    "TCPStore(libuv)": lambda tmp: _tcp_store(use_libuv=True),
    "TCPStore(legacy)": lambda tmp: _tcp_store(use_libuv=False),
    "PrefixStore(TCPStore)": lambda tmp: dist.PrefixStore("default_pg", _tcp_store(use_libuv=True)),
}


def _tcp_store(*, use_libuv: bool) -> dist.Store:
    return dist.TCPStore("127.0.0.1", 0, 1, True, use_libuv=use_libuv, wait_for_workers=False)


@pytest.mark.parametrize("kind", list(_STORES))
def test_compare_set_semantics_the_protocol_relies_on(kind, tmp_path):
    store = _STORES[kind](tmp_path)
    # absent key, expected "": sets the desired value and returns it (the first writer wins)
    assert store.compare_set("verdict", "", "timeout:x") == b"timeout:x"
    # present key, expected "": leaves it and returns the value there (later writers adopt it)
    assert store.compare_set("verdict", "", "agree:y") == b"timeout:x"
    assert store.get("verdict") == b"timeout:x"
    # (absent key, expected non-empty: sets nothing and returns the *expected* value, so
    # the protocol always passes "" and never writes an empty verdict)
    assert store.compare_set("absent", "z", "w") == b"z"
    assert not store.check(["absent"])


def test_a_rank_that_falls_back_lets_the_others_go_at_once(session):
    r0, r1 = _scenario(session, "fallback")
    assert not r0["agreed"] and not r1["agreed"] and r0["reason"] == r1["reason"]
    assert r0["reason"] == "rank 1 falls back (('r0/forward', 1))"
    # of a 30 s timeout: rank 1 did not wait the 2 s for rank 0, nor rank 0 for anyone
    assert r0["elapsed_s"] < 1 and r1["elapsed_s"] < 1


def test_a_wait_of_over_a_second_says_what_it_waits_for_and_until_when(session):
    r0 = _scenario(session, "told")[0]
    assert not r0["agreed"]
    waits = [msg for level, msg in session[0]["told_logs"] if level == "WARNING"]
    assert len(waits) == 1, waits
    assert re.search(r"kareus/agree/told/0,1 waits for rank\(s\) \[1\] to confirm its "
                     r"decision, at most 0\.\d s more \(agreement_timeout_s\)", waits[0]), waits


def _mesh_lines(rank: int, shape: tuple[int, ...]) -> list[list[int]]:
    """The groups of a row-major device mesh of ``shape`` that hold ``rank``, one per dim."""
    import numpy as np

    grid = np.arange(math.prod(shape)).reshape(shape)
    at = np.argwhere(grid == rank)[0]
    return [grid[tuple(slice(None) if d == dim else int(i) for d, i in enumerate(at))].tolist()
            for dim in range(len(shape))]


def test_every_rank_of_a_mesh_plane_waits_for_the_same_ranks():
    # CP2 x TP2: rank 0's groups are {0, 1} and {0, 2}, rank 3's {2, 3} and {1, 3}
    assert all(spanned_ranks(r, _mesh_lines(r, (2, 2)), 4) == {0, 1, 2, 3} for r in range(4))
    # PP2 x CP2 x TP2, a graph with CP and TP collectives: its stage's plane, not the world
    for r in range(8):
        cp_tp = _mesh_lines(r, (2, 2, 2))[1:]
        assert spanned_ranks(r, cp_tp, 8) == set(range(4 * (r // 4), 4 * (r // 4) + 4))
    assert spanned_ranks(5, [[4, 5]], 8) == {4, 5}  # one group: its ranks
    # nested groups (the world and a TP group): their union, the world
    assert spanned_ranks(1, [[0, 1, 2, 3], [0, 1]], 4) == {0, 1, 2, 3}
    # groups that are no lines of a grid: their union
    assert spanned_ranks(0, [[0, 1], [0, 3]], 4) == {0, 1, 3}
