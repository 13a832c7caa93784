"""Stage 3 of 3 (analyse -> decide -> apply): the graph that runs, from a choice.

``apply`` materialises the chosen variant (the k-way rewrite, each collective issued at
its slot, on the process group the runtime created for its resources) and puts the
chosen clock's switch at the graph's entry. It returns a new GraphModule and leaves the
analysed one untouched, so one analysis serves many choices (a search). Variants of one
count differ only in node order and group names: their k-way graph is emitted and its
tensor metadata propagated once per analysis and count (``NanobatchRewrite``).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
import torch.fx

from kareus.codegen.clock_switch import insert_clock_switch
from kareus.codegen.nanobatch import NanobatchRewrite, Schedule
from kareus.passes.analyse import GraphAnalysis
from kareus.passes.decide import Choice


def apply(
    gm: torch.fx.GraphModule,
    analysis: GraphAnalysis,
    choice: Choice,
    *,
    groups: Sequence[str | None] | None = None,
    clocked: bool = True,
) -> torch.fx.GraphModule:
    """``gm`` as ``choice`` says: rewritten into its variant (``CannotRewrite`` if the
    emitter meets what it cannot rewrite) and clocked (``clocked=False``: no switch; its
    caller asks for the clock, as a pipeline instruction does for each of its graphs).

    ``groups[p]``: the process group partition ``p``'s collective is issued on (None: the
    graph's own), as the runtime materialised it for the variant's resources after the
    ranks agreed; no group is created here.
    """
    variant = choice.variant
    if variant is None:
        new = _copy(gm)
    else:
        k = variant.nanobatches
        if groups is None:
            groups = (None,) * len(variant.slots)
        if k not in analysis.rewrites:
            analysis.rewrites[k] = NanobatchRewrite(
                gm,
                analysis.partitioning,
                analysis.collectives,
                analysis.placements[k],
                k,
                analysis.example_inputs,
                lambda group: analysis.exclusive.get(group, frozenset()),
                analysis.table,
            )
        new = analysis.rewrites[k].materialise(Schedule(k, variant.slots, tuple(groups)))
    if clocked:
        insert_clock_switch(new.graph, analysis.label, choice.clock_mhz)
    new.graph.lint()
    new.recompile()
    return new


def _copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A GraphModule of a copy of ``gm``'s graph (node metadata included)."""
    graph = torch.fx.Graph()
    graph._codegen = copy.deepcopy(gm.graph._codegen)  # the calling convention (pytree specs)
    output = graph.graph_copy(gm.graph, {})
    graph.output(output)
    return torch.fx.GraphModule(gm, graph)
