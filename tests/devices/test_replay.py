"""Variants captured into CUDA graphs and replayed while measured (``devices.nvml.replay``),
on a stand-in for ``torch.cuda``'s graph API (``fake_cuda``): the warm-up on a side stream,
the capture in thread-local mode, the replay without the variant's host code, and the
eager fallbacks with their reasons."""

from __future__ import annotations

import pytest
from fake_cuda import FakeCudaGraphs

from kareus.devices.nvml.replay import (
    WARMUP_RUNS,
    EagerKind,
    agreed,
    replayable,
)


class Variant:
    """Host code around one kernel: counts both."""

    def __init__(self, cuda: FakeCudaGraphs) -> None:
        self.cuda = cuda
        self.host_calls = 0
        self.kernels_run = 0

    def __call__(self) -> None:
        self.host_calls += 1
        self.cuda.launch(self.kernel)

    def kernel(self) -> None:
        self.kernels_run += 1


def test_a_variant_is_captured_after_its_warm_up_and_replayed_without_its_host_code() -> None:
    cuda = FakeCudaGraphs()
    run = Variant(cuda)
    replay = replayable(run, cuda, pool="batch")
    assert replay.replayed and replay.eager is None
    # the warm-up ran eagerly on a side stream; the capture ran the host code once more
    assert cuda.launched_on == ["side"] * WARMUP_RUNS
    assert (run.host_calls, run.kernels_run) == (WARMUP_RUNS + 1, WARMUP_RUNS)
    # thread-local: the clock controller's thread may query CUDA events meanwhile
    assert cuda.modes == ["thread_local"] and cuda.pools == ["batch"]
    for _ in range(5):
        replay.run()
    assert (run.host_calls, run.kernels_run) == (WARMUP_RUNS + 1, WARMUP_RUNS + 5)


def test_a_failed_capture_runs_the_variant_eagerly_and_says_why() -> None:
    cuda = FakeCudaGraphs(fail="CUDA error: operation not permitted when stream is "
                               "capturing\nCUDA kernel errors might be reported later")
    run = Variant(cuda)
    replay = replayable(run, cuda)
    assert not replay.replayed and replay.run is run
    assert replay.eager is not None and replay.eager.kind is EagerKind.CAPTURE_FAILED
    assert str(replay.eager) == ("its capture failed: RuntimeError: CUDA error: operation "
                                 "not permitted when stream is capturing")
    replay.run()
    assert run.host_calls == WARMUP_RUNS + 2  # eager: the host code runs every time


@pytest.mark.parametrize(("nccl", "collectives", "replayed"), [
    ((2, 8, 4), True, False),   # collectives, and an NCCL that cannot capture them
    ((2, 8, 4), False, True),   # no collective: the NCCL does not matter
    ((2, 9, 6), True, True),
    ((2, 21, 5), True, True),
    (None, True, True),          # no NCCL in torch: the collectives are not NCCL's
])
def test_collectives_are_captured_only_by_an_nccl_that_can(
    nccl: tuple[int, ...] | None, collectives: bool, replayed: bool
) -> None:
    cuda = FakeCudaGraphs()
    run = Variant(cuda)
    replay = replayable(run, cuda, collectives=collectives, nccl=nccl)
    assert replay.replayed is replayed
    if not replayed:
        assert replay.eager is not None and replay.eager.kind is EagerKind.NCCL_TOO_OLD
        assert str(replay.eager) == ("NCCL 2.8.4 cannot capture collectives into CUDA "
                                     "graphs (2.9.6 and newer can)")
        assert run.host_calls == 0  # not even warmed up: nothing to capture


def test_every_rank_of_a_group_replays_a_variant_or_none_does() -> None:
    cuda = FakeCudaGraphs()
    run = Variant(cuda)
    captured = replayable(run, cuda)
    failed = replayable(run, FakeCudaGraphs(fail="out of memory"))
    proposals: list[int] = []

    def group(other: int):  # the largest of this rank's proposal and the other's
        def agree(mine: int) -> int:
            proposals.append(mine)
            return max(mine, other)
        return agree

    assert agreed(captured, run, group(0)) is captured
    peer = agreed(captured, run, group(1))
    assert peer.run is run and peer.eager is not None
    assert peer.eager.kind is EagerKind.PEER_EAGER
    assert agreed(failed, run, group(0)) is failed  # this rank's own reason stays
    assert proposals == [0, 0, 1]  # every rank proposes, whatever its capture gave
    assert agreed(captured, run, None) is captured  # alone: nothing to agree
