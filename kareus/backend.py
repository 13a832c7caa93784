"""``torch.compile(model, backend="kareus", options={...})``.

The backend is glue: Inductor's AOT path (decompositions, AOT autograd, min-cut
partitioner) hands us the forward and backward graphs one at a time (the backward lazily,
at the first backward call); each goes through the pass pipeline and is lowered.
"""

from __future__ import annotations

import collections
import functools
import itertools
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.fx
from torch._inductor.compile_fx import compile_fx

from kareus import reports
from kareus.runtime.clock import NullClockController, active_controller, set_active_controller
from kareus.runtime.communicators import exclusive_kinds
from kareus.codegen.lowering import lower, pinned_schedule_config
from kareus.runtime.agreement import agree
from kareus.options import KareusOptionError, KareusOptions
from kareus.passes.collectives import Collective, find_collectives
from kareus.passes.frequency import insert_clock_switch
from kareus.passes.interface import (
    ForwardInterface,
    backward_inputs,
    forward_inputs,
    record_forward,
)
from kareus.passes.nanobatch import CannotRewrite, Schedule, feasibility, nanobatch_graph
from kareus.passes.ops import OP_TABLE
from kareus.passes.partition import GraphPartitioning, graph_hash, partition_graph
from kareus.passes.placement import PlacementResult, per_nanobatch, propagate
from kareus.passes.variants import NANOBATCH_COUNTS, Variant, VariantSpace, variant_space
from kareus.profiler.devices import Device, Measurement, SimulatedGPU, Workload
from kareus.profiler.devices.nvml import NvmlGPU
from kareus.profiler.devices.resolve import resolve_device

log = logging.getLogger("kareus")

_regions = itertools.count()

VariantChooser = Callable[[str, VariantSpace, int], Variant]


def _earliest_slots(label: str, space: VariantSpace, k: int) -> Variant:
    return space.default(k)


_choose_variant: VariantChooser = _earliest_slots


def set_variant_chooser(chooser: VariantChooser | None) -> VariantChooser:
    """Choose the variant of each graph rewritten with k > 1 nanobatches (None: the default,
    every collective at its earliest slot on default resources); returns the previous one.

    The chooser gets the graph's label, its variant space and k, and must return the same
    variant on every rank, or the ranks' collectives would not match.
    """
    global _choose_variant
    previous, _choose_variant = _choose_variant, chooser or _earliest_slots
    return previous


def kareus_backend(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    options: Mapping[str, Any] | None = None,
    mode: str | None = None,
) -> Callable[..., Any]:
    """The ``torch._dynamo`` backend: one call per captured region (graph break)."""
    if mode not in (None, "default"):
        raise KareusOptionError(
            f"torch.compile mode {mode!r} is not supported by the kareus backend; "
            "leave mode unset and pass kareus settings through options={...}"
        )
    opts = KareusOptions.from_dict(options)
    device = open_device(opts.device)
    if isinstance(device, NvmlGPU) and isinstance(active_controller(), NullClockController):
        # A controller the user installed (use_controller) wins over the device's own.
        set_active_controller(device.clock_controller())
    region = next(_regions)
    forward: ForwardInterface | None = None  # set by the forward, read by the backward

    def inner_compile(graph_module: torch.fx.GraphModule, inputs: Sequence[Any], **kwargs: Any):
        nonlocal forward
        if kwargs.get("is_backward"):
            kind = "backward"
        elif kwargs.get("is_inference"):
            kind = "inference"
        else:
            kind = "forward"
        result = run_passes(
            graph_module, inputs, f"r{region}/{kind}", kind, opts, device,
            static_input_idxs=kwargs.get("static_input_idxs") or (), forward=forward,
        )
        if kind == "forward":
            forward = result.interface
        report = result.report
        reports.record(report)
        log.info(
            "%s: %d collectives, %d partitions, %d nanobatches%s", report.label,
            len(report.collectives), len(report.partitions), report.nanobatches,
            "".join(f"\n  {n}" for n in report.notes),
        )
        if report.fallback_reason:
            log.warning("%s runs unrewritten: %s", report.label, report.fallback_reason)
        if opts.explain:
            reports.print_report(report)
        return lower(result.gm, inputs, opts.lowering, **kwargs)

    # A warm AOT-autograd cache would return compiled graphs without calling
    # inner_compile, skipping kareus's passes and reports; Inductor's own FX-graph cache
    # still applies (its key is the graph after our passes).
    with torch._functorch.config.patch(enable_autograd_cache=False):
        return compile_fx(
            gm, example_inputs, inner_compile=inner_compile, config_patches=pinned_schedule_config()
        )


@functools.cache
def open_device(spec: str) -> Device:
    """One device per spec and process: NVML is opened (and "auto" decided and logged) once."""
    return resolve_device(spec)


@dataclass(frozen=True)
class PassResult:
    gm: torch.fx.GraphModule
    report: reports.GraphReport
    interface: ForwardInterface | None  # what the backward needs to know of a forward


def run_passes(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    label: str,
    kind: str,
    opts: KareusOptions,
    device: Device,
    *,
    static_input_idxs: Sequence[int] = (),
    forward: ForwardInterface | None = None,
) -> PassResult:
    """Analyse ``gm``, rewrite it as the options ask where that is safe, add clock switches."""
    num_nodes = len(gm.graph.nodes)
    collectives = find_collectives(gm.graph)
    partitioning = partition_graph(gm.graph, collectives)
    symbolic = symbolic_shapes(gm.graph)
    if symbolic:
        # Placement reads sizes; on symbolic ones that would add guards and specialise the
        # graph (a recompile per batch size), so such a graph is not split at all.
        inputs: dict = {}
    elif kind == "backward":
        inputs = backward_inputs(gm.graph, forward)
    else:
        inputs = forward_inputs(gm.graph, static_input_idxs)
    placements = {k: propagate(gm.graph, inputs, k, OP_TABLE) for k in NANOBATCH_COUNTS[1:]}
    infeasible = {
        k: symbolic or why for k, result in placements.items()
        if symbolic or (why := feasibility(gm.graph, result, k, collectives))
    }
    space = variant_space(partitioning, placements[2], infeasible)
    k = opts.nanobatches
    chosen = placements[max(k, 2)]  # k = 1 reports what k = 2 would split
    interface = record_forward(gm.graph, chosen) if kind == "forward" else None
    fallback = infeasible.get(k) if k > 1 else None
    gm, variant, fallback = _apply_nanobatches(
        gm, example_inputs, label, k, fallback, partitioning, collectives,
        chosen, space, opts.agreement_timeout_s,
    )
    insert_clock_switch(gm.graph, label)
    gm.graph.lint()
    gm.recompile()
    estimate, not_costed = _estimate(gm, label, device)
    report = reports.GraphReport.build(
        label, kind, num_nodes, opts.lowering, collectives, partitioning,
        device=device.name, estimate=estimate, notes=(not_costed,) if not_costed else (),
        nanobatches=k if variant else 1, fallback_reason=fallback,
        variants=space, variant=variant, barriers=chosen.barriers,
        split_collectives=sum(per_nanobatch(chosen.placements[c.node]) for c in collectives),
    )
    return PassResult(gm, report, interface)


def symbolic_shapes(graph: torch.fx.Graph) -> str | None:
    """Why ``graph`` is not split because its inputs have symbolic sizes (None: they don't)."""
    for node in graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if isinstance(val, torch.SymInt) or (
            isinstance(val, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in val.shape)
        ):
            return (
                f"{node.name} has symbolic sizes (dynamic shapes): kareus splits only graphs "
                "of static shapes, so that it never specialises a dynamic graph"
            )
    return None


def _apply_nanobatches(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    label: str,
    k: int,
    fallback: str | None,
    partitioning: GraphPartitioning,
    collectives: Sequence[Collective],
    placements: PlacementResult,
    space: VariantSpace,
    timeout_s: float,
) -> tuple[torch.fx.GraphModule, Variant | None, str | None]:
    """The graph in ``k`` nanobatches, the variant that runs, or the graph and why not.

    Every rank must run the same collectives: the ranks of the graph's collectives compare
    their decisions (through the store, never a collective: ``consensus.agree``) before any
    takes effect, also where this rank asked for no rewrite. Sub-communicators for resource
    caps are created (a collective call) only after that, so no rank creates one alone.
    """
    variant = rewritten = None
    if k > 1 and fallback is None:
        variant = _choose_variant(label, space, k)
        slots_only = Schedule(k, variant.slots, (None,) * len(variant.slots))
        try:
            rewritten = nanobatch_graph(
                gm, partitioning, collectives, placements, slots_only, example_inputs, exclusive_kinds
            )
        except CannotRewrite as exc:
            fallback, variant = str(exc), None
    if collectives:
        verdict = agree(
            _agreement_key(graph_hash(gm.graph, shapes=False)), variant,
            (c.group_name for c in collectives), timeout_s=timeout_s,
        )
        if not verdict:
            fallback = f"the ranks did not confirm one decision ({verdict.reason}); runs unrewritten"
    if variant is None or fallback:
        return gm, None, fallback
    if any(cap is not None for cap in variant.resources):
        rewritten = nanobatch_graph(
            gm, partitioning, collectives, placements, space.schedule(variant), example_inputs,
            exclusive_kinds,
        )
    return rewritten, variant, None


_compiles_of: collections.Counter[str] = collections.Counter()
_compiles_lock = threading.Lock()


def _agreement_key(graph: str) -> str:
    """The graph's hash (without shapes: data-dependent sizes differ between ranks) and how
    often this process compiled it before: the n-th compile of a graph on one rank pairs
    with the n-th on the others (a program compiled twice with other options agrees afresh;
    a rank that compiled it once more than the others times out there, and its peers then
    fall back too, at the same compile)."""
    with _compiles_lock:
        _compiles_of[graph] += 1
        return f"{graph}.{_compiles_of[graph]}"


def _estimate(gm: torch.fx.GraphModule, label: str, device: Device) -> tuple[Measurement | None, str | None]:
    """Modelled time and energy at the default clock (only a simulated GPU can tell at
    compile time), or why the graph could not be costed: an estimate never fails a compile."""
    if not isinstance(device, SimulatedGPU):
        return None, None
    world = dist.get_world_size() if dist.is_initialized() else 1
    try:
        return device.measure(Workload(label, gm=gm, world_size=world), device.search_clocks()[0]), None
    except Exception as exc:  # noqa: BLE001 - any model failure is reported, not raised
        log.warning("%s: %s cannot cost this graph: %s", label, device.name, exc)
        return None, f"{device.name} cannot cost this graph: {type(exc).__name__}: {exc}"
