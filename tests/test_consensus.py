"""Ranks compare compile-time decisions: every rank gets the same answer (2 gloo processes)."""

import socket
import tempfile
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

from kareus.consensus import agree


def _worker(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        world = dist.group.WORLD.group_name
        same = agree(("r0/forward", 2, (0, 1)), [world])
        different = agree(("r0/forward", 2 if rank == 0 else 1), [world, world])
        Path(out, str(rank)).write_text(f"{same} {different}")
    finally:
        dist.destroy_process_group()


def test_every_rank_sees_the_same_verdict():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_worker, args=(port, out), nprocs=2, start_method="spawn")
        assert [Path(out, str(r)).read_text() for r in range(2)] == ["True False"] * 2


def test_single_process_groups_agree_trivially(fake_pg):
    assert agree(object(), [dist.group.WORLD.group_name])
    assert agree("anything", [])
