"""Replicas sharing searches (``profiler.replicas``): the slices, and the pool on one store
shared by threads that stand for replicas (the store is what they share across processes;
tests/test_replicas_e2e.py runs the backend on gloo ranks)."""

import threading
import time

import pytest
import torch.distributed as dist

from kareus.profiler.interrupt import ProfilingInterrupted
from kareus.profiler.replicas import Pool, ReplicaSlicesError, deal, digest


def test_deal_covers_every_search_once_in_balanced_slices():
    weights = [32, 36, 12, 32, 36, 12, 32, 4]
    parts = deal(weights, 3)
    assert sorted(i for part in parts for i in part) == list(range(len(weights)))
    loads = [sum(weights[i] for i in part) for part in parts]
    assert max(loads) - min(loads) <= max(weights)
    assert parts == deal(weights, 3)  # every replica deals alike
    assert deal(weights, 1) == [list(range(len(weights)))]
    assert deal([5, 5], 8) == [[0], [1]]  # no empty slice
    assert deal([], 4) == []
    with pytest.raises(ReplicaSlicesError, match="at least one slice"):
        deal(weights, 0)


def test_digest_names_the_searches_not_their_order_of_arrival():
    assert digest(["a", "b"]) == digest(["a", "b"]) != digest(["a", "c"])


class Replica:
    """One replica's side: which slices it searched and what it adopted."""

    def __init__(self, pool: Pool, name: str, run_s: float = 0.0, fails: bool = False):
        self.pool, self.name, self.run_s, self.fails = pool, name, run_s, fails
        self.ran: list[list[int]] = []
        self.adopted: dict[tuple[int, ...], str] = {}
        self.error: BaseException | None = None

    def run(self, part):
        self.ran.append(list(part))
        time.sleep(self.run_s)
        if self.fails:
            raise RuntimeError("this replica's GPU failed")
        return f"{self.name}:{list(part)}"

    def share(self, weights, start: threading.Barrier | None = None):
        if start is not None:
            start.wait()
        try:
            for shared in self.pool.share(deal(weights, self.pool.slots), self.run):
                if not shared.here:
                    self.adopted[shared.indices] = shared.posted
        except BaseException as exc:  # noqa: BLE001 - the test asserts on it
            self.error = exc

    def outcome(self, part) -> str:
        """What this replica ends with for ``part``: its adopted post, else its own run."""
        return self.adopted.get(tuple(part), f"{self.name}:{list(part)}")


def _pools(n: int, timeout_s: float = 10.0, store=None) -> list[Pool]:
    store = store or dist.HashStore()
    return [Pool("kareus/replicas/test", n, timeout_s, store) for _ in range(n)]


def _together(replicas, weights):
    start = threading.Barrier(len(replicas))
    threads = [threading.Thread(target=r.share, args=(weights, start)) for r in replicas]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)


WEIGHTS = [32, 32, 12, 36]


def test_replicas_search_disjoint_slices_and_end_alike():
    replicas = [Replica(pool, f"r{i}", run_s=0.3) for i, pool in enumerate(_pools(2))]
    _together(replicas, WEIGHTS)
    assert all(r.error is None for r in replicas)
    parts = deal(WEIGHTS, 2)
    ran = [tuple(p) for r in replicas for p in r.ran]
    assert sorted(ran) == sorted(map(tuple, parts))  # each slice searched once
    assert all(r.ran for r in replicas)  # both measured: the work was shared
    for part in parts:
        assert replicas[0].outcome(part) == replicas[1].outcome(part)


def test_a_late_replica_adopts_everything_and_measures_nothing():
    store = dist.HashStore()
    early, late = (Replica(pool, f"r{i}") for i, pool in enumerate(_pools(2, store=store)))
    early.share(WEIGHTS)
    late.share(WEIGHTS)
    assert len(early.ran) == 2 and late.ran == []
    assert late.adopted == {tuple(p): f"r0:{p}" for p in deal(WEIGHTS, 2)}


def test_a_failed_replica_releases_its_slice_and_another_takes_it_at_once():
    failing, healthy = (Replica(pool, f"r{i}", run_s=0.2, fails=i == 0)
                        for i, pool in enumerate(_pools(2, timeout_s=600.0)))
    started = time.monotonic()
    _together([failing, healthy], WEIGHTS)
    assert isinstance(failing.error, RuntimeError)
    assert healthy.error is None and time.monotonic() - started < 30  # not the 600 s timeout
    assert sorted(map(tuple, healthy.ran)) == sorted(map(tuple, deal(WEIGHTS, 2)))


def test_a_slow_replica_hands_its_slice_back_after_the_timeout_and_the_first_post_stands():
    slow, quick = (Replica(pool, f"r{i}", run_s=3.0 if i == 0 else 0.0)
                   for i, pool in enumerate(_pools(2, timeout_s=0.5)))
    start = threading.Barrier(2)
    threads = [threading.Thread(target=slow.share, args=(WEIGHTS, start)),
               threading.Thread(target=quick.share, args=(WEIGHTS, start))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert slow.error is None and quick.error is None
    taken = slow.ran[0]
    assert taken in quick.ran  # taken over after the timeout
    # the quick replica posted first: the slow one adopts that post for its own slice
    assert slow.outcome(taken) == quick.outcome(taken) == f"r1:{taken}"


def test_a_signal_stops_a_replica_waiting_for_another():
    store = dist.HashStore()
    stop = threading.Event()
    stop.set()
    first, waiting = _pools(2, timeout_s=600.0, store=store)
    store.add(f"{first.key}/claimed", 2)  # both slices claimed by replicas that never post
    waiting.stop = stop
    with pytest.raises(ProfilingInterrupted):
        waiting.share(deal(WEIGHTS, 2), lambda part: "")


def test_a_replica_claims_one_slice_then_every_one_left():
    (pool,) = _pools(1)
    pool.slots = 4
    assert pool.claim(4) == [0]
    assert pool.claim(4, every=True) == [1, 2, 3]
    assert pool.claim(4) == [] and pool.claim(4, every=True) == []
    alone = Pool("alone", 1, 1.0)  # no store: counted here
    assert alone.claim(2) == [0] and alone.claim(2, every=True) == [1] and alone.claim(2) == []


def test_one_slot_runs_everything_here_without_a_store():
    pool = Pool("alone", 1, 1.0)
    replica = Replica(pool, "r0")
    replica.share(WEIGHTS)
    assert replica.ran == [list(range(len(WEIGHTS)))] and replica.adopted == {}
