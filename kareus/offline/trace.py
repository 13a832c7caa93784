"""Each pipeline stage's graphs for one rank, traced over fake tensors, with their frontiers.

Two ways of compiling (``Workload.regions``):

- "block", as torchtitan compiles: the token embedding, each transformer block, and the
  tail (final norm, output projection and loss) are separate ``torch.compile`` regions
  with the kareus backend. Identical blocks share one compiled forward and one backward
  graph (Dynamo lifts the parameters to inputs and does not recompile per layer; checked
  on every trace: a second block that compiles anew is a ``TraceError``). So one forward
  and backward of embedding -> two blocks -> tail, on fake bf16 tensors of one microbatch
  under a fake process group of ``tp`` ranks, gives every distinct graph of every stage:
  a block's graphs do not depend on what feeds it, nor on how many blocks follow. A
  stage's instructions are then these graphs counted: its forward is ``[(embed, 1)]`` on
  the first stage, ``(block, layers)``, and ``[(tail, 1)]`` on the last; its backward the
  reverse. Tracing costs the same for 2 layers or 80. Nanobatches are joined at every
  block's end, and each block's last collective has nothing of its own block left to hide
  behind.
- "stage", as the method's own engine runs a stage: each pipeline stage (its layers, the
  embedding on the first, the tail on the last) is one region, one forward and one
  backward graph, traced with all its layers. Nanobatches flow from block to block
  without a join, so one nanobatch's last collective of block L runs while the other
  computes block L + 1. Stages of the same shape share their graphs.

Each graph's frontier is the planner's (``StepPlanner.frontiers``): with
``nanobatches="auto"`` every graph is planned as it compiles, each distinct partition
profiled on the device (a simulated one answers analytically) through the profile store
in ``cache_dir``, and its frontier built over the nanobatch counts, launch slots, SMs and
clocks. No budget is needed: the step plan the backend makes as a by-product (the fastest,
its default) is not used. Frontiers are per GPU, times in seconds and energies in joules
(effective: less static power, as the planner plans them).

Full recomputation (``recompute="full"``) is Megatron's and torchtitan's full activation
checkpointing of every transformer layer: each block runs under
``torch.utils.checkpoint`` (non-reentrant), so its forward graph saves only the block's
input and its backward graph recomputes the forward before differentiating it (kareus's
partitioner hands that input over in nanobatch pieces, ``codegen.partitioner``). The
embedding and the tail are not recomputed.
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
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from kareus.backend import KareusBackend
from kareus.errors import KareusError
from kareus.interrupts import raise_if_interrupted
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
    backend: KareusBackend | None = None,
) -> tuple[StageGraphs, ...]:
    """Each of ``workload``'s pipeline stages, its instructions' graphs and counts, costed
    on ``device`` (a kareus ``device`` option: ``"sim:<preset>"``, a GPU .json...),
    compiled as ``workload.regions`` says. ``backend``: the one to compile with instead
    (its options as the tracing one's: ``tracing_options``), e.g. one that keeps the
    graphs for a closer look."""
    backend = backend or KareusBackend(
        tracing_options(device, cache_dir, search_budget, search, seed))
    if workload.regions == "stage":
        with fake_group(workload.tp), _fresh_dynamo():
            return _trace_by_stage(workload, backend)
    with fake_group(workload.tp), _fresh_dynamo():
        return stage_graphs(workload, _trace(workload, backend))


def stage_graphs(workload: Workload, traced: TracedModel) -> tuple[StageGraphs, ...]:
    """The stages of ``workload`` composed from its distinct graphs (compiled per block:
    under full recomputation the block's backward graph recomputes its forward)."""
    stages = []
    last = workload.pp - 1
    for s, layers in enumerate(workload.stage_layers):
        n = len(layers)
        head = [(traced.embed, 1)] if s == 0 else []
        tail = [(traced.tail, 1)] if s == last else []
        pieces = [*head, (traced.block, n), *tail]
        forward = [(p.forward, k) for p, k in pieces]
        backward = [(p.backward, k) for p, k in reversed(pieces)]
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
    """Trace and cost every distinct graph of ``workload`` compiled per block (the module
    docstring says how), in this process: under a fake process group of ``workload.tp``
    ranks (made for the trace and destroyed after it; a fake default group of that size
    already made is used as it is), with Dynamo's caches reset before and after (what was
    compiled before compiles again at its next call). ``search``: the backend's option;
    "grid" by default, every variant of every partition measured: on a simulated GPU one
    costs about 4 ms, a Bayesian proposal about 0.6 s."""
    backend = KareusBackend(tracing_options(device, cache_dir, search_budget, search, seed))
    with fake_group(workload.tp), _fresh_dynamo():
        return _trace(dataclasses.replace(workload, regions="block"), backend)


def tracing_options(
    device: str, cache_dir: str | Path | None = None, search_budget: int = 32,
    search: str = "grid", seed: int = 0,
) -> dict[str, object]:
    """The kareus options a trace compiles with: every graph planned ("auto") on
    ``device``, lowered eagerly (nothing runs: fake tensors)."""
    return {
        "device": device, "nanobatches": "auto", "lowering": "eager",
        "cache_dir": None if cache_dir is None else str(cache_dir),
        "search_budget": search_budget, "search": search, "seed": seed,
    }


class _Tail(nn.Module):
    """The last stage's tail: final norm, output projection and mean cross-entropy on fp32
    logits. The logits are as ``parallelize_llama`` leaves them: replicated (all-gathered),
    or sharded on the vocabulary with ``loss_parallel``, the cross-entropy then run
    vocab-parallel under torch's ``loss_parallel()`` (entered by ``run_microbatch``) and its
    replicated loss returned as the plain tensor each rank holds, as Megatron's is. (A
    DTensor output hands AOT autograd its device mesh as an output, which torch 2.13's
    partitioner can take for the tangent's: "tangents_2 was invalid, but is output".)"""

    def __init__(self, model: Llama) -> None:
        super().__init__()
        self.norm, self.output = model.norm, model.output

    def forward(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.output(self.norm(h))
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        return loss.to_local() if isinstance(loss, DTensor) else loss


class _Block(nn.Module):
    """A transformer block as the workload runs it: under ``torch.utils.checkpoint`` with
    full recomputation (non-reentrant, as torchtitan's ``checkpoint_wrapper``)."""

    def __init__(self, block: nn.Module, recompute: bool) -> None:
        super().__init__()
        self.block, self.recompute = block, recompute

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.recompute:
            return checkpoint(self.block, h, cos, sin, use_reentrant=False)
        return self.block(h, cos, sin)


class _Stage(nn.Module):
    """A pipeline stage as one region: the embedding on the first stage, its blocks, the
    tail on the last (its input: the tokens on the first stage, else the activations)."""

    def __init__(self, model: Llama, layers: range, first: bool, last: bool,
                 recompute: bool) -> None:
        super().__init__()
        self.embed = model.tok_embeddings if first else None
        self.blocks = nn.ModuleList(_Block(model.layers[i], recompute) for i in layers)
        self.tail = _Tail(model) if last else None

    def forward(
        self, x: torch.Tensor, labels: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        h = x if self.embed is None else self.embed(x)
        for block in self.blocks:
            h = block(h, cos, sin)
        return h if self.tail is None else self.tail(h, labels)


def run_microbatch(
    workload: Workload,
    backend: KareusBackend,
    compiled: Callable[[str, int], None] = lambda role, index: None,
) -> None:
    """One forward and backward of one microbatch through ``workload``'s regions, compiled
    with ``backend`` on fake tensors (under a fake process group of ``workload.tp`` ranks,
    see ``trace_model``): per block (two blocks stand for all of them), ``compiled(role,
    index)`` after each region's forward ("embed", "block" with its number from 1,
    "tail"), or per stage ("stage" and its index). The model is laid out as
    ``workload.layout`` says; with ``workload.vocab_parallel_loss`` the tail's forward and
    the backward run under ``loss_parallel()`` (its docs: the backward must run under it
    too)."""
    from torch.distributed.tensor.parallel import loss_parallel

    per_stage = workload.regions == "stage"
    layers = workload.model.n_layers if per_stage else min(2, workload.model.n_layers)
    cfg = dataclasses.replace(workload.traced_model, n_layers=layers)
    vocab_parallel = workload.vocab_parallel_loss
    recompute = workload.recompute == "full"
    with fake_parallel_llama(cfg, workload.tp, sequence_parallel=workload.sp,
                             layout=workload.layout, loss_parallel=vocab_parallel) as model:
        tokens = torch.zeros(workload.microbatch_size, workload.seq, dtype=torch.long)
        parallel = loss_parallel() if vocab_parallel else contextlib.nullcontext()
        if per_stage:
            last = workload.pp - 1
            h = tokens
            with parallel:
                for s, share in enumerate(workload.stage_layers):
                    # Each stage compiles in a process of its own in a pipeline: Dynamo
                    # recompiling one stage's code for the next fails (torch 2.13: a
                    # RecursionError tracing the second stage's joint graph).
                    torch._dynamo.reset()
                    stage = _Stage(model, share, s == 0, s == last, recompute)
                    h = torch.compile(stage, backend=backend)(h, tokens, model.rope_cos,
                                                              model.rope_sin)
                    compiled("stage", s)
                    raise_if_interrupted()
                h.backward()
            return
        embed = torch.compile(model.tok_embeddings, backend=backend)
        blocks = [torch.compile(_Block(block, recompute), backend=backend)
                  for block in model.layers]
        tail = torch.compile(_Tail(model), backend=backend)
        h = embed(tokens)
        compiled("embed", 0)
        for i, block in enumerate(blocks, start=1):
            raise_if_interrupted()
            h = block(h, model.rope_cos, model.rope_sin)
            compiled("block", i)
        with parallel:
            raise_if_interrupted()
            loss = tail(h, tokens)
            compiled("tail", 0)
            raise_if_interrupted()
            loss.backward()


def compile_microbatch(workload: Workload, backend: KareusBackend) -> None:
    """``run_microbatch`` as ``trace_stages`` runs it: under a fake process group of
    ``workload.tp`` ranks, Dynamo reset before and after; what a compile of the workload
    with any options (a ``plan`` kareus plan wrote) does to its graphs."""
    with fake_group(workload.tp), _fresh_dynamo():
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


def _trace_by_stage(workload: Workload, backend: KareusBackend) -> tuple[StageGraphs, ...]:
    """Each stage's one forward and one backward graph: stages of one shape (neither first
    nor last, as many layers) run the graphs Dynamo compiled for the first of them."""
    found = _Regions(backend.planner)
    regions: list[int] = []
    last = workload.pp - 1
    shapes = [(s == 0, s == last, len(r)) for s, r in enumerate(workload.stage_layers)]

    def compiled(role: str, s: int) -> None:
        earlier = shapes.index(shapes[s])
        if earlier < s:
            found.none_new(f"stage {s} (as stage {earlier})")
            regions.append(regions[earlier])
        else:
            regions.append(found.new_forward(f"stage {s}"))

    run_microbatch(workload, backend, compiled)
    stages = []
    for s, (layers, region) in enumerate(zip(workload.stage_layers, regions, strict=True)):
        piece = found.piece(f"stage{shapes.index(shapes[s])}", region)
        stages.append(StageGraphs(s, layers, ((piece.forward, 1),), ((piece.backward, 1),)))
    return tuple(stages)


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
def fake_group(tp: int) -> Iterator[None]:
    """A fake default process group of ``tp`` ranks (this is rank 0) for the duration (one
    already made, fake and of that size, is used as it is)."""
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

