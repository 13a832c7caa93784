"""``torch.compile(model, backend="kareus", options={...})``, or ``backend=KareusBackend(...)``.

The backend is glue: Inductor's AOT path (decompositions, AOT autograd, min-cut
partitioner) hands us the forward and backward graphs one at a time (the backward lazily,
at the first backward call); each goes through analyse -> decide -> apply, the ranks
agree on the decision, and the result is lowered.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.fx
from torch._inductor.compile_fx import compile_fx

from kareus.codegen.apply import apply
from kareus.codegen.lowering import lower, pinned_schedule_config
from kareus.codegen.nanobatch import CannotRewrite
from kareus.devices.base import Device, Measurement
from kareus.options import KareusOptionError, KareusOptions
from kareus.passes.analyse import ForwardInterfaces, GraphAnalysis, analyse
from kareus.passes.decide import Decision, Policy, VariantChooser, decide, earliest_slots
from kareus.passes.ops import DEFAULT_CLOCK_MHZ
from kareus.passes.reasons import Reason, ReasonKind
from kareus.passes.variants import Variant
from kareus.planner.compose import GraphChoice
from kareus.planner.graph import GraphOptions, graph_options, variant_of
from kareus.planner.plan import Plan
from kareus.planner.step import SelectableGraph, StepPlanner
from kareus.profiler.measure import Protocol
from kareus.profiler.profile import PartitionProfile, Settings, profile_graph
from kareus.profiler.progress import ProfilingProgress, summary_table
from kareus.profiler.store import ProfileStore, default_cache_dir
from kareus.reports import GraphReport, make_console, print_report
from kareus.runtime import process_runtime
from kareus.runtime.agreement import agree
from kareus.runtime.communicators import graph_backend
from kareus.verify import RandomState, outputs_mismatch

log = logging.getLogger("kareus")


@dataclass(frozen=True)
class _Compiled:
    """A graph as compiled: what runs first, its analysis and the plan's choice for it
    (None: nothing planned; it runs as compiled)."""

    gm: torch.fx.GraphModule
    analysis: GraphAnalysis
    compile_key: str
    choice: GraphChoice | None
    decision: Decision


def _choice_of(decision: Decision) -> GraphChoice:
    """The decision as a plan's choice (its clock as asked: 0 for the default)."""
    variant = decision.variant
    if variant is None:
        return GraphChoice(1, decision.clock_mhz, ())
    return GraphChoice(variant.nanobatches, decision.clock_mhz,
                       tuple(zip(variant.slots, variant.resources, strict=True)))


def _report_fields(decision: Decision) -> dict[str, Any]:
    variant = decision.variant
    return {"nanobatches": variant.nanobatches if variant else 1, "variant": variant,
            "clock_mhz": decision.clock_mhz}


class KareusBackend:
    """A torch.compile backend with its own options, device, policy and reports.

    ``chooser`` picks each rewritten graph's variant and ``clock_mhz`` its clock; given,
    they replace the plan (which otherwise picks both where profiling is on); a chooser
    must choose alike on every rank. ``device`` overrides the
    ``device`` option with an opened Device; ``protocol`` is how its variants are measured
    while profiling (``profiler.measure.Protocol``). What is truly per process (the GPU's clock
    controller, capped communicators, agreement counters) belongs to ``process_runtime()``.
    """

    def __init__(
        self,
        options: KareusOptions | Mapping[str, Any] | None = None,
        *,
        chooser: VariantChooser = earliest_slots,
        clock_mhz: int | None = None,
        device: Device | None = None,
        protocol: Protocol | None = None,
    ) -> None:
        self.options = KareusOptions.from_dict(options)
        # A chooser or clock given in code is the policy: only the default one is planned.
        self._default_policy = chooser is earliest_slots and clock_mhz is None
        self.options.check_planning(policy_in_code=not self._default_policy)
        kwargs = {} if clock_mhz is None else {"clock_mhz": clock_mhz}
        requested = self.options.nanobatches
        self.policy = Policy(1 if requested == "auto" else requested, chooser, **kwargs)
        self._given_plan = Plan.load(self.options.plan) if self.options.plan else None
        self._planner: StepPlanner | None = None
        self.runtime = process_runtime()
        self._device = device
        self.protocol = protocol or Protocol()
        self._store: ProfileStore | None = None
        self._driving = False
        self._lock = threading.Lock()
        self._reports: list[tuple[int, GraphReport]] = []
        self._forwards: dict[int, ForwardInterfaces] = {}  # region -> its forward's interfaces
        _REGISTRY.add(self)

    @property
    def device(self) -> Device:
        if self._device is None:
            self._device = self.runtime.device(self.options.device)
        if not self._driving:
            self.runtime.drive(self._device)
            self._driving = True
        return self._device

    def __call__(
        self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]
    ) -> Callable[..., Any]:
        """One call per region torch._dynamo captured (between graph breaks)."""
        _ = self.device  # opened (a bad one fails) before any graph is touched
        region = _REGISTRY.next_region()

        def inner_compile(graph_module: torch.fx.GraphModule, inputs: Sequence[Any], **kwargs: Any):
            compiled = self._compile(graph_module, inputs, region, kwargs)
            lowered = lower(compiled.gm, inputs, self.options.lowering, **kwargs)
            if compiled.choice is None and not self.options.verify:
                return lowered
            return self._selectable(graph_module, compiled, lowered, kwargs)

        # A warm AOT-autograd cache would return compiled graphs without calling
        # inner_compile, skipping kareus's passes and reports; Inductor's own FX-graph
        # cache still applies (its key is the graph after our passes).
        with torch._functorch.config.patch(enable_autograd_cache=False):
            return compile_fx(
                gm, example_inputs, inner_compile=inner_compile,
                config_patches=pinned_schedule_config(),
            )

    def compile_graph(
        self, gm: torch.fx.GraphModule, inputs: Sequence[Any], region: int, **kwargs: Any
    ) -> torch.fx.GraphModule:
        """One AOT graph through analyse -> decide -> (agree) -> apply, with its report."""
        return self._compile(gm, inputs, region, kwargs).gm

    def _compile(
        self, gm: torch.fx.GraphModule, inputs: Sequence[Any], region: int,
        kwargs: Mapping[str, Any],
    ) -> _Compiled:
        if kwargs.get("is_backward"):
            kind = "backward"
        elif kwargs.get("is_inference"):
            kind = "inference"
        else:
            kind = "forward"
        analysis = analyse(
            gm, inputs, kind, self._forwards.get(region), backend=graph_backend(gm.graph),
            static_input_idxs=kwargs.get("static_input_idxs") or (), label=f"r{region}/{kind}",
        )
        if kind == "forward":
            self._forwards[region] = analysis.interfaces
        compile_key = self.runtime.compiles.key(analysis.shape_free_key)
        profiles, profile_note, plans = self._profile(analysis, compile_key)
        choice, plan_note = None, None
        if plans:
            choice, plan_note = self._choose(gm, analysis, profiles, region, compile_key)
        elif self._given_plan is not None:
            choice, plan_note = self._planned(analysis)
        if choice is None:
            decision = decide(analysis, self.policy)
        else:
            decision = self._decision(analysis, choice)
        compiled, decision = self._agreed(gm, analysis, decision, compile_key)
        if choice is not None and decision.variant is None and choice.nanobatches > 1:
            choice = GraphChoice(1, choice.clock_mhz, ())  # the ranks fell back
        estimate, estimate_note = self._estimate(compiled, analysis.label, decision.clock_mhz)
        report = GraphReport.build(
            analysis, decision, lowering=self.options.lowering, device=self.device.name,
            estimate=estimate,
            notes=tuple(n for n in (profile_note, plan_note, estimate_note) if n),
            profiles=profiles,
        )
        self._record(report)
        return _Compiled(compiled, analysis, compile_key, choice, decision)

    # -- planning -----------------------------------------------------------------------

    def _counts(self, analysis: GraphAnalysis) -> tuple[int, ...]:
        """The nanobatch counts the plan may choose for this graph."""
        if self.options.nanobatches == "auto":
            return analysis.space.nanobatches
        return (self.policy.nanobatches,)

    @property
    def planner(self) -> StepPlanner:
        if self._planner is None:
            import kareus

            self._planner = StepPlanner(
                self.options.to_dict(), self.options.budget, self.device, kareus.__version__,
                self.store_dir / "plans", given=self._given_plan,
            )
            if self._given_plan is not None:
                _REGISTRY.latest_plan = self._given_plan
        return self._planner

    @property
    def plans(self) -> bool:
        """Whether this backend plans: profiling on, no plan given, no chooser or clock
        given in code, and something to choose (a nanobatch count other than 1, or a
        budget: with one count and no budget, nothing is asked of the plan)."""
        options = self.options
        return (self._default_policy and self._given_plan is None and options.profile != "off"
                and (options.nanobatches != 1 or options.budget.kind != "fastest"))

    def _planned(self, analysis: GraphAnalysis) -> tuple[GraphChoice | None, str]:
        """The given plan's choice for this graph (a ``PlanError`` where it was made for
        another graph of its kind)."""
        entry = self.planner.plan.match(analysis.label, analysis.key, analysis.kind)
        if entry is None:
            return None, f"not in the plan {self.options.plan}: runs as the options say"
        return entry.choice, f"choice from the plan {self.options.plan}"

    def _choose(
        self, gm: torch.fx.GraphModule, analysis: GraphAnalysis,
        profiles: tuple[PartitionProfile, ...], region: int, compile_key: str,
    ) -> tuple[GraphChoice | None, str | None]:
        """The plan's choice for this graph (planning the step when this graph completes
        it), and a note on where it comes from; (None, why) where nothing is planned."""
        graph, why_not = self._graph_options(gm, analysis, profiles)
        if graph is None:
            return None, why_not
        planner = self.planner
        groups = tuple(sorted({c.group_name for c in analysis.collectives}))
        planner.add(analysis.kind, region, graph, groups)
        if planner.complete():
            self._plan_step(compile_key)
        choice, source = planner.initial_choice(graph, analysis.kind)
        return choice, f"planned: k={choice.nanobatches} at {choice.clock_mhz} MHz ({source})"

    def _graph_options(
        self, gm: torch.fx.GraphModule, analysis: GraphAnalysis,
        profiles: tuple[PartitionProfile, ...],
    ) -> tuple[GraphOptions | None, str | None]:
        device = self.device
        clocks = device.search_clocks()
        world = dist.get_world_size() if dist.is_initialized() else 1

        def cost(variant: Variant | None, at: Sequence[int]) -> dict[int, Measurement] | None:
            k = variant.nanobatches if variant else 1
            graph = apply(gm, analysis, Decision(k, variant, DEFAULT_CLOCK_MHZ))
            return device.estimate_at(graph, at, world)

        try:
            graph = graph_options(analysis, profiles, self._counts(analysis), clocks, cost)
        except Exception as exc:  # noqa: BLE001 - a graph that cannot be planned still runs
            log.warning("%s: not planned: %s: %s", analysis.label, type(exc).__name__, exc)
            return None, f"not planned: {type(exc).__name__}: {exc}"
        if graph is None:
            why = (f"not planned: {device.name} cannot cost a whole graph without running it; "
                   "runs as the options say at the default clock")
            log.warning("%s: %s", analysis.label, why)  # the budget asked for goes unmet
            return None, why
        if not graph.options:
            return None, "not planned: no variant of the graph could be costed at any clock"
        return graph, None

    def _plan_step(self, compile_key: str) -> None:
        """Plan the step (a ``BudgetError`` where no plan meets the budget) and run it once
        every rank of the step's collectives made the same plan."""
        planner = self.planner
        plan = planner.make()
        verdict = agree(f"{compile_key}/plan", plan.digest, planner.groups(),
                        timeout_s=self.options.agreement_timeout_s)
        if not verdict:
            log.warning("the ranks made different plans (%s); each graph keeps its choice",
                        verdict.reason)
            return
        planner.adopt(plan)
        _REGISTRY.latest_plan = plan
        log.info(
            "kareus plan: %.4g s, %.4g J per step and GPU (baseline %.4g s, %.4g J); %s",
            plan.predicted.time_s, plan.predicted.energy_j, plan.baseline.time_s,
            plan.baseline.energy_j,
            ", ".join(f"{g.label} k={g.nanobatches} {g.clock_mhz} MHz" for g in plan.graphs),
        )

    def _decision(self, analysis: GraphAnalysis, choice: GraphChoice) -> Decision:
        variant = variant_of(choice)
        default = choice.clock_mhz == self.device.search_clocks()[0]
        clock = DEFAULT_CLOCK_MHZ if default else choice.clock_mhz
        return decide(analysis, Policy(choice.nanobatches, lambda a, k: variant, clock))

    def _selectable(
        self, gm: torch.fx.GraphModule, compiled: _Compiled, lowered: Callable[..., Any],
        kwargs: Mapping[str, Any],
    ) -> SelectableGraph:
        analysis = compiled.analysis
        choice = compiled.choice or _choice_of(compiled.decision)

        def build(choice: GraphChoice, args: list[Any]) -> Callable[..., Any]:
            decision = self._decision(analysis, choice)
            graph = self._materialise(gm, analysis, decision)
            self._update_report(analysis.label, **_report_fields(decision))
            # Compiled while the step runs, outside any compile's context (fake mode).
            with torch._guards.tracing(None):
                return lower(graph, args, self.options.lowering, **kwargs)

        def verify(choice: GraphChoice, args: list[Any], run: Callable[..., Any]):
            return self._verify(gm, compiled, choice, args, run, build)

        def current_plan() -> Plan | None:
            return self._planner.plan if self._planner is not None else None

        return SelectableGraph(
            analysis.label, analysis.key, choice, lowered, build, current_plan,
            verify if self.options.verify else None,
        )

    def _verify(
        self, gm: torch.fx.GraphModule, compiled: _Compiled, choice: GraphChoice,
        args: list[Any], run: Callable[..., Any],
        build: Callable[[GraphChoice, list[Any]], Callable[..., Any]],
    ) -> tuple[Any, Callable[..., Any]]:
        """The first call of a newly chosen rewrite, checked against the unrewritten graph
        on the same inputs and random state; the ranks agree on the verdict (through the
        store), and on a mismatch anywhere the graph runs unrewritten from then on."""
        analysis = compiled.analysis
        examples = list(args)
        rng = RandomState.capture()
        expected = gm.forward(*examples)
        rng.restore()
        got = run(args)
        problem = outputs_mismatch(expected, got)
        verdict = agree(
            f"{compiled.compile_key}/verify/{choice}", problem is None,
            (c.group_name for c in analysis.collectives),
            timeout_s=self.options.agreement_timeout_s,
        )
        if problem is None and verdict:
            return got, run
        why = problem or f"another rank's check failed ({verdict.reason})"
        message = f"verify: k={choice.nanobatches} differs from the unrewritten graph: {why}"
        log.error("%s: %s; runs unrewritten", analysis.label, message)
        unrewritten = build(GraphChoice(1, choice.clock_mhz, ()), examples)
        self._update_report(
            analysis.label, fallback=Reason(ReasonKind.VERIFY_FAILED, None, message),
            notes_added=(message,),
        )
        return expected, unrewritten

    def _update_report(self, label: str, notes_added: tuple[str, ...] = (),
                       **changes: Any) -> None:
        with self._lock:
            for i, (n, report) in reversed(list(enumerate(self._reports))):
                if report.label == label:
                    notes = (*report.notes, *notes_added)
                    self._reports[i] = (n, dataclasses.replace(report, notes=notes, **changes))
                    return

    def _profile(
        self, analysis: GraphAnalysis, compile_key: str
    ) -> tuple[tuple[PartitionProfile, ...], str | None, bool]:
        """The frontiers of the graph's distinct partitions at every nanobatch count the plan
        may choose, and whether the graph is planned,
        from the profile store or measured now (``profiler.profile``), and why not where
        the ranks do not all profile this graph alike. Rank 0 shows progress and a summary;
        the device's clocks are back at default afterwards.

        Every rank of the graph's collectives first confirms (through the store, as the
        decision is) that all of them will search the same graph with the same settings,
        so that a leader never waits out the timeout for a rank that will not follow; and
        that all plan it under the same budget, so that no rank waits for another's plan.
        """
        options = self.options
        space = analysis.space.nanobatches
        counts = tuple(k for k in self._counts(analysis) if k > 1 and k in space)
        plans = self.plans and bool(set(self._counts(analysis)) & set(space))
        wants = options.profile != "off" and bool(counts) and self._given_plan is None
        if not analysis.collectives:
            return (), None, plans
        settings = Settings(
            options.profile, options.search_budget, options.seed, options.agreement_timeout_s,
            self.protocol,
        )
        intent = (analysis.key, counts if wants else (), settings, plans and options.budget)
        verdict = agree(
            f"{compile_key}/profile", intent if wants or plans else None,
            (c.group_name for c in analysis.collectives), timeout_s=options.agreement_timeout_s,
        )
        if not (wants or plans):
            return (), None, False
        if not verdict:
            return (), (
                "not profiled or planned: the ranks do not all profile and plan this graph "
                f"alike ({verdict.reason})"
            ), False
        if not wants:
            return (), None, plans
        shows = not dist.is_initialized() or dist.get_rank() == 0
        device = self.device
        profiles: tuple[PartitionProfile, ...] = ()
        try:
            with ProfilingProgress(shows) as progress:
                for k in counts:
                    profiles += profile_graph(
                        analysis, k, device, self.store, settings, prefix=compile_key,
                        progress=progress,
                        lower=lambda gm, inputs: lower(gm, inputs, self.options.lowering),
                        communicators=self.runtime.communicators,
                    )
        finally:
            if device.controls_clocks:
                device.clock_controller().reset()
        if shows and profiles:
            make_console().print(summary_table(
                f"kareus {analysis.label}: partition frontiers on {device.identity}", profiles
            ))
        return profiles, None, plans

    @property
    def store_dir(self) -> Path:
        """The cache directory: the profile store and stored plans."""
        return Path(self.options.cache_dir).expanduser() if self.options.cache_dir else (
            default_cache_dir())

    @property
    def store(self) -> ProfileStore:
        """The profile store of ``options.cache_dir``, opened at the first profiling."""
        if self._store is None:
            self._store = ProfileStore(cache_dir=self.options.cache_dir)
        return self._store

    def _agreed(
        self,
        gm: torch.fx.GraphModule,
        analysis: GraphAnalysis,
        decision: Decision,
        compile_key: str,
    ) -> tuple[torch.fx.GraphModule, Decision]:
        """The graph that runs and the decision every rank of its collectives took.

        The ranks compare decisions through the store, never a collective
        (``runtime.agreement``), also where this rank asked for no rewrite. Capped
        sub-communicators are created (a collective call) only after that, so no rank
        creates one alone.
        """
        compiled = None
        if decision.variant is not None:
            try:
                compiled = apply(gm, analysis, decision)
            except CannotRewrite as exc:
                decision = decision.fallback(Reason(ReasonKind.CANNOT_REWRITE, None, str(exc)))
        if analysis.collectives:
            verdict = agree(
                compile_key, (decision.variant, decision.clock_mhz),
                (c.group_name for c in analysis.collectives),
                timeout_s=self.options.agreement_timeout_s,
            )
            if not verdict:
                decision = decision.fallback(
                    Reason(
                        ReasonKind.RANKS_DISAGREED, None,
                        f"the ranks did not confirm one decision ({verdict.reason}); "
                        "runs unrewritten",
                    )
                )
        variant = decision.variant
        if variant is None:
            return apply(gm, analysis, decision), decision
        if any(cap is not None for cap in variant.resources):
            compiled = self._materialise(gm, analysis, decision)
        return compiled, decision

    def _materialise(
        self, gm: torch.fx.GraphModule, analysis: GraphAnalysis, decision: Decision
    ) -> torch.fx.GraphModule:
        """``apply`` with the capped sub-communicators the variant's resources need (made
        now: call only where the ranks agreed on it)."""
        variant, groups = decision.variant, None
        if variant is not None and any(cap is not None for cap in variant.resources):
            parts = analysis.space.partitions(variant.nanobatches)
            groups = [
                None if cap is None else self.runtime.communicators.capped(p.group_name, cap)
                for p, cap in zip(parts, variant.resources)
            ]
        return apply(gm, analysis, decision, groups=groups)

    def _estimate(
        self, gm: torch.fx.GraphModule, label: str, clock_mhz: int = DEFAULT_CLOCK_MHZ
    ) -> tuple[Measurement | None, str | None]:
        """Modelled time and energy at the graph's clock (measured there, so its own clock
        switch stalls nothing) where the device can tell at compile time, or why the graph
        could not be costed: an estimate never fails a compile."""
        device = self.device
        world = dist.get_world_size() if dist.is_initialized() else 1
        try:
            if clock_mhz != DEFAULT_CLOCK_MHZ:
                costs = device.estimate_at(gm, [clock_mhz], world)
                return (costs[clock_mhz] if costs else None), None
            return device.estimate(gm, world), None
        except Exception as exc:  # noqa: BLE001 - any model failure is reported, not raised
            log.warning("%s: %s cannot cost this graph: %s", label, device.name, exc)
            return None, f"{device.name} cannot cost this graph: {type(exc).__name__}: {exc}"

    def _record(self, report: GraphReport) -> None:
        with self._lock:
            self._reports.append((_REGISTRY.next_report(), report))
        log.info(
            "%s: %d collectives, %d partitions, %d nanobatches%s", report.label,
            len(report.collectives), len(report.partitions), report.nanobatches,
            "".join(f"\n  {n}" for n in report.notes),
        )
        if report.fallback:
            log.warning("%s runs unrewritten: %s", report.label, report.fallback)
        if self.options.explain:
            print_report(report)

    def reports(self) -> list[GraphReport]:
        """This backend's graph reports, in compilation order."""
        with self._lock:
            return [r for _, r in self._reports]

    def clear_reports(self) -> None:
        with self._lock:
            self._reports.clear()

    def _numbered_reports(self) -> list[tuple[int, GraphReport]]:
        with self._lock:
            return list(self._reports)


class _BackendRegistry:
    """Every backend of the process: the one per options value the registered entry point
    reuses, and those users built themselves; it numbers regions and reports in order."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._backends: list[KareusBackend] = []
        self._by_options: dict[KareusOptions, KareusBackend] = {}
        self._regions = itertools.count()
        self._report_order = itertools.count()
        self.latest_plan: Plan | None = None  # the plan made or loaded last, by any backend

    def add(self, backend: KareusBackend) -> None:
        with self._lock:
            self._backends.append(backend)

    def for_options(self, options: KareusOptions) -> KareusBackend:
        with self._lock:
            backend = self._by_options.get(options)
        if backend is None:
            backend = KareusBackend(options)
            with self._lock:
                backend = self._by_options.setdefault(options, backend)
        return backend

    def next_region(self) -> int:
        return next(self._regions)

    def next_report(self) -> int:
        return next(self._report_order)

    def reports(self) -> list[GraphReport]:
        with self._lock:
            backends = list(self._backends)
        return [r for _, r in heapq.merge(*(b._numbered_reports() for b in backends))]

    def clear(self) -> None:
        with self._lock:
            backends = list(self._backends)
        for backend in backends:
            backend.clear_reports()


_REGISTRY = _BackendRegistry()


def graph_reports() -> list[GraphReport]:
    """One record per graph compiled by any kareus backend of this process, in order."""
    return _REGISTRY.reports()


def clear_graph_reports() -> None:
    _REGISTRY.clear()


def current_plan() -> Plan | None:
    """The plan this process runs: the last one a kareus backend made (once every graph
    of the step compiled, agreed by the ranks) or loaded from its ``plan`` option."""
    return _REGISTRY.latest_plan


def backend_for(options: KareusOptions | Mapping[str, Any] | None) -> KareusBackend:
    """The backend the registered entry point uses for ``options`` (one per options value)."""
    return _REGISTRY.for_options(KareusOptions.from_dict(options))


def kareus_backend(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    options: Mapping[str, Any] | None = None,
    mode: str | None = None,
) -> Callable[..., Any]:
    """The registered ``torch._dynamo`` backend "kareus": one backend per options value."""
    if mode not in (None, "default"):
        raise KareusOptionError(
            f"torch.compile mode {mode!r} is not supported by the kareus backend; "
            "leave mode unset and pass kareus settings through options={...}"
        )
    return backend_for(options)(gm, example_inputs)
