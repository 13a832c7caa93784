"""``kareus demo``: a small tensor-parallel Llama trained on this machine's CPU.

Spawns ``world_size`` gloo processes; each builds the same model, shards it with
PyTorch's tensor-parallel API, compiles it with ``backend="kareus"`` and trains it. With
``compare_eager`` an identical eager copy trains alongside, so losses and gradients of
the compiled model can be checked step by step (the end-to-end tests use this).

What every worker would refuse is checked once, before any is spawned (``check``); an error
kareus raises in a worker all the same (a budget no plan meets, found when the first step
compiles) comes back as a ``DemoError`` with that error's message, not as tracebacks.
"""

from __future__ import annotations

import os
import pickle
import random
import socket
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from kareus.devices.resolve import check_device
from kareus.errors import KareusError
from kareus.models.llama import Llama, LlamaConfig, check_tensor_parallel, parallelize_llama
from kareus.options import KareusOptions
from kareus.passes.analyse import GraphAnalysis
from kareus.passes.variants import Variant


@dataclass(frozen=True)
class DemoConfig:
    world_size: int = 2
    steps: int = 5
    batch: int = 4
    seq_len: int = 32
    model: LlamaConfig = field(default_factory=LlamaConfig)
    sequence_parallel: bool = False
    options: dict[str, object] = field(default_factory=dict)
    lr: float = 3e-3
    seed: int = 0
    compare_eager: bool = False
    # With compare_eager: compile the reference copy with these kareus options (None: eager).
    reference_options: dict[str, object] | None = None
    slot_seed: int | None = None  # draw every partition's launch slot at random (tests)


@dataclass
class RankResult:
    rank: int
    losses: list[float]
    reference_losses: list[float]
    max_grad_diff: list[float]  # per step, max |grad_compiled - grad_reference| over all params
    clock_switches: list[tuple[str, int]]
    reports: list[object]
    plan: object = None  # kareus.planner.plan.Plan this rank ran (None: none was made)


class DemoError(KareusError, RuntimeError):
    """The demo cannot run as configured, or a worker stopped on an error kareus raised."""


MAX_PARAMETERS = 1_000_000_000
"""The largest model the demo trains: on CPU, fp32 weights, gradients and AdamW's two
moments take 16 bytes a parameter (16 GB here), in every worker."""

MAX_ACTIVATION = 1_000_000_000
"""The most elements of one layer's activation (batch x sequence x dim, 4 GB in fp32); a
layer keeps tens of them for the backward."""

_RECORDED = 3  # a worker's exit status after recording a KareusError for the parent


def check(cfg: DemoConfig) -> None:
    """Refuse what every worker would fail on, before any is spawned: the options (budgets,
    the device's name), a custom GPU's spec, the model's shape, its split over the ranks
    and a size no CPU trains."""
    for options in (cfg.options, cfg.reference_options):
        if options is not None:
            check_device(KareusOptions.from_dict(options).device)
    check_tensor_parallel(cfg.model, cfg.world_size)
    if cfg.seq_len > cfg.model.max_seq_len:
        raise DemoError(f"sequence length {cfg.seq_len} is beyond the model's "
                        f"max_seq_len {cfg.model.max_seq_len}")
    if cfg.sequence_parallel and cfg.seq_len % cfg.world_size:
        raise DemoError(f"sequence parallelism splits the sequence ({cfg.seq_len}) over "
                        f"{cfg.world_size} ranks: it must divide evenly")
    if cfg.model.parameters > MAX_PARAMETERS:
        raise DemoError(f"a {cfg.model.parameters:,}-parameter model is more than the demo "
                        f"trains on CPU (at most {MAX_PARAMETERS:,}): lower --dim or --layers")
    activation = cfg.batch * cfg.seq_len * cfg.model.dim
    if activation > MAX_ACTIVATION:
        raise DemoError(f"batch x sequence x dim = {activation:,} elements per activation; at "
                        f"most {MAX_ACTIVATION:,}: lower --microbatch-size, --seq-len or --dim")


def run(cfg: DemoConfig) -> list[RankResult]:
    """Train on ``cfg.world_size`` gloo processes and return each rank's result (a
    ``KareusError`` where ``check`` refuses ``cfg``, a ``DemoError`` where a worker raised
    one)."""
    check(cfg)
    with tempfile.TemporaryDirectory(prefix="kareus-demo-") as tmp:
        try:
            mp.start_processes(
                _worker,
                args=(cfg, f"tcp://127.0.0.1:{_free_port()}", tmp),
                nprocs=cfg.world_size,
                join=True,
                start_method="spawn",
            )
        except ProcessException:
            recorded = sorted(Path(tmp).glob("rank*.error"), key=lambda p: int(p.stem[4:]))
            if not recorded:
                raise  # not an error kareus raised on purpose: its traceback is the report
            raise DemoError(recorded[0].read_text()) from None
        return [pickle.loads(Path(tmp, f"rank{r}.pkl").read_bytes()) for r in range(cfg.world_size)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, cfg: DemoConfig, init_method: str, out_dir: str) -> None:
    # One intra-op thread per process: the ranks share this machine's cores.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.world_size))
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=cfg.world_size)
    try:
        try:
            result = train(rank, cfg)
        except KareusError as exc:
            # For the parent to report once; SystemExit passes torch's traceback recording,
            # and the join stops the other ranks, which may wait on this one.
            Path(out_dir, f"rank{rank}.error").write_text(f"rank {rank}: {exc}")
            sys.exit(_RECORDED)
        Path(out_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
        # Every rank done before any tears down: a rank (the store's host) exiting while
        # another still finished aborted at interpreter exit (SIGABRT) in 6 of 86 runs of
        # tests/test_agreement_e2e.py before this barrier, 0 of 50 with it.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def build_model(cfg: DemoConfig) -> Llama:
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(cfg.seed)  # same initial weights on every rank and for every copy
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return parallelize_llama(Llama(cfg.model), mesh, sequence_parallel=cfg.sequence_parallel)


def batches(cfg: DemoConfig) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """A learnable next-token task: sequences of a fixed random permutation's orbits.

    Every token has one successor, so the loss can fall quickly; the data is identical on
    all ranks, as tensor parallelism requires. Made a step at a time: any step count fits.
    """
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    successor = torch.randperm(cfg.model.vocab_size, generator=gen)
    for _ in range(cfg.steps):
        tokens = [torch.randint(0, cfg.model.vocab_size, (cfg.batch,), generator=gen)]
        for _ in range(cfg.seq_len):
            tokens.append(successor[tokens[-1]])
        seq = torch.stack(tokens, dim=1)
        yield seq[:, :-1], seq[:, 1:]


def train(rank: int, cfg: DemoConfig) -> RankResult:
    import kareus
    from kareus.passes.decide import earliest_slots

    chooser = earliest_slots if cfg.slot_seed is None else SeededSlots(cfg.slot_seed)
    model = build_model(cfg)
    compiled = torch.compile(model, backend=kareus.KareusBackend(cfg.options, chooser=chooser))
    reference = build_model(cfg) if cfg.compare_eager else None
    run_reference = reference
    if reference is not None and cfg.reference_options is not None:
        run_reference = torch.compile(
            reference, backend="kareus", options=dict(cfg.reference_options)
        )
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=cfg.lr) if reference else None

    losses, reference_losses, grad_diffs = [], [], []
    recorder = kareus.RecordingClockController()
    with kareus.use_controller(recorder):
        for inputs, targets in batches(cfg):
            loss = _step(compiled, opt, inputs, targets)
            losses.append(loss)
            if reference is not None:
                reference_losses.append(_step(run_reference, ref_opt, inputs, targets))
                grad_diffs.append(_max_grad_diff(model, reference))
                ref_opt.step()
            opt.step()
    return RankResult(
        rank=rank,
        losses=losses,
        reference_losses=reference_losses,
        max_grad_diff=grad_diffs,
        clock_switches=[(s.graph, s.mhz) for s in recorder.switches],
        reports=kareus.graph_reports(),
        plan=kareus.current_plan(),
    )


@dataclass(frozen=True)
class SeededSlots:
    """Draws every partition's launch slot at random, seeded by the graph's structural
    hash: every rank draws the same variant."""

    seed: int

    def __call__(self, analysis: GraphAnalysis, k: int) -> Variant:
        return analysis.space.sample(random.Random(f"{self.seed}:{analysis.key}"), k)


def _step(model, opt, inputs, targets) -> float:
    opt.zero_grad(set_to_none=True)
    logits = model(inputs)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    return loss.item()


def _max_grad_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    worst = 0.0
    for pa, pb in zip(a.parameters(), b.parameters()):
        ga, gb = _local(pa.grad), _local(pb.grad)
        worst = max(worst, (ga - gb).abs().max().item())
    return worst


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t
