"""Each pipeline stage's graphs for one rank, traced over fake tensors, with their frontiers.

Compiled per block, as torchtitan compiles: the token embedding, each transformer block,
and the tail (final norm, output projection and cross-entropy loss) are separate
``torch.compile`` regions with the kareus backend. Identical blocks share one compiled
forward and one backward graph (Dynamo lifts the parameters to inputs and does not
recompile per layer; checked on every trace: a second block that compiles anew is a
``TraceError``). So one forward and backward of embedding -> two blocks -> tail, on fake
bf16 tensors of one microbatch under a fake process group of ``tp`` ranks, gives every
distinct graph of every stage: a block's graphs do not depend on what feeds it (the
embedding, or a stage input received from the previous stage: both are activations that
require grad), nor on how many blocks follow. A stage's instructions are then these graphs
counted: its forward is ``[(embed, 1)]`` on the first stage, ``(block, layers)``, and
``[(tail, 1)]`` on the last; its backward the reverse. Tracing costs the same for 2 layers
or 80: it grows with the distinct graphs and their partitions, never with layers or
stages.

Each graph's frontier is the planner's (``StepPlanner.frontiers``): with
``nanobatches="auto"`` every graph is planned as it compiles, each distinct partition
profiled on the device (a simulated one answers analytically) through the profile store
in ``cache_dir``, and its frontier built over the nanobatch counts, launch slots, SMs and
clocks. No budget is needed: the step plan the backend makes as a by-product (the fastest,
its default) is not used. Frontiers are per GPU, times in seconds and energies in joules
(effective: less static power, as the planner plans them).

Full recomputation (``recompute="full"``) models Megatron-style full activation
checkpointing of every transformer layer: a backward instruction runs the layer's forward
again before its backward, so the block's forward graph is counted again in the backward
instruction. The backward graph traced is the one without checkpointing (what AOT
autograd gives with activations saved); the embedding and the tail are not recomputed.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kareus.backend import KareusBackend
from kareus.errors import KareusError
from kareus.models.llama import Llama, fake_parallel_llama
from kareus.offline.workload import Workload
from kareus.planner.compose import FrontierPoint
from kareus.planner.graph import GraphFrontier
from kareus.planner.step import StepPlanner

GraphCount = tuple[GraphFrontier, int]
"""A graph and how many times one instruction runs it."""


class TraceError(KareusError, RuntimeError):
    """A workload's graphs could not be traced and costed (the message says which)."""


@dataclass(frozen=True)
class PieceGraphs:
    """One compiled region's forward and backward graph."""

    forward: GraphFrontier
    backward: GraphFrontier


@dataclass(frozen=True)
class TracedModel:
    """Every distinct graph of a workload's stages: the token embedding, one transformer
    block (every layer's), and the tail (final norm, output projection, loss). Labels are
    "embed/forward", "block/backward", ...; ``graph_hash`` is the graph's structural
    hash, as in its ``GraphReport``."""

    embed: PieceGraphs
    block: PieceGraphs
    tail: PieceGraphs

    @property
    def graphs(self) -> tuple[GraphFrontier, ...]:
        return tuple(g for piece in (self.embed, self.block, self.tail)
                     for g in (piece.forward, piece.backward))


@dataclass(frozen=True)
class StageGraphs:
    """What one microbatch's forward and backward instructions of a stage run on each of
    its GPUs: graphs in order, each with its count; ``layers``: the model's layers the
    stage holds."""

    stage: int
    layers: range
    forward: tuple[GraphCount, ...]
    backward: tuple[GraphCount, ...]

    def baseline(self, instruction: str) -> FrontierPoint:
        """The "forward" or "backward" instruction's cost with every graph unrewritten at
        the default clock: its graphs' baselines, counted."""
        graphs = {"forward": self.forward, "backward": self.backward}[instruction]
        return FrontierPoint(
            sum(n * g.baseline.time_s for g, n in graphs),
            sum(n * g.baseline.effective_energy_j for g, n in graphs),
        )


def trace_stages(
    workload: Workload,
    device: str = "sim:h200",
    *,
    cache_dir: str | Path | None = None,
    search_budget: int = 32,
    search: str = "grid",
    seed: int = 0,
) -> tuple[StageGraphs, ...]:
    """Each of ``workload``'s pipeline stages, its instructions' graphs and counts, costed
    on ``device`` (a kareus ``device`` option: ``"sim:<preset>"``, a GPU .json...)."""
    traced = trace_model(workload, device, cache_dir=cache_dir, search_budget=search_budget,
                         search=search, seed=seed)
    return stage_graphs(workload, traced)


def stage_graphs(workload: Workload, traced: TracedModel) -> tuple[StageGraphs, ...]:
    """The stages of ``workload`` composed from its distinct graphs."""
    stages = []
    last = workload.pp - 1
    for s, layers in enumerate(workload.stage_layers):
        n = len(layers)
        head = [(traced.embed, 1)] if s == 0 else []
        tail = [(traced.tail, 1)] if s == last else []
        forward = [(p.forward, k) for p, k in [*head, (traced.block, n), *tail]]
        recomputed = [(traced.block.forward, n)] if workload.recompute == "full" else []
        backward = [
            *[(p.backward, k) for p, k in tail],
            *recomputed,
            *[(p.backward, k) for p, k in [(traced.block, n), *head]],
        ]
        stages.append(StageGraphs(s, layers, tuple(forward), tuple(backward)))
    return tuple(stages)


def trace_model(
    workload: Workload,
    device: str = "sim:h200",
    *,
    cache_dir: str | Path | None = None,
    search_budget: int = 32,
    search: str = "grid",
    seed: int = 0,
) -> TracedModel:
    """Trace and cost every distinct graph of ``workload`` (the module docstring says
    how), in this process: under a fake process group of ``workload.tp`` ranks (made for
    the trace and destroyed after it; a fake default group of that size already made is
    used as it is), with Dynamo's caches reset before and after (what was compiled before
    compiles again at its next call). ``search``: the backend's option; "grid" by default,
    every variant of every partition measured: on a simulated GPU one costs about 4 ms, a
    Bayesian proposal about 0.6 s."""
    backend = KareusBackend({
        "device": device, "nanobatches": "auto", "lowering": "eager",
        "cache_dir": None if cache_dir is None else str(cache_dir),
        "search_budget": search_budget, "search": search, "seed": seed,
    })
    with _fake_group(workload.tp), _fresh_dynamo():
        return _trace(workload, backend)


class _Tail(nn.Module):
    """The last stage's tail: final norm, output projection (its logits replicated, as
    ``parallelize_llama`` gives them) and mean cross-entropy on fp32 logits."""

    def __init__(self, model: Llama) -> None:
        super().__init__()
        self.norm, self.output = model.norm, model.output

    def forward(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.output(self.norm(h))
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def run_microbatch(
    workload: Workload,
    backend: KareusBackend,
    compiled: Callable[[str, int], None] = lambda role, block: None,
) -> None:
    """One forward and backward of one microbatch through ``workload``'s pieces, compiled
    per block with ``backend`` on fake tensors (two blocks stand for all of them; under a
    fake process group of ``workload.tp`` ranks, see ``trace_model``): ``compiled(role,
    block)`` after each piece's forward ("embed", "block" with its number from 1, "tail")."""
    cfg = dataclasses.replace(workload.traced_model, n_layers=min(2, workload.model.n_layers))
    mb, seq = workload.microbatch_size, workload.seq
    with fake_parallel_llama(cfg, workload.tp, sequence_parallel=workload.sp) as model:
        embed = torch.compile(model.tok_embeddings, backend=backend)
        blocks = [torch.compile(block, backend=backend) for block in model.layers]
        tail = torch.compile(_Tail(model), backend=backend)
        h = embed(torch.zeros(mb, seq, dtype=torch.long))
        compiled("embed", 0)
        for i, block in enumerate(blocks, start=1):
            h = block(h, model.rope_cos, model.rope_sin)
            compiled("block", i)
        loss = tail(h, torch.zeros(mb, seq, dtype=torch.long))
        compiled("tail", 0)
        loss.backward()


def compile_microbatch(workload: Workload, backend: KareusBackend) -> None:
    """``run_microbatch`` as ``trace_model`` runs it: under a fake process group of
    ``workload.tp`` ranks, Dynamo reset before and after; what a compile of the workload
    with any options (a ``plan`` kareus plan wrote) does to its graphs."""
    with _fake_group(workload.tp), _fresh_dynamo():
        run_microbatch(workload, backend)


def _trace(workload: Workload, backend: KareusBackend) -> TracedModel:
    found = _Regions(backend.planner)
    regions: dict[str, int] = {}

    def compiled(role: str, block: int) -> None:
        if block > 1:
            found.none_new(f"transformer block {block}")
        else:
            what = {"embed": "the token embedding", "block": "the first transformer block",
                    "tail": "the tail (norm, output, loss)"}[role]
            regions[role] = found.new_forward(what)

    run_microbatch(workload, backend, compiled)
    return TracedModel(**{role: found.piece(role, region) for role, region in regions.items()})


class _Regions:
    """The regions the planner holds frontiers for, as each module's first call compiles
    its forward."""

    def __init__(self, planner: StepPlanner) -> None:
        self.planner = planner
        self.seen: set[int] = set()

    def _forwards(self) -> set[int]:
        return {r for kind, r, _ in self.planner.frontiers() if kind == "forward"}

    def new_forward(self, what: str) -> int:
        new = self._forwards() - self.seen
        if len(new) != 1:
            raise TraceError(
                f"{what} compiled {len(new)} planned forward graphs, not one: "
                f"{self._why(new)}"
            )
        self.seen |= new
        return new.pop()

    def none_new(self, what: str) -> None:
        new = self._forwards() - self.seen
        if new:
            raise TraceError(
                f"{what} compiled a forward graph of its own: Dynamo recompiled for it, so "
                "identical blocks would be traced once per layer; counting one block's "
                "graphs per layer would not be what runs"
            )

    def piece(self, role: str, region: int) -> PieceGraphs:
        graphs = {kind: f for kind, r, f in self.planner.frontiers() if r == region}
        if set(graphs) != {"forward", "backward"}:
            raise TraceError(f"{role}: compiled graphs {sorted(graphs)}, not a forward and "
                             "its backward")
        return PieceGraphs(*(dataclasses.replace(graphs[k], label=f"{role}/{k}")
                             for k in ("forward", "backward")))

    def _why(self, new: set[int]) -> str:
        if new:
            return f"regions {sorted(new)} (a graph break splits it)"
        return ("none planned (a graph with no frontier: the kareus log says why, "
                "e.g. a device that cannot cost a whole graph)")


@contextlib.contextmanager
def _fake_group(tp: int) -> Iterator[None]:
    """A fake default process group of ``tp`` ranks (this is rank 0) for the duration."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        backend, size = dist.get_backend(), dist.get_world_size()
        if backend != "fake" or size != tp:
            raise TraceError(
                f"the default process group ({backend}, {size} ranks) is not a fake one of "
                f"tp={tp} ranks: trace offline in a process without a process group"
            )
        yield
        return
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    try:
        yield
    finally:
        torch._dynamo.reset()

