"""GPU check for the simulated presets: measure three kernels, compare with the model.

On a CUDA GPU, at its default clocks (the dry-run controller: no NVML setter is ever
called), measures with NVML's energy counter a large bf16 GEMM, a memory-bound copy and a
small elementwise kernel, predicts the same graphs with a simulated preset, and writes a
JSON comparison (a calibration record to keep beside the preset table).

    python benchmarks/gpu_check.py --preset sim:h200 --out benchmarks/results/gpu_check_h200.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from kareus.profiler.devices import Measurement, SimulatedGPU, Workload
from kareus.runtime.clock import DEFAULT_CLOCK_MHZ


@dataclass(frozen=True)
class Case:
    name: str
    fn: Callable[..., torch.Tensor]
    shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype
    flops: float  # useful work, for the achieved-rate column
    bytes: float


N = 8192
COPY_ELEMS = 1 << 29  # 1 GiB of bf16 read and 1 GiB written
SMALL = 1 << 12

CASES = (
    Case("gemm_bf16_8192", torch.mm, ((N, N), (N, N)), torch.bfloat16, 2.0 * N**3, 3 * N * N * 2),
    Case(
        "copy_bf16_1gib", lambda x: x * 2, ((COPY_ELEMS,),), torch.bfloat16, 0.0, 2 * COPY_ELEMS * 2
    ),
    Case("relu_fp32_4k", torch.relu, ((SMALL,),), torch.float32, 0.0, 2 * SMALL * 4),
)


def traced(case: Case) -> torch.fx.GraphModule:
    """The case's aten graph with fake-tensor metadata, which is all the model needs."""
    with FakeTensorMode():
        args = [torch.empty(s, dtype=case.dtype) for s in case.shapes]
        return make_fx(case.fn)(*args)


def predict(preset: str) -> dict[str, Measurement]:
    gpu = SimulatedGPU(preset)
    return {
        c.name: gpu.measure(Workload(c.name, gm=traced(c)), gpu.search_clocks()[0]) for c in CASES
    }


def measure_on_gpu() -> tuple[dict[str, Measurement], dict[str, object]]:
    from kareus.profiler.devices.nvml import NvmlGPU

    results = {}
    with NvmlGPU(dry_run=True, min_window_s=2.0) as gpu:
        info = {
            "gpu": gpu.gpu_name,
            "nvml_device": gpu.name,
            "energy_method": gpu.method,
            "idle_power_w": _idle_power_w(gpu),
            "static_power_w_assumed": gpu.static_power_w,
        }
        for case in CASES:
            args = [torch.randn(s, device="cuda").to(case.dtype) for s in case.shapes]
            workload = Workload(case.name, run=lambda c=case, a=args: c.fn(*a))
            results[case.name] = gpu.measure(workload, DEFAULT_CLOCK_MHZ)
            del args
            torch.cuda.empty_cache()
    return results, info


def _idle_power_w(gpu) -> float:
    """Power with a CUDA context open and nothing running (read before any case)."""
    torch.cuda.synchronize()
    samples = [gpu.power_w() for _ in range(20)]
    return sum(samples) / len(samples)


def compare(
    measured: dict[str, Measurement], predicted: dict[str, Measurement]
) -> list[dict[str, object]]:
    rows = []
    for case in CASES:
        m, p = measured[case.name], predicted[case.name]
        row = {
            "case": case.name,
            "measured_time_s": m.time_s,
            "predicted_time_s": p.time_s,
            "time_ratio": p.time_s / m.time_s,
            "measured_energy_j": m.energy_j,
            "predicted_energy_j": p.energy_j,
            "energy_ratio": p.energy_j / m.energy_j,
            "measured_power_w": m.average_power_w,
            "predicted_power_w": p.average_power_w,
            "measurement_details": m.details,
        }
        if case.flops:
            row["measured_tflops"] = case.flops / m.time_s / 1e12
        if case.bytes:
            row["measured_gb_per_s"] = case.bytes / m.time_s / 1e9
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="sim:h200")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu_check.json"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    predicted = predict(args.preset)
    measured, info = measure_on_gpu()
    record = {
        "preset": args.preset,
        "torch": torch.__version__,
        "host": platform.node(),
        "clocks": "default (dry run: no clock was set)",
        **info,
        "cases": compare(measured, predicted),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2))
    for row in record["cases"]:
        print(
            f"{row['case']:>16}: measured {row['measured_time_s'] * 1e3:9.3f} ms "
            f"{row['measured_energy_j']:8.3f} J | model x{row['time_ratio']:.2f} time, "
            f"x{row['energy_ratio']:.2f} energy"
        )
    print(f"idle {info['idle_power_w']:.0f} W; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
