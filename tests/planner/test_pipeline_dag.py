"""The pipeline-parallel iteration: its DAG (1F1B, GPipe and interleaved 1F1B against the
orders torch's schedules run, any per-rank orders), its critical path, and its exact planner
under every budget against brute force on random small pipelines (every combination of
options costed by an independent, vectorised evaluation of the energy model)."""

from __future__ import annotations

import itertools
import math
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.distributed.pipelining.schedules import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

from kareus.errors import KareusError
from kareus.passes.decide import Choice
from kareus.planner.budget import Budget, BudgetError
from kareus.planner.compose import FrontierPoint
from kareus.planner.pipeline import (
    KINDS,
    EnergyModel,
    PipelineActionError,
    PipelineEnergyLimitError,
    PipelineInputError,
    PipelineOrderError,
    PipelineShapeError,
    PipelineSolveError,
    PipelineTimeLimitError,
    baseline,
    fastest,
    fastest_within,
    from_orders,
    gpipe,
    interleaved_one_f_one_b,
    least_energy,
    least_tradeoff,
    one_f_one_b,
    pipeline_frontier,
    schedule,
    solve_budget,
    stoppable,
    torch_orders,
)

P = FrontierPoint


def _orders(dag) -> list[str]:
    """Each rank's order, as "F0 F1 B0 ..."."""
    return [" ".join(f"{dag.instructions[i].kind[0].upper()}{dag.instructions[i].microbatch}"
                     for i in order) for order in dag.orders]


def _triples(dag) -> list[list[tuple[int, int, str]]]:
    """Each rank's order, as (stage, microbatch, kind)."""
    return [[(dag.instructions[i].stage, dag.instructions[i].microbatch,
              dag.instructions[i].kind) for i in order] for order in dag.orders]


def _edges(dag) -> set[tuple[tuple[int, int, str], tuple[int, int, str]]]:
    label = {n: (i.stage, i.microbatch, i.kind) for n, i in enumerate(dag.instructions)}
    return {(label[a], label[b]) for a, b in dag.edges}


@pytest.mark.parametrize(("stages", "microbatches", "expected"), [
    (2, 2, ["F0 F1 B0 B1", "F0 B0 F1 B1"]),
    (2, 4, ["F0 F1 B0 F2 B1 F3 B2 B3", "F0 B0 F1 B1 F2 B2 F3 B3"]),
    (3, 4, ["F0 F1 F2 B0 F3 B1 B2 B3", "F0 F1 B0 F2 B1 F3 B2 B3",
            "F0 B0 F1 B1 F2 B2 F3 B3"]),
])
def test_one_f_one_b_warms_up_alternates_and_cools_down(stages, microbatches, expected):
    assert _orders(one_f_one_b(stages, microbatches)) == expected


@pytest.mark.parametrize(("stages", "microbatches"), [(2, 2), (2, 4), (3, 2), (3, 4)])
def test_gpipe_runs_every_forward_then_every_backward(stages, microbatches):
    forwards = " ".join(f"F{m}" for m in range(microbatches))
    backwards = " ".join(f"B{m}" for m in range(microbatches))
    assert _orders(gpipe(stages, microbatches)) == [f"{forwards} {backwards}"] * stages


@pytest.mark.parametrize(("make", "stages", "microbatches"), [
    (one_f_one_b, 2, 2), (one_f_one_b, 2, 4), (one_f_one_b, 3, 4),
    (gpipe, 2, 2), (gpipe, 2, 4), (gpipe, 3, 2), (gpipe, 3, 4),
])
def test_edges_are_the_rank_orders_and_the_microbatches_dataflow(make, stages, microbatches):
    dag = make(stages, microbatches)
    assert len(dag.instructions) == 2 * stages * microbatches
    label = {n: (i.stage, i.microbatch, i.kind) for n, i in enumerate(dag.instructions)}
    expected = {(label[a], label[b]) for order in dag.orders
                for a, b in itertools.pairwise(order)}
    for m in range(microbatches):
        for s in range(stages - 1):
            expected.add(((s, m, "forward"), (s + 1, m, "forward")))
            expected.add(((s + 1, m, "backward"), (s, m, "backward")))
        expected.add(((stages - 1, m, "forward"), (stages - 1, m, "backward")))
    assert _edges(dag) == expected
    assert len(dag.edges) == len(set(dag.edges))


def test_shapes_the_schedules_cannot_run_are_refused():
    with pytest.raises(PipelineShapeError, match="at least as many microbatches as stages"):
        one_f_one_b(3, 2)
    for stages, microbatches in ((0, 2), (2, 0), (True, 2), (2, 1.5)):
        with pytest.raises(PipelineShapeError, match="an integer >= 1"):
            gpipe(stages, microbatches)
    assert issubclass(PipelineShapeError, KareusError) and issubclass(PipelineShapeError,
                                                                      ValueError)


# -- torch's schedules, and any per-rank orders -----------------------------------------


def _torch_interleaved(ranks, virtual, microbatches, schedule=ScheduleInterleaved1F1B):
    """torch's own ``pipeline_order``, built by the schedule's constructor over objects that
    stand in for rank 0's stages (it reads their group and stage attributes only; a zero
    bubble schedule also checks ``submod``)."""
    stages = [SimpleNamespace(group_size=ranks, group_rank=0, num_stages=ranks * virtual,
                              stage_index=v * ranks, submod=torch.nn.Identity())
              for v in range(virtual)]
    return schedule(stages, microbatches).pipeline_order


@pytest.mark.parametrize(("ranks", "virtual", "microbatches"), [
    (2, 2, 2), (2, 2, 4), (2, 2, 8), (4, 2, 8), (2, 3, 6), (3, 2, 6), (4, 3, 4), (4, 2, 2),
    (4, 2, 12), (1, 3, 2),
])
def test_interleaved_one_f_one_b_is_torchs_order(ranks, virtual, microbatches):
    dag = interleaved_one_f_one_b(ranks, virtual, microbatches)
    expected = torch_orders(_torch_interleaved(ranks, virtual, microbatches))
    assert _triples(dag) == expected
    assert (dag.stages, dag.ranks, dag.microbatches) == (ranks * virtual, ranks, microbatches)
    assert all(i.stage % ranks == r for r, order in enumerate(dag.orders)
               for i in map(dag.instructions.__getitem__, order))
    assert from_orders(ranks * virtual, microbatches, expected) == dag


def test_interleaved_one_f_one_b_refuses_what_torch_refuses():
    with pytest.raises(ValueError, match="multiple of the number of rounds"):
        _torch_interleaved(2, 2, 5)
    with pytest.raises(PipelineShapeError, match="got 5 microbatches for 2 ranks; accepted: "
                                                 "a multiple of 2"):
        interleaved_one_f_one_b(2, 2, 5)
    with pytest.raises(PipelineShapeError, match="virtual: got 0"):
        interleaved_one_f_one_b(2, 0, 4)


class _Recorder:
    """A stand-in for a single-stage schedule's stage that records what it is made to
    compute; its communication is none."""

    def __init__(self, stage: int, stages: int) -> None:
        self.stage_index, self.num_stages, self.is_last = stage, stages, stage == stages - 1
        self.ran: list[tuple[int, int, str]] = []

    def get_fwd_recv_ops(self, microbatch):
        return []

    get_fwd_send_ops = get_bwd_recv_ops = get_bwd_send_ops = get_fwd_recv_ops

    def forward_one_chunk(self, microbatch, *args, **kwargs):
        self.ran.append((self.stage_index, microbatch, "forward"))

    def backward_one_chunk(self, microbatch, **kwargs):
        self.ran.append((self.stage_index, microbatch, "backward"))

    def perform_reduce_grad(self, scale):
        pass


@pytest.mark.parametrize(("make", "torch_schedule"), [(one_f_one_b, Schedule1F1B),
                                                      (gpipe, ScheduleGPipe)])
@pytest.mark.parametrize(("stages", "microbatches"), [(2, 2), (2, 4), (3, 4), (4, 6)])
def test_one_f_one_b_and_gpipe_are_what_torchs_schedules_run(make, torch_schedule, stages,
                                                             microbatches):
    # What each stage's step computes, in order (the schedules' pipeline_order is not: 1F1B's
    # starts the last stage at microbatch 1, and both hold gradient reductions).
    ran = []
    for s in range(stages):
        stage = _Recorder(s, stages)
        run = torch_schedule(stage, microbatches)
        run._initialize_stage = lambda *args, **kwargs: None  # no shapes to exchange
        run._step_microbatches()
        ran.append(stage.ran)
    assert _triples(make(stages, microbatches)) == ran


def test_torch_actions_without_an_instruction_are_refused():
    zero_bubble = _torch_interleaved(2, 2, 4, ScheduleInterleavedZeroBubble)
    with pytest.raises(PipelineActionError,
                       match=r"pipeline_order\[0\]\[5\]: got 2I0 \(BACKWARD_INPUT\); accepted: "
                             r"FORWARD \(F\) and FULL_BACKWARD \(B\)"):
        torch_orders(zero_bubble)
    reduced = Schedule1F1B(_Recorder(0, 2), 2).pipeline_order  # ends with a REDUCE_GRAD
    with pytest.raises(PipelineActionError, match=r"got 0REDUCE_GRAD \(REDUCE_GRAD\)"):
        torch_orders(reduced)
    with pytest.raises(PipelineOrderError, match=r"ranks \[0, 2\]; accepted: ranks 0 to n - 1"):
        torch_orders({0: [], 2: []})
    assert issubclass(PipelineActionError, PipelineOrderError)
    assert issubclass(PipelineOrderError, KareusError) and issubclass(PipelineOrderError,
                                                                      ValueError)


def _order(text: str) -> list[tuple[int, int, str]]:
    """Instructions in torch's notation ("0F0 1B2") as (stage, microbatch, kind)."""
    return [(int(a[0]), int(a[2:]), {"F": "forward", "B": "backward"}[a[1]])
            for a in text.split()]


def test_from_orders_builds_the_dag_of_any_per_rank_orders():
    # Two stages on one rank: the rank's order is the only one; stage 0's forward feeds
    # stage 1's on the same rank.
    dag = from_orders(2, 2, [_order("0F0 1F0 1B0 0F1 0B0 1F1 1B1 0B1")])
    assert (dag.stages, dag.ranks) == (2, 1)
    assert _orders(dag) == ["F0 F0 B0 F1 B0 F1 B1 B1"]
    label = {n: (i.stage, i.microbatch, i.kind) for n, i in enumerate(dag.instructions)}
    assert ((0, 1, "forward"), (1, 1, "forward")) in _edges(dag)  # dataflow, not adjacent
    assert {(label[a], label[b]) for a, b in itertools.pairwise(dag.orders[0])} <= _edges(dag)
    assert len(dag.edges) == len(set(dag.edges))


@pytest.mark.parametrize(("orders", "message"), [
    ([_order("0F0 0B0"), _order("1B0 1F0")],
     (r"orders deadlock: in 1F0 -> 1B0 -> 1F0 \(stage, F\|B, microbatch\) each instruction "
      r"waits for the one before it")),
    ([_order("0F0 0B0"), _order("1B0 1F0"), _order("2F0 2B0")],
     r"orders deadlock: in 1F0 -> 2F0 -> 2B0 -> 1B0 -> 1F0 "),
    ([_order("0F0 0B0"), _order("1F0")],
     (r"orders: 1 instruction never run \(1B0: stage, F\|B, microbatch\); accepted: each "
      r"stage's forward and backward of each microbatch, 2 x 1 x 2 in all")),
    ([_order("0F0 0B0 1F0"), _order("1B0")],
     (r"orders\[1\]\[0\]: stage 1 runs on rank 1 and on rank 0 \(at orders\[0\]\[2\]\); "
      r"accepted: each stage's instructions on one rank")),
    ([_order("0F0 0B0 0F0"), _order("1F0 1B0")],
     r"orders\[0\]\[2\]: 0F0 runs a second time \(first at orders\[0\]\[0\]\)"),
    ([_order("0F0 0B0"), [(1, 0, "forward"), (1, 1, "backward")]],
     (r"orders\[1\]\[1\]: got \(1, 1, 'backward'\); accepted: \(stage, microbatch, kind\) "
      r"with stage 0 to 1, microbatch 0 to 0, kind 'forward' or 'backward'")),
    ([_order("0F0 0B0"), [(1, 0, "fwd"), (1, 0, "backward")]], r"got \(1, 0, 'fwd'\)"),
    ([_order("0F0 0B0"), [(True, 0, "forward")]], r"got \(True, 0, 'forward'\)"),
    ([_order("0F0 0B0 1F0 1B0"), []], r"orders\[1\]: empty; accepted: every rank runs"),
    ([], r"orders: none given"),
])
def test_orders_no_dag_can_be_built_from_are_refused(orders, message):
    stages = 3 if len(orders) == 3 else 2
    with pytest.raises(PipelineOrderError, match=message):
        from_orders(stages, 1, orders)


def _durations(dag, times):
    """Durations from {(stage, kind): seconds}."""
    return [times[i.stage, i.kind] for i in dag.instructions]


def _index(dag, stage, microbatch, kind):
    return next(n for n, i in enumerate(dag.instructions)
                if (i.stage, i.microbatch, i.kind) == (stage, microbatch, kind))


def test_gpipe_critical_path_by_hand():
    # Forward 1 s, backward 2 s on both stages.
    # stage 0: F0 [0, 1], F1 [1, 2]
    # stage 1: F0 [1, 2] (after stage 0's F0), F1 [2, 3], B0 [3, 5], B1 [5, 7]
    # stage 0: B0 waits for stage 1's B0: [5, 7]; B1 for stage 1's B1 (7): [7, 9]
    dag = gpipe(2, 2)
    times = {(0, "forward"): 1.0, (0, "backward"): 2.0, (1, "forward"): 1.0,
             (1, "backward"): 2.0}
    starts, makespan = schedule(dag, _durations(dag, times))
    expected = {(0, 0, "forward"): 0, (0, 1, "forward"): 1, (1, 0, "forward"): 1,
                (1, 1, "forward"): 2, (1, 0, "backward"): 3, (1, 1, "backward"): 5,
                (0, 0, "backward"): 5, (0, 1, "backward"): 7}
    assert {k: starts[_index(dag, *k)] for k in expected} == expected
    assert makespan == 9


def test_one_f_one_b_critical_path_by_hand_with_switches():
    # Stage 0: forward 1 s, backward 2 s; stage 1: forward 2 s, backward 3 s.
    # stage 0: F0 [0, 1], F1 [1, 2]
    # stage 1: F0 [1, 3], B0 [3, 6], F1 after B0 and stage 0's F1: [6, 8], B1 [8, 11]
    # stage 0: B0 after F1 (2) and stage 1's B0 (6): [6, 8]; B1 after stage 1's B1: [11, 13]
    dag = one_f_one_b(2, 2)
    times = {(0, "forward"): 1.0, (0, "backward"): 2.0, (1, "forward"): 2.0,
             (1, "backward"): 3.0}
    durations = _durations(dag, times)
    starts, makespan = schedule(dag, durations)
    assert starts[_index(dag, 1, 1, "forward")] == 6
    assert starts[_index(dag, 0, 0, "backward")] == 6
    assert makespan == 13
    # A 0.5 s switch after stage 0's F1 is absorbed (B0 waits for stage 1 until 6 anyway);
    # one after stage 1's B0 delays its F1 to 6.5, so B1 [8.5, 11.5] and stage 0's B1
    # [11.5, 13.5]; stage 0's switch back to its first clock (0.25 s) ends it at 13.75.
    switch_s = [0.0] * len(durations)
    switch_s[_index(dag, 0, 1, "forward")] = 0.5
    switch_s[_index(dag, 1, 0, "backward")] = 0.5
    switch_s[_index(dag, 0, 1, "backward")] = 0.25
    starts, makespan = schedule(dag, durations, switch_s)
    assert starts[_index(dag, 0, 0, "backward")] == 6
    assert starts[_index(dag, 1, 1, "forward")] == 6.5
    assert starts[_index(dag, 0, 1, "backward")] == 11.5
    assert makespan == 13.75
    with pytest.raises(PipelineInputError, match="one per instruction"):
        schedule(dag, durations[:-1])


def test_interleaved_critical_path_by_hand():
    # 2 ranks x 2 virtual stages (rank 0: stages 0 and 2, rank 1: 1 and 3), 2 microbatches,
    # every instruction 1 s. torch's orders:
    #   rank 0: 0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1
    #   rank 1: 1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1
    # rank 0: 0F0 [0, 1], 0F1 [1, 2]; rank 1: 1F0 [1, 2], 1F1 [2, 3]
    # rank 0: 2F0 after 1F0: [2, 3], 2F1 after 1F1: [3, 4]
    # rank 1: 3F0 after 1F1 and 2F0: [3, 4], 3B0 [4, 5], 3F1 [5, 6] (2F1 ended at 4), 3B1 [6, 7]
    # rank 0: 2B0 after 3B0: [5, 6], 2B1 after 3B1: [7, 8]
    # rank 1: 1B0 after 3B1 (7) and 2B0 (6): [7, 8], 1B1 after 2B1: [8, 9]
    # rank 0: 0B0 after 2B1 and 1B0: [8, 9], 0B1 after 1B1: [9, 10]
    dag = interleaved_one_f_one_b(2, 2, 2)
    assert _orders(dag) == ["F0 F1 F0 F1 B0 B1 B0 B1", "F0 F1 F0 B0 F1 B1 B0 B1"]
    starts, makespan = schedule(dag, [1.0] * len(dag.instructions))
    expected = {"0F0": 0, "0F1": 1, "1F0": 1, "1F1": 2, "2F0": 2, "2F1": 3, "3F0": 3,
                "3B0": 4, "3F1": 5, "2B0": 5, "3B1": 6, "2B1": 7, "1B0": 7, "1B1": 8,
                "0B0": 8, "0B1": 9}
    assert {k: starts[_index(dag, *_order(k)[0])] for k in expected} == expected
    assert makespan == 10
    # blocked time is per rank (GPU), not per stage: 2 x 10 - 16 busy seconds = 4 s
    options = {key: [P(1.0, 10.0, "c")] for key in itertools.product(range(4), KINDS)}
    point = baseline(dag, options, {k: v[0] for k, v in options.items()},
                     model=EnergyModel(static_power_w=100.0, blocking_power_w=5.0,
                                       switch_key=lambda c: 0))
    assert point.effective_energy_j == pytest.approx(16 * 10 + 5 * 4)
    assert point.energy_j == pytest.approx(180 + 100 * 10)


# -- the energy model, by hand ------------------------------------------------------------


def _uniform(forward: P, backward: P, stages: int = 2) -> dict:
    return {(s, kind): [point] for s in range(stages)
            for kind, point in (("forward", forward), ("backward", backward))}


def test_baseline_prices_compute_blocking_and_static_power():
    # GPipe 2 x 2, forward 1 s / 10 J, backward 2 s / 20 J: T = 9 s (by hand above); each
    # stage is busy 6 s, so 2 x 9 - 12 = 6 s blocked at 5 W; static 100 W over 9 s.
    f, b = P(1.0, 10.0, "f"), P(2.0, 20.0, "b")
    options = _uniform(f, b)
    point = baseline(gpipe(2, 2), options, {k: v[0] for k, v in options.items()},
                     model=EnergyModel(static_power_w=100.0, blocking_power_w=5.0,
                                       switch_key=lambda c: 0))
    assert point.time_s == 9
    assert point.effective_energy_j == pytest.approx(4 * 10 + 4 * 20 + 5 * 6)
    assert point.energy_j == pytest.approx(150 + 100 * 9)
    assert point.choices == ("f", "f", "b", "b") * 2


def test_switch_costs_are_counted():
    # 1F1B 2 x 2, forward 1 s, backward 2 s: T = 9 s at any clock. A forward at 1200 MHz
    # saves 1 J; backwards run at 1980 MHz only. Running the forwards at 1200 switches
    # twice on stage 0 (F1 -> B0, and B1 -> F0 into the next iteration) and four times on
    # stage 1 (F B F B): 6 switches of 5 J cost more than the 4 J saved.
    fast, frugal = P(1.0, 10.0, Choice(1, 1980)), P(1.0, 9.0, Choice(1, 1200))
    options = {(s, kind): points for s in range(2) for kind, points in
               (("forward", [fast, frugal]), ("backward", [P(2.0, 20.0, Choice(1, 1980))]))}
    dag = one_f_one_b(2, 2)
    priced = EnergyModel(static_power_w=100.0, switch=lambda a, b: (0.0, 5.0))
    point = least_energy(dag, options, time_limit_s=None, model=priced)
    assert {c.clock_mhz for c in point.choices} == {1980}
    assert point.energy_j == pytest.approx(4 * 10 + 4 * 20 + 100 * 9)
    free = least_energy(dag, options, time_limit_s=None, model=EnergyModel(100.0))
    assert free.energy_j == pytest.approx(4 * 9 + 4 * 20 + 100 * 9)
    # a switch's seconds delay its stage: with 0.1 s switches, 9 s is still the fastest
    slow = EnergyModel(static_power_w=100.0, switch=lambda a, b: (0.1, 0.0))
    with pytest.raises(PipelineTimeLimitError, match="fastest takes 9 s"):
        least_energy(dag, options, time_limit_s=8.5, model=slow)


def test_blocking_power_is_counted():
    # 1F1B 2 x 2, forward 1 s, backward 2 s (T = 9 s): stage 0's F1 [1, 2] has 2 s of
    # slack (its B0 waits for stage 1 until 4). Its slower option (1.5 s, 12 J) costs 2 J
    # more but blocks 0.5 s less: at 10 W blocking it saves 5 J. Stage 0's F0 is on the
    # critical path, where 0.5 s more costs 0.5 s of static and blocking power.
    f, b = P(1.0, 10.0, "fast"), P(2.0, 20.0, "b")
    options = _uniform(f, b)
    options[0, "forward"] = [f, P(1.5, 12.0, "slow")]
    dag = one_f_one_b(2, 2)
    blocking = EnergyModel(static_power_w=100.0, blocking_power_w=10.0,
                           switch_key=lambda c: 0)
    point = least_energy(dag, options, time_limit_s=None, model=blocking)
    assert point.choices[_index(dag, 0, 0, "forward")] == "fast"
    assert point.choices[_index(dag, 0, 1, "forward")] == "slow"
    # busy: stage 0 1 + 1.5 + 2 + 2, stage 1 6; blocked 18 - 12.5 = 5.5 s
    assert point.time_s == 9
    assert point.energy_j == pytest.approx(122 + 10 * 5.5 + 100 * 9)
    unblocked = EnergyModel(static_power_w=100.0, switch_key=lambda c: 0)
    assert "slow" not in least_energy(dag, options, time_limit_s=None,
                                      model=unblocked).choices


def test_malformed_inputs_are_refused():
    dag = one_f_one_b(2, 2)
    options = _uniform(P(1.0, 1.0, 0), P(2.0, 2.0, 0))
    model = EnergyModel(10.0, switch_key=lambda c: c)
    with pytest.raises(PipelineInputError, match=r"options\[\(1, 'backward'\)\]: none given"):
        fastest(dag, {k: v for k, v in options.items() if k != (1, "backward")}, model=model)
    with pytest.raises(PipelineInputError, match=r"baseline_of\[\(0, 'forward'\)\]"):
        baseline(dag, options, {**{k: v[0] for k, v in options.items()},
                                (0, "forward"): P(3.0, 3.0, 0)}, model=model)
    with pytest.raises(PipelineInputError, match="points"):
        pipeline_frontier(dag, options, model=model, points=1)
    with pytest.raises(PipelineInputError, match="nan"):
        least_energy(dag, options, time_limit_s=float("nan"), model=model)
    with pytest.raises(PipelineInputError, match="energy_limit_j: got nan; accepted: joules"):
        fastest_within(dag, options, energy_limit_j=float("nan"), model=model)
    for eta in (-0.1, 1.5, True, "0.5"):
        with pytest.raises(PipelineInputError, match=r"eta: got .*; accepted: a number in "
                                                     r"\[0, 1\]"):
            least_tradeoff(dag, options, eta=eta, max_power_w=100.0, model=model)
    for power in (0.0, -1.0, math.inf, None):
        with pytest.raises(PipelineInputError, match="max_power_w: got .*; accepted: watts > 0"):
            least_tradeoff(dag, options, eta=0.5, max_power_w=power, model=model)
    base = baseline(dag, options, {k: v[0] for k, v in options.items()}, model=model)
    for budget, message in (
        (Budget("speed"), r"budget.kind: got 'speed'; accepted: 'fastest', 'time'"),
        (Budget("time"), r"accepted: a time budget with a value \(absolute\) or a fraction"),
        (Budget("energy", value=1.0, fraction=1.0), "one of them"),
        (Budget("tradeoff", value=2.0), r"eta: got 2\.0"),
    ):
        with pytest.raises(KareusError, match=message):
            solve_budget(dag, options, budget, model=model, max_power_w=100.0,
                         baseline_point=base)


def test_a_solve_not_proven_optimal_is_an_error():
    rng = random.Random(0)
    options = {(s, kind): [P(rng.uniform(1, 2), rng.uniform(1, 2), (c, k)) for c in range(6)
                           for k in range(3)] for s in range(2) for kind in ("forward",
                                                                              "backward")}
    model = EnergyModel(10.0, switch=lambda a, b: (0.1, 0.1), switch_key=lambda c: c[0])
    with pytest.raises(PipelineSolveError, match="max_solve_s"):
        least_energy(one_f_one_b(2, 2), options, time_limit_s=None, model=model,
                     max_solve_s=1e-9)


def test_past_its_solve_time_the_best_plan_found_is_kept_with_its_gap():
    rng = random.Random(1)
    dag, options, model, _ = _case(rng)
    best = least_energy(dag, options, time_limit_s=None, model=model)
    assert best.gap == 0.0
    kept = least_energy(dag, options, time_limit_s=None, model=model, max_solve_s=60.0,
                        best_found=True)
    assert kept == best  # proven within the time: the same plan, no gap
    try:
        rushed = least_energy(dag, options, time_limit_s=None, model=model, max_solve_s=1e-9,
                              best_found=True)
    except PipelineSolveError:  # nothing found at all in no time: still an error
        return
    assert rushed.energy_j >= best.energy_j * (1 - 1e-9) and rushed.gap >= 0.0


# -- against brute force -----------------------------------------------------------------

CLOCKS = (0, 1, 2)


def _random_dag(rng: random.Random):
    if rng.random() < 0.3:  # two ranks of two or three virtual stages
        return interleaved_one_f_one_b(2, rng.choice([2, 3]), rng.choice([2, 4]))
    stages, microbatches = rng.choice([2, 3]), rng.choice([2, 3, 4])
    make = one_f_one_b if microbatches >= stages and rng.random() < 0.6 else gpipe
    return make(stages, microbatches)


def _case(rng: random.Random, dag=None):
    """A random small pipeline (on ``dag``, else a random one) whose combinations of options
    number 16 to 50,000."""
    while True:
        case_dag = dag or _random_dag(rng)
        counts = {(s, kind): rng.choice([1, 2, 2, 3]) for s in range(case_dag.stages)
                  for kind in ("forward", "backward")}
        while _combinations(case_dag, counts) > 50_000:  # one option fewer somewhere
            counts[rng.choice([key for key, n in counts.items() if n > 1])] -= 1
        if _combinations(case_dag, counts) >= 16:
            dag = case_dag
            break
    options = {}
    for (s, kind), count in counts.items():
        scale = rng.uniform(0.5, 1.5) * (2 if kind == "backward" else 1)
        options[s, kind] = [P(scale * rng.uniform(0.6, 1.4), scale * rng.uniform(20, 60),
                              (rng.choice(CLOCKS), k)) for k in range(count)]
    style = rng.choice(["free", "uniform", "pairs"])
    if style == "free":
        table = {}
    elif style == "uniform":
        cost = (rng.choice([0.0, rng.uniform(0, 0.5)]), rng.uniform(0, 3))
        table = {(a, b): cost for a in CLOCKS for b in CLOCKS if a != b}
    else:  # per direction, some switch energy below what blocking would have drawn
        table = {(a, b): (rng.uniform(0, 0.5), rng.uniform(0, 3)) for a in CLOCKS
                 for b in CLOCKS if a != b}
    model = EnergyModel(
        static_power_w=rng.uniform(20, 100) * dag.ranks,
        blocking_power_w=rng.choice([0.0, rng.uniform(0, 30)]),
        switch=lambda a, b: table.get((a[0], b[0]), (0.0, 0.0)),
        switch_key=lambda c: c[0],
    )
    base = {key: rng.choice(points) for key, points in options.items()}
    return dag, options, model, base


def _combinations(dag, counts) -> int:
    return math.prod(counts[i.stage, i.kind] for i in dag.instructions)


def _brute_force(dag, options, model):
    """(makespan, energy) of every combination of the instructions' options: an
    independent, vectorised evaluation of the energy model."""
    per = [options[i.stage, i.kind] for i in dag.instructions]
    picks = np.array(list(itertools.product(*(range(len(o)) for o in per)))).T  # (n, C)
    time = np.array([np.array([o.time_s for o in opts])[row] for opts, row in zip(per, picks)])
    energy = sum(np.array([o.effective_energy_j for o in opts])[row]
                 for opts, row in zip(per, picks))
    after = np.zeros_like(time)  # switch seconds after each instruction on its rank
    for order in dag.orders:
        for i, j in zip(order, order[1:] + order[:1]):
            costs = np.array([[model.switch(a.choice, b.choice) if a.choice[0] != b.choice[0]
                               else (0.0, 0.0) for b in per[j]] for a in per[i]])
            after[i] = costs[picks[i], picks[j], 0]
            energy = energy + costs[picks[i], picks[j], 1]
    finish = {}
    rank_pred = {b: a for order in dag.orders for a, b in itertools.pairwise(order)}
    preds = {b: [a for a, b2 in dag.edges if b2 == b] for b in range(len(per))}
    remaining = list(range(len(per)))
    while remaining:  # longest path, in any order the edges allow
        i = next(i for i in remaining if all(a in finish for a in preds[i]))
        remaining.remove(i)
        start = np.zeros(picks.shape[1])
        for a in preds[i]:
            start = np.maximum(start, finish[a] + (after[a] if rank_pred.get(i) == a else 0))
        finish[i] = start + time[i]
    makespan = np.max([finish[o[-1]] + after[o[-1]] for o in dag.orders], axis=0)
    blocked = dag.ranks * makespan - time.sum(axis=0) - after.sum(axis=0)
    energy = (energy + model.blocking_power_w * blocked + model.static_power_w * makespan)
    return makespan, energy


def _close(a, b, rel=1e-9):
    return abs(a - b) <= rel * max(abs(a), abs(b))


def _least(costs, limit):
    makespan, energy = costs
    return energy[makespan <= limit * (1 + 1e-12)].min()


@pytest.mark.parametrize("seed", range(50))
def test_the_planner_matches_brute_force_and_never_loses_to_the_baseline(seed):
    rng = random.Random(seed)
    _check_against_brute_force(rng, *_case(rng))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(("ranks", "virtual", "microbatches"),
                         [(2, 2, 2), (2, 2, 4), (2, 3, 2), (3, 2, 3)])
def test_the_planner_matches_brute_force_on_interleaved_pipelines(ranks, virtual, microbatches,
                                                                   seed):
    rng = random.Random(seed)
    _check_against_brute_force(
        rng, *_case(rng, interleaved_one_f_one_b(ranks, virtual, microbatches)))


def _check_against_brute_force(rng, dag, options, model, base_of):
    costs = _brute_force(dag, options, model)
    makespan, energy = costs
    base = baseline(dag, options, base_of, model=model)
    base_costs = _brute_force(dag, {k: [v] for k, v in base_of.items()}, model)
    assert _close(base.time_s, base_costs[0][0]) and _close(base.energy_j, base_costs[1][0])

    quick = fastest(dag, options, model=model)
    assert _close(quick.time_s, makespan.min())
    assert _close(quick.energy_j, _least(costs, makespan.min()))

    limits = [None, quick.time_s, base.time_s,
              *(rng.uniform(makespan.min(), makespan.max()) for _ in range(2))]
    for limit in limits:
        point = least_energy(dag, options, time_limit_s=limit, model=model)
        assert _close(point.energy_j, _least(costs, np.inf if limit is None else limit)), limit
        if limit is not None:
            assert point.time_s <= limit * (1 + 1e-9)
    frugal = least_energy(dag, options, time_limit_s=base.time_s, model=model)
    assert frugal.energy_j <= base.energy_j * (1 + 1e-9)

    frontier = pipeline_frontier(dag, options, model=model, points=4)
    assert _close(frontier[0].time_s, quick.time_s)
    assert _close(frontier[-1].energy_j, energy.min())
    for a, b in itertools.pairwise(frontier):
        assert a.time_s < b.time_s and a.energy_j > b.energy_j
    for p in frontier:  # each point is the least energy within its own time: Pareto
        assert _close(p.energy_j, _least(costs, p.time_s))
        assert not (p.time_s > base.time_s * (1 + 1e-9) and p.energy_j > base.energy_j
                    * (1 + 1e-9))
        assert len(p.choices) == len(dag.instructions)


@pytest.mark.parametrize("seed", range(3))
def test_a_limit_below_the_fastest_states_the_range(seed):
    dag, options, model, _ = _case(random.Random(seed))
    quick = fastest(dag, options, model=model)
    with pytest.raises(PipelineTimeLimitError, match=f"the fastest takes {quick.time_s:.4g} s"):
        least_energy(dag, options, time_limit_s=quick.time_s * 0.99, model=model)


# -- every budget, against brute force ----------------------------------------------------


def _fastest_within(costs, limit):
    """The least time of the plans within ``limit`` joules, and of those the least energy."""
    makespan, energy = costs
    fits = energy <= limit * (1 + 1e-12)
    quickest = makespan[fits].min()
    return quickest, energy[fits & (makespan <= quickest * (1 + 1e-12))].min()


@pytest.mark.parametrize("seed", range(30))
def test_every_budget_matches_brute_force(seed):
    rng = random.Random(1000 + seed)
    dag, options, model, base_of = _case(rng)
    costs = makespan, energy = _brute_force(dag, options, model)
    base = baseline(dag, options, base_of, model=model)

    for limit in (energy.min(), base.energy_j, rng.uniform(energy.min(), energy.max()),
                  math.inf):
        point = fastest_within(dag, options, energy_limit_j=limit, model=model)
        quickest, least = _fastest_within(costs, limit)
        assert _close(point.time_s, quickest) and _close(point.energy_j, least), limit
        assert point.energy_j <= limit * (1 + 1e-9)
    with pytest.raises(PipelineEnergyLimitError,
                       match=f"the least-energy plan takes {energy.min():.4g} J"):
        fastest_within(dag, options, energy_limit_j=energy.min() * 0.99, model=model)

    max_power_w = rng.uniform(1, 3) * (model.static_power_w + 60 * dag.ranks)
    for eta in (0.0, rng.random(), 1.0):
        point = least_tradeoff(dag, options, eta=eta, max_power_w=max_power_w, model=model)
        objective = eta * energy + (1 - eta) * max_power_w * makespan
        assert _close(eta * point.energy_j + (1 - eta) * max_power_w * point.time_s,
                      objective.min()), eta
        if eta == 0:  # time only: of the fastest plans, the least energy
            assert _close(point.energy_j, _least(costs, makespan.min()))

    def solve(budget):
        return solve_budget(dag, options, budget, model=model, max_power_w=max_power_w,
                            baseline_point=base)

    quick = solve(Budget("fastest"))
    assert _close(quick.time_s, makespan.min())
    assert _close(quick.energy_j, _least(costs, makespan.min()))
    eta = rng.random()
    traded = solve(Budget("tradeoff", value=eta))
    assert _close(eta * traded.energy_j + (1 - eta) * max_power_w * traded.time_s,
                  (eta * energy + (1 - eta) * max_power_w * makespan).min())
    for budget, limit in ((Budget("time", fraction=1.0), base.time_s),
                          (Budget("time", value=makespan.min()), makespan.min())):
        assert _close(solve(budget).energy_j, _least(costs, limit)), budget
    spend = rng.uniform(energy.min(), energy.max())
    for budget, limit in ((Budget("energy", fraction=1.0), base.energy_j),
                          (Budget("energy", value=spend), spend)):
        point = solve(budget)
        assert (_close(point.time_s, _fastest_within(costs, limit)[0])
                and _close(point.energy_j, _fastest_within(costs, limit)[1])), budget

    short = 0.99 * makespan.min() / base.time_s
    with pytest.raises(PipelineTimeLimitError,
                       match=f"within the time budget {short:g} of the baseline's "
                             f"{base.time_s:.4g} s = .*: the fastest takes "
                             f"{makespan.min():.4g} s"):
        solve(Budget("time", fraction=short))
    with pytest.raises(BudgetError, match=f"the least-energy plan takes {energy.min():.4g} J"):
        solve(Budget("energy", value=0.99 * energy.min()))


def test_budgets_no_plan_meets_are_budget_errors_stating_the_range():
    # 1F1B 2 x 2, forward 1 s / 10 J, backward 2 s / 20 J, 100 W static: the one plan takes
    # 9 s (by hand above), 120 J + 900 J static.
    dag = one_f_one_b(2, 2)
    options = _uniform(P(1.0, 10.0, "f"), P(2.0, 20.0, "b"))
    model = EnergyModel(static_power_w=100.0, switch_key=lambda c: 0)
    base = baseline(dag, options, {k: v[0] for k, v in options.items()}, model=model)
    assert (base.time_s, base.energy_j) == (9.0, 1020.0)

    def solve(budget):
        return solve_budget(dag, options, budget, model=model, max_power_w=400.0,
                            baseline_point=base)

    with pytest.raises(PipelineTimeLimitError, match=(
            r"no plan of the pipeline finishes an iteration within the time budget 0\.5 of "
            r"the baseline's 9 s = 4\.5 s: the fastest takes 9 s \(1020 J\), the least-energy "
            r"plan 9 s \(1020 J\)")):
        solve(Budget("time", fraction=0.5))
    with pytest.raises(PipelineEnergyLimitError, match=(
            r"no plan of the pipeline takes at most the energy budget 900 J an iteration: "
            r"the least-energy plan takes 1020 J \(9 s\), the fastest 1020 J \(9 s\)")):
        solve(Budget("energy", value=900.0))
    assert issubclass(PipelineTimeLimitError, BudgetError)
    assert issubclass(PipelineEnergyLimitError, BudgetError)
    assert issubclass(PipelineEnergyLimitError, ValueError)


def test_a_solve_runs_where_ctrl_c_stops_the_wait_at_once():
    """HiGHS releases the GIL but returns to Python only at its end: the solve runs on a
    thread, and a Ctrl-C (here ``interrupt_main``) ends the caller's wait in a poll."""
    import _thread
    import signal
    import threading
    import time

    assert stoppable(lambda: 42) == 42
    with pytest.raises(PipelineInputError, match="raised on the caller"):
        stoppable(lambda: (_ for _ in ()).throw(PipelineInputError("raised on the caller")))
    # SIGINT's handler as in a terminal: a background job's children ignore it
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        timer = threading.Timer(0.2, _thread.interrupt_main)
        started = time.perf_counter()
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            stoppable(lambda: time.sleep(30), poll_s=0.05)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert time.perf_counter() - started < 5
