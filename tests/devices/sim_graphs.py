"""Graphs the simulated GPU is tested on: the probes of ``probes``
(traced over fake tensors, nothing is allocated).

Collectives need a process group: call from tests that run in an 8-rank fake world
(``conftest.init_fake_pg(8)``, or ``probes.fake_world()``); ``group`` is its name.
"""

from __future__ import annotations

from probes import (
    GiB,
    all_reduces,
    attention,
    beside,
    c10d,
    collective,
    copy,
    gemm,
    trace,
)

__all__ = [
    "GiB", "all_reduces", "attention", "beside", "c10d", "collective", "copy", "gemm", "trace"
]
