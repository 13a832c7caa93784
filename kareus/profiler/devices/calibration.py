"""Published data points the simulated GPUs are checked against (tests/profiler).

Each point names a preset, a quantity (see ``QUANTITIES``), the published value, the band
the simulator must land in and the source (as cited in /work/shared/CALIBRATION.md). A band
is wide where the source is approximate or the model leaves out what the point depends on;
the comment says which. Points are data only: nothing here feeds the model.

Published facts not compared, and why: A100 idle at locked 1410 MHz, 65 W (bare idle is
below the method's static power, and the simulator has no bare-idle state); H100 FP32 burn
580-650 W (no non-tensor-core FP32 model); H200 decode 137-300 W (decode is no pure HBM
stream: launch gaps, attention, sampling); DGEMM power varying 67% with input values, and
the GEMM tail effect beside NCCL (neither data values nor wave quantisation are modelled);
Domino's 17-43% communication share (a workload result, benchmark territory).
"""

from __future__ import annotations

from dataclasses import dataclass

QUANTITIES = {
    "gemm_tflops": "TFLOP/s of a bf16 8192^3 matmul at the default clock",
    "gemm_clock_mhz": "SM clock that matmul runs at (power-capped)",
    "gemm_power_w": "average power of that matmul",
    "copy_tbps": "HBM traffic (read + write, TB/s) of a 1 GiB bf16 device-local copy",
    "all_reduce_us": "time of an 8-rank all-reduce of size_bytes, alone, default CTAs",
    "all_reduce_busbw_gbps": "nccl-tests bus bandwidth of that all-reduce",
    "all_gather_busbw_gbps": "bus bandwidth of an 8-rank all-gather of size_bytes (output)",
    "reduce_scatter_busbw_gbps": "bus bandwidth of an 8-rank reduce-scatter of size_bytes",
    "static_power_w": "the device's P_static",
    "blocked_power_w": "average power while a 32 KiB all-reduce waits on its peers",
    "memory_clock_saving": "largest energy saving of the 1 GiB copy at any supported clock",
    "overlap_compute_slowdown": "relative slowdown of the matmul beside a 1 GiB all-reduce",
    "overlap_comm_slowdown": "relative slowdown of a 256 MiB all-reduce beside HBM copies",
}


@dataclass(frozen=True)
class DataPoint:
    preset: str
    quantity: str
    value: float
    low: float
    high: float
    source: str
    size_bytes: int = 0


def _around(
    preset: str, quantity: str, value: float, tol: float, source: str, size_bytes: int = 0
) -> DataPoint:
    low, high = value * (1 - tol), value * (1 + tol)
    return DataPoint(preset, quantity, value, low, high, source, size_bytes)


A100, H100, H200 = "sim:a100-sxm4-40gb", "sim:h100-sxm", "sim:h200"
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
_ML_ENG = "stas00/ml-engineering network/README.md"
_OVERLAP = "arXiv 2507.03114: compute slows 18.9% on average, at most 40%, when overlapped"

POINTS: tuple[DataPoint, ...] = (
    # GEMM throughput; 5% covers shape effects the model leaves out.
    _around(A100, "gemm_tflops", 264.5, 0.05, "zzc0721/torch-performance-test-data"),
    _around(A100, "gemm_tflops", 257.5, 0.05, "thonking.ai, 8192^3 random inputs"),
    _around(A100, "gemm_tflops", 271.2, 0.05, "stas00/ml-engineering, best shape"),
    _around(H100, "gemm_tflops", 789.2, 0.05, "zzc0721/torch-performance-test-data"),
    _around(H100, "gemm_tflops", 794.5, 0.05, "stas00/ml-engineering, best shape"),
    _around(H200, "gemm_tflops", 790.3, 0.05, "zzc0721/torch-performance-test-data"),
    # Power-capped clocks and power of that GEMM.
    _around(A100, "gemm_clock_mhz", 1305, 0.05, "glennklockwood.com: DGEMM at 400 W"),
    _around(H200, "gemm_clock_mhz", 1500, 0.10, "tile-ai/TileOPs 1587-1588: ~1500 MHz"),
    DataPoint(A100, "gemm_power_w", 400, 380, 400, "nvidia-docker 1648: 400 W limit"),
    DataPoint(H100, "gemm_power_w", 700, 665, 700, "REF s3: 700 W TDP"),
    DataPoint(H200, "gemm_power_w", 700, 665, 700, "tile-ai/TileOPs 1587-1588: 700 W"),
    # Device-local copy bandwidth.
    _around(A100, "copy_tbps", 1.355, 0.03, "PTsolvers/gpu-workshop-JuliaCon23 issue 7"),
    _around(H100, "copy_tbps", 2.51, 0.03, f"{_ML_ENG}; NVIDIA/nccl 1264: 2.49-2.53"),
    # 8x A100 all-reduce sweep (nccl-tests). The 1 MiB and 8 MiB points sit off any smooth
    # curve through the rest (NCCL switches protocol there; not modelled): wide bands.
    _around(A100, "all_reduce_us", 43.8, 0.10, _ML_ENG, 32 * KiB),
    DataPoint(A100, "all_reduce_us", 101.9, 50.0, 112.0, _ML_ENG, MiB),
    _around(A100, "all_reduce_us", 133.5, 0.30, _ML_ENG, 8 * MiB),
    _around(A100, "all_reduce_us", 684.6, 0.10, _ML_ENG, 64 * MiB),
    _around(A100, "all_reduce_us", 2420, 0.15, _ML_ENG, 256 * MiB),
    _around(A100, "all_reduce_us", 8200, 0.10, _ML_ENG, GiB),
    _around(A100, "all_reduce_us", 128_000, 0.05, _ML_ENG, 16 * GiB),
    # 8x H100: NVLS and ring bus bandwidth (nccl-tests), latency via torch.distributed
    # (sizes read as binary units; 20% as the two sources were measured differently).
    _around(H100, "all_reduce_busbw_gbps", 478, 0.05, "NVIDIA/nccl-tests 212, 290", 16 * GiB),
    _around(H100, "all_gather_busbw_gbps", 370, 0.05, "NVIDIA/nccl-tests 212, 290", 16 * GiB),
    *(
        _around(H100, "all_reduce_us", us, 0.20, "ByteDance-Seed/Triton-distributed 57", size)
        for size, us in (
            (128, 19.2), (32 * KiB, 22.7), (MiB, 32.4), (4 * MiB, 59.4), (16 * MiB, 135.7)
        )
    ),
    # 8x H200 sweep (nccl-tests).
    _around(H200, "all_reduce_us", 40.0, 0.10, _ML_ENG, 32 * KiB),
    *(
        _around(H200, "all_reduce_busbw_gbps", gbps, 0.10, _ML_ENG, size)
        for size, gbps in ((MiB, 39.9), (64 * MiB, 346.5), (256 * MiB, 436.2), (GiB, 463.6))
    ),
    _around(H200, "all_reduce_busbw_gbps", 480.0, 0.05, _ML_ENG, 16 * GiB),
    _around(H200, "all_gather_busbw_gbps", 361.4, 0.05, _ML_ENG, 16 * GiB),
    _around(H200, "reduce_scatter_busbw_gbps", 362.9, 0.05, _ML_ENG, 16 * GiB),
    # Static and blocked power.
    _around(A100, "static_power_w", 85, 0.01, "REF s1: blocked in communication"),
    _around(A100, "blocked_power_w", 85, 0.05, "REF s1: blocked in communication"),
    DataPoint(H100, "static_power_w", 142.5, 140, 145, "wilicc/gpu-burn 114: idle P0"),
    _around(H200, "static_power_w", 115, 0.01, "NVIDIA/cuda-samples 311: idle P0"),
    # Locking the SM clock on memory-bound work (the one point memory_sm_activity is
    # calibrated to, so this checks the calibration holds).
    DataPoint(H200, "memory_clock_saving", 0.32, 0.24, 0.40, "arXiv 2605.11999: up to 32%"),
    # Interference while a collective and compute overlap.
    DataPoint(A100, "overlap_compute_slowdown", 0.189, 0.0, 0.40, _OVERLAP),
    DataPoint(H100, "overlap_compute_slowdown", 0.189, 0.0, 0.40, _OVERLAP),
    DataPoint(A100, "overlap_comm_slowdown", 1.0, 0.0, 1.0, "NVIDIA/nccl 1433: up to 2x slower"),
)
