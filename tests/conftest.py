"""Shared fixtures: a fake process group for single-process graph tests, clean compile state."""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.fx
from torch._functorch.aot_autograd import make_boxed_func
from torch._inductor.compile_fx import compile_fx
from torch.testing._internal.distributed.fake_pg import FakeStore

import kareus
from kareus.codegen.partitioner import partitioner_config
from kareus.models.llama import Llama, LlamaConfig, parallelize_llama
from kareus.passes.analyse import GraphAnalysis, analyse
from kareus.runtime import process_runtime

# The fidelity benchmark's calibration points and probes, which tests read too
# (benchmarks/ is not a package).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def init_fake_pg(world_size: int) -> None:
    """(Re)initialise the default group as a fake one of ``world_size`` ranks (this is rank 0)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)


@pytest.fixture
def fake_pg():
    init_fake_pg(2)
    yield 2
    dist.destroy_process_group()


def fake_collectives_compute() -> bool:
    """Whether the fake group (initialised) writes its collectives' outputs: torch 2.11's
    leaves those of a reduce-scatter, an all-to-all and a scatter (``distribute_tensor``'s)
    unwritten, so numbers computed through it are garbage; probed on a reduce-scatter."""
    out = torch.full((1,), float("nan"))
    with warnings.catch_warnings():  # its replacement, reduce_scatter_single, is newer
        warnings.simplefilter("ignore", FutureWarning)
        dist.reduce_scatter_tensor(out, torch.ones(dist.get_world_size()))
    return not out.isnan().any()


def skip_unless_fake_collectives_compute() -> None:
    if not fake_collectives_compute():
        pytest.skip(f"torch {torch.__version__}'s fake process group leaves the outputs of "
                    "some collectives unwritten: nothing to compare through it")


@pytest.fixture
def fake_pg_numbers(fake_pg):
    """A fake group of 2 ranks whose collectives give numbers to compare (the test skips
    where they do not)."""
    skip_unless_fake_collectives_compute()
    return fake_pg


@pytest.fixture(autouse=True)
def clock_lock_dir(tmp_path_factory, monkeypatch):
    """NVML controllers on the fake driver record clock ownership here, never in the
    machine-wide /tmp/kareus-clocks (two test runs would refuse each other)."""
    monkeypatch.setenv("KAREUS_CLOCK_LOCK_DIR", str(tmp_path_factory.mktemp("clock-locks")))


@pytest.fixture(autouse=True)
def profile_cache_dir(tmp_path_factory, monkeypatch):
    """Profile stores of compiles that do not name a cache_dir go to a per-test directory,
    never the user's ~/.cache/kareus (a test would otherwise reuse an earlier run's)."""
    monkeypatch.setenv("KAREUS_CACHE_DIR", str(tmp_path_factory.mktemp("kareus-cache")))


@pytest.fixture(autouse=True)
def no_environment_options(monkeypatch):
    """Options the environment of whoever runs the tests gives kareus do not reach them."""
    monkeypatch.delenv("KAREUS_OPTIONS", raising=False)
    monkeypatch.delenv("KAREUS_OPTIONS_FILE", raising=False)


@pytest.fixture
def fresh_runtime():
    """Devices opened in a test and the default clock controller (an NVML device's, once a
    backend drove it) do not outlive the test."""
    runtime = process_runtime()
    runtime.forget_devices()
    previous = runtime.clocks.set_default(kareus.NullClockController())
    yield runtime
    runtime.forget_devices()
    runtime.clocks.set_default(previous)


@pytest.fixture(autouse=True)
def fresh_compile_state():
    torch._dynamo.reset()
    kareus.clear_graph_reports()
    yield
    torch._dynamo.reset()


def tp_llama(n_layers: int, *, sequence_parallel: bool = False, world_size: int = 2) -> Llama:
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world_size,))
    return parallelize_llama(
        Llama(LlamaConfig(n_layers=n_layers)), mesh, sequence_parallel=sequence_parallel
    )


@dataclass(frozen=True)
class AotGraph:
    """A graph as AOT autograd hands it to a backend's inner compiler, before any pass."""

    gm: torch.fx.GraphModule
    inputs: tuple[Any, ...]
    kind: str
    static_input_idxs: tuple[int, ...]


def aot_graphs(
    model: torch.nn.Module, *args: Any, backward: bool = True, pieces: int = 1
) -> list[AotGraph]:
    """The forward (and, after ``.sum().backward()`` of its floating-point outputs, backward)
    graphs of ``model(*args)``; with ``pieces`` > 1, partitioned as the kareus backend
    partitions them (saved values in that many pieces)."""
    captured = []

    def capture(gm, inputs, **kwargs):
        kind = (
            "backward" if kwargs.get("is_backward")
            else "inference" if kwargs.get("is_inference")
            else "forward"
        )
        captured.append(
            AotGraph(gm, tuple(inputs), kind, tuple(kwargs.get("static_input_idxs") or ()))
        )
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    patches = partitioner_config(pieces, "tests") if pieces > 1 else {}
    compiled = torch.compile(model, backend=lambda gm, ex: compile_fx(
        gm, ex, inner_compile=capture, config_patches=patches))
    out = compiled(*args)
    if backward:  # of every floating-point output (token counts have no gradient)
        sum(o.sum() for o in (out if isinstance(out, tuple) else (out,))
            if o.is_floating_point()).backward()
    torch._dynamo.reset()
    return captured


def analysed(
    model: torch.nn.Module, *args: Any, backward: bool = True, backend: str | None = "fake",
    pieces: int = 1,
) -> list[tuple[AotGraph, GraphAnalysis]]:
    """``aot_graphs`` with each graph analysed as the backend does (a backward after its
    forward), its collectives on a group of ``backend`` (the fake one of ``fake_pg``)."""
    out, forward = [], None
    for g in aot_graphs(model, *args, backward=backward, pieces=pieces):
        a = analyse(
            g.gm, g.inputs, g.kind, forward, backend=backend,
            static_input_idxs=g.static_input_idxs, label=g.kind,
        )
        forward = a.interfaces if g.kind == "forward" else forward
        out.append((g, a))
    return out
