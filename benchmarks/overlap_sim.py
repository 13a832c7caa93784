"""Modelled effect of nanobatch overlap on a Llama-3.2-3B-sized tensor-parallel layer.

Traces one layer (dim 3072, 24 heads as an MHA stand-in for 24/8 GQA, FFN 8192, bf16,
microbatch 8 x 4096 tokens) under TP8 over fake tensors, compiles it with the kareus
backend at 1, 2 and 4 nanobatches (earliest launch slots), and reports the simulated GPU's
time and energy of the forward and backward graphs at the default clock. No GPU and no
real tensor is needed; the numbers are the model's (see kareus/devices/sim/model.py).

    python benchmarks/overlap_sim.py --device sim:a100-sxm4-40gb \\
        --out benchmarks/results/overlap_sim.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table
from torch.testing._internal.distributed.fake_pg import FakeStore

import kareus
from kareus.models.llama import LlamaConfig, fake_parallel_llama

LLAMA_3B_LAYER = LlamaConfig(dim=3072, n_layers=1, n_heads=24, ffn_dim=8192, max_seq_len=4096)


def step_layer(backend: object, tp: int, batch: int, seq: int) -> None:
    """One forward and backward of the layer, TP ``tp``, on fake bf16 tensors, compiled
    with ``backend`` (run under a fake process group of ``tp`` ranks)."""
    torch._dynamo.reset()
    with fake_parallel_llama(LLAMA_3B_LAYER, tp) as model:
        compiled = torch.compile(model, backend=backend)
        compiled(torch.zeros(batch, seq, dtype=torch.long)).float().sum().backward()


def compile_layer(
    device: str, nanobatches: int, tp: int, batch: int, seq: int
) -> list[kareus.GraphReport]:
    options = {"device": device, "nanobatches": nanobatches, "lowering": "eager"}
    backend = kareus.KareusBackend(options)
    step_layer(backend, tp, batch, seq)
    return backend.reports()


def add_layer_arguments(parser: argparse.ArgumentParser) -> None:
    """The layer's parallel degree and tokens (``step_layer``), shared by the benchmarks."""
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=4096)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="sim:a100-sxm4-40gb")
    add_layer_arguments(parser)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/overlap_sim.json"))
    args = parser.parse_args(argv)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.tp)
    rows = []
    for k in (1, 2, 4):
        for report in compile_layer(args.device, k, args.tp, args.batch, args.seq):
            e = report.estimate
            rows.append(
                {
                    "nanobatches": report.nanobatches,
                    "requested": k,
                    "graph": report.kind,
                    "time_ms": e.time_s * 1e3,
                    "energy_j": e.energy_j,
                    "effective_energy_j": e.effective_energy_j,
                    "exposed_comm_ms": e.details.get("exposed_comm_s", 0.0) * 1e3,
                    "fallback": None if report.fallback is None else str(report.fallback),
                }
            )
    table = Table(title=f"Llama-3.2-3B-sized layer, TP{args.tp}, {args.batch}x{args.seq} tokens, "
                  f"{args.device} at its default clock (modelled)", title_justify="left")
    for column in (
        "graph", "k", "time (ms)", "energy (J)", "E - P_static t (J)", "exposed comm (ms)"
    ):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(
            r["graph"], str(r["nanobatches"]), f"{r['time_ms']:.2f}", f"{r['energy_j']:.2f}",
            f"{r['effective_energy_j']:.2f}", f"{r['exposed_comm_ms']:.2f}",
        )
    Console(width=120).print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"device": args.device, "tp": args.tp, "batch": args.batch,
                                    "seq": args.seq, "rows": rows}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
