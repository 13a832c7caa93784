"""What kareus found in every graph it compiled: plain records, a book of them and a table.

Records hold no FX nodes, only names and numbers, so they outlive the graphs and can be
serialised.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch.fx
from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from kareus.options import KareusOptions

from kareus.devices.base import Device, Measurement
from kareus.passes.analyse import GraphAnalysis
from kareus.passes.collectives import Collective
from kareus.passes.decide import Choice, Decision
from kareus.passes.ops import DEFAULT_CLOCK_MHZ
from kareus.passes.partition import Slot
from kareus.passes.placement import per_nanobatch
from kareus.passes.reasons import Reason
from kareus.passes.variants import Variant, VariantSpace
from kareus.profiler.profile import PartitionProfile
from kareus.profiler.progress import make_console

log = logging.getLogger("kareus")


@dataclass(frozen=True)
class CollectiveReport:
    name: str
    kind: str
    group_name: str
    group_size: int | None
    reduce_op: str | None
    dtype: str
    shapes: tuple[tuple[int, ...], ...]
    payload_bytes: int
    bytes_per_rank: int | None

    @classmethod
    def of(cls, c: Collective) -> CollectiveReport:
        return cls(
            c.name, c.kind, c.group_name, c.group_size, c.reduce_op,
            str(c.dtype).removeprefix("torch."), c.shapes, c.payload_bytes, c.bytes_per_rank,
        )


@dataclass(frozen=True)
class PartitionReport:
    index: int
    collective: str
    collective_kind: str
    key: str
    slots: tuple[Slot, ...]
    num_nodes: int


@dataclass(frozen=True)
class Coverage:
    """How much of a graph's communication the nanobatch rewrite can hide: ``split`` of its
    ``total`` collectives stay split into nanobatches, and where the first split region
    ended (None: none ended)."""

    split: int
    total: int
    first_barrier: Reason | None

    def __str__(self) -> str:
        text = f"{self.split}/{self.total} collectives split"
        if self.first_barrier is not None:
            text += f"; first barrier {self.first_barrier}"
        return text


@dataclass(frozen=True)
class GraphReport:
    """One compiled graph: its kind, label (as passed to ``set_clock``) and what was found."""

    label: str  # for display and clock-switch records
    key: str  # the graph's structural hash: its identity across ranks and runs
    kind: str  # "forward" | "backward" | "inference"
    num_nodes: int
    lowering: str
    collectives: tuple[CollectiveReport, ...]
    partitions: tuple[PartitionReport, ...]
    notes: tuple[str, ...]
    device: str
    estimate: Measurement | None  # modelled at its clock (simulated devices only)
    requested: int  # the nanobatch count asked for
    choice: Choice  # what runs: the count applied (1: unrewritten), its clock, its partitions'
    fallback: Reason | None  # why the requested count did not apply (None: it did)
    variants: VariantSpace
    barriers: tuple[Reason, ...]  # where split regions end, and why
    coverage: Coverage
    profiles: tuple[PartitionProfile, ...] = ()  # frontiers of its distinct partitions
    profile_gpu_s: float = 0.0  # GPU-seconds measuring it took on this rank (``GpuTime``)

    @classmethod
    def build(
        cls,
        analysis: GraphAnalysis,
        decision: Decision,
        *,
        lowering: str,
        device: str,
        estimate: Measurement | None = None,
        notes: tuple[str, ...] = (),
        profiles: tuple[PartitionProfile, ...] = (),
        profile_gpu_s: float = 0.0,
    ) -> GraphReport:
        placed = analysis.placements_at(decision.requested)
        split = sum(per_nanobatch(placed.placements[c.node]) for c in analysis.collectives)
        barriers = tuple(placed.barriers)
        return cls(
            label=analysis.label,
            key=analysis.key,
            kind=analysis.kind,
            num_nodes=analysis.num_nodes,
            lowering=lowering,
            collectives=tuple(CollectiveReport.of(c) for c in analysis.collectives),
            partitions=tuple(
                PartitionReport(
                    p.index, p.collective.name, p.collective.kind, p.key, p.slots, len(p.nodes)
                )
                for p in analysis.partitioning.partitions
            ),
            notes=(*analysis.partitioning.notes, *notes),
            device=device,
            estimate=estimate,
            requested=decision.requested,
            choice=decision.choice,
            fallback=decision.reason,
            variants=analysis.space,
            barriers=barriers,
            coverage=Coverage(split, len(analysis.collectives), barriers[0] if barriers else None),
            profiles=profiles,
            profile_gpu_s=profile_gpu_s,
        )

    @property
    def nanobatches(self) -> int:
        """The count applied (1: unrewritten)."""
        return self.choice.nanobatches

    @property
    def clock_mhz(self) -> int:
        """The clock the graph asks for at its start (0: default clocks)."""
        return self.choice.clock_mhz

    @property
    def variant(self) -> Variant | None:
        """The point of the space that runs (None: unrewritten)."""
        return self.choice.variant

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


class ReportBook:
    """One backend's graph reports, numbered in the process's compilation order
    (``number``: the process-wide counter) and updated where a graph later runs another
    choice (the plan's, or unrewritten after a failed check)."""

    def __init__(self, number: Callable[[], int], explain: bool = False) -> None:
        self._number, self._explain = number, explain
        self._lock = threading.Lock()
        self._reports: list[tuple[int, GraphReport]] = []

    def add(self, report: GraphReport) -> None:
        with self._lock:
            self._reports.append((self._number(), report))
        log.info(
            "%s: %d collectives, %d partitions, %d nanobatches%s", report.label,
            len(report.collectives), len(report.partitions), report.nanobatches,
            "".join(f"\n  {n}" for n in report.notes),
        )
        if report.fallback:
            log.warning("%s runs unrewritten: %s", report.label, report.fallback)
        if self._explain:
            print_report(report)

    def update(self, label: str, notes_added: tuple[str, ...] = (), **changes: Any) -> None:
        """The latest report of ``label`` with ``changes`` (and more notes)."""
        with self._lock:
            for i, (n, report) in reversed(list(enumerate(self._reports))):
                if report.label == label:
                    notes = (*report.notes, *notes_added)
                    self._reports[i] = (n, dataclasses.replace(report, notes=notes, **changes))
                    return

    def all(self) -> list[GraphReport]:
        with self._lock:
            return [r for _, r in self._reports]

    def numbered(self) -> list[tuple[int, GraphReport]]:
        with self._lock:
            return list(self._reports)

    def clear(self) -> None:
        with self._lock:
            self._reports.clear()


def modelled_cost(
    device: Device, gm: torch.fx.GraphModule, label: str, clock_mhz: int, world_size: int
) -> tuple[Measurement | None, str | None]:
    """Modelled time and energy of ``gm`` at its clock (measured there, so its own clock
    switch stalls nothing) where the device can tell at compile time, or why the graph
    could not be costed: an estimate never fails a compile."""
    try:
        if clock_mhz != DEFAULT_CLOCK_MHZ:
            costs = device.estimate_at(gm, [clock_mhz], world_size)
            return (costs[clock_mhz] if costs else None), None
        return device.estimate(gm, world_size), None
    except Exception as exc:  # noqa: BLE001 - any model failure is reported, not raised
        log.warning("%s: %s cannot cost this graph: %s", label, device.name, exc)
        return None, f"{device.name} cannot cost this graph: {type(exc).__name__}: {exc}"


def report_table(report: GraphReport) -> Table:
    """Collectives with their partitions (key and launch slots) as a rich table."""
    title = (
        f"kareus {report.label}: {report.kind} graph, {report.num_nodes} nodes, "
        f"{len(report.collectives)} collectives, {len(report.partitions)} partitions"
    )
    if report.estimate is not None:
        e = report.estimate
        title += (
            f"\non {report.device} at {e.clock_mhz} MHz (modelled, per GPU): "
            f"{e.time_s * 1e3:.3f} ms, {e.energy_j * 1e3:.2f} mJ "
            f"({e.effective_energy_j * 1e3:.2f} mJ above static)"
        )
    if report.profile_gpu_s:
        title += f"\nprofiling took {report.profile_gpu_s:.1f} GPU-s on this rank"
    space = report.variants
    title += f"\ncoverage: {report.coverage}"
    title += (
        f"\nnanobatches applied: {report.nanobatches}; variant space: k in "
        f"{{{', '.join(map(str, space.nanobatches))}}}, {space.size():,} variants"
    )
    if report.variant is not None:
        title += f"; launch slots {list(report.variant.slots)}"
    if report.clock_mhz:
        title += f"; clock {report.clock_mhz} MHz"
    table = Table(title=title, title_justify="left")
    for column in (
        "collective", "kind", "group", "payload", "partition key", "launch slots", "resources"
    ):
        table.add_column(column, overflow="fold")
    by_collective = {p.collective: p for p in report.partitions}
    shown = report.variant.nanobatches if report.variant else max(space.nanobatches)
    choices = {c.collective: c for c in space.choices.get(shown, ())}
    for c in report.collectives:
        p, choice = by_collective.get(c.name), choices.get(c.name)
        table.add_row(
            c.name,
            c.kind + (f"({c.reduce_op})" if c.reduce_op else ""),
            f"{c.group_name}×{c.group_size}",
            _human_bytes(c.payload_bytes),
            p.key if p else "-",
            " | ".join(s.label for s in p.slots) if p else "-",
            _resources(choice.resources) if choice else "-",
        )
    caption = [*report.notes]
    if report.fallback:
        caption.append(f"runs unrewritten: {report.fallback}")
    caption += [f"k={k} does not apply: {why}" for k, why in sorted(space.infeasible.items())]
    caption += [f"split region ends at {b}" for b in report.barriers[:3]]
    if len(report.barriers) > 3:
        caption.append(f"... and {len(report.barriers) - 3} more barriers")
    if caption:
        table.caption = "\n".join(caption)
        table.caption_justify = "left"
    return table


def _resources(choices: tuple[int | None, ...]) -> str:
    caps = [c for c in choices if c is not None]
    return f"default, {min(caps)}..{max(caps)} CTAs" if caps else "default only"


def print_report(report: GraphReport, console: Console | None = None) -> None:
    (console or make_console()).print(report_table(report))


def print_options(options: KareusOptions, console: Console | None = None) -> None:
    """Every option's value and where it came from (``explain``)."""
    table = Table(title="kareus options")
    for column in ("option", "value", "from"):
        table.add_column(column)
    for name, source in options.sources.items():
        table.add_row(name, repr(getattr(options, name)), source)
    (console or make_console()).print(table)


def _human_bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    size = n / 1024
    for unit in ("KiB", "MiB"):
        if size < 1024:
            return f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"
