"""Insert GPU clock switches into a graph.

The clock is chosen per graph (one forward or backward of a microbatch is one
"instruction", as in Perseus): a ``kareus::set_clock`` call at the graph's entry, before
any compute, asks the active controller for the graph's clock.
"""

from __future__ import annotations

import torch.fx

from kareus.passes.ops import DEFAULT_CLOCK_MHZ, SET_CLOCK


def insert_clock_switch(
    graph: torch.fx.Graph, graph_label: str, mhz: int = DEFAULT_CLOCK_MHZ
) -> torch.fx.Node:
    """Put ``set_clock(graph_label, mhz)`` right after the placeholders and return it."""
    placeholders = list(graph.find_nodes(op="placeholder"))
    anchor = placeholders[-1] if placeholders else None
    with graph.inserting_after(anchor) if anchor else graph.inserting_before(None):
        return graph.call_function(SET_CLOCK, (graph_label, mhz))
