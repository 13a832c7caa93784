"""``torch.compile(model, backend="kareus", options={...})``.

The backend is glue: Inductor's AOT path (decompositions, AOT autograd, min-cut
partitioner) hands us the forward and backward graphs one at a time (the backward lazily,
at the first backward call); each goes through the pass pipeline and is lowered.
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.fx
from torch._inductor.compile_fx import compile_fx

import torch.distributed as dist

from kareus import reports
from kareus.codegen.clock import NullClockController, active_controller, set_active_controller
from kareus.codegen.lowering import lower, pinned_schedule_config
from kareus.options import KareusOptionError, KareusOptions
from kareus.passes.collectives import find_collectives
from kareus.passes.frequency import insert_clock_switch
from kareus.passes.partition import partition_graph
from kareus.profiler.devices import Device, Measurement, SimulatedGPU, Workload
from kareus.profiler.devices.nvml import NvmlGPU
from kareus.profiler.devices.resolve import resolve_device

log = logging.getLogger("kareus")

_regions = itertools.count()


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

    def inner_compile(graph_module: torch.fx.GraphModule, inputs: Sequence[Any], **kwargs: Any):
        if kwargs.get("is_backward"):
            kind = "backward"
        elif kwargs.get("is_inference"):
            kind = "inference"
        else:
            kind = "forward"
        report = run_passes(graph_module, f"r{region}/{kind}", kind, opts, device)
        reports.record(report)
        log.info(
            "%s: %d collectives, %d partitions%s", report.label, len(report.collectives),
            len(report.partitions), "".join(f"\n  {n}" for n in report.notes),
        )
        if opts.explain:
            reports.print_report(report)
        return lower(graph_module, inputs, opts.lowering, **kwargs)

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


def run_passes(
    gm: torch.fx.GraphModule, label: str, kind: str, opts: KareusOptions, device: Device
) -> reports.GraphReport:
    """Analyse ``gm`` and rewrite it in place; returns what was found and done."""
    num_nodes = len(gm.graph.nodes)
    collectives = find_collectives(gm.graph)
    partitioning = partition_graph(gm.graph, collectives)
    insert_clock_switch(gm.graph, label)
    gm.graph.lint()
    gm.recompile()
    return reports.GraphReport.build(
        label, kind, num_nodes, opts.lowering, collectives, partitioning,
        device=device.name, estimate=_estimate(gm, label, device),
    )


def _estimate(gm: torch.fx.GraphModule, label: str, device: Device) -> Measurement | None:
    """Modelled time and energy at the default clock; only a simulated GPU can tell at compile time."""
    if not isinstance(device, SimulatedGPU):
        return None
    world = dist.get_world_size() if dist.is_initialized() else 1
    return device.measure(Workload(label, gm=gm, world_size=world), device.search_clocks()[0])
