"""``torch.cuda``'s graph API as ``devices.nvml.replay`` uses it, without a GPU.

A variant "launches" its device work through ``launch``: run eagerly, the work runs at
once; while a graph captures (on a stream other than the default), it is recorded instead,
and each ``replay`` runs what was recorded, without the variant's host code.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


class FakeStream:
    def __init__(self, name: str) -> None:
        self.name = name
        self.waited: list[str] = []

    def wait_stream(self, other: FakeStream) -> None:
        self.waited.append(other.name)


class FakeGraph:
    def __init__(self) -> None:
        self.kernels: list[Callable[[], object]] = []
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        for kernel in self.kernels:
            kernel()


class FakeCudaGraphs:
    """Streams, captures and replays; ``fail``: the error a capture raises at its end
    (as torch does where the captured work was not capturable)."""

    def __init__(self, fail: str | None = None) -> None:
        self.fail = fail
        self.default = FakeStream("default")
        self.current = self.default
        self.capturing: FakeGraph | None = None
        self.graphs: list[FakeGraph] = []
        self.modes: list[str] = []
        self.pools: list[Any] = []
        self.launched_on: list[str] = []  # the stream of each eager launch

    def launch(self, kernel: Callable[[], object]) -> None:
        if self.capturing is not None:
            self.capturing.kernels.append(kernel)
            return
        self.launched_on.append(self.current.name)
        kernel()

    def Stream(self) -> FakeStream:
        return FakeStream("side")

    @contextmanager
    def stream(self, stream: FakeStream) -> Iterator[None]:
        before, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = before

    def current_stream(self) -> FakeStream:
        return self.current

    def CUDAGraph(self) -> FakeGraph:
        return FakeGraph()

    @contextmanager
    def graph(self, cuda_graph: FakeGraph, pool: Any = None, stream: Any = None,
              capture_error_mode: str = "global") -> Iterator[None]:
        self.modes.append(capture_error_mode)
        self.pools.append(pool)
        self.capturing = cuda_graph
        try:
            yield
        finally:
            self.capturing = None
        if self.fail is not None:
            raise RuntimeError(self.fail)
        self.graphs.append(cuda_graph)

    def graph_pool_handle(self) -> tuple[str, int]:
        return ("pool", len(self.pools))
