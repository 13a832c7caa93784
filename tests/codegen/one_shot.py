"""The rewrite of one graph for one schedule, as tests compare and check it."""

from __future__ import annotations

from collections.abc import Sequence

import torch.fx

from kareus.codegen.nanobatch import NanobatchRewrite, Schedule
from kareus.passes.collectives import Collective
from kareus.passes.partition import GraphPartitioning
from kareus.passes.placement import PlacementResult


def nanobatch_graph(
    gm: torch.fx.GraphModule,
    partitioning: GraphPartitioning,
    collectives: Sequence[Collective],
    placements: PlacementResult,
    schedule: Schedule,
    example_inputs: Sequence[object],
) -> torch.fx.GraphModule:
    """A new GraphModule computing what ``gm`` computes, in ``schedule.nanobatches`` pieces:
    a ``NanobatchRewrite`` materialised once (what the backend does for one variant)."""
    rewrite = NanobatchRewrite(
        gm, partitioning, collectives, placements, schedule.nanobatches, example_inputs
    )
    return rewrite.materialise(schedule)
