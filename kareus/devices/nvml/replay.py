"""Variants replayed from CUDA graphs while a GPU measures them.

A variant run op by op leaves gaps between its kernels wherever the host launches them more
slowly than the GPU runs them (small partitions, a busy host), and the gaps are timed and
metered as the variant's. Captured once into a CUDA graph and replayed, its kernels run back
to back: the CUDA-event time of the replays is the GPU's own.

Collectives are captured with the graph where NCCL can (2.9.6 and newer): torch's
ProcessGroupNCCL keeps a capture's collectives away from its watchdog (pytorch#102542,
#148594). A capture runs in thread-local mode, so that another thread's CUDA calls (the
clock controller's event queries, NCCL's watchdog) neither fail nor invalidate it. Where a
variant cannot be captured it runs eagerly, and the reason is a record (``Eager``): the
device logs it and marks the measurement.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

NCCL_CAPTURES = (2, 9, 6)
"""The first NCCL that captures collectives into CUDA graphs."""

WARMUP_RUNS = 2
"""Eager runs on a side stream before a capture: the first initialises what a capture
cannot (Inductor's compile, cuBLAS's workspace, NCCL's communicator and its peer
connections), the second runs as every later one will."""


class CudaGraphs(Protocol):
    """The part of ``torch.cuda`` a capture uses (tests pass a stand-in)."""

    def Stream(self) -> Any: ...

    def stream(self, stream: Any) -> AbstractContextManager[Any]: ...

    def current_stream(self) -> Any: ...

    def CUDAGraph(self) -> Any: ...

    def graph(self, cuda_graph: Any, pool: Any = None, stream: Any = None,
              capture_error_mode: str = "global") -> AbstractContextManager[Any]: ...

    def graph_pool_handle(self) -> Any: ...


class EagerKind(enum.Enum):
    """Why a variant is measured eagerly rather than replayed (``OFF``: the device does
    not replay, having no CUDA or being told not to)."""

    OFF = "off"
    NCCL_TOO_OLD = "nccl-too-old"
    CAPTURE_FAILED = "capture-failed"
    PEER_EAGER = "peer-eager"


@dataclass(frozen=True)
class Eager:
    """A variant measured eagerly, and why."""

    kind: EagerKind
    detail: str

    def __str__(self) -> str:
        return self.detail


@dataclass(frozen=True)
class Replay:
    """What a measurement runs of a variant: its graph's replay, or the variant itself with
    the reason (``eager``)."""

    run: Callable[[], object]
    eager: Eager | None = None

    @property
    def replayed(self) -> bool:
        return self.eager is None


def replayable(
    run: Callable[[], object],
    cuda: CudaGraphs,
    *,
    pool: Any = None,
    collectives: bool = False,
    nccl: tuple[int, ...] | None = None,
) -> Replay:
    """``run`` captured into a CUDA graph after ``WARMUP_RUNS`` eager runs on a side stream,
    its replay sharing ``pool`` (a batch's graphs never run at once, and a measurement reads
    none of their outputs, so they may reuse each other's memory); ``run`` itself where it
    holds ``collectives`` and ``nccl`` (the version) cannot capture them, or its capture
    fails. The warm-up runs are eager and equally many on every rank, so that their
    collectives match."""
    if collectives and nccl is not None and nccl < NCCL_CAPTURES:
        version = ".".join(map(str, nccl))
        return Replay(run, Eager(EagerKind.NCCL_TOO_OLD, (
            f"NCCL {version} cannot capture collectives into CUDA graphs "
            f"({'.'.join(map(str, NCCL_CAPTURES))} and newer can)")))
    side = cuda.Stream()
    side.wait_stream(cuda.current_stream())
    with cuda.stream(side):
        for _ in range(WARMUP_RUNS):
            run()
    cuda.current_stream().wait_stream(side)
    graph = cuda.CUDAGraph()
    try:
        with cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            run()
    except RuntimeError as exc:  # torch's CUDA errors (out of memory among them)
        first = next(_lines(str(exc)), "")
        return Replay(run, Eager(EagerKind.CAPTURE_FAILED,
                                 f"its capture failed: {type(exc).__name__}: {first}"))
    return Replay(graph.replay)


def agreed(replay: Replay, run: Callable[[], object],
           agree: Callable[[int], int] | None) -> Replay:
    """``replay`` where every rank running the variant together (``agree``: the largest of
    their proposals, called alike on every rank) replays it, else ``run`` eagerly: the ranks
    then measure one program."""
    if agree is None:
        return replay
    if agree(int(not replay.replayed)) and replay.replayed:
        return Replay(run, Eager(EagerKind.PEER_EAGER,
                                 "another rank of its group runs it eagerly"))
    return replay


def nccl_version() -> tuple[int, ...] | None:
    """The NCCL torch was built with; None where it has none (a CPU build)."""
    try:
        version = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):
        return None
    return tuple(version) if isinstance(version, tuple) else None


def _lines(text: str) -> Iterator[str]:
    return (line.strip() for line in text.splitlines() if line.strip())
