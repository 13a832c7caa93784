"""The one interface the profiler measures through: a real GPU (NVML) or a simulated one.

Also the clock-controller protocol every device's controller implements (what the
``kareus::set_clock`` op calls when a graph starts, through the runtime's router), the two
controllers that touch no hardware. ``DEFAULT_CLOCK_MHZ`` (a request for the device's
default clocks) is the op's convention, ``passes.ops``.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch.fx


@runtime_checkable
class ClockController(Protocol):
    def set_clock(self, graph: str, mhz: int) -> None:
        """Request SM clock ``mhz`` (``DEFAULT_CLOCK_MHZ``: default clocks) as ``graph`` starts."""

    def reset(self) -> None:
        """Return the device to its default clocks."""


class NullClockController:
    """No device to control: every request is accepted and ignored."""

    def set_clock(self, graph: str, mhz: int) -> None:
        pass

    def reset(self) -> None:
        pass


@dataclass(frozen=True)
class ClockSwitch:
    order: int
    graph: str
    mhz: int


class RecordingClockController:
    """Records every request in call order; changes nothing on any device."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.switches: list[ClockSwitch] = []
        self.resets = 0

    def set_clock(self, graph: str, mhz: int) -> None:
        with self._lock:
            self.switches.append(ClockSwitch(len(self.switches), graph, mhz))

    def reset(self) -> None:
        with self._lock:
            self.resets += 1


@dataclass(frozen=True)
class Workload:
    """What to measure: a graph variant.

    ``gm`` carries tensor metadata (``node.meta["val"]``, fake or real) so a model can cost
    it without running it; ``run`` executes the variant once on the real device (with its
    inputs bound) and is what a hardware device times. Either may be absent when the
    device that measures does not need it.
    """

    name: str
    gm: torch.fx.GraphModule | None = None
    run: Callable[[], object] | None = None
    world_size: int = 1
    agree: Callable[[int], int] | None = None
    """Where ranks run the workload together (its collective needs every one of them):
    the largest of the counts the ranks propose, called in the same order on each, so
    that all run it equally often (a rank running it once more would wait forever in its
    collective). None: this rank decides alone."""


@dataclass(frozen=True)
class Measurement:
    """Time and energy of one workload execution at one clock, with how they were obtained."""

    time_s: float
    energy_j: float
    static_power_w: float
    clock_mhz: int
    method: str
    resources: tuple[tuple[str, int], ...] = ()
    """The SM caps the collectives ran with, as (issuing node, SMs) in issue order; one not
    named ran on the library's default. ``dict(resources)`` measures under them again."""
    details: dict[str, float] = field(default_factory=dict)
    model_version: str | None = None
    """The model and GPU a simulated measurement comes from (``presets.MODEL_VERSION`` and
    the spec's name); None for a measurement of real hardware."""

    @property
    def effective_energy_j(self) -> float:
        """E - P_static * t: the energy the schedule and clock can change (REFERENCE.md s1)."""
        return self.energy_j - self.static_power_w * self.time_s

    @property
    def average_power_w(self) -> float:
        return self.energy_j / self.time_s if self.time_s > 0 else 0.0


@dataclass(frozen=True)
class EnergyReading:
    """A device's clock and energy counter read at one instant (once the work queued
    before it ran): a window's measurement is the difference of two."""

    time_s: float  # on the device's timer (seconds, from any origin)
    energy_j: float  # the counter (joules, from any origin)
    method: str  # how energy was read ("nvml-energy-counter")


@dataclass(frozen=True)
class StepMeasurement:
    """What training steps took, measured (not modelled) while the plan ran: Zeus's
    ``Measurement`` (time in s, energy in J per GPU and in total) of one step, averaged
    over ``steps`` consecutive steps from ``first_step`` (counted from the process's first
    step). ``time_s`` is this rank's, from one step's start to the next's;
    ``gpu_energy_j`` holds, by rank, each GPU's energy per step: this rank's, and every
    rank's once all of the job's ranks told theirs (``runtime.step_meter``)."""

    first_step: int
    steps: int
    time_s: float
    gpu_energy_j: tuple[tuple[int, float], ...]  # (rank, J per step), by rank
    rank: int
    world_size: int
    method: str  # how energy was read ("nvml-energy-counter")

    @property
    def energy_j(self) -> float:
        """This rank's GPU's energy per step."""
        return dict(self.gpu_energy_j)[self.rank]

    @property
    def total_energy_j(self) -> float | None:
        """Every GPU of the job's energy per step, summed; None until each rank told its."""
        if len(self.gpu_energy_j) < self.world_size:
            return None
        return sum(j for _, j in self.gpu_energy_j)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> StepMeasurement:
        """The record from what ``dataclasses.asdict`` made of it (lists for tuples)."""
        return cls(raw["first_step"], raw["steps"], raw["time_s"],
                   tuple((rank, joules) for rank, joules in raw["gpu_energy_j"]),
                   raw["rank"], raw["world_size"], raw["method"])


Resources = Mapping[str, int | None]
"""SM (CTA) cap per collective, keyed by the name of its issuing node in ``Workload.gm``
(e.g. "all_reduce_3"); a missing key or None means the library's default."""


class Device(abc.ABC):
    """A GPU the profiler can measure on and whose SM clock a controller can set."""

    name: str

    controls_clocks: ClassVar[bool] = False
    """Whether the ``kareus::set_clock`` calls of compiled graphs running in this process
    should drive :meth:`clock_controller`: true only for a device that is the GPU this
    process runs on. A model's controller only records switches for planning."""

    models_resources: ClassVar[bool] = False
    """Whether :meth:`measure` applies SM caps given as ``resources`` (a model). A real GPU
    caps a collective only through a capped communicator the runtime creates."""

    costs_graphs: ClassVar[bool] = False
    """Whether :meth:`estimate_at` costs a whole graph without running it (a model); a
    device that cannot has its graphs measured at their first call (``planner.measured``)."""

    deterministic: ClassVar[bool] = False
    """Whether measuring the same workload again gives the same answer (a model): the
    measurement protocol then measures once instead of repeating."""

    @property
    def identity(self) -> str:
        """What makes two devices' measurements interchangeable (a profile store key): the
        GPU model, not which one of a node's GPUs."""
        return self.name

    @property
    def model_version(self) -> str | None:
        """The model its measurements come from (``Measurement.model_version``); None for
        real hardware."""
        return None

    @abc.abstractmethod
    def supported_clocks(self) -> tuple[int, ...]:
        """Every SM clock (MHz) the device accepts, descending."""

    @abc.abstractmethod
    def search_clocks(self) -> tuple[int, ...]:
        """The SM clocks (MHz) searched by default, descending; the first is the default clock."""

    @property
    @abc.abstractmethod
    def static_power_w(self) -> float:
        """Power drawn while on and blocked (P_static of E_eff = E - P_static * t)."""

    @abc.abstractmethod
    def measure(
        self, workload: Workload, clock_mhz: int, *, resources: Resources | None = None
    ) -> Measurement:
        """Time and energy of one execution of ``workload`` at ``clock_mhz``.

        ``resources`` caps the SMs of individual collectives (see :data:`Resources`).
        Raises ``UnsupportedClockError`` for a clock the device does not accept and
        ``UnsupportedMeasurementError`` for a cap it cannot apply.
        """

    def measure_batch(
        self, workloads: Sequence[Workload], clock_mhz: int,
        agree: Callable[[int], int] | None = None,
        resources: Sequence[Resources | None] | None = None,
    ) -> list[Measurement]:
        """Each of ``workloads`` at ``clock_mhz``, in their order, with its SM caps from
        ``resources`` (None: none): what :meth:`measure` gives one by one, where a device
        measures them no better together. A GPU whose energy counter integrates runs them
        interleaved and recovers each one's energy from the counter's readings
        (``nvml.multiplex``), the clock switched once. ``agree`` (``Workload.agree``) is
        the batch's, where ranks run it together: every decision that changes what runs
        goes through it, in the same order on every rank."""
        caps = list(resources) if resources is not None else [None] * len(workloads)
        return [self.measure(w if agree is None else replace(w, agree=agree), clock_mhz,
                             resources=r)
                for w, r in zip(workloads, caps, strict=True)]

    def probe_counter(self, cache: Any = None) -> None:
        """Find how the device's energy counter behaves before measuring on it (a GPU's:
        seconds, once per GPU model and driver, kept in ``cache``, the profile store:
        ``ProfileStore.counter``/``record_counter``); a model has nothing to probe."""

    @property
    def estimates_error(self) -> bool:
        """Whether :meth:`measure_batch` repeats what it needs itself and states each
        estimate's error (``details["error"]``, relative): the measurement protocol then
        takes one answer instead of repeating windows (``profiler.measure``)."""
        return False

    def check(self, workload: Workload, clock_mhz: int) -> Measurement:
        """``workload`` at ``clock_mhz`` measured independently of :meth:`measure_batch`,
        with long windows: what a plan's chosen points are checked against."""
        return self.measure(workload, clock_mhz)

    def estimate(self, gm: torch.fx.GraphModule, world_size: int = 1) -> Measurement | None:
        """Time and energy of one execution of ``gm`` at the default clock (the first
        search clock), from its tensor metadata alone: None where the device can only
        measure by running the graph (a real GPU)."""
        return None

    def estimate_at(
        self, gm: torch.fx.GraphModule, clocks: Sequence[int], world_size: int = 1
    ) -> dict[int, Measurement] | None:
        """:meth:`estimate` at each of ``clocks``: what the planner costs a whole graph with
        (its compute outside the profiled partitions); None where the device cannot."""
        return None

    @property
    def clock_limitation(self) -> str | None:
        """Why this device cannot set the clocks it supports, in one sentence that says how
        to allow it; its :meth:`search_clocks` is then the default clock alone, so a plan
        changes overlap only. None: clocks can be set (or are modelled)."""
        return None

    def read_energy(self) -> EnergyReading | None:
        """The device's timer and energy counter now, read once the work queued on it has
        run (on CUDA: after a synchronize): the two ends of a measured window of training
        steps (``runtime.step_meter``). None: the device measures nothing while training
        runs (a model, or a GPU without an energy counter)."""
        return None

    @property
    def min_window_s(self) -> float:
        """The shortest window whose energy :meth:`read_energy` tells well (a GPU's counter
        updates every 20-100 ms); 0 where it tells none."""
        return 0.0

    @property
    def clock_switch_s(self) -> float:
        """How long the GPU stalls when its clock changes (a plan pays it per switch)."""
        return 0.0

    @property
    def power_limit_w(self) -> float | None:
        """The board's power limit (Zeus's P_max for an energy-time trade-off); None where
        unknown."""
        return None

    @abc.abstractmethod
    def clock_controller(self) -> ClockController:
        """The controller the ``kareus::set_clock`` op drives on this device."""
