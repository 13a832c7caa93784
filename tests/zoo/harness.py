"""Train a zoo model compiled with kareus next to an eager copy, on 2 gloo CPU ranks.

``run_zoo(name, options_list)`` spawns the ranks once and, in each, for every kareus
options dict in turn: resets Dynamo and kareus's report registry, builds a compiled copy
and an eager copy of the model (identical weights), trains both ``steps`` SGD steps on the
same batches, and records per step the two losses and the largest difference between any
parameter's gradients, then the graph reports kareus recorded. The ranks are forked from a
server that has imported the libraries once (``gloo.start_ranks``); one spawn runs many
option sets.

A failure in one option set is recorded (with its traceback) and the next option set
runs. The whole spawn is bounded by ``timeout_s``: shortly before it, a watchdog thread in
each rank records the running option set with the graphs compiled so far and the main
thread's stack (where it hangs), then the ranks are killed. Every (options, rank) pair
gets a ``ZooResult``; ``error`` says what went wrong. Results travel back as pickles in a
temporary directory, rewritten after every option set.
"""

from __future__ import annotations

import pickle
import re
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gloo import start_ranks
from torch.distributed.tensor import DTensor

WORLD_SIZE = 2
# An option set with this key true profiles on a device that runs every variant it
# measures (``_measuring_backend``), not on the simulator, which only costs their graphs.
FAKE_NVML = "measure_on_fake_nvml"
LR = 0.1

# The option sets the zoo is measured at: k = 1, 2, 4 with Inductor, k = 2, 4 op by op.
OPTION_SETS: tuple[dict[str, object], ...] = (  # the rewrite alone: nothing planned
    {"nanobatches": 1, "profile": "off"},
    {"nanobatches": 2, "profile": "off"},
    {"nanobatches": 4, "profile": "off"},
    {"nanobatches": 2, "lowering": "eager", "profile": "off"},
    {"nanobatches": 4, "lowering": "eager", "profile": "off"},
)


@dataclass
class ZooResult:
    model: str
    options: dict[str, object]  # the option set under test
    rank: int
    compile_options: dict[str, object] = field(default_factory=dict)  # what kareus got
    losses: list[float] = field(default_factory=list)
    reference_losses: list[float] = field(default_factory=list)
    max_grad_diff: list[float] = field(default_factory=list)  # per step, over all parameters
    reports: list[object] = field(default_factory=list)  # kareus.GraphReport, in compile order
    error: str | None = None  # traceback of what failed, or why the run did not finish
    seconds: float = 0.0  # build + compile + train, this option set on this rank

    @property
    def max_loss_rel_diff(self) -> float:
        return max(
            (abs(a - b) / max(abs(b), 1e-12) for a, b in zip(self.losses, self.reference_losses)),
            default=float("nan"),
        )


def run_zoo(
    model_name: str,
    options_list: list[dict[str, object]],
    steps: int = 2,
    *,
    timeout_s: float = 600.0,
    collective_timeout_s: float = 120.0,
    isolate: bool = True,
) -> list[ZooResult]:
    """Results ordered by option set, then rank.

    ``timeout_s`` bounds the whole spawn (ranks still running then are killed);
    ``collective_timeout_s`` is the gloo timeout: a rank whose peer failed gives up waiting
    after it and goes on with the next option set. ``isolate``: every option set gets a
    fresh default process group (and store prefix); False keeps one group for all, as one
    process that recompiles with new options would.
    """
    with tempfile.TemporaryDirectory(prefix="kareus-zoo-") as tmp:
        port = _free_port()
        # The ranks write what they have (and where they are stuck) shortly before the kill.
        snapshot_at = time.time() + max(timeout_s - 15.0, 0.8 * timeout_s)
        context = start_ranks(
            _worker,
            (model_name, options_list, steps, port, tmp, collective_timeout_s, isolate,
             snapshot_at),
            WORLD_SIZE,
            join=False,
        )
        failure = _join(context, timeout_s)
        return _collect(model_name, options_list, tmp, failure)


def _join(context, timeout_s: float) -> str | None:
    """Wait for the ranks; kill them past the deadline. None, or why the spawn did not end well."""
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                _kill(context)
                return f"timed out after {timeout_s:.0f} s (ranks killed)"
    # a rank died (signal) or raised outside an option set
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
        _kill(context)
        return f"{type(exc).__name__}: {exc}"
    return None


def _kill(context) -> None:
    for process in context.processes:
        if process.is_alive():
            process.kill()  # our own children, by handle
    for process in context.processes:
        process.join(timeout=10)


def _collect(model_name, options_list, tmp, failure) -> list[ZooResult]:
    by_rank = {}
    for rank in range(WORLD_SIZE):
        path = Path(tmp, f"rank{rank}.pkl")
        by_rank[rank] = pickle.loads(path.read_bytes()) if path.exists() else []
    results = []
    for i, options in enumerate(options_list):
        for rank in range(WORLD_SIZE):
            done = by_rank[rank]
            if i < len(done):
                results.append(done[i])
            else:
                why = failure or "the rank ended before this option set"
                results.append(ZooResult(model_name, dict(options), rank, error=why))
    return results


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    rank, model_name, options_list, steps, port, out_dir, collective_timeout_s, isolate, snapshot_at
):
    from .models import set_distributed_env

    torch.set_num_threads(1)  # the ranks share this machine's cores
    set_distributed_env(rank, WORLD_SIZE, port)
    timeout = timedelta(seconds=collective_timeout_s)
    store = dist.TCPStore("127.0.0.1", port, WORLD_SIZE, is_master=rank == 0, timeout=timeout)
    scratch = Path(out_dir, "scratch")
    scratch.mkdir(exist_ok=True)
    done: list[ZooResult] = []
    current: list[tuple[ZooResult, float]] = []  # running now, since (read by the watchdog)
    _start_watchdog(snapshot_at, out_dir, rank, done, current)
    try:
        for i, options in enumerate(options_list):
            if isolate or i == 0:
                _init_group(store, i, rank, timeout)
            # A failed option set is recorded and the next one runs: a failure on every
            # rank (a compile error) leaves the ranks in step; a rank whose peer failed
            # alone gets a gloo timeout in its next collective, and the ranks meet again
            # when the next option set's group forms.
            result = ZooResult(
                model_name, dict(options), rank,
                compile_options={k: v for k, v in options.items() if k != FAKE_NVML},
            )
            current[:] = [(result, time.perf_counter())]
            _run_options(result, steps, _setup(rank, scratch))
            current.clear()
            done.append(result)
            _write(out_dir, rank, done)
            if isolate:
                dist.destroy_process_group()
    finally:
        _write(out_dir, rank, done)
        if dist.is_initialized():
            dist.destroy_process_group()


def _start_watchdog(at: float, out_dir: str, rank: int, done: list, current: list) -> None:
    """Shortly before the parent kills this rank: record the running option set, with the
    graphs compiled so far and the main thread's stack (where it hangs)."""
    import threading

    main = threading.main_thread().ident

    def snapshot() -> None:
        time.sleep(max(0.0, at - time.time()))
        if not current:
            return
        import kareus

        result, start = current[0]
        result.seconds = time.perf_counter() - start
        frame = sys._current_frames().get(main)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "(no stack)\n"
        result.error = f"still running at the spawn timeout (killed); main thread was at:\n{stack}"
        result.reports = kareus.graph_reports()
        _write(out_dir, rank, [*done, result], writer="watchdog")

    threading.Thread(target=snapshot, name="zoo-watchdog", daemon=True).start()


def _init_group(store, i: int, rank: int, timeout: timedelta) -> None:
    """A fresh default group per option set, its store keys under their own prefix.

    Each option set then starts like a new training job: kareus's compile-time agreements
    (kept in the default group's store, keyed by graph structure) do not carry over from
    the previous option set's compile of the same graph.
    """
    prefixed = dist.PrefixStore(f"zoo/{i}/", store)
    dist.init_process_group(
        "gloo", store=prefixed, rank=rank, world_size=WORLD_SIZE, timeout=timeout
    )


def _setup(rank: int, scratch: Path):
    from torch.distributed.device_mesh import init_device_mesh

    from .models import ZooSetup

    mesh = init_device_mesh("cpu", (WORLD_SIZE,), mesh_dim_names=("tp",))
    return ZooSetup(rank, WORLD_SIZE, mesh, scratch)


def _write(out_dir: str, rank: int, done: list[ZooResult], writer: str = "main") -> None:
    tmp = Path(out_dir, f"rank{rank}.pkl.{writer}")
    tmp.write_bytes(pickle.dumps(done))
    tmp.replace(Path(out_dir, f"rank{rank}.pkl"))


def _run_options(result: ZooResult, steps: int, setup) -> None:
    import kareus

    from .models import build

    start = time.perf_counter()
    torch._dynamo.reset()
    kareus.clear_graph_reports()
    try:
        _train(build(result.model, setup), build(result.model, setup), steps, result)
    except Exception:  # noqa: BLE001 -- any failure is a result: recorded, the next set runs
        result.error = traceback.format_exc()
    result.reports = kareus.graph_reports()
    result.seconds = time.perf_counter() - start


def _train(tested, reference, steps: int, result: ZooResult) -> None:
    """``tested`` compiled with kareus, ``reference`` eager; the same batches, step by step."""
    if result.options.get(FAKE_NVML):
        compiled = torch.compile(tested.model, backend=_measuring_backend(result.compile_options))
    else:
        compiled = torch.compile(tested.model, backend="kareus", options=result.compile_options)
    opt = torch.optim.SGD(tested.model.parameters(), lr=LR)
    ref_opt = torch.optim.SGD(reference.model.parameters(), lr=LR)
    with torch._dynamo.config.patch(tested.dynamo_config):
        for step in range(steps):
            batch = tested.batch(step)
            result.losses.append(_step(compiled, tested, opt, batch))
            result.reference_losses.append(_step(reference.model, reference, ref_opt, batch))
            result.max_grad_diff.append(_max_grad_diff(tested.model, reference.model))
            opt.step()
            ref_opt.step()


def _measuring_backend(options: dict[str, object]):
    """kareus measuring every profiled variant for real: the NVML meter on the fake driver
    (tests/fake_pynvml.py; dry run, CPU), one short window per evaluation."""
    from fake_pynvml import FakeNvml

    import kareus
    from kareus.devices.nvml.gpu import NvmlGPU
    from kareus.profiler.measure import Protocol

    gpu = NvmlGPU(nvml_module=FakeNvml(), dry_run=True, cuda=False, min_window_s=0.01,
                  settle_s=0.0, reset_at_exit=False)
    return kareus.KareusBackend(options, device=gpu, protocol=Protocol(repeats=1, max_repeats=1))


def _step(run_model, zoo_model, opt, batch) -> float:
    opt.zero_grad(set_to_none=True)
    with zoo_model.context():
        loss = zoo_model.loss(run_model, batch)
        loss.backward()
    return _local(loss).item()


def _max_grad_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    """max |grad_a - grad_b| over all parameters (built alike, so they pair up in order)."""
    worst = 0.0
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        if pa.grad is None and pb.grad is None:
            continue
        if pa.grad is None or pb.grad is None:
            only = "eager" if pa.grad is None else "compiled"
            raise AssertionError(f"{name}: a gradient only in the {only} copy")
        worst = max(worst, (_local(pa.grad) - _local(pb.grad)).abs().max().item())
    return worst


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard: both copies shard alike, so shards compare one to one."""
    return t.to_local() if isinstance(t, DTensor) else t


# --- what the reports say, as text (tests and benchmarks/zoo_coverage.py) ----------------


def options_label(options: dict[str, object]) -> str:
    """``k2-inductor``: the nanobatch count and the lowering, ``-planned`` where the graphs
    are profiled and the plan runs (``-measured``: every variant run on the fake NVML)."""
    label = f"k{options.get('nanobatches', 1)}-{options.get('lowering', 'inductor')}"
    if options.get("nanobatches", 1) != 1 and options.get("profile", "auto") != "off":
        label += "-planned"
    return label + ("-measured" if options.get(FAKE_NVML) else "")


def coverage_text(report) -> str:
    """``split/total`` collectives that stay split, or "-" where the report has no coverage."""
    coverage = getattr(report, "coverage", None)
    return "-" if coverage is None else f"{coverage.split}/{coverage.total}"


def first_barrier_text(report) -> str:
    coverage = getattr(report, "coverage", None)
    if coverage is None:
        return "-"
    barrier = coverage.first_barrier
    return "none" if barrier is None else f"{barrier} ({barrier.kind.value})"


def graph_line(result: ZooResult, report) -> str:
    """One line per compiled graph: model, options, kind, applied k, coverage, why not."""
    return (
        f"{result.model} {options_label(result.options)} {report.kind}: "
        f"k={report.nanobatches} split {coverage_text(report)}, "
        f"first barrier {first_barrier_text(report)}, "
        f"fallback {report.fallback or '-'}"
    )


def error_origin(error: str | None) -> str:
    """The innermost kareus frame of a traceback (``kareus/x.py:123 in f``), else the last."""
    if not error:
        return "-"
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', error)
    inside = [f for f in frames if "/kareus/" in f[0] and "/tests/" not in f[0]]
    if not (chosen := (inside or frames)):
        return "-"
    path, line, func = chosen[-1]
    short = path[path.rindex("/kareus/") + 1:] if "/kareus/" in path else path.rsplit("/", 1)[-1]
    return f"{short}:{line} in {func}"


def error_message(error: str | None) -> str:
    """The exception line of a traceback (its last line that names an error)."""
    if not error:
        return "-"
    if not error.startswith("Traceback"):  # the harness's own words (timeout, ended early)
        return error.splitlines()[0]
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    exception = re.compile(r"^[\w.]+(Error|Exception|Failed|Interrupt)\b")
    named = [line for line in lines if exception.match(line)]
    return (named or lines)[-1]
