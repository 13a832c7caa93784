"""The ``options={...}`` of ``torch.compile(..., backend="kareus")``, parsed and checked.

Every key is declared once in ``KareusOptions`` with its accepted values (field metadata:
``choices``, or ``validate`` and ``accepted``, or ``type``; ``doc``; ``plans: False`` where
the option does not change what a plan chooses); anything else is rejected with one message
that names the key, the bad value and what is accepted, before any graph is touched. The
options then yield their typed parts once: the lowering, the profiler's settings, the
budget, the counts a plan chooses among, the plan given, and whether graphs are planned.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kareus.errors import KareusError
from kareus.planner.budget import Budget, BudgetError

if TYPE_CHECKING:
    from kareus.planner.plan import Plan
    from kareus.profiler.measure import Protocol
    from kareus.profiler.profile import Settings


class KareusOptionError(KareusError, ValueError):
    """An option given to the kareus backend is unknown, of the wrong type or out of range."""


@dataclass(frozen=True)
class KareusOptions:
    lowering: str = dataclasses.field(
        default="inductor",
        metadata={
            "plans": False,
            "choices": ("inductor", "eager"),
            "doc": "how each graph is lowered: Inductor code generation, or run op by op",
        },
    )
    device: str = dataclasses.field(
        default="auto",
        metadata={
            "validate": lambda value: _device_problem(value),
            "accepted": '"auto" | "nvml" | "nvml-dry-run" | "sim:<preset>" '
            "| a custom GPU .json path",
            "doc": "the GPU whose clocks kareus controls and whose time and energy it measures "
            "or models; auto: this GPU through NVML, else the simulated default",
        },
    )
    nanobatches: int | str = dataclasses.field(
        default=1,
        metadata={
            "choices": (1, 2, 4, "auto"),
            "doc": "split every graph where it is safe into this many nanobatches (1: no "
            "rewrite; auto: the plan picks the count per graph); with profiling on, the plan "
            "picks each partition's launch slot and resources and each graph's clock, else "
            "every collective is issued at its earliest slot",
        },
    )
    agreement_timeout_s: float = dataclasses.field(
        default=120.0,
        metadata={
            "plans": False,
            "validate": lambda value: _timeout_problem(value),
            "accepted": "a number of seconds > 0",
            "doc": "how long a rank waits, while compiling a graph, for the other ranks of its "
            "collectives to confirm the same rewrite before it runs that graph unrewritten",
        },
    )
    profile: str = dataclasses.field(
        default="auto",
        metadata={
            "plans": False,
            "choices": ("auto", "off", "refresh"),
            "doc": "search each distinct partition of a rewritten graph for its time-energy "
            "frontier on the device; auto: reuse what the profile store holds, refresh: "
            "measure again and replace it, off: no profiling",
        },
    )
    search_budget: int = dataclasses.field(
        default=32,
        metadata={
            "validate": lambda value: _count_problem(value),
            "accepted": "an integer >= 1",
            "doc": "the most variants measured per distinct partition (the search may stop "
            "earlier once the frontier stops improving)",
        },
    )
    profile_budget_s: float | None = dataclasses.field(
        default=None,
        metadata={
            "plans": False,
            "validate": lambda value: None if value is None else _timeout_problem(value),
            "accepted": "None | a number of GPU-seconds > 0",
            "doc": "the most GPU-seconds this rank spends measuring (partitions and whole "
            "graphs; a simulated GPU counts what a real one would take). Once spent, nothing "
            "more is measured: a partition not searched yet runs at its earliest slot, a graph "
            "not measured yet is not planned and runs as the options say at the default clock",
        },
    )
    search: str = dataclasses.field(
        default="bayesian",
        metadata={
            "choices": ("bayesian", "grid"),
            "doc": "how a partition is searched: bayesian: multi-objective Bayesian "
            "optimisation within search_budget; grid: every variant, search_budget aside "
            "(slots x SMs x clocks measurements: instant on a simulated GPU, seconds each on "
            "a real one)",
        },
    )
    seed: int = dataclasses.field(
        default=0,
        metadata={
            "type": int,
            "doc": "seeds the search's random start and surrogate: the same seed, store and "
            "device give the same frontiers",
        },
    )
    cache_dir: str | None = dataclasses.field(
        default=None,
        metadata={
            "plans": False,
            "validate": lambda value: _directory_problem(value),
            "accepted": "None | a directory path",
            "doc": "where the profile store lives (None: $KAREUS_CACHE_DIR, else "
            "$XDG_CACHE_HOME/kareus, else ~/.cache/kareus); must be a local filesystem",
        },
    )
    energy_budget: float | str | None = dataclasses.field(
        default=None,
        metadata={
            "validate": lambda value: _budget_problem(energy_budget=value),
            "accepted": 'None | a fraction of the baseline\'s step energy (0.9) | an energy '
            'per step ("350 J", "2 kJ")',
            "doc": "run the fastest plan whose step energy fits (baseline: default clocks, no "
            "rewrite)",
        },
    )
    time_budget: float | str | None = dataclasses.field(
        default=None,
        metadata={
            "validate": lambda value: _budget_problem(time_budget=value),
            "accepted": 'None | a fraction of the baseline\'s step time (1.05) | a time per '
            'step ("1.2 s", "800 ms")',
            "doc": "run the least-energy plan whose step time fits",
        },
    )
    energy_time_tradeoff: float | None = dataclasses.field(
        default=None,
        metadata={
            "validate": lambda value: _budget_problem(energy_time_tradeoff=value),
            "accepted": "None | a number in [0, 1]",
            "doc": "run the plan of least eta * energy + (1 - eta) * P_max * time (Zeus's "
            "eta); without any budget: the least energy no slower than the fastest plan",
        },
    )
    microbatches: int = dataclasses.field(
        default=1,
        metadata={
            "validate": lambda value: _count_problem(value),
            "accepted": "an integer >= 1",
            "doc": "forward and backward passes per optimizer step (gradient accumulation): "
            "a budget given per step is met by that many of them",
        },
    )
    pipeline_schedule: str | None = dataclasses.field(
        default=None,
        metadata={
            "choices": (None, "1f1b", "gpipe"),
            "doc": "the schedule a pipeline stage runs under, where kareus cannot tell it from "
            "the schedule object (a schedule class of your own that runs 1F1B or GPipe); "
            "torch's Schedule1F1B, ScheduleGPipe and ScheduleInterleaved1F1B are found "
            "without it",
        },
    )
    plan: str | None = dataclasses.field(
        default=None,
        metadata={
            "plans": False,
            "validate": lambda value: _directory_problem(value),
            "accepted": "None | a plan JSON path",
            "doc": "run the choices of a plan kareus wrote (kareus.current_plan(), the cache "
            "directory's plans/) instead of planning; refused for graphs it was not made for",
        },
    )
    verify: bool = dataclasses.field(
        default=False,
        metadata={
            "plans": False,
            "type": bool,
            "doc": "check the first run of every newly chosen rewrite against the unrewritten "
            "graph (outputs, and so gradients); a mismatch runs that graph unrewritten",
        },
    )
    explain: bool = dataclasses.field(
        default=False,
        metadata={
            "plans": False,
            "type": bool,
            "doc": "print a table of the collectives and partitions of every compiled graph",
        },
    )

    def __post_init__(self) -> None:
        # However the options are built (from a dict, or directly), a bad value fails here.
        for f in dataclasses.fields(self):
            _check(f, getattr(self, f.name))
        problem = _budget_problem(self.energy_budget, self.time_budget, self.energy_time_tradeoff)
        if problem:
            raise KareusOptionError(f"kareus options: {problem}")
        self.check_planning()

    def check_planning(self, policy_in_code: bool = False) -> None:
        """Refuse what asks the plan for something no plan is made for: a budget or
        ``nanobatches="auto"`` without profiling, beside a given plan, or beside a chooser
        or clock given in code (``policy_in_code``), which replace the plan; and, beside a
        given plan, what it would silently override: a nanobatch count, a chooser or a
        clock given in code."""
        asks = [name for name, given in (("a budget", self.budget.kind != "fastest"),
                                         ('nanobatches="auto"', self.nanobatches == "auto"))
                if given]
        why = (
            'profile="off" (planning needs the profiles)' if self.profile == "off"
            else f"plan={self.plan!r} (it says what runs)" if self.plan is not None
            else "a chooser or clock_mhz given in code (it replaces the plan)" if policy_in_code
            else None
        )
        if asks and why:
            raise KareusOptionError(
                f"kareus options: {' and '.join(asks)} {'needs' if len(asks) == 1 else 'need'} "
                f"a plan, and none is made with {why}"
            )
        overridden = [name for name, given in (
            (f"nanobatches={self.nanobatches!r}", self.nanobatches not in (1, "auto")),
            ("a chooser or clock_mhz given in code", policy_in_code),
        ) if given]
        if self.plan is not None and overridden:
            raise KareusOptionError(
                f"kareus options: {' and '.join(overridden)} and plan={self.plan!r} contradict: "
                "the plan says each graph's nanobatch count, variant and clock; give one"
            )

    def check_plan(self, plan: Plan) -> None:
        """Refuse options the given ``plan`` contradicts: its step costs count the
        microbatches of the options it was made with."""
        made = plan.options.get("microbatches", 1)
        if made != self.microbatches:
            raise KareusOptionError(
                f"kareus options: microbatches={self.microbatches!r} and plan={self.plan!r}, "
                f"made with microbatches={made!r}, contradict: its step costs count {made!r} "
                f"passes a step; give microbatches={made!r}, or make a new plan"
            )

    @property
    def budget(self) -> Budget:
        """What the plan optimises for (``planner.budget``)."""
        return Budget.parse(self.energy_budget, self.time_budget, self.energy_time_tradeoff)

    def profiling(self, protocol: Protocol) -> Settings:
        """What the profiler is asked to do, its variants measured under ``protocol``."""
        from kareus.profiler.profile import Settings

        return Settings(self.profile, self.search_budget, self.seed, self.agreement_timeout_s,
                        protocol, self.search)

    @property
    def plan_counts(self) -> tuple[int, ...] | None:
        """The nanobatch counts a plan chooses among (None: each graph's own, "auto")."""
        return None if self.nanobatches == "auto" else (self.nanobatches,)

    @property
    def saved_pieces(self) -> int:
        """How many pieces the forward's saved values are handed to the backward in
        (``codegen.partitioner``): the nanobatches asked for; 2 where the plan chooses
        them ("auto", or a plan given), the method's count; 1 (whole) otherwise."""
        if self.nanobatches == "auto" or self.plan is not None:
            return 2
        return self.nanobatches

    def planning(self) -> dict[str, Any]:
        """The options that change what a plan chooses (a plan stored under other values of
        the rest serves)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.metadata.get("plans", True)}

    def plans(self, space: tuple[int, ...], *, policy_in_code: bool = False,
              pipelined: bool = False) -> bool:
        """Whether a graph whose nanobatch counts are ``space`` is planned: profiling on,
        no plan given, no chooser or clock given in code, something to choose (a count
        other than 1, a budget, or a pipeline stage's clocks: with one count and no
        budget, nothing else is asked of the plan), and a count the plan may choose
        applies to it."""
        counts = space if self.plan_counts is None else self.plan_counts
        return (not policy_in_code and self.plan is None and self.profile != "off"
                and (self.nanobatches != 1 or self.budget.kind != "fastest" or pipelined)
                and bool(set(counts) & set(space)))

    @classmethod
    def from_dict(cls, options: Mapping[str, Any] | None) -> KareusOptions:
        if options is None:
            return cls()
        if isinstance(options, KareusOptions):
            return options
        if not isinstance(options, Mapping):
            raise KareusOptionError(
                f"kareus options must be a dict, got {type(options).__name__}: {options!r}"
            )
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(str(k) for k in options if k not in fields)
        if unknown:
            raise KareusOptionError(
                f"unknown kareus option{'s' if len(unknown) > 1 else ''} "
                f"{', '.join(repr(k) for k in unknown)}; accepted options: "
                f"{', '.join(sorted(fields))}"
            )
        return cls(**options)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def describe(cls) -> dict[str, str]:
        """Option name -> what it does and what it accepts (for help texts)."""
        return {f.name: f"{f.metadata['doc']} ({_accepted(f)})" for f in dataclasses.fields(cls)}


def _device_problem(value: object) -> str | None:
    from kareus.devices.resolve import spec_problem

    return spec_problem(value)


def _budget_problem(
    energy_budget: object = None, time_budget: object = None, energy_time_tradeoff: object = None
) -> str | None:
    try:
        Budget.parse(energy_budget, time_budget, energy_time_tradeoff)
    except BudgetError as exc:
        return str(exc)
    return None


def _timeout_problem(value: object) -> str | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "not a number"
    return None if 0 < value < float("inf") else "must be finite and > 0"


def _count_problem(value: object) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return "not an integer"
    return None if value >= 1 else "must be >= 1"


def _directory_problem(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        return "not a string"
    if "\0" in value:
        return "holds a NUL byte, which no path can"
    return None if value.strip() else "empty"


def _accepted(f: dataclasses.Field) -> str:
    if "accepted" in f.metadata:
        return f.metadata["accepted"]
    if "choices" in f.metadata:
        return " | ".join(repr(c) for c in f.metadata["choices"])
    return f.metadata["type"].__name__


def _check(f: dataclasses.Field, value: Any) -> None:
    meta = f.metadata
    if "validate" in meta:
        problem = meta["validate"](value)
    elif "choices" in meta:
        ok = any(value == c and type(value) is type(c) for c in meta["choices"])
        problem = None if ok else ""
    else:
        problem = None if type(value) is meta["type"] else ""
    if problem is not None and "accepted:" in problem:  # says it all (a budget's parser)
        raise KareusOptionError(f"kareus option {f.name!r}: {problem.split(': ', 1)[-1]}")
    if problem is not None:
        raise KareusOptionError(
            f"kareus option {f.name!r}: got {value!r} ({type(value).__name__}); "
            f"{problem + '; ' if problem else ''}accepted: {_accepted(f)}"
        )

