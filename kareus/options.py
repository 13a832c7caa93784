"""The ``options={...}`` of ``torch.compile(..., backend="kareus")``, parsed and checked.

Every key is declared once in ``KareusOptions`` with its accepted values (field metadata:
``choices``, or ``validate`` and ``accepted``, or ``type``; ``doc``; ``plans: False`` where
the option does not change what a plan chooses); anything else is rejected with one message
that names the key, the bad value and what is accepted, before any graph is touched. The
options then yield their typed parts once: the lowering, the profiler's settings, the
budget, the counts a plan chooses among, the plan given, and whether graphs are planned.

Options come from layers, each checked on its own so that an error names where the bad key
was given: torch.compile's ``mode`` (a preset), the file ``$KAREUS_OPTIONS_FILE`` (TOML or
JSON), the JSON object ``$KAREUS_OPTIONS``, then the code's ``options={...}``; a later layer
wins (a budget given in one replaces every budget of the layers below). A framework that
only names the backend (torchtitan's ``--compile.backend kareus``, a Trainer) thus still
passes options. ``sources`` says where each value came from.

Two defaults follow the others: where a plan is made (profiling on, no plan given, no
policy in code), ``nanobatches`` defaults to "auto" and the budget to ``time_budget=1.0``
(the least energy within the baseline's step time), so the name alone saves energy;
elsewhere to 1 and no budget, which is plain Inductor.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kareus.errors import KareusError
from kareus.planner.budget import Budget, BudgetError

if TYPE_CHECKING:
    from kareus.planner.plan import Plan
    from kareus.profiler.measure import Protocol
    from kareus.profiler.profile import Settings


class KareusOptionError(KareusError, ValueError):
    """An option given to the kareus backend is unknown, of the wrong type or out of range."""


OPTIONS_VARIABLE = "KAREUS_OPTIONS"
OPTIONS_FILE_VARIABLE = "KAREUS_OPTIONS_FILE"
CODE = "code"
DEFAULT_SOURCE = "default"
BUDGETS = ("energy_budget", "time_budget", "energy_time_tradeoff")

# torch.compile's modes, as kareus follows them: option values they preset (below any
# option given), or why a mode does not fit.
MODES: Mapping[str, Mapping[str, Any]] = {
    "default": {},
    "max-autotune": {"search_budget": 64, "autotune": True},
    "max-autotune-no-cudagraphs": {"search_budget": 64, "autotune": True},
}
REFUSED_MODES: Mapping[str, str] = {
    "reduce-overhead": "it replays CUDA graphs, which would replay kernels without the host "
    "calls that switch clocks and read energy",
}


class _Default:
    """The value of an option left unset; ``KareusOptions`` resolves it from the others."""

    def __repr__(self) -> str:
        return "<default>"


DEFAULT: Any = _Default()


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
    zeusd_socket: str | None = dataclasses.field(
        default=None,
        metadata={
            "plans": False,
            "validate": lambda value: _path_problem(value),
            "accepted": "None | a Unix socket path",
            "doc": "zeusd's socket: where NVML denies this process clock changes, they go "
            "through Zeus's privileged daemon there (None: $ZEUSD_SOCK_PATH, if set)",
        },
    )
    nanobatches: int | str = dataclasses.field(
        default=DEFAULT,
        metadata={
            "choices": (1, 2, 4, "auto"),
            "doc": "split every graph where it is safe into this many nanobatches (1: no "
            "rewrite; auto: the plan picks the count per graph); with profiling on, the plan "
            "picks each partition's launch slot and resources and each graph's clock, else "
            "every collective is issued at its earliest slot; default: auto where a plan is "
            "made, else 1",
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
        default=DEFAULT,
        metadata={
            "validate": lambda value: _budget_problem(time_budget=value),
            "accepted": 'None | a fraction of the baseline\'s step time (1.05) | a time per '
            'step ("1.2 s", "800 ms")',
            "doc": "run the least-energy plan whose step time fits; default: 1.0 where a plan "
            "is made and no other budget is given; None and no other budget: the fastest plan",
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
            "validate": lambda value: _path_problem(value),
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
            "doc": "print a table of the collectives and partitions of every compiled graph, "
            "and where each option came from",
        },
    )
    autotune: bool = dataclasses.field(
        default=False,
        metadata={
            "plans": False,
            "type": bool,
            "doc": "Inductor's max_autotune for every graph's kernels (what torch.compile's "
            'mode="max-autotune" sets)',
        },
    )

    def __post_init__(self) -> None:
        # However the options are built (from a dict, or directly), a bad value fails here.
        planned = self.profile != "off" and self.plan is None
        resolved = {
            "nanobatches": "auto" if planned else 1,
            "time_budget": 1.0 if planned and self.energy_budget is None
            and self.energy_time_tradeoff is None else None,
        }
        sources = {}
        for f in dataclasses.fields(self):
            if getattr(self, f.name) is DEFAULT:
                object.__setattr__(self, f.name, resolved[f.name])
                sources[f.name] = DEFAULT_SOURCE
            else:
                sources[f.name] = DEFAULT_SOURCE if getattr(self, f.name) == f.default else CODE
            _check(f, getattr(self, f.name))
        object.__setattr__(self, "_sources", sources)
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
    def budget_defaulted(self) -> bool:
        """Whether the budget is kareus's default, none given."""
        return all(self.sources[name] == DEFAULT_SOURCE for name in BUDGETS)

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

    @property
    def sources(self) -> Mapping[str, str]:
        """Option name -> where its value came from: "default", "code", a torch.compile
        mode, ``$KAREUS_OPTIONS`` or ``$KAREUS_OPTIONS_FILE (<path>)``."""
        return dict(self._sources)  # type: ignore[attr-defined]

    def given(self) -> dict[str, str]:
        """The options not left at their defaults, each as ``name=value (source)``."""
        return {name: f"{name}={getattr(self, name)!r} ({source})"
                for name, source in self.sources.items() if source != DEFAULT_SOURCE}

    @classmethod
    def from_dict(cls, options: Mapping[str, Any] | None) -> KareusOptions:
        """The options given in code alone (``resolve`` adds the environment's)."""
        if isinstance(options, KareusOptions):
            return options
        return cls._layered([(CODE, {} if options is None else options)])

    @classmethod
    def resolve(
        cls,
        options: KareusOptions | Mapping[str, Any] | None = None,
        *,
        mode: str | None = None,
        environ: Mapping[str, str] | None = None,
        policy_in_code: bool = False,
    ) -> KareusOptions:
        """The options a backend is built with: torch.compile's ``mode``, then
        ``$KAREUS_OPTIONS_FILE``, ``$KAREUS_OPTIONS`` (of ``environ``, default
        ``os.environ``), then ``options`` given in code, each later layer winning.
        ``policy_in_code``: a chooser or clock given in code replaces the plan, so the
        defaults are those of no plan. A ``KareusOptions`` given is taken as it is."""
        if isinstance(options, KareusOptions):
            return options
        environ = os.environ if environ is None else environ
        layers = [(f"torch.compile mode={mode!r}", _mode_options(mode))]
        layers += _environment_layers(environ)
        layers.append((CODE, {} if options is None else options))
        if policy_in_code:
            layers.insert(0, (DEFAULT_SOURCE, {"nanobatches": 1, "time_budget": None}))
        return cls._layered(layers)

    @classmethod
    def _layered(cls, layers: list[tuple[str, Any]]) -> KareusOptions:
        """Options from ``layers`` (source, mapping), each checked alone, later ones
        winning; a budget replaces the budgets below it."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        merged: dict[str, Any] = {}
        sources: dict[str, str] = {}
        for source, given in layers:
            where = "" if source == CODE else f"{source}: "
            if not isinstance(given, Mapping):
                raise KareusOptionError(
                    f"{where}kareus options must be a dict, got {type(given).__name__}: "
                    f"{given!r}"
                )
            unknown = sorted(str(k) for k in given if k not in fields)
            if unknown:
                raise KareusOptionError(
                    f"{where}unknown kareus option{'s' if len(unknown) > 1 else ''} "
                    f"{', '.join(repr(k) for k in unknown)}; accepted options: "
                    f"{', '.join(sorted(fields))}"
                )
            for name, value in given.items():
                try:
                    _check(fields[name], value)
                except KareusOptionError as exc:
                    raise KareusOptionError(f"{where}{exc}") from None
            if any(name in given for name in BUDGETS):
                for name in BUDGETS:
                    merged.pop(name, None)
                    sources.pop(name, None)
            merged.update(given)
            sources.update(dict.fromkeys(given, source))
        try:
            options = cls(**merged)
        except KareusOptionError as exc:
            given = ", ".join(f"{name} ({source})" for name, source in sources.items()
                              if source not in (CODE, DEFAULT_SOURCE))
            raise KareusOptionError(f"{exc}{f'; given: {given}' if given else ''}") from None
        object.__setattr__(options, "_sources", {**options.sources, **sources})
        return options

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def describe(cls) -> dict[str, str]:
        """Option name -> what it does and what it accepts (for help texts)."""
        return {f.name: f"{f.metadata['doc']} ({_accepted(f)})" for f in dataclasses.fields(cls)}


def _mode_options(mode: object) -> Mapping[str, Any]:
    """The option values torch.compile's ``mode`` presets, or why kareus refuses it."""
    if mode is None:
        return {}
    if mode in REFUSED_MODES:
        raise KareusOptionError(f"torch.compile mode {mode!r} does not fit kareus: "
                                f"{REFUSED_MODES[mode]}; accepted: {', '.join(map(repr, MODES))}")
    if mode not in MODES:
        raise KareusOptionError(f"torch.compile mode {mode!r} is none kareus knows; accepted: "
                                f"{', '.join(map(repr, MODES))}")
    return MODES[mode]


def _environment_layers(environ: Mapping[str, str]) -> list[tuple[str, Any]]:
    """The options of ``$KAREUS_OPTIONS_FILE`` and ``$KAREUS_OPTIONS``, each named."""
    layers = []
    path = environ.get(OPTIONS_FILE_VARIABLE, "").strip()
    if path:
        source = f"${OPTIONS_FILE_VARIABLE} ({path})"
        layers.append((source, _read_options_file(Path(path), source)))
    text = environ.get(OPTIONS_VARIABLE, "")
    if text.strip():
        layers.append((f"${OPTIONS_VARIABLE}", _parse_json(text, f"${OPTIONS_VARIABLE}")))
    return layers


def _read_options_file(path: Path, source: str) -> Any:
    """A TOML file (by its ``.toml`` suffix) or else a JSON one."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise KareusOptionError(f"{source}: cannot read it: {exc.strerror or exc}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise KareusOptionError(f"{source}: not UTF-8 text (byte {exc.start}; a binary "
                                "file?)") from None
    if path.suffix.lower() != ".toml":
        return _parse_json(text, source)
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise KareusOptionError(f"{source}: not valid TOML: {exc}") from None


def _parse_json(text: str, source: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise KareusOptionError(
            f"{source}: not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None


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


def _path_problem(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        return "not a string"
    if "\0" in value:
        return "holds a NUL byte, which no path can"
    return None if value.strip() else "empty"


def _directory_problem(value: object) -> str | None:
    problem = _path_problem(value)
    if problem is not None or value is None:
        return problem
    path = Path(str(value)).expanduser()
    if path.exists() and not path.is_dir():
        return f"{str(path)!r} is a file, not a directory (the profile store goes in one)"
    return None


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

