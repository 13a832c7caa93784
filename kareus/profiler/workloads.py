"""What the profiler measures: one partition of a graph alone, in one variant.

A partition's workload is the compute of its segment for one nanobatch with the other
nanobatch's collective issued at a launch slot, on random inputs of one nanobatch's shapes,
so that partitions sharing a key are measured once (REFERENCE.md section 1). Its graph is
what the rewrite emits of the partition (``codegen.nanobatch.isolated_partition``); this
module adds what measuring it needs: inputs, tensor metadata, a lowering.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from kareus.codegen.nanobatch import isolated_partition
from kareus.devices.base import Workload
from kareus.errors import KareusError
from kareus.passes import sizes
from kareus.passes.collectives import size_hint
from kareus.passes.ops import OP_TABLE, OpTable
from kareus.passes.partition import Partition
from kareus.passes.placement import NodePlacement, PlacementResult, Split

Lower = Callable[[torch.fx.GraphModule, list[torch.Tensor]], Callable[[list[Any]], Any]]
"""Compiles a graph for its example inputs into a boxed callable (``codegen.lowering.lower``
with the lowering the training graphs get)."""


def partition_workload(
    partition: Partition,
    placements: PlacementResult,
    k: int,
    slot: int,
    group_name: str | None = None,
    world_size: int = 1,
    lower: Lower | None = None,
    *,
    table: OpTable = OP_TABLE,
) -> Workload:
    """One partition alone, for isolated profiling: a nanobatch's compute of the segment
    with the other nanobatch's collective issued at ``slot`` and waited at the end
    (``codegen.nanobatch.isolated_partition``), on random inputs of one nanobatch's shapes
    (run it where the collective's group exists; a graph of symbolic sizes at their
    example values, as Inductor benchmarks one). The graph's metadata comes from fake
    inputs; the real ones are made at the first run, so a model that only costs the graph
    never allocates them. ``lower`` compiles the variant (at its first run) as the training
    graph will run, so that a real GPU measures the kernels that will run; without it the
    variant runs op by op.
    """
    alone = isolated_partition(partition, placements, k, slot, group_name, table=table)
    specs = [(_input_value(partition, node), placements.placements[node], node.op == "placeholder")
             for node in alone.inputs]
    gm = alone.gm
    mode = FakeTensorMode()
    with mode:
        fake_inputs = [_random_like(*spec, k) for spec in specs]
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fake_inputs)

    @functools.cache
    def inputs() -> list[torch.Tensor]:
        return [_random_like(*spec, k) for spec in specs]

    @functools.cache
    def runner() -> Callable[[list[Any]], Any]:
        if lower is None:
            return lambda args: gm(*args)
        # Measured while a training graph compiles: this compile gets its own context
        # (fake mode, metadata), never the one of the graph around it.
        with torch._guards.tracing(None):
            return lower(gm, inputs())

    return Workload(
        f"partition {partition.index} ({partition.key}) k={k} slot={slot}",
        gm=gm,
        run=lambda: runner()(list(inputs())),  # a boxed callable may clear its list
        world_size=world_size,
    )


class NonTensorInputError(KareusError, TypeError):
    """A partition's compute takes a value that is neither a tensor nor a size: no random
    input stands for it, so the partition cannot run alone (the graph compiles without its
    profile)."""


def _input_value(partition: Partition, node: torch.fx.Node) -> torch.Tensor | int:
    """The value ``node`` gives the partition's compute: a tensor (random inputs stand for
    it), or a size of the graph (a symbolic one at its example value, like the tensors)."""
    val = node.meta.get("val")
    if isinstance(val, (int, torch.SymInt)) and not isinstance(val, bool):
        return size_hint(val)
    if not isinstance(val, torch.Tensor):
        raise NonTensorInputError(
            f"partition {partition.index}: its compute takes {node.name}, which is neither "
            f"a tensor nor a size ({type(val).__name__})"
        )
    return val


def _random_like(
    val: torch.Tensor | int, p: NodePlacement, sliced: bool, k: int
) -> torch.Tensor | int:
    """Random values laid out as ``val`` (its strides: the graph may view it in ways only
    that layout allows); one nanobatch of it where it is split: a slice of the whole where
    the rewrite takes one (``sliced``: a graph input), else as an op computes one
    nanobatch's value, dense in ``val``'s order of dims (torch 2.11's collectives take
    contiguous inputs only). A size is itself."""
    if isinstance(val, int):
        return val
    shape = [size_hint(d) for d in val.shape]  # a symbolic size's example (no guard)
    split = isinstance(p, Split)
    if split and not sliced:
        shape[p.dim] = _first_piece(val, p, k)
    strides = [size_hint(s) for s in val.stride()]
    stored = [1 if strides[d] == 0 else size for d, size in enumerate(shape)]
    new = torch.empty_strided(stored, _dense_strides(strides, stored), dtype=val.dtype,
                              device=val.device)
    if val.dtype.is_floating_point:
        new.normal_()
    else:
        new.zero_()
    new = new.expand(shape)  # broadcast dims (stride 0) again
    if split and sliced:
        return new.narrow(p.dim, 0, _first_piece(val, p, k))
    return new


def _first_piece(val: torch.Tensor, p: Split, k: int) -> int:
    """Rows of nanobatch 0 along the split dim, cut as the rewrite cuts them: a k-th, or
    for a symbolic dim of ``c * R`` rows ``c * (R // k)`` at its example value."""
    size = sizes.size(val.shape[p.dim])
    if not sizes.symbolic(size):
        return size // k
    coeff, _ = sizes.units(size)
    return coeff * sizes.chunk_start(size.hint // coeff, 1, k)


def _dense_strides(given: list[int], shape: list[int]) -> list[int]:
    """Strides of a dense tensor of ``shape`` whose dims lie in memory in the order of
    strides ``given``; dims broadcast there (stride 0: grouped-query attention's keys over
    heads) stay broadcast."""
    strides = [0] * len(shape)
    step = 1
    for d in sorted(range(len(shape)), key=lambda d: (given[d], -d)):  # inner first
        if given[d] != 0:
            strides[d] = step
            step *= shape[d]
    return strides
