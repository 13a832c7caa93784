"""torch's SDPA context parallelism under kareus on a GPU: does it trace, what kareus splits.

    python benchmarks/gpu_context_parallel.py --out benchmarks/results/gpu_context_parallel.json

``context_parallel`` (all-gather rotation) routes ``F.scaled_dot_product_attention`` through
DTensor's ring attention, which has CUDA kernels only: on the CPU it fails in torch 2.13 and
2.14.1, eagerly too (``tests/test_context_parallel.py``), so whether it traces under
``torch.compile``, and which collectives its graphs then carry, can only be seen on a GPU.

One process plays rank 0 of a 2-rank CP group through torch's fake process group: an
all-gather returns this rank's shard in every slot and a reduce-scatter its first chunk, so
the function computed is not the 2-GPU model's, but eager, ``aot_eager`` and kareus all
compute the same one and can be compared. A causal attention block (4 heads of 64) runs
forward and backward in bf16 (the flash kernel) and fp32 (the memory-efficient one), under
each of: eager, ``aot_eager``, kareus at 2 nanobatches with eager lowering, and (bf16) with
Inductor; kareus's runs verify their rewrite against the unrewritten graph (``verify``).
The GPU's clocks are never touched: kareus runs on the simulated device, and every NVML
setter is refused while the check runs.

Recorded per run: whether it ran (or torch's error), the output's and gradients' largest
difference from eager, and kareus's graphs (kind, collectives, split, applied count,
fallback, notes). On the CPU (``--cpu``, or no GPU) the same runs record the CPU's failure.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from gpu_measure import header, pynvml_module, setters_refused

import kareus

BATCH, SEQ, DIM, HEADS = 2, 1024, 256, 4


class Attention(torch.nn.Module):
    def __init__(self, dim: int = DIM, heads: int = HEADS):
        super().__init__()
        self.q, self.k, self.v, self.out = (torch.nn.Linear(dim, dim) for _ in range(4))
        self.head_dim = dim // heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, -1))


def _graphs(backend: kareus.KareusBackend) -> list[dict[str, Any]]:
    return [
        {
            "label": r.label, "kind": r.kind,
            "collectives": [c.kind for c in r.collectives],
            "split": r.coverage.split, "total": r.coverage.total,
            "nanobatches": r.nanobatches,
            "fallback": None if r.fallback is None else str(r.fallback),
            "notes": list(r.notes),
        }
        for r in backend.reports()
    ]


def _step(run, model: Attention, mesh, device: str, dtype: torch.dtype):
    from torch.distributed.tensor.experimental import context_parallel

    x = torch.randn(BATCH, SEQ, DIM, generator=torch.Generator().manual_seed(1))
    x = x.to(device=device, dtype=dtype)
    with context_parallel(mesh, buffers=[x], buffer_seq_dims=[1]):
        out = run(x)
        out.float().square().mean().backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    return out.detach(), grads


def _difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def run_case(mesh, device: str, dtype: torch.dtype, lowerings: tuple[str, ...]) -> dict:
    """Eager, aot_eager and kareus (each lowering) on one dtype; differences from eager."""
    runs: dict[str, dict[str, Any]] = {}
    reference = None
    names = ["eager", "aot_eager", *(f"kareus-{lowering}" for lowering in lowerings)]
    for name in names:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = Attention().to(device=device, dtype=dtype)
        backend = None
        if name == "eager":
            run = model
        elif name == "aot_eager":
            run = torch.compile(model, backend="aot_eager")
        else:
            backend = kareus.KareusBackend({
                "nanobatches": 2, "lowering": name.removeprefix("kareus-"),
                "profile": "off", "device": "sim:h200", "verify": True,
            })
            run = torch.compile(model, backend=backend)
        started = time.perf_counter()
        entry: dict[str, Any] = {"ran": False, "error": None}
        try:
            out, grads = _step(run, model, mesh, device, dtype)
            entry["ran"] = True
            if name == "eager":
                reference = (out, grads)
            elif reference is not None:
                entry["output_max_diff"] = _difference(out, reference[0])
                entry["grad_max_diff"] = max(map(_difference, grads, reference[1]))
        except Exception as exc:  # noqa: BLE001 - what the user sees is the record
            entry["error"] = f"{type(exc).__name__}: {exc}"[:2000]
            entry["traceback_tail"] = traceback.format_exc()[-3000:]
        entry["seconds"] = round(time.perf_counter() - started, 1)
        if backend is not None:
            entry["graphs"] = _graphs(backend)
        runs[name] = entry
    return {"dtype": str(dtype).removeprefix("torch."), "runs": runs}


def check(device: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental._attention import set_rotate_method
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh(device, (2,), mesh_dim_names=("cp",))
        set_rotate_method("allgather")
        cases = [run_case(mesh, device, torch.bfloat16, ("eager", "inductor")),
                 run_case(mesh, device, torch.float32, ("eager",))]
    finally:
        dist.destroy_process_group()
    return {
        "device": device,
        "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
        "setup": {"cp": 2, "process_group": "fake (rank 0 of 2)", "batch": BATCH, "seq": SEQ,
                  "dim": DIM, "heads": HEADS, "rotate_method": "allgather"},
        "cases": cases,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cpu", action="store_true", help="the CPU even on a GPU")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    started = time.perf_counter()
    with setters_refused(pynvml_module()) as refused:
        record = check(device)
    record = {**header("sim:h200"), **record, "refused_setter_calls": refused,
              "seconds": round(time.perf_counter() - started, 1)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2))
    for case in record["cases"]:
        for name, run in case["runs"].items():
            outcome = "ran" if run["ran"] else f"failed: {run['error'][:150]}"
            diffs = (f", output diff {run['output_max_diff']:.2e}, grad diff "
                     f"{run['grad_max_diff']:.2e}" if "grad_max_diff" in run else "")
            print(f"{case['dtype']:>9} {name:>16}: {outcome}{diffs} ({run['seconds']} s)")
            for g in run.get("graphs", []):
                print(f"{'':>28}{g['label']} {g['kind']}: {g['collectives']} "
                      f"{g['split']}/{g['total']} split, k={g['nanobatches']}, "
                      f"fallback {g['fallback']}")
    print(f"wrote {args.out} in {record['seconds']} s")
    return 1 if refused else 0


if __name__ == "__main__":
    sys.exit(main())
