"""``torch.compile(model, backend="kareus", options={...})``, or ``backend=KareusBackend(...)``.

The backend is glue: Inductor's AOT path (decompositions, AOT autograd, min-cut
partitioner) hands us the forward and backward graphs one at a time (the backward lazily,
at the first backward call); each goes through analyse -> decide -> apply, the ranks
agree on the decision, and the result is lowered.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.fx
from torch._inductor.compile_fx import compile_fx

from kareus.codegen.lowering import lower, pinned_schedule_config
from kareus.options import KareusOptionError, KareusOptions
from kareus.passes.analyse import ForwardInterfaces, GraphAnalysis, analyse
from kareus.passes.apply import apply
from kareus.passes.decide import Decision, Policy, VariantChooser, decide, earliest_slots
from kareus.passes.nanobatch import CannotRewrite
from kareus.passes.reasons import Reason, ReasonKind
from kareus.profiler.devices.base import Device, Measurement
from kareus.profiler.measure import Protocol
from kareus.profiler.profile import PartitionProfile, Settings, profile_graph
from kareus.profiler.progress import ProfilingProgress, summary_table
from kareus.profiler.store import ProfileStore
from kareus.reports import GraphReport, make_console, print_report
from kareus.runtime import process_runtime
from kareus.runtime.agreement import agree

log = logging.getLogger("kareus")


class KareusBackend:
    """A torch.compile backend with its own options, device, policy and reports.

    ``chooser`` picks each rewritten graph's variant (default: every collective at its
    earliest slot); it must choose alike on every rank. ``device`` overrides the
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
        kwargs = {} if clock_mhz is None else {"clock_mhz": clock_mhz}
        self.policy = Policy(self.options.nanobatches, chooser, **kwargs)
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
            compiled = self.compile_graph(graph_module, inputs, region, **kwargs)
            return lower(compiled, inputs, self.options.lowering, **kwargs)

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
        if kwargs.get("is_backward"):
            kind = "backward"
        elif kwargs.get("is_inference"):
            kind = "inference"
        else:
            kind = "forward"
        analysis = analyse(
            gm, inputs, kind, self._forwards.get(region),
            static_input_idxs=kwargs.get("static_input_idxs") or (), label=f"r{region}/{kind}",
        )
        if kind == "forward":
            self._forwards[region] = analysis.interfaces
        compile_key = self.runtime.compiles.key(analysis.shape_free_key)
        profiles, profile_note = self._profile(analysis, compile_key)
        decision = decide(analysis, self.policy)
        compiled, decision = self._agreed(gm, analysis, decision, compile_key)
        estimate, estimate_note = self._estimate(compiled, analysis.label)
        report = GraphReport.build(
            analysis, decision, lowering=self.options.lowering, device=self.device.name,
            estimate=estimate, notes=tuple(n for n in (profile_note, estimate_note) if n),
            profiles=profiles,
        )
        self._record(report)
        return compiled

    def _profile(
        self, analysis: GraphAnalysis, compile_key: str
    ) -> tuple[tuple[PartitionProfile, ...], str | None]:
        """The frontiers of the graph's distinct partitions at the requested nanobatch count,
        from the profile store or measured now (``profiler.profile``), and why not where
        the ranks do not all profile this graph alike. Rank 0 shows progress and a summary;
        the device's clocks are back at default afterwards.

        Every rank of the graph's collectives first confirms (through the store, as the
        decision is) that all of them will search the same graph with the same settings,
        so that a leader never waits out the timeout for a rank that will not follow.
        """
        options, k = self.options, self.options.nanobatches
        wants = options.profile != "off" and k > 1 and k in analysis.space.nanobatches
        if not analysis.collectives:
            return (), None
        settings = Settings(
            options.profile, options.search_budget, options.seed, options.agreement_timeout_s,
            self.protocol,
        )
        verdict = agree(
            f"{compile_key}/profile", (analysis.key, k, settings) if wants else None,
            (c.group_name for c in analysis.collectives), timeout_s=options.agreement_timeout_s,
        )
        if not wants:
            return (), None
        if not verdict:
            return (), f"not profiled: the ranks do not all profile this graph ({verdict.reason})"
        shows = not dist.is_initialized() or dist.get_rank() == 0
        device = self.device
        try:
            with ProfilingProgress(shows) as progress:
                profiles = profile_graph(
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
        return profiles, None

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
                compile_key, decision.variant,
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
            parts = analysis.space.partitions(variant.nanobatches)
            groups = [
                None if cap is None else self.runtime.communicators.capped(p.group_name, cap)
                for p, cap in zip(parts, variant.resources)
            ]
            compiled = apply(gm, analysis, decision, groups=groups)
        return compiled, decision

    def _estimate(
        self, gm: torch.fx.GraphModule, label: str
    ) -> tuple[Measurement | None, str | None]:
        """Modelled time and energy at the default clock where the device can tell at
        compile time, or why the graph could not be costed: an estimate never fails a compile."""
        device = self.device
        world = dist.get_world_size() if dist.is_initialized() else 1
        try:
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
