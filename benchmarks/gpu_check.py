"""GPU check for the simulated presets: measure one kernel of each class, compare with the model.

On a CUDA GPU, at its default clocks (the dry-run controller, every NVML setter refused:
``gpu_measure``), measures with NVML's energy counter one case of every kernel class the
simulated model distinguishes (tensor-core GEMMs large, non-square and small; an fp32
matmul without TF32; causal flash attention forward and forward+backward; memory-bound
copy, write-only, read-only and STREAM triad; a tiny elementwise kernel), predicts the
same graphs with a simulated preset, and writes a JSON comparison (a calibration record to
keep beside the preset table). Each case is one python function: traced over fake tensors
on the CPU for the model, run eagerly on real tensors on the GPU.

    python benchmarks/gpu_check.py --preset sim:h200 --out benchmarks/results/gpu_check_h200.json

``benchmarks/fidelity.py`` reports that record (``gpu_measure.H200_KERNELS``) beside the
model, each case judged by the fidelity tolerances of ``calibration.py``.

Run time on a GPU: each case is warmed up, then measured in windows of at least
``gpu_measure.MIN_WINDOW_S`` (NvmlGPU repeats it to fill one, and once more if the first
falls short), so about 3-5 s a case, under a minute and a half for the eleven.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from gpu_measure import (
    comparison,
    dry_run_gpu,
    gpu_info,
    header,
    measure_warm,
    pynvml_module,
    setters_refused,
)
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from kareus.devices import Measurement, SimulatedGPU, Workload


@dataclass(frozen=True)
class Case:
    name: str
    kind: str  # the kernel class the case stands for
    fn: Callable[..., object]
    shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype
    flops: float  # useful work, for the achieved-rate columns
    bytes: float  # useful HBM traffic (each input read once, each output written once)
    settings: dict[str, bool] = field(default_factory=dict)
    """torch.backends flags set for the case and restored after it (tracing and running),
    e.g. {"cuda.matmul.allow_tf32": False}."""


def _gemm(name: str, m: int, k: int, n: int, dtype: torch.dtype, **kw) -> Case:
    size = torch.empty((), dtype=dtype).element_size()
    return Case(
        name, kw.pop("kind", "gemm"), torch.mm, ((m, k), (k, n)), dtype,
        2.0 * m * n * k, float((m * k + k * n + m * n) * size), **kw,
    )


# Attention: batch 8, 16 heads, sequence 2048, head dim 128, causal (bf16).
ATTN = (8, 16, 2048, 128)
_B, _H, _S, _D = ATTN
ATTN_TENSOR_BYTES = _B * _H * _S * _D * 2
ATTN_FWD_FLOPS = 4.0 * _B * _H * _S * _S * _D / 2  # QK^T and PV; causal skips half
"""The backward does 2.5x the forward's matmul work (dV, dP, dS->dQ, dK: FlashAttention's
count)."""


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def attention_fwd_bwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """Forward and backward in one function, so make_fx traces the joint aten graph (on the
    CPU: ``_scaled_dot_product_flash_attention_for_cpu`` and its backward, which the model
    costs as the CUDA flash kernels) and the GPU runs the same autograd calls."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    with torch.enable_grad():
        out = attention(q, k, v)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
    return (out.detach(), *grads)


def zero_(x: torch.Tensor) -> torch.Tensor:
    return x.zero_()


def total(x: torch.Tensor) -> torch.Tensor:
    return x.sum()


def triad(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """STREAM triad a + 2 b into a new array: one kernel (aten.add with alpha) that reads two
    arrays and writes a third; the caching allocator hands back the same block every run."""
    return torch.add(a, b, alpha=2.0)


def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


N = 8192
COPY_ELEMS = 1 << 29  # 1 GiB of bf16 read and 1 GiB written
BIG_ELEMS = 1 << 30  # 2 GiB of fp16 / bf16
TRIAD_ELEMS = 1 << 28  # 1 GiB of fp32 per array
SMALL = 1 << 12

CASES = (
    _gemm("gemm_bf16_8192", N, N, N, torch.bfloat16),
    # The CUTLASS profiler docs' shape: 3456 rows do not tile a wave of 132 SMs evenly.
    _gemm("gemm_fp16_3456x4096x8192", 3456, 8192, 4096, torch.float16),
    _gemm("gemm_bf16_1024", 1024, 1024, 1024, torch.bfloat16, kind="gemm_small"),
    # PyTorch's default: fp32 matmuls on the FP32 pipes, not TF32 tensor cores.
    _gemm(
        "gemm_fp32_8192_no_tf32", N, N, N, torch.float32, kind="gemm_fp32",
        settings={"cuda.matmul.allow_tf32": False},
    ),
    Case(
        "sdpa_bf16_causal_fwd", "attention", attention, (ATTN,) * 3, torch.bfloat16,
        ATTN_FWD_FLOPS, 4.0 * ATTN_TENSOR_BYTES,  # read q, k, v; write out
    ),
    Case(
        "sdpa_bf16_causal_fwd_bwd", "attention", attention_fwd_bwd, (ATTN,) * 3,
        torch.bfloat16, 3.5 * ATTN_FWD_FLOPS,
        # forward: q, k, v, out; backward: read q, k, v, out, dout, write dq, dk, dv
        12.0 * ATTN_TENSOR_BYTES,
    ),
    Case(
        "copy_bf16_1gib", "memory_copy", double, ((COPY_ELEMS,),), torch.bfloat16,
        0.0, 2 * COPY_ELEMS * 2,
    ),
    Case(
        "zero_fp16_2gib", "memory_write", zero_, ((BIG_ELEMS,),), torch.float16,
        0.0, BIG_ELEMS * 2,
    ),
    Case(
        "sum_bf16_2gib", "memory_read", total, ((BIG_ELEMS,),), torch.bfloat16,
        0.0, BIG_ELEMS * 2,
    ),
    Case(
        "triad_fp32_3x1gib", "memory_triad", triad, ((TRIAD_ELEMS,),) * 2, torch.float32,
        0.0, 3 * TRIAD_ELEMS * 4,  # STREAM counts bytes
    ),
    Case("relu_fp32_4k", "tiny", torch.relu, ((SMALL,),), torch.float32, 0.0, 2 * SMALL * 4),
)


@contextlib.contextmanager
def applied(settings: dict[str, bool]) -> Iterator[None]:
    """Set ``torch.backends.<path>`` flags for the block and restore them after it."""
    saved = []
    try:
        for path, value in settings.items():
            *parents, attr = ("backends." + path).split(".")
            owner = torch
            for part in parents:
                owner = getattr(owner, part)
            saved.append((owner, attr, getattr(owner, attr)))
            setattr(owner, attr, value)
        yield
    finally:
        for owner, attr, value in reversed(saved):
            setattr(owner, attr, value)


def traced(case: Case) -> torch.fx.GraphModule:
    """The case's aten graph with fake-tensor metadata, which is all the model needs."""
    with applied(case.settings), FakeTensorMode():
        args = [torch.empty(s, dtype=case.dtype) for s in case.shapes]
        return make_fx(case.fn)(*args)


def predict(preset: str) -> dict[str, Measurement]:
    gpu = SimulatedGPU(preset)
    clock = gpu.search_clocks()[0]
    return {c.name: gpu.measure(Workload(c.name, gm=traced(c)), clock) for c in CASES}


def measure_on_gpu() -> tuple[dict[str, Measurement], dict[str, object]]:
    results = {}
    with dry_run_gpu() as gpu:
        info = gpu_info(gpu)
        for case in CASES:
            args = [torch.randn(s, device="cuda", dtype=case.dtype) for s in case.shapes]
            with applied(case.settings):
                run = functools.partial(case.fn, *args)
                results[case.name] = measure_warm(gpu, Workload(case.name, run=run))
            del args, run
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    return results, info


def _rates(prefix: str, case: Case, time_s: float) -> dict[str, float]:
    rates = {}
    if case.flops:
        rates[f"{prefix}_tflops"] = case.flops / time_s / 1e12
    if case.bytes:
        rates[f"{prefix}_gb_per_s"] = case.bytes / time_s / 1e9
    return rates


def describe(case: Case) -> dict[str, object]:
    return {
        "kind": case.kind,
        "shapes": [list(s) for s in case.shapes],
        "dtype": str(case.dtype).removeprefix("torch."),
        "useful_flops": case.flops,
        "useful_bytes": case.bytes,
        "settings": {f"torch.backends.{k}": v for k, v in case.settings.items()},
    }


def compare(
    measured: dict[str, Measurement], predicted: dict[str, Measurement]
) -> list[dict[str, object]]:
    rows = []
    for case in CASES:
        m, p = measured[case.name], predicted[case.name]
        rows.append(
            {
                "case": case.name,
                **comparison(m, p),
                **_rates("measured", case, m.time_s),
                **_rates("predicted", case, p.time_s),
                **describe(case),
            }
        )
    return rows


def _rate_text(row: dict[str, object]) -> str:
    if "measured_tflops" in row:
        return f"{row['measured_tflops']:7.1f} TFLOP/s (model {row['predicted_tflops']:7.1f})"
    return f"{row['measured_gb_per_s']:7.0f} GB/s    (model {row['predicted_gb_per_s']:7.0f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="sim:h200")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu_check.json"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    predicted = predict(args.preset)
    with setters_refused(pynvml_module()) as refused:
        measured, info = measure_on_gpu()
    if refused:
        print(f"gpu_check: NVML setters were called: {', '.join(refused)}", file=sys.stderr)
        return 1
    record = {**header(args.preset), **info, "cases": compare(measured, predicted)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2))
    for row in record["cases"]:
        print(
            f"{row['case']:>26}: {row['measured_time_s'] * 1e3:9.3f} ms "
            f"{row['measured_power_w']:4.0f} W {_rate_text(row)} | model "
            f"x{row['time_ratio']:.2f} time, x{row['energy_ratio']:.2f} energy"
        )
    print(f"idle {info['idle_power_w']:.0f} W; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
