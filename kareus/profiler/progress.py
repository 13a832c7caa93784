"""What rank 0 shows while partitions are profiled: a progress bar, then a summary table."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kareus.profiler.profile import PartitionProfile
from kareus.profiler.search import Point, pareto

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11


def make_console() -> Console:
    """A console wide enough for the partition tables, also when output goes to a file."""
    return Console(width=None if sys.stdout.isatty() else 160)


class ProfilingProgress:
    """A bar per partition: evaluation i of n and the best time and energy so far. Use it as
    a context manager; a disabled one (other ranks) shows nothing, nor does one whose
    console is not a terminal (a log gets the summary table instead)."""

    def __init__(self, enabled: bool, console: Console | None = None) -> None:
        console = console or Console(stderr=True)
        self._progress = (
            Progress(
                TextColumn("[bold]profiling[/] {task.description}"), BarColumn(),
                MofNCompleteColumn(), TextColumn("{task.fields[best]}"), TimeElapsedColumn(),
                console=console,
            )
            if enabled and console.is_terminal
            else None
        )
        self._tasks: dict[str, int] = {}

    def __enter__(self) -> Self:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._progress is not None:
            self._progress.stop()

    def __call__(self, label: str, done: int, total: int, points: list[Point]) -> None:
        if self._progress is None:
            return
        front = pareto(points)
        best = (
            f"fastest {front[0].time_s * 1e3:.3f} ms, least {front[-1].energy_j * 1e3:.2f} mJ "
            f"({len(front)} on the frontier)"
        )
        if label not in self._tasks:
            self._tasks[label] = self._progress.add_task(label, total=total, best=best)
        self._progress.update(self._tasks[label], completed=done, total=total, best=best)


def summary_table(title: str, profiles: Sequence[PartitionProfile]) -> Table:
    """Every profiled partition's frontier: its ends, size, and how it was obtained."""
    table = Table(title=title, title_justify="left")
    for column in ("partition key", "k", "collective", "used by", "evaluations", "measured",
                   "stopped", "frontier", "fastest (ms, mJ)", "least energy (ms, mJ)", "GPU-s"):
        table.add_column(column, overflow="fold")
    for p in profiles:
        ends = [
            f"{point.time_s * 1e3:.3f}, {point.energy_j * 1e3:.2f} @ {point.knobs.clock_mhz} MHz"
            for point in (p.frontier[0], p.frontier[-1])
        ] if p.frontier else ["-", "-"]
        table.add_row(
            p.key[:12], str(p.nanobatches), p.collective,
            ", ".join(f"p{i}" for i in p.partitions), f"{p.evaluations}/{p.space_size}",
            str(p.measured), p.error or p.stopped, str(len(p.frontier)), *ends,
            f"{p.gpu_s:.1f}",
        )
    return table
