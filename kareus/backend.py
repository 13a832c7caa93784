"""``torch.compile(model, backend="kareus", options={...})``, or ``backend=KareusBackend(...)``.

The backend is glue: Inductor's AOT path (decompositions, AOT autograd, min-cut
partitioner) hands us the forward and backward graphs one at a time (the backward lazily,
at the first backward call); each goes through the stages, each a call into its package:

    analyse (passes) -> profile (profiler) -> choose (planner) -> decide (passes)
      -> agree and materialise (runtime: codegen's apply) -> report -> lower (codegen)

and, where a plan may later choose otherwise or ``verify`` checks the first run, what
runs is a ``runtime.selectable.SelectableGraph``. On a device that cannot cost a graph
without running it (a real GPU), choosing waits for the graph's first call: it is
measured on its inputs then (``planner.measured``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.fx
from torch._inductor.compile_fx import compile_fx

from kareus.codegen.lowering import lower, pinned_schedule_config
from kareus.codegen.partitioner import partitioner_config
from kareus.devices.base import Device
from kareus.devices.resolve import check_device
from kareus.errors import KareusError
from kareus.interrupts import raise_if_interrupted
from kareus.options import (
    DEFAULT_SOURCE,
    OPTIONS_FILE_VARIABLE,
    OPTIONS_VARIABLE,
    KareusOptionError,
    KareusOptions,
)
from kareus.passes.analyse import ForwardInterfaces, analyse
from kareus.passes.decide import Policy, VariantChooser, decide, earliest_slots, follow
from kareus.passes.unwrap import opened_notes, unwrap_collectives
from kareus.passes.variants import NANOBATCH_COUNTS
from kareus.planner.graph import device_cost
from kareus.planner.measured import FirstCallPlanning, FirstCalls
from kareus.planner.pipeline_step import PipelinePlanning
from kareus.planner.plan import Plan
from kareus.planner.step import StepPlanner
from kareus.profiler.graph import profile
from kareus.profiler.measure import GpuTime, Protocol
from kareus.profiler.profile import Searched
from kareus.profiler.store import default_cache_dir
from kareus.reports import GraphReport, ReportBook, modelled_cost, print_options
from kareus.runtime import process_runtime
from kareus.runtime.communicators import graph_backend
from kareus.runtime.materialise import GraphBuilder, agreed
from kareus.runtime.pipelining import Detection, detect, unused_schedule
from kareus.runtime.selectable import SelectableGraph
from kareus.verify import Verifier
from kareus.version import build

log = logging.getLogger("kareus")

EXCHANGED = ("rows exchanged in per-rank blocks: split by those exchanges only, as the "
             "nanobatches option says, on every rank alike (neither planned, verified nor "
             "agreed: ranks compile its versions at different steps)")


class KareusBackend:
    """A torch.compile backend with its own options, device, policy and reports.

    ``chooser`` picks each rewritten graph's variant and ``clock_mhz`` its clock; given,
    they replace the plan (which otherwise picks both where profiling is on); a chooser
    must choose alike on every rank. ``device`` overrides the ``device`` option with an
    opened Device; ``protocol`` is how its variants are measured while profiling
    (``profiler.measure.Protocol``). What is truly per process (the GPU's clock controller,
    capped communicators, agreement counters, the registry of backends) belongs to
    ``process_runtime()``.
    """

    def __init__(
        self,
        options: KareusOptions | Mapping[str, Any] | None = None,
        *,
        chooser: VariantChooser = earliest_slots,
        clock_mhz: int | None = None,
        device: Device | None = None,
        protocol: Protocol | None = None,
        mode: str | None = None,
    ) -> None:
        # A chooser or clock given in code is the policy: only the default one is planned.
        self._policy_in_code = chooser is not earliest_slots or clock_mhz is not None
        self.options = KareusOptions.resolve(options, mode=mode,
                                             policy_in_code=self._policy_in_code)
        self.options.check_planning(policy_in_code=self._policy_in_code)
        kwargs = {} if clock_mhz is None else {"clock_mhz": clock_mhz}
        requested = self.options.nanobatches
        self.policy = Policy(1 if requested == "auto" else requested, chooser, **kwargs)
        self.runtime = process_runtime()
        self._device = device
        self._driving = False
        self.protocol = protocol or Protocol()
        self._reports = ReportBook(self.runtime.backends.next_report, self.options.explain)
        self._planner: StepPlanner | None = None
        # the step's graphs measured at their first calls
        self._first_calls = FirstCalls(self.runtime.compiles.key)
        self._spend: GpuTime | None = None
        self._announced = False
        # What can be refused before any graph is: a device file that is no GPU, a plan
        # file that is none, or one made for other options or another device.
        if device is None:
            check_device(self.options.device)
        self._given_plan = Plan.load(self.options.plan) if self.options.plan else None
        if self._given_plan is not None:
            self.options.check_plan(self._given_plan)
            if self._device is None:
                self._device = self.runtime.device(self.options.device, self.options.zeusd_socket)
            self._given_plan.check_device(self._device, str(self.options.plan))
        self._forwards: dict[int, ForwardInterfaces] = {}  # region -> its forward's interfaces
        self._stages: dict[int, int] = {}  # region -> the pipeline stage it was compiled for
        self._pipeline: PipelinePlanning | None = None
        self._unused_schedule_said = False
        self.runtime.backends.add(self)

    @property
    def device(self) -> Device:
        if self._device is None:
            self._device = self.runtime.device(self.options.device, self.options.zeusd_socket)
        if not self._driving:
            self.runtime.drive(self._device)
            self._driving = True
        return self._device

    @property
    def store_dir(self) -> Path:
        """The cache directory: the profile store and stored plans."""
        directory = self.options.cache_dir
        return Path(directory).expanduser() if directory else default_cache_dir()

    @property
    def spend(self) -> GpuTime:
        """The GPU-seconds this backend's profiling took on this rank, per graph and in
        total, against ``profile_budget_s``."""
        if self._spend is None:
            self._spend = GpuTime(self.options.profile_budget_s,
                                  estimated=self.device.deterministic)
        return self._spend

    @property
    def planner(self) -> StepPlanner:
        if self._planner is None:
            options = self.options
            self._planner = StepPlanner(
                options.to_dict(), options.planning(), options.budget, self.device,
                build(), self.store_dir / "plans", counts=options.plan_counts,
                microbatches=options.microbatches, timeout_s=options.agreement_timeout_s,
                given=self._given_plan, publish=self.runtime.backends.publish,
                budget_defaulted=options.budget_defaulted,
                option_sources={name: source for name, source in options.sources.items()
                                if source != DEFAULT_SOURCE},
            )
        return self._planner

    def __call__(
        self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **compile_kwargs: Any
    ) -> Callable[..., Any]:
        """One call per region torch._dynamo captured (between graph breaks)."""
        if compile_kwargs:  # torch.compile(backend=KareusBackend(...), mode=/options=)
            raise KareusOptionError(
                f"torch.compile({', '.join(f'{k}=...' for k in compile_kwargs)}) with a "
                "KareusBackend object: give them to it, KareusBackend(options, mode=...)"
            )
        _ = self.device  # opened (a bad one fails) before any graph is touched
        self._announce()
        if self._given_plan is not None:
            _ = self.planner  # the given plan is the process's from now on
        region = self.runtime.backends.next_region()
        options = self.options
        self._join_pipeline(region, detect(
            schedule=options.pipeline_schedule,
            microbatches=None if options.microbatches == 1 else options.microbatches))

        def inner_compile(graph_module: torch.fx.GraphModule, inputs: Sequence[Any], **kwargs: Any):
            return self._compile(graph_module, inputs, region, kwargs)

        # A warm AOT-autograd cache would return compiled graphs without calling
        # inner_compile, skipping kareus's passes and reports; Inductor's own FX-graph
        # cache still applies (its key is the graph after our passes).
        with torch._functorch.config.patch(enable_autograd_cache=False):
            return compile_fx(
                gm, example_inputs, inner_compile=inner_compile,
                config_patches={**pinned_schedule_config(),
                                **partitioner_config(options.saved_pieces, build()),
                                **({"max_autotune": True} if options.autotune else {})},
            )

    def _announce(self) -> None:
        """Say once, on rank 0, what this backend does and how to change it: loudly where
        nothing was asked of it (the name alone), else on the kareus logger's INFO."""
        if self._announced:
            return
        self._announced = True
        if dist.is_initialized() and dist.get_rank() != 0:
            return
        options = self.options
        given = options.given()
        if options.plans(NANOBATCH_COUNTS, policy_in_code=self._policy_in_code):  # any graph
            what = (f"plans each step on {self.device.name} for {options.budget.describe()} "
                    f"(nanobatches={options.nanobatches!r})")
        elif options.plan is not None:
            what = f"runs the plan {options.plan}"
        else:
            what = (f"runs every graph in {options.nanobatches} nanobatch(es), "
                    f"{'as the policy in code says' if self._policy_in_code else 'unplanned'}")
        log.log(logging.INFO if given else logging.WARNING,
                "kareus %s (%s); change it with torch.compile(..., options={...}), $%s or $%s"
                "; options: %s", build(), what, OPTIONS_VARIABLE, OPTIONS_FILE_VARIABLE,
                "; ".join(given.values()) or "all defaults")
        if options.explain:
            print_options(options)

    def _join_pipeline(self, region: int, found: Detection) -> None:
        """Where ``region`` is a pipeline stage's module: name its graphs by the stage and,
        at the first, watch the pipeline's instructions and plan it as one. A
        ``pipeline_schedule`` that does nothing is said once."""
        unused = unused_schedule(found, self.options.pipeline_schedule, region)
        if unused is not None and not self._unused_schedule_said:
            self._unused_schedule_said = True
            log.warning("kareus options: %s", unused)
        if found.stage is None:
            return
        self._stages[region] = found.stage
        if found.shape is None:
            log.warning("kareus: pipeline stage %d: %s", found.stage, found.reason)
            return
        shape = found.shape
        tracker = self.runtime.instructions
        tracker.attach(found)
        given = self._given_plan
        if given is not None:  # its instructions run as it says, where it has any
            given.check_layout(shape.stages, shape.ranks, shape.microbatches, shape.schedule,
                               str(self.options.plan))
            return
        if self._pipeline is None:
            self.planner.pipelined = True
            self._pipeline = PipelinePlanning(self.planner, shape, tracker,
                                              timeout_s=self.options.agreement_timeout_s)
            tracker.listeners.append(self._pipeline)

    def _compile(
        self, gm: torch.fx.GraphModule, inputs: Sequence[Any], region: int,
        kwargs: Mapping[str, Any],
    ) -> Callable[..., Any]:
        """One AOT graph through the stages, recorded in its report, lowered."""
        raise_if_interrupted()  # a pending Ctrl-C of ``kareus plan``: each graph is a safe point
        kind = ("backward" if kwargs.get("is_backward")
                else "inference" if kwargs.get("is_inference") else "forward")
        options, device, world = self.options, self.device, _world_size()
        stage = self._stages.get(region)
        given = self._given_plan
        pipelined = stage is not None and (
            self._pipeline is not None or (given is not None and given.pipeline is not None))
        opened = unwrap_collectives(gm)
        analysis = analyse(
            gm, inputs, kind, self._forwards.get(region), backend=graph_backend(gm.graph),
            static_input_idxs=kwargs.get("static_input_idxs") or (),
            label=("" if stage is None else f"s{stage}/") + f"r{region}/{kind}",
        )
        if kind == "forward":
            self._forwards[region] = analysis.interfaces
        compile_key = self.runtime.compiles.key(analysis.shape_free_key)
        # A graph exchanging rows in per-rank blocks runs as the options say, on every
        # version alike (``runtime.materialise.agreed``): profiles differ by rank.
        planning = not analysis.exchanged and options.plans(
            analysis.space.nanobatches, policy_in_code=self._policy_in_code,
            pipelined=pipelined)
        counts = () if self._given_plan or analysis.exchanged else (
            self.planner.graph_counts(analysis))
        settings = options.profiling(self.protocol)
        searched = Searched(analysis, (), lambda g, examples: lower(g, examples, options.lowering),
                            self.runtime.communicators)
        profiled = profile(
            analysis, counts, device, self.store_dir, settings,
            plans=options.budget if planning else None, compile_key=compile_key,
            lower=searched.lower, communicators=searched.communicators, spend=self.spend,
            # planned at its first call (a device that must run it): searched then, with
            # the step's other graphs, side by side
            search=device.costs_graphs or not planning,
        )
        builder = GraphBuilder(gm, analysis, options.lowering, kwargs, self.runtime.communicators)
        choice, plan_note, first_call = None, None, None
        if profiled.planned and device.costs_graphs:
            choice, plan_note = self.planner.choose(
                analysis, profiled.profiles, device_cost(gm, analysis, device, world),
                region=region, compile_key=compile_key,
            )
        elif profiled.planned:
            plan_note = ("planned at its first call: once the step's graphs had theirs, their "
                         "partitions are searched and their variants measured together, on "
                         f"their first calls' inputs, on {device.name}")
            first_call = FirstCallPlanning(
                analysis, profiled.profiles, self.planner, builder, device, self.store_dir,
                settings, self.spend, self._reports, region, compile_key, world,
                self._first_calls, dataclasses.replace(searched, counts=profiled.later),
            )
        elif self._given_plan is not None:
            choice, plan_note = self.planner.given_choice(analysis)
        decision = decide(analysis, self.policy if choice is None else follow(choice))
        compiled, decision = agreed(
            gm, analysis, decision, compile_key=compile_key,
            timeout_s=options.agreement_timeout_s, communicators=self.runtime.communicators,
        )
        estimate, estimate_note = modelled_cost(device, compiled, analysis.label,
                                                decision.clock_mhz, world)
        self._reports.add(GraphReport.build(
            analysis, decision, lowering=options.lowering, device=device.name,
            estimate=estimate, profiles=profiled.profiles,
            notes=tuple(n for n in (*opened_notes(opened), profiled.note, plan_note,
                                    estimate_note, analysis.exchanged and EXCHANGED) if n),
            profile_gpu_s=self.spend.by_graph.get(analysis.label, 0.0),
        ))
        raise_if_interrupted()
        lowered = lower(compiled, inputs, options.lowering, **kwargs)
        # An exchanged graph's check would be agreed on, as its decision is not.
        verify = options.verify and not analysis.exchanged
        if choice is None and first_call is None and not verify and not pipelined:
            return lowered
        verifier = Verifier(
            gm, analysis, builder, self._reports, compile_key=compile_key,
            timeout_s=options.agreement_timeout_s,
        ) if verify else None
        return SelectableGraph(
            analysis.label, analysis.key, decision.choice, lowered, builder, self.planner,
            self._reports, verifier, self.runtime.instructions if pipelined else None,
            first_call,
        )

    @property
    def pipeline(self) -> PipelinePlanning | None:
        """The pipeline this backend's stages plan as one (None: none found)."""
        return self._pipeline

    def reports(self) -> list[GraphReport]:
        """This backend's graph reports, in compilation order."""
        return self._reports.all()

    def clear_reports(self) -> None:
        self._reports.clear()

    def numbered_reports(self) -> list[tuple[int, GraphReport]]:
        return self._reports.numbered()


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def graph_reports() -> list[GraphReport]:
    """One record per graph compiled by any kareus backend of this process, in order."""
    return process_runtime().backends.reports()


def clear_graph_reports() -> None:
    for backend in process_runtime().backends.each():
        backend.clear_reports()


def current_plan() -> Plan | None:
    """The plan this process runs: the last one a kareus backend made (once every graph
    of the step compiled, agreed by the ranks) or loaded from its ``plan`` option."""
    return process_runtime().backends.latest_plan


def backend_for(options: KareusOptions | Mapping[str, Any] | None,
                mode: str | None = None) -> KareusBackend:
    """The backend the registered entry point uses for ``options`` and torch.compile's
    ``mode``, with the environment's options (one backend per resolved value)."""
    return process_runtime().backends.for_options(
        KareusOptions.resolve(options, mode=mode), KareusBackend)


def kareus_backend(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    options: Mapping[str, Any] | None = None,
    mode: str | None = None,
) -> Callable[..., Any]:
    """The registered ``torch._dynamo`` backend "kareus": one backend per options value.

    torch builds nothing of a backend named by a string before the first graph, so this is
    where its options (the environment's too), mode, device and plan are checked. What
    kareus refuses there reaches the user as the ``KareusError`` it is (``surfaced``), not
    inside dynamo's ``BackendCompilerFailed``."""
    try:
        backend = backend_for(options, mode)
        _ = backend.device
    except KareusError as exc:
        raise surfaced(exc) from exc.__cause__
    return backend(gm, example_inputs)


def surfaced(exc: KareusError) -> KareusError:
    """``exc`` as dynamo lets it through a backend: dynamo re-raises a ``ShortenTraceback``
    as it is, and wraps any other error in ``BackendCompilerFailed``. The copy is an
    instance of both ``exc``'s class (``except KareusOptionError`` still catches it) and
    ``ShortenTraceback``, with ``exc``'s message and attributes."""
    shorten = getattr(torch._dynamo.exc, "ShortenTraceback", None)
    if shorten is None or isinstance(exc, shorten):
        return exc
    cls = type(exc)
    kind = type(cls.__name__, (cls, shorten), {"__module__": cls.__module__,
                                               "__qualname__": cls.__qualname__})
    copy = kind.__new__(kind, *exc.args)
    copy.__dict__.update(exc.__dict__)
    copy.args = exc.args
    copy.first_useful_frame = None
    return copy.with_traceback(exc.__traceback__)
