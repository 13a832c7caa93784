"""The step meter: a warm-up step, then windows of at least ``window_steps`` steps and
``min_window_s`` read at their two ends only, per step; a window the counter did not
advance over stays open; ranks tell their energies through a store; a device that reads
no energy (a model) measures nothing."""

import torch.distributed as dist

from kareus.devices import SimulatedGPU
from kareus.devices.base import EnergyReading
from kareus.runtime.step_meter import RankBoard, StepMeter


class Counter:
    """A device's readings, scripted: ``watts`` from the start, time moving only when told."""

    def __init__(self, watts: float = 200.0) -> None:
        self.watts, self.now, self.energy_j, self.reads = watts, 0.0, 1000.0, 0

    def run(self, seconds: float) -> None:
        self.now += seconds
        self.energy_j += self.watts * seconds

    def read(self) -> EnergyReading:
        self.reads += 1
        return EnergyReading(self.now, self.energy_j, "nvml-energy-counter")


def meter(counter, **kwargs):
    kwargs.setdefault("min_window_s", 0.0)
    return StepMeter(counter.read, host_clock=lambda: counter.now, **kwargs)


def run_steps(meter_, counter, steps, seconds=0.1, first=0):
    measured = []
    for step in range(first, first + steps):
        m = meter_.step_started(step)
        if m is not None:
            measured.append(m)
        counter.run(seconds)
    return measured


def test_windows_after_a_warm_up_step_are_read_at_their_ends_only():
    counter = Counter(watts=200.0)
    m = meter(counter, window_steps=4)
    measured = run_steps(m, counter, 11, first=3)  # steps 3..13: 3 warms up, 4 opens
    # 4 opens, 8 closes, 12 closes: three reads in eleven steps
    assert counter.reads == 3
    assert [(w.first_step, w.steps) for w in measured] == [(4, 4), (8, 4)]
    for w in measured:
        assert abs(w.time_s - 0.1) < 1e-9 and abs(w.energy_j - 20.0) < 1e-9  # 200 W x 0.1 s
        assert w.gpu_energy_j == ((0, w.energy_j),) and w.total_energy_j == w.energy_j
        assert w.method == "nvml-energy-counter"


def test_a_window_lasts_min_window_s():
    counter = Counter()
    m = meter(counter, window_steps=2, min_window_s=0.45)
    measured = run_steps(m, counter, 12)  # 0.1 s steps: windows of 5 steps, from step 1
    assert [(w.first_step, w.steps) for w in measured] == [(1, 5), (6, 5)]


def test_a_window_stays_open_while_the_counter_stands_still():
    counter = Counter(watts=0.0)
    m = meter(counter, window_steps=2)
    assert run_steps(m, counter, 11) == []  # 0 warms up, 1 opens, nothing closes it
    counter.watts = 100.0
    (late,) = run_steps(m, counter, 2, first=11)
    assert (late.first_step, late.steps) == (1, 11)
    assert abs(late.energy_j - 100 * 0.1 / 11) < 1e-9  # only step 11 drew power


def test_a_device_that_reads_no_energy_measures_nothing():
    m = StepMeter.of(SimulatedGPU("sim:a100-sxm4-40gb"), "kareus/measured/x")
    assert all(m.step_started(step) is None for step in range(20))
    assert m.off


def test_the_total_sums_every_rank_once_all_told_theirs():
    store = dist.HashStore()
    counters = [Counter(watts=100.0), Counter(watts=300.0)]
    meters = [meter(c, window_steps=2, rank=r, world_size=2,
                    board=RankBoard(store, "kareus/measured/x", r, 2))
              for r, c in enumerate(counters)]
    seen: list[list] = [[], []]
    for step in range(8):
        for rank in (0, 1):
            m = meters[rank].step_started(step)
            if m is not None:
                seen[rank].append(m)
            counters[rank].run(0.1)
    first0, first1 = seen[0][0], seen[1][0]
    assert first0.total_energy_j is None and first0.gpu_energy_j == ((0, first0.energy_j),)
    assert first1.gpu_energy_j == ((0, 10.0), (1, 30.0))  # rank 0 had told its
    assert abs(first1.total_energy_j - 40.0) < 1e-9 and first1.energy_j == 30.0
    assert all(abs(m.total_energy_j - 40.0) < 1e-9 for m in seen[0][1:] + seen[1][1:])


def test_a_failing_store_leaves_the_total_unknown_and_training_on(caplog):
    class Broken:
        def set(self, *args):
            raise RuntimeError("store gone")

    counter = Counter()
    m = meter(counter, window_steps=1, rank=1, world_size=2,
              board=RankBoard(Broken(), "p", 1, 2))
    measured = run_steps(m, counter, 5)
    assert len(measured) == 3 and all(w.total_energy_j is None for w in measured)
    assert sum("cannot be exchanged" in r.message for r in caplog.records) == 1


def test_an_nvml_meter_reads_the_counter_and_one_without_it_reads_nothing():
    from fake_pynvml import FakeClock, FakeGpu, FakeNvml, opened

    from kareus.devices.nvml.energy import NvmlEnergyMeter

    clock = FakeClock()
    fake, handle = opened(FakeNvml([FakeGpu(power_w=300.0)], clock=clock))
    meter_ = NvmlEnergyMeter(fake, handle, gpu="GPU 0", timer=clock)
    first = meter_.reading()
    clock.advance(2.0)
    second = meter_.reading()
    assert (second.time_s - first.time_s, second.energy_j - first.energy_j) == (2.0, 600.0)
    assert second.method == "nvml-energy-counter"
    fake, handle = opened(FakeNvml([FakeGpu(energy_counter=False)], clock=clock))
    assert NvmlEnergyMeter(fake, handle, gpu="GPU 0", timer=clock).reading() is None


def test_the_step_planner_measures_from_the_plans_first_graph_at_each_steps_first_microbatch(
        tmp_path):
    from kareus.passes.decide import Choice
    from kareus.planner.budget import Budget
    from kareus.planner.compose import FrontierPoint
    from kareus.planner.graph import GraphFrontier
    from kareus.planner.plan import make_plan
    from kareus.planner.step import StepPlanner

    def graph(label, key):
        point = FrontierPoint(1.0, 10.0, Choice(1, 1410, ()))
        return GraphFrontier(label, key, (point,), (point,), point)

    counter = Counter(watts=100.0)

    class Metered(SimulatedGPU):
        def read_energy(self):
            return counter.read()

    device = Metered("sim:a100-sxm4-40gb")
    plan = make_plan([graph("r0/forward", "f" * 16), graph("r0/backward", "b" * 16)],
                     Budget("fastest"), device, {}, "0.1.0", microbatches=2)
    published = []
    planner = StepPlanner({}, {}, Budget("fastest"), device, "0.1.0", tmp_path, counts=None,
                          microbatches=2, timeout_s=1.0, given=plan, publish=published.append)
    for call in range(1, 2 * 8 + 1):  # 8 steps of 2 microbatches, 0.1 s each
        planner.graph_called("r0/forward", "f" * 16, call)
        planner.graph_called("r0/backward", "b" * 16, call)
        counter.run(0.1)
    # step 0 warms up (the plan is given: it runs from the first step), 1 opens, 6 closes
    assert counter.reads == 2
    measured = published[-1].measured
    assert (measured.first_step, measured.steps) == (1, 5)
    assert abs(measured.time_s - 0.2) < 1e-9 and abs(measured.energy_j - 20.0) < 1e-9
    assert published[-1].digest == plan.digest and planner.plan.measured is None
    assert list(tmp_path.iterdir()) == []  # a given plan is the user's file: nothing stored
