"""Rewritten graphs on a real GPU: lowered to Triton, equal to the originals, measured and modelled.

Run once on a lent GPU (at most 10 minutes); ``benchmarks/fidelity.py`` reads what it writes:

    python benchmarks/gpu_plan_check.py                  # GPU: benchmarks/results/h200_default.json
    python benchmarks/gpu_plan_check.py --regions block --out benchmarks/results/h200_block.json
    python benchmarks/gpu_plan_check.py --tiny --out /tmp/plan_check.json    # CPU mode, anywhere

Rules: default clocks only. The GPU is kareus's "nvml-dry-run" device: its controller takes
the graphs' clock switches and the measurements' and records them, never applying one;
every NVML setter is refused while the check runs (``gpu_measure.setters_refused``), and
one call fails the script.

Setup: world size 1 (NCCL on a GPU, gloo on the CPU), kareus's Llama of a few layers (bf16
on a GPU, fp32 on the CPU) with Megatron-style tensor-parallel all-reduces on the one-rank
group around each block's attention and MLP (``one_rank_tensor_parallel``: DTensor skips
the collectives of a one-rank mesh, so ``parallelize_llama`` would leave nothing to split).
One step (forward, ``.sum().backward()``) through AOT autograd gives the forward and
backward graphs as Inductor's inner compiler gets them, with the real inputs the step
passed each: of the whole model (``--regions stage``, the default: a pipeline stage
compiled whole, nanobatches passing from block to block) or of one block (``--regions
block``: each block compiled alone, as torchtitan compiles), the saved values handed to
the backward in 2 pieces as the backend's partitioner does where it plans
(``--saved-pieces 2``, the default; 1: AOT's own partition, as the 2026-12-04 record was
measured, so k = 2 then joins them at the forward's end). Each graph is analysed, applied
at k = 1 (unrewritten: the clock switch only) and k = 2 (the default variant: earliest
launch slots) and lowered with Inductor, kareus's schedule pinned, as the backend lowers
it.

Checks, each recorded:

- lowering: Inductor's output code of each graph has kernels of the device's kind (Triton
  on a GPU; on the CPU C++ ones, and the Triton check is reported skipped), its clock
  switch once and every collective of the applied graph (twice as many at k = 2), counted
  in the code's statements (torch 2.11's Inductor also names a collective it made in place
  in comments);
- numerics: on the step's inputs, the outputs of the k = 2 graph equal those of the
  unrewritten one (the forward's outputs; the backward's, which are the gradients) as the
  ``verify`` option judges them (``kareus.verify.outputs_mismatch``): each floating-point
  output within ``verify.tolerance`` of its largest magnitude, since a sum of nanobatch
  partials rounds differently from one matmul's accumulation by an amount that scales with
  the tensor, not the element; integer outputs exactly, except the attention kernels'
  dropout state;
- time, energy and power (GPU only): each graph at k = 1 and 2, and each distinct
  partition's workload (``profiler.workloads.partition_workload``, as the profiler measures
  it) at k = 1 (the whole batch, its collective issued after the compute, as the
  unrewritten graph runs them) and k = 2 (one nanobatch, the other's collective at the
  default variant's slot), through NvmlGPU at default clocks; beside each, the simulated
  GPU's estimate of the same graph at its default clock.

The JSON (``--out``; on a GPU benchmarks/results/h200_default.json unless given; on the CPU
``--out`` is required, and CPU results never replace the H200 record unless
``--replace-h200-record``):

    preset, model_version, torch, host, clocks          as gpu_check.py's records
    gpu, nvml_device, energy_method, idle_power_w,
      static_power_w_assumed                            GPU mode only
    mode                "cuda" | "cpu"
    setup               {world_size, process_group, device, dtype, batch, seq, model
                         (LlamaConfig fields), tensor_parallel}
    skipped             [{what, why}]: every check or measurement not done, and why
    lowering            [{graph, k, kernel_kind, kernels, triton_kernels, cpp_kernels,
                          collectives, expected_collectives, clock_switches, ok, error}]
    numerics            [{graph, dtype, outputs, compared, state_outputs, tolerance,
                          worst_scaled_error, worst_output, mismatch, ok, error}]
    workloads           [{name, workload ("graph" | "partition"), graph, k, partition, key,
                          instances, slot, measured_time_s, predicted_time_s, time_ratio,
                          measured_energy_j, predicted_energy_j, energy_ratio,
                          measured_power_w, predicted_power_w, measurement_details,
                          error}]; measured_* and the ratios are null where not measured,
                          ratios are predicted / measured
    dry_run_switches    [{graph, mhz}] the dry-run controller recorded (null on the CPU)
    refused_setter_calls  NVML setters called (and refused); must be empty
    ok                  every check passed
    seconds             {capture, graphs, partitions, total}

Run time on an H200: 4 step graphs (forward and backward at k = 1, 2) and, at 4 layers, 7
distinct partitions (3 of the forward's 8, 4 of the backward's 8, as the CPU run of the same
model finds them) at 2 counts each: 18 workloads, each measured after 3 warm-up runs in a
sizing run and a window of at least ``MIN_WINDOW_S`` = 2 s (a second window where the first
falls short): 50-90 s of measuring. The rest is expected to be imports and one eager step
(under a minute) and Inductor compiling the 18 graphs with a cold cache (each step graph
30-60 s, each partition's small graph 5-10 s): about 5 minutes in all, 8 if every compile
takes its longest. No measurement and no partition compile starts after ``--budget-s``
(default 450 s from the check's start); each one skipped is listed, so the record is
written within the 10 minutes. ``seconds`` in the record says how long each phase took.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.fx
import torch.utils._pytree as pytree
from gpu_measure import (
    H200_RECORD,
    comparison,
    dry_run_gpu,
    gpu_info,
    header,
    measure_warm,
    pynvml_module,
    setters_refused,
)
from rich.console import Console
from rich.table import Table
from torch._functorch.aot_autograd import make_boxed_func
from torch._inductor import config as inductor_config
from torch._inductor.compile_fx import compile_fx
from torch._inductor.utils import run_and_get_code

from kareus.codegen.apply import apply
from kareus.codegen.lowering import lower, pinned_schedule_config
from kareus.codegen.partitioner import partitioner_config
from kareus.devices import Measurement, SimulatedGPU, Workload
from kareus.devices.nvml.gpu import NvmlGPU
from kareus.errors import KareusError
from kareus.models.llama import Llama, LlamaConfig
from kareus.passes.analyse import GraphAnalysis, analyse
from kareus.passes.collectives import find_collectives
from kareus.passes.decide import Policy, decide
from kareus.passes.ops import DEFAULT_CLOCK_MHZ
from kareus.passes.variants import PartitionChoices
from kareus.profiler.workloads import Lower, partition_workload
from kareus.runtime import use_controller
from kareus.runtime.communicators import graph_backend
from kareus.verify import outputs_mismatch, scaled_error, state_outputs, tolerance

COUNTS = (1, 2)

# (model, batch, sequence): H200-sized (Llama-3.2-1B widths, multi-head attention of
# head dim 128 for the flash kernels, 4 layers), and the CPU tests' size.
H200_SIZE = (
    LlamaConfig(vocab_size=32768, dim=2048, n_layers=4, n_heads=16, ffn_dim=8192,
                max_seq_len=2048),
    8,
    2048,
)
TINY_SIZE = (LlamaConfig(n_layers=1), 4, 16)


class StepCaptureError(KareusError, RuntimeError):
    """The step did not give exactly one forward and one backward graph."""


# --- setup -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setup:
    cfg: LlamaConfig
    batch: int
    seq: int
    device: str  # "cuda" | "cpu"
    fp32: bool = False  # on a GPU too (no TF32): there k = 2 equals k = 1 to verify's tolerance
    regions: str = "stage"  # the whole model one graph, or "block": each block its own
    saved_pieces: int = 2  # as the backend partitions where it plans (1: AOT's own partition)

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.device == "cuda" and not self.fp32 else torch.float32

    @property
    def process_group(self) -> str:
        return "nccl" if self.device == "cuda" else "gloo"

    def describe(self) -> dict[str, object]:
        return {
            "world_size": 1,
            "process_group": self.process_group,
            "device": self.device,
            "dtype": str(self.dtype).removeprefix("torch."),
            "batch": self.batch,
            "seq": self.seq,
            "model": dataclasses.asdict(self.cfg),
            "tensor_parallel": "Megatron-style all-reduces on the one-rank group around "
            "each block's attention and MLP (one_rank_tensor_parallel)",
            "regions": self.regions,
            "saved_pieces": self.saved_pieces,
        }


class _SumForward(torch.autograd.Function):
    """Megatron's g: the ranks' partial results summed going forward, the gradient as it is."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: str) -> torch.Tensor:
        return funcol.all_reduce(x, "sum", group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _SumBackward(torch.autograd.Function):
    """Megatron's f: the input as it is going forward, its gradient summed over the ranks."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: str) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return funcol.all_reduce(grad, "sum", ctx.group), None


def one_rank_tensor_parallel(model: Llama, group: str) -> Llama:
    """``model`` with the collectives of tensor parallelism on ``group`` (of one rank; the
    weights stay whole): each block's attention and MLP take their input through f and give
    their output through g, as Megatron (and ``parallelize_llama`` on more ranks) does."""
    def enter(_: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (_SumBackward.apply(args[0], group), *args[1:])

    def leave(_: torch.nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
        return _SumForward.apply(out, group)

    for block in model.layers:
        for region in (block.attention, block.feed_forward):
            region.register_forward_pre_hook(enter)
            region.register_forward_hook(leave)
    return model


# --- the step's graphs ----------------------------------------------------------------------


@dataclass(frozen=True)
class StepGraph:
    """A graph of the step as Inductor's inner compiler got it, analysed, with the real
    inputs the step passed it and the inner compiler's keyword arguments."""

    gm: torch.fx.GraphModule
    analysis: GraphAnalysis
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


REGIONS = ("stage", "block")


def step_graphs(
    model: Llama, tokens: torch.Tensor, regions: str = "stage", saved_pieces: int = 1
) -> tuple[StepGraph, StepGraph]:
    """The forward and backward graphs of one step, run op by op to record their inputs:
    the whole model's (``regions`` "stage": one graph each way, as a pipeline stage compiled
    whole), or its first block's ("block": each block compiled alone, as torchtitan compiles,
    the rest eager; the blocks' graphs are one), its saved values handed to the backward in
    ``saved_pieces`` pieces as the kareus backend partitions (``codegen.partitioner``)."""
    if regions not in REGIONS:
        raise ValueError(f"regions must be one of {REGIONS}, got {regions!r}")
    seen: list[tuple[torch.fx.GraphModule, tuple[Any, ...], dict[str, Any], list[Any]]] = []

    def inner(gm: torch.fx.GraphModule, examples: Sequence[Any], **kwargs: Any):
        calls: list[Any] = []
        seen.append((gm, tuple(examples), kwargs, calls))

        def run(*args: Any) -> Any:
            calls.append(args)
            return gm(*args)

        return make_boxed_func(run)

    torch._dynamo.reset()
    patches = partitioner_config(saved_pieces, "gpu_plan_check") if saved_pieces > 1 else {}
    backend = functools.partial(compile_fx, inner_compile=inner, config_patches=patches)
    if regions == "stage":
        torch.compile(model, backend=backend)(tokens).sum().backward()
    else:
        blocks = list(model.layers)
        for i, block in enumerate(blocks):
            model.layers[i] = torch.compile(block, backend=backend, fullgraph=True)
        try:
            model(tokens).sum().backward()
        finally:
            for i, block in enumerate(blocks):
                model.layers[i] = block
    kinds = ["backward" if kw.get("is_backward") else "forward" for _, _, kw, _ in seen]
    runs = len(model.layers) if regions == "block" else 1
    if kinds != ["forward", "backward"] or any(len(calls) != runs for *_, calls in seen):
        raise StepCaptureError(
            f"the step gave graphs {kinds} run {[len(c) for *_, c in seen]} times; expected "
            f"one forward and one backward, each run {runs} time(s) (a graph break, or "
            "blocks compiled apart?)"
        )
    (fw, fw_examples, fw_kwargs, fw_calls), (bw, bw_examples, bw_kwargs, bw_calls) = seen
    forward = analyse(
        fw, fw_examples, "forward", backend=graph_backend(fw.graph), label="forward",
        static_input_idxs=fw_kwargs.get("static_input_idxs") or (),
    )
    backward = analyse(
        bw, bw_examples, "backward", forward.interfaces, backend=graph_backend(bw.graph),
        label="backward",
    )
    return (
        StepGraph(fw, forward, fw_calls[0], fw_kwargs),
        StepGraph(bw, backward, bw_calls[0], bw_kwargs),
    )


@dataclass(frozen=True)
class Lowered:
    """One graph at one count, applied and lowered, with what was learnt on the way."""

    graph: str
    k: int
    predicted: Measurement
    expected_collectives: int
    code: str
    run: Callable[[list[Any]], Any]


def applied_graph(graph: StepGraph, k: int) -> torch.fx.GraphModule:
    """``graph`` at ``k`` as the backend applies it: decided (the default variant) and
    applied; what the model costs (``fidelity.py`` re-predicts records from it)."""
    return apply(graph.gm, graph.analysis, decide(graph.analysis, Policy(k)).choice)


def lowered(graph: StepGraph, k: int, sim: SimulatedGPU) -> Lowered:
    """``graph`` at ``k`` as the backend runs it: applied (``applied_graph``), costed by the
    model (before Inductor, which rewrites the graph in place) and lowered."""
    applied = applied_graph(graph, k)
    predicted = sim.estimate(applied, 1)
    expected = len(find_collectives(applied.graph))
    with torch._guards.tracing(None):  # outside any compile's context, as GraphBuilder
        run, codes = run_and_get_code(
            lower, applied, list(graph.args), "inductor", **graph.kwargs
        )
    return Lowered(graph.analysis.kind, k, predicted, expected, "\n".join(codes), run)


@torch.no_grad()  # as AOT autograd runs its graphs: the inputs include parameters
def call(run: Callable[[list[Any]], Any], args: Sequence[Any]) -> Any:
    return run(list(args))  # a boxed callable may clear its list


# --- checks ---------------------------------------------------------------------------------


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


def lowering_row(low: Lowered, device: str) -> dict[str, object]:
    """Whether Inductor's code has kernels of the device's kind, the clock switch once and
    every collective of the applied graph (in its statements, not its comments)."""
    code = "\n".join(line for line in low.code.splitlines()
                     if not line.lstrip().startswith("#"))
    triton, cpp = code.count("async_compile.triton("), code.count("async_compile.cpp_pybinding(")
    issued = code.count("torch.ops._c10d_functional.") - code.count(
        "torch.ops._c10d_functional.wait_tensor"
    )
    switches = code.count("torch.ops.kareus.set_clock.default(")
    kernels = triton if device == "cuda" else cpp
    return {
        "graph": low.graph,
        "k": low.k,
        "kernel_kind": "triton" if device == "cuda" else "cpp",
        "kernels": kernels,
        "triton_kernels": triton,
        "cpp_kernels": cpp,
        "collectives": issued,
        "expected_collectives": low.expected_collectives,
        "clock_switches": switches,
        "ok": kernels > 0 and issued == low.expected_collectives and switches == 1,
        "error": None,
    }


def numerics_row(
    graph: str, expected: Any, got: Any, dtype: torch.dtype, state: frozenset[int]
) -> dict[str, object]:
    """The k = 2 graph's outputs against the unrewritten graph's, as ``verify`` judges
    them; ``state`` are the outputs that are kernel state (``verify.state_outputs``), not
    compared. Also the worst floating-point output, relative to its scale."""
    want, have = pytree.tree_leaves(expected), pytree.tree_leaves(got)
    compared = [i for i, (a, b) in enumerate(zip(want, have)) if i not in state
                and isinstance(a, torch.Tensor) and a.is_floating_point()
                and isinstance(b, torch.Tensor)]
    errors = {i: scaled_error(want[i], have[i]) for i in compared}
    worst = max(errors, key=errors.__getitem__, default=None)
    try:
        problem = outputs_mismatch(expected, got, state)
    except Exception as exc:  # noqa: BLE001 - an output it cannot compare
        problem = f"not comparable: {error_text(exc)}"
    return {
        "graph": graph,
        "dtype": str(dtype).removeprefix("torch."),
        "outputs": len(want),
        "compared": len(compared),
        "state_outputs": sorted(state),
        "tolerance": f"max |error| <= {tolerance(dtype):.3g} x max |output| (kareus verify)",
        "worst_scaled_error": None if worst is None else errors[worst],
        "worst_output": worst,
        "mismatch": problem,
        "ok": problem is None,
        "error": None,
    }


# --- workloads ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Planned:
    """A workload to measure, what it is and the model's estimate of it."""

    row: dict[str, object]
    workload: Workload
    predicted: Measurement


def graph_workload(low: Lowered, args: Sequence[Any]) -> Planned:
    name = f"{low.graph} k={low.k}"
    row = {"name": name, "workload": "graph", "graph": low.graph, "k": low.k,
           "partition": None, "key": None, "instances": None, "slot": None}
    return Planned(row, Workload(name, run=functools.partial(call, low.run, args)), low.predicted)


def partition_rows(graph: StepGraph) -> Iterator[dict[str, object]]:
    """The first partition of each distinct key of ``graph`` whose collective can overlap,
    at k = 1 (its last slot: after the compute) and k = 2 (the default variant's slot)."""
    analysis = graph.analysis
    choices = analysis.space.partitions(2)
    default = analysis.space.default(2)
    overlapping = [c for c in choices if c.launch_slots > 1]
    instances = Counter(c.key for c in overlapping)
    first: dict[str, PartitionChoices] = {}
    for c in overlapping:
        first.setdefault(c.key, c)
    for key, c in first.items():
        for k in COUNTS:
            yield {"name": f"{analysis.kind} partition {c.index} k={k}",
                   "workload": "partition", "graph": analysis.kind, "k": k,
                   "partition": c.index, "key": key, "instances": instances[key],
                   "slot": c.launch_slots - 1 if k == 1 else default.slots[c.index]}


def partition_of(
    analysis: GraphAnalysis, row: dict[str, object], lower: Lower | None = None
) -> Workload:
    """The workload of a row of ``partition_rows`` (``profiler.workloads.partition_workload``,
    as the profiler measures it), lowered with ``lower`` at its first run; its graph is what
    the model costs (``fidelity.py`` re-predicts records from it)."""
    return partition_workload(
        analysis.partitioning.partitions[row["partition"]], analysis.placements_at(row["k"]),
        row["k"], row["slot"], lower=lower, table=analysis.table,
    )


# --- the run --------------------------------------------------------------------------------


class Check:
    """One run of the check on this machine (its GPU: None on the CPU) and what it found,
    in the JSON's shape."""

    def __init__(self, setup: Setup, preset: str, gpu: NvmlGPU | None, budget_s: float,
                 code_dir: Path | None = None):
        self.setup, self.gpu, self.budget_s, self.code_dir = setup, gpu, budget_s, code_dir
        self.sim = SimulatedGPU(preset)
        self.start = time.perf_counter()
        self.seconds: dict[str, float] = {}
        self.skipped: list[dict[str, str]] = []
        self.lowering: list[dict[str, object]] = []
        self.numerics: list[dict[str, object]] = []
        self.workloads: list[dict[str, object]] = []

    def skip(self, what: str, why: str) -> None:
        self.skipped.append({"what": what, "why": why})

    def found(self) -> dict[str, object]:
        return {"skipped": self.skipped, "lowering": self.lowering, "numerics": self.numerics,
                "workloads": self.workloads}

    def ok(self) -> bool:
        return all(r["ok"] for r in self.lowering + self.numerics) and all(
            r["error"] is None for r in self.workloads
        )

    def run(self) -> None:
        setup = self.setup
        torch.manual_seed(0)
        with torch.device(setup.device):
            model = one_rank_tensor_parallel(
                Llama(setup.cfg).to(setup.dtype), dist.group.WORLD.group_name
            )
            tokens = torch.randint(0, setup.cfg.vocab_size, (setup.batch, setup.seq))
        graphs = step_graphs(model, tokens, setup.regions, setup.saved_pieces)
        self._lap("capture")
        for graph in graphs:
            self._graph(graph)
        self._lap("graphs")
        for graph in graphs:
            for row in partition_rows(graph):
                self._partition(graph.analysis, row)
        self._lap("partitions")

    def _graph(self, graph: StepGraph) -> None:
        outputs: dict[int, Any] = {}
        for k in COUNTS:
            try:
                low = lowered(graph, k, self.sim)
                self.lowering.append(lowering_row(low, self.setup.device))
                if self.code_dir is not None:
                    self.code_dir.mkdir(parents=True, exist_ok=True)
                    (self.code_dir / f"{low.graph}_k{k}.py").write_text(low.code)
                outputs[k] = call(low.run, graph.args)
            except Exception as exc:  # noqa: BLE001 - recorded; the other checks still run
                self.lowering.append(
                    {"graph": graph.analysis.kind, "k": k, "ok": False, "error": error_text(exc)}
                )
                continue
            self._measure(graph_workload(low, graph.args))
        kind = graph.analysis.kind
        if len(outputs) < len(COUNTS):
            self.numerics.append({"graph": kind, "ok": False,
                                  "error": "a count did not lower: nothing to compare"})
            return
        try:
            row = numerics_row(kind, outputs[1], outputs[2], self.setup.dtype,
                               state_outputs(graph.gm))
        except Exception as exc:  # noqa: BLE001 - recorded; the other checks still run
            row = {"graph": kind, "ok": False, "error": error_text(exc)}
        self.numerics.append(row)

    def _partition(self, analysis: GraphAnalysis, row: dict[str, object]) -> None:
        """A partition's workload (``partition_rows``), costed now: its first run lowers it,
        and Inductor rewrites the graph in place."""
        try:
            workload = partition_of(analysis, row, functools.partial(lower, lowering="inductor"))
            predicted = self.sim.estimate(workload.gm, 1)
        except Exception as exc:  # noqa: BLE001 - recorded; the other workloads still run
            self.workloads.append({**row, **comparison(None, None), "error": error_text(exc)})
            return
        self._measure(Planned(row, workload, predicted))

    def _measure(self, planned: Planned) -> None:
        """Measured on the GPU (within the budget); on the CPU run once, which lowers it."""
        row = {**planned.row, **comparison(None, planned.predicted), "error": None}
        self.workloads.append(row)
        name = planned.row["name"]
        if time.perf_counter() - self.start > self.budget_s:
            self.skip(f"{name}: run and measurement", f"past --budget-s {self.budget_s}")
            return
        try:
            if self.gpu is None:
                planned.workload.run()
            else:
                row |= comparison(measure_warm(self.gpu, planned.workload), planned.predicted)
        except Exception as exc:  # noqa: BLE001 - recorded; the other workloads still run
            row["error"] = error_text(exc)

    def _lap(self, phase: str) -> None:
        self.seconds[phase] = time.perf_counter() - self.start - sum(self.seconds.values())


def cpu_skips(check: Check, measured: bool) -> None:
    """Say what the CPU mode does not do (``measured``: a GPU to measure on was given)."""
    why = ("no CUDA GPU (torch.cuda.is_available() is False)" if not torch.cuda.is_available()
           else "the CPU mode was asked for (--cpu)")
    check.skip("NCCL, bf16", f"{why}: gloo and fp32 on the CPU instead")
    check.skip("Triton kernel check", f"{why}: Inductor emits C++ kernels on the CPU; checked "
               "those instead")
    if not measured:
        check.skip("NVML time, energy and power of every workload, the dry-run controller",
                   f"{why}: each workload ran once on the CPU, unmeasured; the simulated "
                   "GPU's estimates are recorded")


def run_check(
    setup: Setup,
    preset: str,
    budget_s: float,
    gpu: Callable[[], NvmlGPU] | None,
    nvml: ModuleType | Any | None,
    code_dir: Path | None = None,
) -> dict[str, object]:
    """The check on this machine, as the JSON record (see the module). ``gpu`` opens the
    GPU to measure on (None: nothing is measured); ``nvml`` is the NVML module whose
    setters are refused meanwhile (the one ``gpu`` opens: pynvml, or a stand-in); Inductor's
    code of every lowered step graph goes to ``code_dir`` where one is given."""
    record: dict[str, object] = {**header(preset), "mode": setup.device}
    switches: list[dict[str, object]] | None = None
    dist.init_process_group(setup.process_group, store=dist.HashStore(), rank=0, world_size=1)
    try:
        with setters_refused(nvml) as refused, inductor_config.patch(pinned_schedule_config()):
            if gpu is None:
                check = Check(setup, preset, None, budget_s, code_dir)
                cpu_skips(check, measured=False)
                check.run()
            else:
                with gpu() as opened, use_controller(opened.clock_controller()):
                    record |= gpu_info(opened)
                    check = Check(setup, preset, opened, budget_s, code_dir)
                    if setup.device == "cpu":
                        cpu_skips(check, measured=True)
                    check.run()
                switches = [{"graph": s.graph, "mhz": s.mhz}
                            for s in opened.clock_controller().switches]
    finally:
        dist.destroy_process_group()
    record |= {
        "setup": setup.describe(),
        **check.found(),
        "dry_run_switches": switches,
        "refused_setter_calls": refused,
        "ok": check.ok() and not refused
        and all(s["mhz"] == DEFAULT_CLOCK_MHZ for s in switches or ()),
        "seconds": {**check.seconds, "total": time.perf_counter() - check.start},
    }
    return record


# --- output ---------------------------------------------------------------------------------


def _verdict(ok: bool) -> str:
    return "[green]PASS[/]" if ok else "[bold red]FAIL[/]"


def checks_table(record: dict[str, Any]) -> Table:
    table = Table(title=f"Checks ({record['mode']}, world size 1, "
                  f"{record['setup']['process_group']}, {record['setup']['dtype']})",
                  title_justify="left")
    for column in ("check", "graph", "k", "verdict", "detail"):
        table.add_column(column, justify="left" if column in ("check", "detail") else "right")
    for r in record["lowering"]:
        detail = r["error"] or (
            f"{r['kernels']} {r['kernel_kind']} kernels, {r['collectives']}/"
            f"{r['expected_collectives']} collectives, {r['clock_switches']} clock switch"
        )
        table.add_row("Inductor lowering", r["graph"], str(r["k"]), _verdict(r["ok"]), detail)
    for r in record["numerics"]:
        detail = r["error"] or r["mismatch"] or (
            f"worst output {r['worst_output']}: {r['worst_scaled_error']:.2e} of its scale; "
            f"tolerance {r['tolerance']}; {len(r['state_outputs'])} kernel state outputs "
            "not compared"
        )
        table.add_row("k=2 equals k=1", r["graph"], "2", _verdict(r["ok"]), detail)
    refused = record["refused_setter_calls"]
    table.add_row("NVML setters refused", "", "", _verdict(not refused),
                  ", ".join(refused) or "none called")
    switches = record["dry_run_switches"]
    if switches is None:
        table.add_row("dry-run controller", "", "", "skipped", "no GPU")
    else:
        default = all(s["mhz"] == DEFAULT_CLOCK_MHZ for s in switches)
        table.add_row("dry-run controller", "", "", _verdict(default),
                      f"{len(switches)} switches recorded, "
                      f"{'all to' if default else 'not all to'} default clocks")
    return table


def _cell(value: object, scale: float = 1.0, digits: int = 3) -> str:
    return "-" if value is None else f"{scale * value:.{digits}f}"


def workloads_table(record: dict[str, Any]) -> Table:
    table = Table(title=f"Time, power and energy at default clocks: measured (NVML) and "
                  f"{record['preset']} (model)", title_justify="left")
    for column in ("workload", "key", "slot", "ms", "W", "J", "model ms", "model W", "model J",
                   "t model/meas", "E model/meas"):
        table.add_column(column, justify="left" if column in ("workload", "key") else "right")
    for r in record["workloads"]:
        key = "" if r["key"] is None else f"{r['key']} (x{r['instances']})"
        table.add_row(
            r["name"] + (f" [red]{r['error']}[/]" if r["error"] else ""), key,
            "" if r["slot"] is None else str(r["slot"]),
            _cell(r["measured_time_s"], 1e3), _cell(r["measured_power_w"], digits=0),
            _cell(r["measured_energy_j"]), _cell(r["predicted_time_s"], 1e3),
            _cell(r["predicted_power_w"], digits=0), _cell(r["predicted_energy_j"]),
            _cell(r["time_ratio"], digits=2), _cell(r["energy_ratio"], digits=2),
        )
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="sim:h200", help="the simulated GPU beside")
    parser.add_argument("--out", type=Path,
                        help=f"the JSON record (on a GPU by default {H200_RECORD})")
    parser.add_argument("--tiny", action="store_true",
                        help="the tests' model (1 layer of width 64, 4 x 16 tokens)")
    parser.add_argument("--cpu", action="store_true", help="the CPU mode even on a GPU")
    parser.add_argument("--budget-s", type=float, default=450.0,
                        help="no measurement or partition compile starts after this")
    parser.add_argument("--fp32", action="store_true",
                        help="fp32 on a GPU too (no TF32), where k = 2 must equal k = 1 to "
                        "the verify option's tolerance")
    parser.add_argument("--code-dir", type=Path,
                        help="write Inductor's code of each step graph there")
    parser.add_argument("--regions", choices=REGIONS, default="stage",
                        help="the whole model as one graph (a pipeline stage compiled whole), "
                        "or each block its own graph, as torchtitan compiles (default stage)")
    parser.add_argument("--saved-pieces", type=int, choices=(1, 2), default=2,
                        help="the saved values handed to the backward in 2 pieces, as the "
                        "backend partitions where it plans, or whole (1: AOT's own "
                        "partition, as the 2026-12-04 record measured; default 2)")
    parser.add_argument("--replace-h200-record", action="store_true",
                        help=f"let CPU results replace {H200_RECORD}")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    out = args.out or (H200_RECORD if device == "cuda" else None)
    if out is None:
        print(f"gpu_plan_check: on the CPU give --out PATH ({H200_RECORD} holds GPU "
              "measurements)", file=sys.stderr)
        return 2
    if device == "cpu" and out.resolve() == H200_RECORD and not args.replace_h200_record:
        print(f"gpu_plan_check: refusing to replace {H200_RECORD} with CPU results (pass "
              "--replace-h200-record to do it anyway)", file=sys.stderr)
        return 2
    cfg, batch, seq = TINY_SIZE if args.tiny else H200_SIZE
    gpu = dry_run_gpu if device == "cuda" else None
    record = run_check(Setup(cfg, batch, seq, device, args.fp32, args.regions,
                             args.saved_pieces), args.preset, args.budget_s,
                       gpu, pynvml_module(), args.code_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2))
    console = Console(width=160)
    console.print(checks_table(record))
    console.print(workloads_table(record))
    for s in record["skipped"]:
        console.print(f"[yellow]skipped[/] {s['what']}: {s['why']}")
    verdict = "all checks passed" if record["ok"] else "[bold red]a check failed[/]"
    console.print(f"{verdict}; wrote {out} in {record['seconds']['total']:.0f} s")
    return 0 if record["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
