"""``torch.compile(model, backend="kareus", options={...})``.

The backend is glue: Inductor's AOT path (decompositions, AOT autograd, min-cut
partitioner) hands us the forward and backward graphs one at a time (the backward lazily,
at the first backward call); each goes through the pass pipeline and is lowered.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.fx
from torch._inductor.compile_fx import compile_fx

from kareus import reports
from kareus.codegen.lowering import lower, pinned_schedule_config
from kareus.options import KareusOptionError, KareusOptions
from kareus.passes.collectives import find_collectives
from kareus.passes.frequency import insert_clock_switch
from kareus.passes.partition import partition_graph

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
    region = next(_regions)

    def inner_compile(graph_module: torch.fx.GraphModule, inputs: Sequence[Any], **kwargs: Any):
        if kwargs.get("is_backward"):
            kind = "backward"
        elif kwargs.get("is_inference"):
            kind = "inference"
        else:
            kind = "forward"
        report = run_passes(graph_module, f"r{region}/{kind}", kind, opts)
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


def run_passes(
    gm: torch.fx.GraphModule, label: str, kind: str, opts: KareusOptions
) -> reports.GraphReport:
    """Analyse ``gm`` and rewrite it in place; returns what was found and done."""
    num_nodes = len(gm.graph.nodes)
    collectives = find_collectives(gm.graph)
    partitioning = partition_graph(gm.graph, collectives)
    insert_clock_switch(gm.graph, label)
    gm.graph.lint()
    gm.recompile()
    return reports.GraphReport.build(label, kind, num_nodes, opts.lowering, collectives, partitioning)
