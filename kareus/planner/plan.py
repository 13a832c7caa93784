"""The plan: which variant and clock each graph of a training step runs, and why.

A plan is made from the step's graph frontiers (``planner.graph``) and the user's budget
(``planner.budget``) once every graph of the step has been compiled; it is written as JSON
(every choice, the predicted step time and energy, the step frontier, the frequency-only
frontier and the baseline, the device, the options, the graph hashes, the kareus version)
and can be loaded back as the ``plan`` option, which refuses a plan made for other graphs.
Times and energies are per step and per GPU; every GPU of a symmetric group runs the same.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kareus.devices.base import Device
from kareus.errors import KareusError
from kareus.passes.decide import Choice
from kareus.planner.budget import Budget, choose
from kareus.planner.compose import StepPoint, clock_of, step_frontier
from kareus.planner.graph import GraphFrontier

PLAN_SCHEMA = 2  # 2: a graph's choice is one record, the default clock spelled 0


class PlanError(KareusError, ValueError):
    """A plan file that cannot be read, or that was made for other graphs."""


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
        c = raw["choice"]
        choice = Choice(c["nanobatches"], c["clock_mhz"],
                        tuple((slot, sms) for slot, sms in c["partitions"]))
        return cls(raw["label"], raw["graph_hash"], choice, raw["time_s"],
                   raw["effective_energy_j"])


@dataclass(frozen=True)
class StepCost:
    time_s: float
    energy_j: float


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
    schema: int = PLAN_SCHEMA

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
        return hashlib.sha256(json.dumps(choices).encode()).hexdigest()[:16]

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(self.to_json())
        tmp.replace(path)  # readers never see half a plan
        return path

    @classmethod
    def from_json(cls, text: str, source: str = "plan") -> Plan:
        try:
            raw = json.loads(text)
            if raw.get("schema") != PLAN_SCHEMA:
                raise PlanError(
                    f"{source}: plan schema {raw.get('schema')!r}, made by another kareus "
                    f"(this one reads schema {PLAN_SCHEMA}); make a new plan: run without "
                    "the plan option, with the same options, and use the plan it stores"
                )
            return cls(
                graphs=tuple(GraphPlan.from_dict(g) for g in raw["graphs"]),
                predicted=StepCost(**raw["predicted"]),
                baseline=StepCost(**raw["baseline"]),
                frontier=tuple(StepCost(**p) for p in raw["frontier"]),
                frequency_only=tuple(StepCost(**p) for p in raw["frequency_only"]),
                budget=Budget(**raw["budget"]),
                **{k: raw[k] for k in ("device", "model_version", "static_power_w", "options",
                                       "kareus_version", "schema")},
            )
        except PlanError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise PlanError(f"{source}: not a kareus plan ({type(exc).__name__}: {exc})") from exc

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise PlanError(f"cannot read the plan {path}: {exc}") from exc
        return cls.from_json(text, str(path))


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
