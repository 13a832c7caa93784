"""Pipeline parallelism at run time: which stage a graph belongs to, and which instruction
(stage, microbatch, forward | backward) of the iteration runs now.

``torch.distributed.pipelining`` runs a stage's forward of microbatch m in
``stage.forward_one_chunk(m, ...)`` and its backward in ``stage.backward_one_chunk(m,
...)``, both called by the schedule's ``step``. A stage module compiled with kareus is
compiled inside those calls, so the compile finds the stage and the schedule on the
Python stack (``detect``): the stages, the schedule's kind and its microbatches, without
any option. From then on ``InstructionTracker`` wraps the stages' two methods (on the
instances), so every graph call knows its instruction, and it watches which graphs each
instruction runs and how often (per-block compilation runs one block graph per layer) and
when the rank's part of an iteration is over: as the next ``step`` starts, the pipeline
can be planned.

A backward graph may run on autograd's device thread (CUDA), where the stack does not
lead back to the schedule; the current instruction is therefore the process's, set and
reset by the wrappers on the thread that calls the schedule (which waits for the
backward), not the calling thread's.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

from kareus.errors import KareusError

log = logging.getLogger("kareus")

SCHEDULES = {
    "Schedule1F1B": "1f1b",
    "ScheduleGPipe": "gpipe",
    "ScheduleInterleaved1F1B": "interleaved_1f1b",
}
"""The torch.distributed.pipelining schedules kareus plans, by class name."""

class PipelineHintError(KareusError, ValueError):
    """What the options say of the pipeline contradicts what its schedule says."""


Instruction = tuple[int, int, str]
"""(stage, microbatch, "forward" | "backward")."""


@dataclass(frozen=True)
class PipelineShape:
    """The pipeline a compiled stage belongs to: its schedule's kind (``SCHEDULES``), all
    its stages, the ranks they run on, the microbatches of an iteration, this rank's
    stages, and every rank's order of instructions where the schedule computes one
    (interleaved 1F1B; None: the schedule's own rule, ``planner.pipeline``)."""

    schedule: str
    stages: int
    ranks: int
    microbatches: int
    local_stages: tuple[int, ...]
    orders: tuple[tuple[Instruction, ...], ...] | None = None

    @property
    def last(self) -> Instruction:
        """This rank's last instruction of an iteration: once it ends, so does the rank's
        part of the iteration (stage s runs on rank s mod ranks)."""
        if self.orders is not None:
            return self.orders[self.local_stages[0] % self.ranks][-1]
        return (self.local_stages[0], self.microbatches - 1, "backward")


@dataclass(frozen=True)
class Detection:
    """What a compile found on its stack: the pipeline (None: not planned as one, and
    ``reason`` says why, or no pipeline at all where both are None), the stage whose
    forward is compiling, and the schedule object."""

    shape: PipelineShape | None
    stage: int | None
    reason: str | None = None
    schedule: Any = None


def unused_schedule(found: Detection, schedule: str | None, region: int) -> str | None:
    """Why the ``pipeline_schedule`` option, given, does nothing for ``region`` (None:
    it is used, or not given): the region compiles outside any pipeline stage, or in a
    pipeline of one stage, where every schedule runs its microbatches in turn."""
    if schedule is None:
        return None
    if found.stage is None:
        return (f"pipeline_schedule={schedule!r} does nothing for region {region}: it compiles "
                "outside any pipeline stage (torch.distributed.pipelining)")
    if found.shape is not None and found.shape.stages == 1:
        return (f"pipeline_schedule={schedule!r} does nothing: the pipeline has one stage, "
                "where every schedule runs its microbatches in turn")
    return None


def detect(frame: FrameType | None = None, *, schedule: str | None = None,
           microbatches: int | None = None) -> Detection:
    """The pipeline whose stage is compiling now, from the frames of the calling thread:
    the innermost ``self`` that is a pipelining stage, and a schedule above it.

    ``schedule`` ("1f1b" | "gpipe") and ``microbatches``: what the user says of a schedule
    kareus cannot read (a class of their own; another torch's layout), never against what
    it reads (a contradiction is a ``PipelineHintError``)."""
    stage_cls, schedule_cls = _classes()
    if stage_cls is None:
        return Detection(None, None)
    stage = found = None
    f = frame or sys._getframe(1)
    while f is not None and found is None:
        me = f.f_locals.get("self")
        if stage is None and isinstance(me, stage_cls):
            stage = me
        elif stage is not None and isinstance(me, schedule_cls):
            found = me
        f = f.f_back
    if stage is None:
        return Detection(None, None)
    index = int(stage.stage_index)
    if found is None:
        return Detection(None, index, (
            "a pipeline stage runs outside any schedule's step, so kareus has no point "
            "between iterations to plan the pipeline at without holding back a peer's "
            "activations; each stage is planned alone"))
    name = type(found).__name__
    kind = SCHEDULES.get(name)
    if kind is not None and schedule not in (None, kind):
        raise PipelineHintError(
            f"kareus options: pipeline_schedule={schedule!r}, but the stage runs under "
            f"{name} ({kind}); leave pipeline_schedule unset")
    kind = kind or schedule
    if kind is None:
        return Detection(None, index, (
            f"schedule {name} is not one kareus plans (it plans {', '.join(SCHEDULES)}; "
            "give pipeline_schedule where one of yours runs 1F1B or GPipe); each stage is "
            "planned alone"), found)
    _check_microbatches(found, microbatches)
    count = getattr(found, "_n_microbatches", None) or microbatches
    if count is None:
        return Detection(None, index, (
            f"schedule {name} does not say how many microbatches an iteration runs; give "
            "microbatches; each stage is planned alone"), found)
    try:
        stages = _stages(found)
        orders = _orders(found) if kind == "interleaved_1f1b" else None
        if isinstance(orders, str):
            return Detection(None, index, f"schedule {name}: {orders}; each stage is planned "
                             "alone", found)
        shape = PipelineShape(
            schedule=kind,
            stages=int(stages[0].num_stages),
            ranks=int(stages[0].group_size),
            microbatches=int(count),
            local_stages=tuple(sorted(int(s.stage_index) for s in stages)),
            orders=orders,
        )
    except (AttributeError, TypeError, ValueError, KeyError) as exc:  # another torch's layout
        return Detection(None, index, (
            f"could not read schedule {name} ({type(exc).__name__}: {exc}); each stage is "
            "planned alone"), found)
    return Detection(shape, index, None, found)


def _check_microbatches(schedule: Any, given: int | None) -> None:
    """Refuse ``given`` microbatches where they contradict the schedule's own."""
    read = getattr(schedule, "_n_microbatches", None)
    if read is not None and given is not None and int(read) != given:
        raise PipelineHintError(
            f"kareus options: microbatches={given!r}, but the pipeline's schedule runs "
            f"{int(read)} per iteration; leave microbatches unset under a pipeline schedule "
            "(kareus reads it from there)")


def _classes() -> tuple[type | None, type | None]:
    try:
        from torch.distributed.pipelining.schedules import _PipelineSchedule
        from torch.distributed.pipelining.stage import _PipelineStageBase
    except ImportError:  # a torch built without distributed
        return None, None
    return _PipelineStageBase, _PipelineSchedule


def _stages(schedule: Any) -> list[Any]:
    return list(schedule._stages) if hasattr(schedule, "_stages") else [schedule._stage]


def _orders(schedule: Any) -> tuple[tuple[Instruction, ...], ...] | str:
    """Every rank's instructions in the order the schedule runs them (its
    ``pipeline_order``, idle slots left out); why not, where it runs other actions than
    whole forwards and backwards."""
    from torch.distributed.pipelining.schedules import _ComputationType

    kinds = {_ComputationType.FORWARD: "forward", _ComputationType.FULL_BACKWARD: "backward"}
    order = schedule.pipeline_order
    other = next((a for rank in order for a in order[rank]
                  if a is not None and a.computation_type not in kinds), None)
    if other is not None:
        return (f"its order has a {other.computation_type.name} action ({other}), where kareus "
                "plans whole forwards and backwards")
    return tuple(
        tuple((a.stage_index, a.microbatch_index, kinds[a.computation_type])
              for a in order[rank] if a is not None)
        for rank in sorted(order)
    )


Composition = tuple[tuple[str, str, int], ...]
"""The graphs an instruction runs: (label, graph hash, calls), in the order first called."""


class InstructionTracker:
    """Which instruction runs now, what each (stage, kind) runs, and when this rank's part
    of an iteration ended (``listeners``, called on the schedule's thread as its next
    ``step`` starts).

    One per process (``ProcessRuntime.instructions``); a schedule is attached once, at the
    first compile of one of its stages.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._current: list[Instruction] = []
        self._shapes: dict[int, PipelineShape] = {}  # id(schedule) -> its shape
        self._calls: dict[Instruction, Counter[tuple[str, str]]] = {}  # this iteration's
        self.compositions: dict[tuple[int, str], Composition] = {}
        self.listeners: list[Callable[[PipelineShape], None]] = []
        self._ended: list[PipelineShape] = []  # iterations ended, not yet told
        self.steps = 0

    def attach(self, detection: Detection) -> None:
        """Watch the instructions of the detected schedule's stages (once per schedule)."""
        schedule, shape = detection.schedule, detection.shape
        if shape is None or id(schedule) in self._shapes:
            return
        self._shapes[id(schedule)] = shape
        schedule.step = self._wrap_step(schedule.step)
        for stage in _stages(schedule):
            index = int(stage.stage_index)
            stage.forward_one_chunk = self._wrap(stage.forward_one_chunk, index, "forward", shape)
            stage.backward_one_chunk = self._wrap(stage.backward_one_chunk, index, "backward",
                                                  shape)

    def current(self) -> Instruction | None:
        """The instruction running now (None: outside any, e.g. a stage's shape inference)."""
        current = self._current
        return current[-1] if current else None

    def called(self, label: str, graph_hash: str) -> None:
        """A graph ran: counted in the current instruction."""
        now = self.current()
        if now is not None:
            with self._lock:
                self._calls.setdefault(now, Counter())[label, graph_hash] += 1

    def _wrap(self, method: Callable[..., Any], stage: int, kind: str,
              shape: PipelineShape) -> Callable[..., Any]:
        @functools.wraps(method)
        def run(chunk: int, *args: Any, **kwargs: Any) -> Any:
            instruction = (stage, int(chunk), kind)
            self._current.append(instruction)
            try:
                result = method(chunk, *args, **kwargs)
            finally:
                self._current.pop()
            self._finished(instruction, shape)
            return result

        return run

    def _wrap_step(self, step: Callable[..., Any]) -> Callable[..., Any]:
        """The schedule's ``step``, which first tells the listeners of each iteration that
        ended since: between iterations, where no stage waits on another's send (inside
        one, a rank that stops to plan would hold back the activation or gradient a peer
        waits for)."""

        @functools.wraps(step)
        def run(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                ended, self._ended = self._ended, []
            for shape in ended:
                for listener in list(self.listeners):
                    listener(shape)
            return step(*args, **kwargs)

        return run

    def _finished(self, instruction: Instruction, shape: PipelineShape) -> None:
        stage, _, kind = instruction
        with self._lock:
            calls = self._calls.pop(instruction, None)
            if calls:
                self.compositions[stage, kind] = tuple(
                    (label, h, n) for (label, h), n in calls.items())
            if instruction == shape.last:
                self._calls.clear()
                self._ended.append(shape)
                self.steps += 1

    def composition(self, local_stages: Sequence[int]) -> dict[tuple[int, str], Composition]:
        """What each of ``local_stages``' forward and backward ran in its last instruction
        (a (stage, kind) without any graph call is absent)."""
        with self._lock:
            return {key: c for key, c in self.compositions.items() if key[0] in local_stages}
