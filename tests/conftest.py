"""Shared fixtures: a fake process group for single-process graph tests, clean compile state."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import kareus
from kareus.models.llama import Llama, LlamaConfig, parallelize_llama


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
