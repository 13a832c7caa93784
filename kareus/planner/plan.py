"""The plan: which variant and clock each graph of a training step runs, and why.

A plan is made from the step's graph frontiers (``planner.graph``) and the user's budget
(``planner.budget``) once every graph of the step has been compiled; it is written as JSON
(every choice, the predicted step time and energy, the step frontier, the frequency-only
frontier and the baseline, the device, the options, the graph hashes, the kareus version)
and can be loaded back as the ``plan`` option, which refuses a plan made for other graphs.
Times and energies are per step and per GPU; every GPU of a symmetric group runs the same.

Once the plan runs on a GPU that reads energy (NVML), ``measured`` holds what its steps
really took there (``runtime.step_meter``): the plan that ``kareus.current_plan()`` names
carries the latest window's measurement, and rank 0 stores it with the plan, so that
``kareus show`` prints it beside the prediction. A measurement is no part of the decision:
the digest the ranks agree on leaves it out, a plan given as the ``plan`` option (or found
stored) runs without the measurement of the run that stored it, and a simulated device
measures nothing (its plan's ``measured`` stays None: every cost of it is modelled). It
lives in the plan rather than beside it because it means nothing without the prediction
it is read against, and one record keeps the two together in the process, in the file
and in what shows it.

A pipeline's plan (``pipeline`` set) is a choice per instruction (stage, microbatch,
forward | backward: a clock and each of its graphs' variants), planned over the
iteration's DAG (``planner.pipeline``); its costs are per iteration of one pipeline
replica, energies summed over its GPUs, and ``graphs`` holds what a call outside any
instruction runs (each graph's choice in the first instruction that runs it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import reprlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kareus.devices.base import Device, StepMeasurement
from kareus.errors import KareusError
from kareus.passes.decide import Choice
from kareus.passes.ops import DEFAULT_CLOCK_MHZ
from kareus.passes.variants import NANOBATCH_COUNTS, VariantError, VariantSpace
from kareus.planner.budget import Budget, choose
from kareus.planner.compose import StepPoint, clock_of, step_frontier
from kareus.planner.graph import GraphFrontier

PIPELINE_SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b")
PLAN_SCHEMA = 4
"""2: a graph's choice is one record, the default clock spelled 0; 3: pipelines; 4: the
steps measured while it ran (``measured``)."""
READ_SCHEMAS = (3, PLAN_SCHEMA)  # a schema-3 plan is a schema-4 one that measured nothing


class PlanError(KareusError, ValueError):
    """A plan file that cannot be read, or that was made for other graphs or another device."""


@dataclass(frozen=True)
class GraphPlan:
    """One graph's choice and what it is predicted to cost (per GPU)."""

    label: str
    graph_hash: str
    choice: Choice
    time_s: float
    effective_energy_j: float

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> GraphPlan:
        return cls(raw["label"], raw["graph_hash"], _choice(raw["choice"]), raw["time_s"],
                   raw["effective_energy_j"])


@dataclass(frozen=True)
class StepCost:
    time_s: float
    energy_j: float


@dataclass(frozen=True)
class PipelineLayout:
    """What the pipeline's plan was made for: its schedule ("1f1b", "gpipe",
    "interleaved_1f1b"), its stages (all ranks'), the ranks they run on, the microbatches of
    an iteration."""

    schedule: str
    stages: int
    ranks: int
    microbatches: int


@dataclass(frozen=True)
class InstructionGraph:
    """A graph an instruction runs, how many times (per-block compilation: once per
    layer), and its choice there (at the instruction's clock)."""

    label: str
    graph_hash: str
    calls: int
    choice: Choice

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> InstructionGraph:
        return cls(raw["label"], raw["graph_hash"], raw["calls"], _choice(raw["choice"]))


@dataclass(frozen=True)
class InstructionPlan:
    """One instruction of the iteration: its clock, its graphs' choices, and when it is
    predicted to start and how long it takes (seconds from the iteration's start), with its
    energy above static (summed over its stage's GPUs)."""

    stage: int
    microbatch: int
    kind: str  # "forward" | "backward"
    clock_mhz: int
    graphs: tuple[InstructionGraph, ...]
    start_s: float
    time_s: float
    effective_energy_j: float

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> InstructionPlan:
        return cls(raw["stage"], raw["microbatch"], raw["kind"], raw["clock_mhz"],
                   tuple(InstructionGraph.from_dict(g) for g in raw["graphs"]),
                   raw["start_s"], raw["time_s"], raw["effective_energy_j"])

    def choice_of(self, graph_hash: str) -> Choice | None:
        """What the graph of this hash runs in this instruction (None: not one of its)."""
        return next((g.choice for g in self.graphs if g.graph_hash == graph_hash), None)


def _choice(c: Mapping[str, Any]) -> Choice:
    return Choice(c["nanobatches"], c["clock_mhz"],
                  tuple((slot, sms) for slot, sms in c["partitions"]))


@dataclass(frozen=True)
class Plan:
    graphs: tuple[GraphPlan, ...]
    predicted: StepCost
    baseline: StepCost  # every graph unrewritten at the default clock
    frontier: tuple[StepCost, ...]  # the step's, fastest first
    frequency_only: tuple[StepCost, ...]  # unrewritten graphs, a clock each
    budget: Budget
    device: str
    model_version: str | None
    static_power_w: float
    options: dict[str, Any]
    kareus_version: str
    pipeline: PipelineLayout | None = None
    instructions: tuple[InstructionPlan, ...] = ()
    measured: StepMeasurement | None = None  # on this rank, from the latest window
    option_sources: dict[str, str] = dataclasses.field(default_factory=dict)
    """The options the run that made the plan was given, each with where from ("code",
    "$KAREUS_OPTIONS", ...; the rest were defaults)."""
    schema: int = PLAN_SCHEMA

    def instruction(self, stage: int, microbatch: int, kind: str) -> InstructionPlan | None:
        """The plan of one instruction of the pipeline (None: none such is planned)."""
        index = self.__dict__.get("_index")
        if index is None:  # built once: a graph looks its instruction up at every call
            index = {(i.stage, i.microbatch, i.kind): i for i in self.instructions}
            object.__setattr__(self, "_index", index)
        return index.get((stage, microbatch, kind))

    def match(self, label: str, graph_hash: str, kind: str) -> GraphPlan | None:
        """The choice for a compiled graph: by label, else by hash and kind (another
        process may number regions otherwise); a ``PlanError`` naming both hashes where
        the plan has graphs of this kind but none made for this one; None where it has
        none of this kind."""
        entry = next((g for g in self.graphs if g.label == label), None)
        if entry is None or entry.graph_hash != graph_hash:
            entry = self.graph_like(graph_hash, kind) or entry
        if entry is None:
            of_kind = [g for g in self.graphs if g.label.endswith("/" + kind)]
            if not of_kind:
                return None
            entry = of_kind[0]
        if entry.graph_hash != graph_hash:
            raise PlanError(
                f"the plan was made for another graph {entry.label}: its hash is "
                f"{entry.graph_hash}, this graph ({label})'s is {graph_hash} (a different "
                "model, shapes or parallel plan); make a new plan (drop the plan option)"
            )
        return entry

    def graph_like(self, graph_hash: str, kind: str) -> GraphPlan | None:
        """The choice for a graph of this hash and kind, whatever its label (regions are
        numbered in compile order, which another run or process need not repeat)."""
        return next((g for g in self.graphs if g.graph_hash == graph_hash
                     and g.label.endswith("/" + kind)), None)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @property
    def digest(self) -> str:
        """What identifies the choices (ranks compare it to agree on one plan)."""
        choices = [(g.label, g.graph_hash, dataclasses.astuple(g.choice)) for g in self.graphs]
        choices += [dataclasses.astuple(i)[:5] for i in self.instructions]
        return hashlib.sha256(json.dumps(choices).encode()).hexdigest()[:16]

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        # One temporary name per process: the ranks of one machine share a cache directory.
        tmp = path.with_suffix(f"{path.suffix}.{os.getpid()}.tmp")
        tmp.write_text(self.to_json())
        tmp.replace(path)  # readers never see half a plan
        return path

    @classmethod
    def from_json(cls, text: str, source: str = "plan") -> Plan:
        """The plan ``text`` holds, checked field by field (``source`` names it in errors):
        a ``PlanError`` naming the source and the field where it is none."""
        try:
            raw = json.loads(text)
        except (ValueError, RecursionError) as exc:  # ValueError: JSONDecodeError, huge ints
            raise PlanError(f"{source}: not a kareus plan: not JSON ({exc})") from exc
        _check_plan(raw, source)
        return cls(
            graphs=tuple(GraphPlan.from_dict(g) for g in raw["graphs"]),
            predicted=StepCost(**raw["predicted"]),
            baseline=StepCost(**raw["baseline"]),
            frontier=tuple(StepCost(**p) for p in raw["frontier"]),
            frequency_only=tuple(StepCost(**p) for p in raw["frequency_only"]),
            budget=Budget(**raw["budget"]),
            pipeline=None if raw["pipeline"] is None else PipelineLayout(**raw["pipeline"]),
            instructions=tuple(InstructionPlan.from_dict(i) for i in raw["instructions"]),
            measured=None if raw.get("measured") is None else StepMeasurement.from_dict(
                raw["measured"]),
            option_sources=dict(raw.get("option_sources", {})),
            **{k: raw[k] for k in ("device", "model_version", "static_power_w", "options",
                                   "kareus_version")},
        )

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        try:
            data = Path(path).read_bytes()
        except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
            raise PlanError(f"cannot read the plan {path}: {exc}") from exc
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise PlanError(
                f"{path}: not a kareus plan: not UTF-8 text (byte {exc.start} is "
                f"{data[exc.start:exc.start + 1]!r}; a binary file?)"
            ) from exc
        return cls.from_json(text, str(path))

    def check_device(self, device: Device, source: str) -> None:
        """Refuse to run on another device, or another model of it, than the plan was made
        on: its choices and predicted costs hold only there (re-costing them needs the
        profiles the plan was made from)."""
        if (self.device, self.model_version) != (device.identity, device.model_version):
            raise PlanError(
                f"{source}: the plan was made on {_device_text(self.device, self.model_version)}"
                f", this is {_device_text(device.identity, device.model_version)}; make a new "
                "plan on this device (drop the plan option)"
            )

    def check_choice(self, entry: GraphPlan, space: VariantSpace, device: Device,
                     source: str) -> None:
        """Refuse ``entry``'s choice, and the instructions' choices of its graph, where one
        is no point of its graph's ``space`` or its clock one ``device`` does not support,
        naming ``source``, the graph and the field."""
        where = f"{source}: graphs[{self.graphs.index(entry)}] ({entry.label}).choice"
        _check_choice(where, entry.choice, space, device)
        for n, instruction in enumerate(self.instructions):
            for m, g in enumerate(instruction.graphs):
                if g.graph_hash == entry.graph_hash:
                    _check_choice(f"{source}: instructions[{n}].graphs[{m}] ({g.label}).choice",
                                  g.choice, space, device)

    def check_layout(self, stages: int, ranks: int, microbatches: int, schedule: str,
                     source: str) -> None:
        """Refuse a pipeline's plan made for another pipeline than the one that runs."""
        runs = PipelineLayout(schedule, stages, ranks, microbatches)
        if self.pipeline is not None and self.pipeline != runs:
            raise PlanError(
                f"{source}: the plan was made for another pipeline ({_layout_text(self.pipeline)})"
                f" than this one ({_layout_text(runs)}); make a new plan (drop the plan option)"
            )


def _layout_text(layout: PipelineLayout) -> str:
    return (f"{layout.schedule}, {layout.stages} stages on {layout.ranks} ranks, "
            f"{layout.microbatches} microbatches")


def _check_choice(where: str, choice: Choice, space: VariantSpace, device: Device) -> None:
    """Refuse ``choice`` where it is no point of ``space`` or its clock one ``device`` does
    not support, naming ``where`` and the field."""
    clocks = device.supported_clocks()
    if choice.clock_mhz != DEFAULT_CLOCK_MHZ and choice.clock_mhz not in clocks:
        supported = (f"its {len(clocks)} clocks run from {max(clocks)} down to "
                     f"{min(clocks)} MHz" if clocks else "it reports none")
        raise PlanError(
            f"{where}.clock_mhz: {device.name} does not support {choice.clock_mhz} MHz "
            f"({supported}; {DEFAULT_CLOCK_MHZ}: the default clocks); make a new plan "
            "(drop the plan option)"
        )
    if choice.variant is None:
        return
    try:
        space.check(choice.variant)
    except VariantError as exc:
        field = "nanobatches" if choice.nanobatches not in space.nanobatches else "partitions"
        raise PlanError(
            f"{where}.{field}: not a variant of this graph: {exc}; make a new plan (drop "
            "the plan option)"
        ) from exc


def _device_text(identity: str, model_version: str | None) -> str:
    return identity + (f" (model {model_version})" if model_version else "")


# -- checking a plan file field by field ------------------------------------------------------

_Spec = "_Rule | _Nullable | dict[str, _Spec] | list[_Spec] | tuple[_Spec, ...]"
"""A rule; null or a spec; a JSON object of exactly these fields; a list of any length,
each item the one spec; a list of exactly these items (a tuple)."""


@dataclass(frozen=True)
class _Rule:
    """What one field accepts: ``test`` on its JSON value, and that in words."""

    test: Callable[[object], bool]
    accepted: str


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _finite(value: object) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer too large for a float
        return False


@dataclass(frozen=True)
class _Nullable:
    """A field that is null or what ``spec`` accepts."""

    spec: _Spec


_TEXT = _Rule(lambda v: isinstance(v, str) and v != "", "a non-empty string")
_AMOUNT = _Rule(lambda v: _finite(v) and v >= 0, "a finite number >= 0")
# Energy above the device's static power: below 0 where a measured GPU drew less than the
# static power assumed for it (a plan made on such a measurement must load back).
_EFFECTIVE = _Rule(_finite, "a finite number")
_POSITIVE = _Rule(lambda v: _finite(v) and v > 0, "a finite number > 0")
_COST = {"time_s": _AMOUNT, "energy_j": _AMOUNT}

_CHOICE = {
        "nanobatches": _Rule(lambda v: _integer(v) and v in NANOBATCH_COUNTS,
                             f"a nanobatch count (one of {', '.join(map(str, NANOBATCH_COUNTS))})"),
        "clock_mhz": _Rule(lambda v: _integer(v) and v >= 0, "a clock (an integer >= 0; "
                           f"{DEFAULT_CLOCK_MHZ}: the default clocks)"),
        # [launch slot, SMs] per partition
        "partitions": [(_Rule(lambda v: _integer(v) and v >= 0, "a launch slot (an integer >= 0)"),
                        _Rule(lambda v: v is None or (_integer(v) and v >= 1),
                              "a number of SMs (an integer >= 1; null: the library's default)"))],
}
_GRAPH = {
    "label": _TEXT,
    "graph_hash": _TEXT,
    "choice": _CHOICE,
    "time_s": _AMOUNT,
    "effective_energy_j": _EFFECTIVE,
}
_COUNT = _Rule(lambda v: _integer(v) and v >= 1, "an integer >= 1")
_INDEX = _Rule(lambda v: _integer(v) and v >= 0, "an integer >= 0")
_LAYOUT = {
    "schedule": _Rule(lambda v: v in PIPELINE_SCHEDULES,
                      f"one of {', '.join(map(repr, PIPELINE_SCHEDULES))}"),
    "stages": _COUNT,
    "ranks": _COUNT,
    "microbatches": _COUNT,
}
_INSTRUCTION_GRAPH = {"label": _TEXT, "graph_hash": _TEXT, "calls": _COUNT, "choice": _CHOICE}
_INSTRUCTION = {
    "stage": _INDEX,
    "microbatch": _INDEX,
    "kind": _Rule(lambda v: v in ("forward", "backward"), '"forward" or "backward"'),
    "clock_mhz": _CHOICE["clock_mhz"],
    "graphs": [_INSTRUCTION_GRAPH],
    "start_s": _AMOUNT,
    "time_s": _AMOUNT,
    "effective_energy_j": _EFFECTIVE,
}
_BUDGET = {
    "kind": _Rule(lambda v: v in ("fastest", "energy", "time", "tradeoff"),
                  'one of "fastest", "energy", "time", "tradeoff"'),
    "value": _Rule(lambda v: v is None or (_finite(v) and v >= 0),
                   "a finite number >= 0 (J, s or eta) or null"),
    "fraction": _Rule(lambda v: v is None or (_finite(v) and v > 0),
                      "a finite number > 0 (of the baseline's) or null"),
}
_MEASURED = {
    "first_step": _INDEX,
    "steps": _COUNT,
    "time_s": _AMOUNT,
    "gpu_energy_j": [(_INDEX, _AMOUNT)],  # [rank, J per step] per rank
    "rank": _INDEX,
    "world_size": _COUNT,
    "method": _TEXT,
}
_PLAN_3 = {  # "schema" is checked first: another schema's fields are another's
    "graphs": [_GRAPH],
    "predicted": _COST,
    "baseline": {"time_s": _POSITIVE, "energy_j": _POSITIVE},  # budgets are fractions of it
    "frontier": [_COST],
    "frequency_only": [_COST],
    "budget": _BUDGET,
    "device": _TEXT,
    "model_version": _Rule(lambda v: v is None or _TEXT.test(v), "a non-empty string or null"),
    "static_power_w": _AMOUNT,
    "options": _Rule(lambda v: isinstance(v, dict), "a JSON object"),
    "kareus_version": _TEXT,
    "pipeline": _Nullable(_LAYOUT),
    "instructions": [_INSTRUCTION],
}
_PLAN = {**_PLAN_3, "measured": _Nullable(_MEASURED), "option_sources": _Rule(
    lambda v: isinstance(v, dict) and all(isinstance(x, str) and x for x in v.values()),
    "a JSON object of non-empty strings")}
_PLANS = {3: _PLAN_3, PLAN_SCHEMA: _PLAN}
assert all(set(fields) == {f.name for f in dataclasses.fields(record)} for record, fields in (
    (Plan, {*_PLAN, "schema"}), (StepMeasurement, _MEASURED), (GraphPlan, _GRAPH),
    (Choice, _CHOICE), (StepCost, _COST), (Budget, _BUDGET), (PipelineLayout, _LAYOUT),
    (InstructionGraph, _INSTRUCTION_GRAPH), (InstructionPlan, _INSTRUCTION),
)), "every field of a plan needs a rule"
_BUDGET_FORMS = {  # kind -> which of (value, fraction) it gives
    "fastest": ((False, False),), "tradeoff": ((True, False),),
    "energy": ((True, False), (False, True)), "time": ((True, False), (False, True)),
}



def _check_plan(raw: object, source: str) -> None:
    """Refuse a plan's JSON that is not what ``Plan.to_json`` writes, naming the field."""
    if not isinstance(raw, dict) or "schema" not in raw:
        raise PlanError(f"{source}: not a kareus plan (no schema field in {reprlib.repr(raw)})")
    if not _integer(raw["schema"]) or raw["schema"] not in READ_SCHEMAS:
        raise PlanError(
            f"{source}: plan schema {raw['schema']!r}, made by another kareus (this one reads "
            f"schemas {' and '.join(map(str, READ_SCHEMAS))}); make a new plan: run without "
            "the plan option, with the same options, and use the plan it stores"
        )
    _check({k: v for k, v in raw.items() if k != "schema"}, _PLANS[raw["schema"]], "", source)
    measured = raw.get("measured")
    if measured is not None:
        ranks = [rank for rank, _ in measured["gpu_energy_j"]]
        if measured["rank"] not in ranks or len(set(ranks)) != len(ranks) or max(
                ranks) >= measured["world_size"]:
            raise PlanError(
                f"{source}: measured.gpu_energy_j: {reprlib.repr(ranks)} are not distinct "
                f"ranks below world_size {measured['world_size']} that include rank "
                f"{measured['rank']}"
            )
    _check_instructions(raw["pipeline"], raw["instructions"], source)
    budget = raw["budget"]
    given = (budget["value"] is not None, budget["fraction"] is not None)
    if given not in _BUDGET_FORMS[budget["kind"]] or (
            budget["kind"] == "tradeoff" and budget["value"] > 1):
        raise PlanError(
            f"{source}: budget: {reprlib.repr(budget)} is not a budget (fastest: neither a "
            "value nor a fraction; tradeoff: a value in [0, 1]; energy or time: a value or a "
            "fraction)"
        )


def _check_instructions(pipeline: Mapping[str, Any] | None, instructions: list[Any],
                        source: str) -> None:
    """Refuse a pipeline plan that does not hold every instruction of its layout once (each
    stage's forward and backward of every microbatch), and instructions without a
    pipeline: its predicted time and energy are those of the whole iteration."""
    found = [(i["stage"], i["microbatch"], i["kind"]) for i in instructions]
    if pipeline is None:
        if found:
            raise PlanError(f"{source}: instructions: {len(found)} without a pipeline layout "
                            "(pipeline is null)")
        return
    expected = {(stage, microbatch, kind) for stage in range(pipeline["stages"])
                for microbatch in range(pipeline["microbatches"])
                for kind in ("forward", "backward")}
    missing = sorted(expected - set(found))
    stray = sorted(set(found) - expected)
    twice = sorted({i for i in found if found.count(i) > 1})
    if missing or stray or twice:
        said = [f"{what} {len(which)}: {reprlib.repr(which)}" for what, which in
                (("missing", missing), ("outside the layout", stray), ("given twice", twice))
                if which]
        raise PlanError(
            f"{source}: instructions: a pipeline of {pipeline['stages']} stages and "
            f"{pipeline['microbatches']} microbatches runs {len(expected)} instructions (each "
            f"stage's forward and backward of every microbatch); the plan holds {len(found)}: "
            f"{'; '.join(said)} (stage, microbatch, kind)")


def _check(value: object, spec: _Spec, path: str, source: str) -> None:
    def refuse(what: str) -> PlanError:
        return PlanError(f"{source}: {path + ': ' if path else ''}{what}")

    if isinstance(spec, _Nullable):
        if value is not None:
            _check(value, spec.spec, path, source)
    elif isinstance(spec, _Rule):
        if not spec.test(value):
            raise refuse(f"{reprlib.repr(value)} is not {spec.accepted}")
    elif isinstance(spec, dict):
        if not isinstance(value, dict):
            raise refuse(f"{reprlib.repr(value)} is not a JSON object")
        missing = [k for k in spec if k not in value]
        unknown = sorted(str(k) for k in value if k not in spec)
        if missing or unknown:
            raise refuse("; ".join(
                f"{what} field{'s' if len(names) > 1 else ''} {', '.join(names)}"
                for what, names in (("missing", missing), ("unknown", unknown)) if names))
        for key, rule in spec.items():
            _check(value[key], rule, f"{path}.{key}" if path else key, source)
    elif not isinstance(value, list) or (isinstance(spec, tuple) and len(value) != len(spec)):
        raise refuse(f"{reprlib.repr(value)} is not a list"
                     + (f" of {len(spec)}" if isinstance(spec, tuple) else ""))
    else:
        for i, item in enumerate(value):
            _check(item, spec[i] if isinstance(spec, tuple) else spec[0], f"{path}[{i}]", source)


def make_plan(
    graphs: Sequence[GraphFrontier],
    budget: Budget,
    device: Device,
    options: Mapping[str, Any],
    kareus_version: str,
    microbatches: int = 1,
) -> Plan:
    """The step's plan: the frontier of running ``graphs`` in order ``microbatches`` times
    (gradient accumulation; clock switches priced by the device), the point ``budget``
    asks for (a ``BudgetError`` stating the range where none meets it), the baseline and
    the frequency-only frontier beside it."""
    static_w = device.static_power_w

    def switch(a: Choice, b: Choice) -> tuple[float, float]:
        # A stall: time at static power, no effective energy.
        return (device.clock_switch_s if a.clock_mhz != b.clock_mhz else 0.0), 0.0

    def frontier(per_graph: Sequence[Sequence]) -> list[StepPoint]:
        return step_frontier(per_graph, repeats=microbatches, static_power_w=static_w,
                             switch=switch, switch_key=clock_of)

    step = frontier([g.points for g in graphs])
    base_time = microbatches * sum(g.baseline.time_s for g in graphs)
    base_effective = microbatches * sum(g.baseline.effective_energy_j for g in graphs)
    baseline = StepPoint(base_time, base_effective + static_w * base_time, base_effective,
                         tuple(g.baseline.choice for g in graphs))
    chosen = choose(step, baseline, budget, device.power_limit_w or 0.0)
    entries = []
    for g, c in zip(graphs, chosen.graphs, strict=True):
        point = next(o for o in g.points if o.choice == c)
        entries.append(GraphPlan(g.label, g.graph_hash, c, point.time_s,
                                 point.effective_energy_j))
    return Plan(
        graphs=tuple(entries),
        predicted=StepCost(chosen.time_s, chosen.energy_j),
        baseline=StepCost(baseline.time_s, baseline.energy_j),
        frontier=tuple(StepCost(p.time_s, p.energy_j) for p in step),
        frequency_only=tuple(StepCost(p.time_s, p.energy_j)
                             for p in frontier([g.frequency_only for g in graphs])),
        budget=budget,
        device=device.identity,
        model_version=device.model_version,
        static_power_w=static_w,
        options=dict(options),
        kareus_version=kareus_version,
    )
