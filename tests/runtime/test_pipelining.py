"""Finding a pipeline on the compiling thread's stack, and tracking its instructions.

Stand-ins are instances of torch.distributed.pipelining's own classes, made without a
process group (``object.__new__``) and given the attributes kareus reads; the frames are
real frames whose ``self`` is a stage, then a schedule, as when a stage's module compiles
inside ``schedule.step``.
"""

import pytest
from torch.distributed.pipelining.schedules import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
    _Action,
    _ComputationType,
)
from torch.distributed.pipelining.stage import PipelineStage

from kareus.runtime.pipelining import (
    Detection,
    InstructionTracker,
    PipelineHintError,
    PipelineShape,
    detect,
    unused_schedule,
)


def _stage(index, stages=2, ranks=2):
    stage = object.__new__(PipelineStage)
    stage.stage_index, stage.num_stages, stage.group_size = index, stages, ranks
    return stage


def _schedule(cls, stage_or_stages, microbatches=4):
    schedule = object.__new__(cls)
    if isinstance(stage_or_stages, list):
        schedule._stages = stage_or_stages
    else:
        schedule._stage = stage_or_stages
    schedule._n_microbatches = microbatches
    return schedule


def _compile_in(self):  # a stage's forward compiling: ``self`` is the stage
    return detect()


def _step(self, stage):  # the schedule's step: ``self`` is the schedule
    return _compile_in(stage)


@pytest.mark.parametrize("cls, kind", [(Schedule1F1B, "1f1b"), (ScheduleGPipe, "gpipe")])
def test_a_stage_compiling_inside_a_schedule_step_finds_its_pipeline(cls, kind):
    stage = _stage(1)
    schedule = _schedule(cls, stage)
    found = _step(schedule, stage)
    assert found.stage == 1 and found.reason is None and found.schedule is schedule
    assert found.shape == PipelineShape(kind, 2, 2, 4, (1,))
    assert found.shape.last == (1, 3, "backward")


def test_interleaved_1f1b_brings_every_rank_s_order_and_other_schedules_are_refused():
    stages = [_stage(0, 4), _stage(2, 4)]
    schedule = _schedule(ScheduleInterleaved1F1B, stages, microbatches=2)
    f, b = _ComputationType.FORWARD, _ComputationType.FULL_BACKWARD
    schedule.pipeline_order = {
        1: [None, _Action(1, f, 0), _Action(3, f, 0), _Action(3, b, 0), _Action(1, b, 0)],
        0: [_Action(0, f, 0), None, _Action(2, f, 0), _Action(2, b, 0), _Action(0, b, 0)],
    }
    found = _step(schedule, stages[1])
    assert found.stage == 2 and found.shape.local_stages == (0, 2)
    assert found.shape.orders == (
        ((0, 0, "forward"), (2, 0, "forward"), (2, 0, "backward"), (0, 0, "backward")),
        ((1, 0, "forward"), (3, 0, "forward"), (3, 0, "backward"), (1, 0, "backward")),
    )
    assert found.shape.last == (0, 0, "backward")
    schedule.pipeline_order[0][2] = _Action(2, _ComputationType.BACKWARD_INPUT, 0)
    split = _step(schedule, stages[1])
    assert split.shape is None and "BACKWARD_INPUT action" in split.reason
    looped = _step(_schedule(ScheduleLoopedBFS, stages), stages[0])
    assert looped.shape is None and looped.stage == 0
    assert "ScheduleLoopedBFS is not one kareus plans" in looped.reason


def test_no_pipeline_and_a_stage_outside_any_schedule():
    assert detect().stage is None and detect().shape is None
    alone = _compile_in(_stage(0))
    assert alone.stage == 0 and alone.shape is None and "outside any schedule" in alone.reason


def test_the_tracker_knows_each_instruction_and_tells_listeners_between_iterations():
    """One stage of two under 1F1B: each graph call is counted in its instruction, and the
    listeners hear of an ended iteration as the next step starts, not inside one."""
    tracker = InstructionTracker()
    stage = _stage(0)
    seen, heard = [], []

    def forward(chunk, *args):
        seen.append(tracker.current())
        tracker.called("s0/r0/forward", "f")
        tracker.called("s0/r1/forward", "g")
        tracker.called("s0/r1/forward", "g")  # a block graph once per layer

    def backward(chunk, loss=None):
        seen.append(tracker.current())
        tracker.called("s0/r0/backward", "b")

    stage.forward_one_chunk, stage.backward_one_chunk = forward, backward
    schedule = _schedule(Schedule1F1B, stage)

    def step():
        heard.append(("step", tracker.steps))
        for kind, m in (("f", 0), ("f", 1), ("b", 0), ("f", 2), ("b", 1), ("f", 3), ("b", 2),
                        ("b", 3)):
            (stage.forward_one_chunk if kind == "f" else stage.backward_one_chunk)(m)

    schedule.step = step
    shape = PipelineShape("1f1b", 2, 2, 4, (0,))
    tracker.attach(Detection(shape, 0, None, schedule))
    tracker.listeners.append(lambda s: heard.append(("ended", s)))
    schedule.step()
    assert tracker.current() is None
    assert seen[:3] == [(0, 0, "forward"), (0, 1, "forward"), (0, 0, "backward")]
    assert heard == [("step", 0)]  # the iteration ended; nobody is told inside it
    assert tracker.composition([0]) == {
        (0, "forward"): (("s0/r0/forward", "f", 1), ("s0/r1/forward", "g", 2)),
        (0, "backward"): (("s0/r0/backward", "b", 1),),
    }
    schedule.step()
    assert heard == [("step", 0), ("ended", shape), ("step", 1)]
    tracker.called("outside", "x")  # outside any instruction: not counted
    assert all(label != "outside" for c in tracker.composition([0]).values() for label, *_ in c)


def test_a_schedule_kareus_cannot_read_is_planned_stage_by_stage_with_the_reason():
    stage = _stage(0)
    schedule = _schedule(Schedule1F1B, stage)
    del stage.group_size  # as another torch might lay a stage out
    found = _step(schedule, stage)
    assert found.shape is None and found.stage == 0
    assert "could not read schedule Schedule1F1B (AttributeError" in found.reason
    del schedule._n_microbatches
    assert "does not say how many microbatches" in _step(schedule, stage).reason


def test_a_schedule_of_one_s_own_is_planned_as_the_options_say_and_never_against_torch():
    class MySchedule(Schedule1F1B):
        """A schedule of the user's own (its class name is none kareus knows)."""

    stage = _stage(1)
    mine = _schedule(MySchedule, stage)
    refused = _step(mine, stage)
    assert refused.shape is None and "give pipeline_schedule" in refused.reason

    assert _step_with(mine, stage, "gpipe", None).shape == PipelineShape("gpipe", 2, 2, 4, (1,))
    del mine._n_microbatches
    assert _step_with(mine, stage, "1f1b", 8).shape == PipelineShape("1f1b", 2, 2, 8, (1,))
    assert "give microbatches" in _step_with(mine, stage, "1f1b", None).reason
    assert _step_with(mine, stage, "1f1b", 8).shape.microbatches == 8
    torch_own = _schedule(Schedule1F1B, stage)
    with pytest.raises(PipelineHintError, match="pipeline_schedule='gpipe', but the stage runs "
                       r"under Schedule1F1B \(1f1b\)"):
        _step_with(torch_own, stage, "gpipe", None)
    with pytest.raises(PipelineHintError, match="microbatches=8, but the pipeline's schedule "
                       "runs 4"):
        _step_with(torch_own, stage, None, 8)


def _compile_in_with(self, schedule, microbatches):
    return detect(schedule=schedule, microbatches=microbatches)


def _step_with(self, stage, schedule, microbatches):
    return _compile_in_with(stage, schedule, microbatches)


def test_a_pipeline_schedule_that_does_nothing_says_why():
    no_pipeline = Detection(None, None)
    assert unused_schedule(no_pipeline, None, 3) is None  # not given
    assert "does nothing for region 3: it compiles outside any pipeline stage" in (
        unused_schedule(no_pipeline, "1f1b", 3))
    one = Detection(PipelineShape("1f1b", 1, 1, 4, (0,)), 0)
    assert "the pipeline has one stage" in unused_schedule(one, "gpipe", 0)
    two = Detection(PipelineShape("1f1b", 2, 2, 4, (0,)), 0)
    assert unused_schedule(two, "1f1b", 0) is None  # used
