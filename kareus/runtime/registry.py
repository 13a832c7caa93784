"""Every kareus backend of the process, in the order they compile.

The registered entry point ``backend="kareus"`` reuses one backend per distinct options
value; users may build others. Regions (what Dynamo captured between graph breaks) and
graph reports are numbered across all of them, so ``kareus.graph_reports()`` lists every
graph of the process in compilation order, and the plan made or loaded last by any of
them is the one ``kareus.current_plan()`` names.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable, Hashable, Iterable
from typing import Any, Protocol, TypeVar


class Reporting(Protocol):
    """A backend as the registry sees it: its reports, each with its number."""

    def numbered_reports(self) -> list[tuple[int, Any]]: ...


B = TypeVar("B", bound=Reporting)


class BackendRegistry:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._backends: list[Reporting] = []
        self._by_options: dict[Hashable, Reporting] = {}
        self._regions = itertools.count()
        self._report_order = itertools.count()
        self._latest_plan: Any = None

    def add(self, backend: Reporting) -> None:
        with self._lock:
            self._backends.append(backend)

    def for_options(self, options: Hashable, make: Callable[[Hashable], B]) -> B:
        """The one backend for ``options``, made by ``make`` the first time."""
        with self._lock:
            backend = self._by_options.get(options)
        if backend is None:
            backend = make(options)  # registers itself: outside the lock
            with self._lock:
                backend = self._by_options.setdefault(options, backend)
        return backend  # type: ignore[return-value]

    def next_region(self) -> int:
        return next(self._regions)

    def next_report(self) -> int:
        return next(self._report_order)

    def publish(self, plan: Any) -> None:
        """``plan`` is the one this process runs now (made, agreed or loaded)."""
        with self._lock:
            self._latest_plan = plan

    @property
    def latest_plan(self) -> Any:
        with self._lock:
            return self._latest_plan

    def reports(self) -> list[Any]:
        """Every backend's reports, in the order they were made."""
        return [r for _, r in heapq.merge(*(b.numbered_reports() for b in self._snapshot()))]

    def each(self) -> Iterable[Reporting]:
        return self._snapshot()

    def _snapshot(self) -> list[Reporting]:
        with self._lock:
            return list(self._backends)
