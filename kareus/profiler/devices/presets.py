"""The preset table of simulated GPUs, and custom GPUs loaded from JSON.

Every constant cites where it comes from: /work/shared/CALIBRATION.md ("CAL", with the
source it names) and REFERENCE.md ("REF s<section>"), or says that it is an assumption and
what bounds it. The table is calibrated once from those sources and then frozen: nothing
here may be tuned towards a benchmark result. simulated.py holds the equations that use it.

A custom GPU is a JSON object with the fields of :class:`GPUSpec`; ``"base": "<preset>"``
starts from a preset and overrides only the fields given::

    {"base": "sim:h100-sxm", "name": "h100-500w", "tdp_w": 500}
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

from kareus.profiler.devices.errors import GPUSpecError

COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")

TENSOR_TIME_SCALE = {"float32": 2.0, "float64": 16.0}
"""Tensor-core time of a matmul in this dtype relative to bf16/fp16 (others: 1).

float32 matmuls are assumed to run on TF32 tensor cores (datasheets: A100 156 vs 312,
H100 495 vs 989 dense TFLOP/s); float64 on FP64 tensor cores (A100 datasheet: 19.5 vs 312).
"""


@dataclass(frozen=True)
class GPUSpec:
    """One simulated GPU model (and its NVLink peers); units are SI unless the name says."""

    name: str
    # -- compute
    sm_count: int
    flop_per_clk: float  # dense bf16 tensor-core FLOP per SM clock, whole GPU
    gemm_efficiency: float  # achieved / peak FLOP/s of a large GEMM at a fixed clock
    measured_gemm_tflops: float  # large bf16 GEMM at default clocks (power-limited)
    kernel_floor_s: float  # shortest time any kernel takes (launch + ramp)
    # -- memory
    hbm_bytes_per_s: float  # datasheet HBM bandwidth
    hbm_efficiency: float  # measured device-local copy bandwidth / datasheet
    memory_clock_sensitivity: float  # sigma in t_mem * (1 + sigma * (f_max / f - 1))
    hbm_pj_per_bit: float  # dynamic energy of HBM traffic
    # -- power
    tdp_w: float
    static_power_w: float
    v_floor: float  # volts below the knee clock
    v_max: float  # volts at the maximum clock (linear from the knee)
    knee_mhz: int
    memory_sm_activity: float  # SM switching of a bandwidth-bound kernel vs a GEMM
    # -- clocks
    min_clock_mhz: int
    max_clock_mhz: int
    clock_step_mhz: int
    search_min_mhz: int
    search_step_mhz: int
    clock_switch_s: float  # GPU stall per clock change
    min_switch_interval_s: float  # closest two switches a plan may place
    # -- collectives
    bus_bytes_per_s: Mapping[str, float]  # nccl-tests bus bandwidth per collective kind
    default_comm_sms: int  # CTAs (one per SM) NCCL gives a collective by default
    saturating_comm_sms: int  # CTAs at which bus bandwidth stops growing
    ring_step_latency_s: float  # per ring step; all-reduce on n ranks has 2(n-1) steps
    nccl_buffer_bytes: int  # pipeline depth per rank (fill cost, see simulated.py)
    comm_hbm_bytes_per_bus_byte: float  # HBM traffic a collective causes per bus byte

    def __post_init__(self) -> None:
        _validate(self)

    def supported_clocks(self) -> tuple[int, ...]:
        """Every SM clock, descending."""
        return tuple(
            range(self.max_clock_mhz, self.min_clock_mhz - 1, -self.clock_step_mhz)
        )

    def search_clocks(self) -> tuple[int, ...]:
        """The clocks searched by default, descending from the maximum (the default)."""
        return tuple(
            range(self.max_clock_mhz, self.search_min_mhz - 1, -self.search_step_mhz)
        )

    def voltage(self, mhz: float) -> float:
        """V(f): flat at ``v_floor`` up to the knee, then linear to ``v_max`` at f_max."""
        if mhz <= self.knee_mhz:
            return self.v_floor
        rise = (mhz - self.knee_mhz) / (self.max_clock_mhz - self.knee_mhz)
        return self.v_floor + (self.v_max - self.v_floor) * rise

    @property
    def sustained_gemm_mhz(self) -> float:
        """Clock at which the measured GEMM throughput is reached (the power-capped clock)."""
        return self.measured_gemm_tflops * 1e12 / (
            self.gemm_efficiency * self.flop_per_clk * 1e6
        )

    @property
    def sm_power_coeff(self) -> float:
        """C of P_sm = activity * C * f[MHz] * V^2, calibrated once: a large GEMM (activity
        1) at the sustained clock draws exactly the TDP. Its small HBM power is neglected
        here, so a simulated GEMM settles one clock step or so below the sustained clock."""
        f = self.sustained_gemm_mhz
        return (self.tdp_w - self.static_power_w) / (f * self.voltage(f) ** 2)


_FIELDS = {f.name: f for f in dataclasses.fields(GPUSpec)}


@dataclass(frozen=True)
class _Range:
    """Accepted values of a numeric field: finite, never a bool, ``low`` < (or <=) value
    <= ``high``; ``integer`` for counts, clocks and sizes."""

    low: float
    low_open: bool = True  # value > low (else value >= low)
    high: float = math.inf
    integer: bool = False

    def accepts(self, value: object) -> bool:
        if isinstance(value, bool) or not isinstance(value, int if self.integer else (int, float)):
            return False
        if not math.isfinite(value):
            return False
        above = value > self.low if self.low_open else value >= self.low
        return above and value <= self.high

    def describe(self) -> str:
        if self.integer:
            return f"an integer >= {self.low + 1 if self.low_open else self.low:g}"
        if self.high < math.inf:
            return f"a finite number in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}]"
        return f"a finite number {'>' if self.low_open else '>='} {self.low:g}"


_COUNT = _Range(0, integer=True)  # SMs, clocks in MHz, bytes: integers >= 1
_POSITIVE = _Range(0)  # divides somewhere, or is a scale whose 0 means no device
_NON_NEGATIVE = _Range(0, low_open=False)  # an added cost that may be zero
_FRACTION = _Range(0, high=1)  # an efficiency or a share

_RANGES: dict[str, _Range] = {
    "sm_count": _COUNT,
    "flop_per_clk": _POSITIVE,
    "gemm_efficiency": _FRACTION,
    "measured_gemm_tflops": _POSITIVE,
    "kernel_floor_s": _POSITIVE,  # a kernel's bytes are divided by its duration
    "hbm_bytes_per_s": _POSITIVE,
    "hbm_efficiency": _FRACTION,
    "memory_clock_sensitivity": _NON_NEGATIVE,
    "hbm_pj_per_bit": _NON_NEGATIVE,
    "tdp_w": _POSITIVE,
    "static_power_w": _NON_NEGATIVE,
    "v_floor": _POSITIVE,
    "v_max": _POSITIVE,
    "knee_mhz": _COUNT,
    "memory_sm_activity": _FRACTION,
    "min_clock_mhz": _COUNT,
    "max_clock_mhz": _COUNT,
    "clock_step_mhz": _COUNT,
    "search_min_mhz": _COUNT,
    "search_step_mhz": _COUNT,
    "clock_switch_s": _NON_NEGATIVE,
    "min_switch_interval_s": _NON_NEGATIVE,
    "bus_bytes_per_s": _POSITIVE,  # each value; a collective's bytes are divided by it
    "default_comm_sms": _COUNT,
    "saturating_comm_sms": _COUNT,
    "ring_step_latency_s": _POSITIVE,  # a collective's HBM bytes are divided by its time
    "nccl_buffer_bytes": _COUNT,
    "comm_hbm_bytes_per_bus_byte": _NON_NEGATIVE,
}
assert set(_RANGES) == set(_FIELDS) - {"name"}, "every numeric GPUSpec field needs a range"


def _check_range(spec_name: object, field: str, value: object, accepted: _Range) -> None:
    if not accepted.accepts(value):
        raise GPUSpecError(
            f"GPU spec {spec_name!r}: {field} must be {accepted.describe()}, got {value!r}"
        )


def _validate(spec: GPUSpec) -> None:
    """Reject values the model cannot use, naming the field, the value and the range."""
    if not isinstance(spec.name, str) or not spec.name:
        raise GPUSpecError(f"GPU spec name must be a non-empty string, got {spec.name!r}")
    kinds = spec.bus_bytes_per_s.keys() if isinstance(spec.bus_bytes_per_s, Mapping) else ()
    if set(kinds) != set(COLLECTIVE_KINDS):
        raise GPUSpecError(
            f"GPU spec {spec.name!r}: bus_bytes_per_s must map each of {COLLECTIVE_KINDS} "
            f"to a positive bandwidth, got {spec.bus_bytes_per_s!r}"
        )
    for name, accepted in _RANGES.items():
        value = getattr(spec, name)
        if name == "bus_bytes_per_s":
            for kind in COLLECTIVE_KINDS:
                _check_range(spec.name, f"{name}[{kind!r}]", value[kind], accepted)
        else:
            _check_range(spec.name, name, value, accepted)
    # Relations between fields (each field is now finite and in its range).
    checks = [
        ("measured_gemm_tflops", spec.sustained_gemm_mhz <= spec.max_clock_mhz),
        ("tdp_w", spec.tdp_w > spec.static_power_w),
        ("v_floor", spec.v_floor <= spec.v_max),
        ("min_clock_mhz", spec.min_clock_mhz <= spec.max_clock_mhz),
        ("clock_step_mhz", (spec.max_clock_mhz - spec.min_clock_mhz) % spec.clock_step_mhz == 0),
        ("knee_mhz", spec.min_clock_mhz <= spec.knee_mhz < spec.max_clock_mhz),
        ("search_step_mhz", spec.search_step_mhz % spec.clock_step_mhz == 0),
        ("search_min_mhz", spec.min_clock_mhz <= spec.search_min_mhz <= spec.max_clock_mhz),
        ("default_comm_sms", spec.default_comm_sms < spec.sm_count),
        ("saturating_comm_sms", spec.saturating_comm_sms < spec.sm_count),
    ]
    bad = [name for name, ok in checks if not ok]
    if bad:
        raise GPUSpecError(
            f"GPU spec {spec.name!r}: invalid "
            + ", ".join(f"{name}={getattr(spec, name)!r}" for name in bad)
        )


# ---------------------------------------------------------------------------------------
# Constants shared by several presets (one citation each).

# CAL (thonking.ai, H. He): an 8192^3 bf16 matmul on A100 reaches 295 TFLOP/s with all-zero
# inputs (low switching power, so not power-limited: it runs at 1410 MHz) against 312 peak.
# Assumed to hold for Hopper's tensor cores too (no unthrottled H100 figure found).
_GEMM_EFFICIENCY = 295 / 312

# CAL (NVIDIA/nvidia-docker issue 1648): A100 idle at 1080 MHz runs 712.5 mV, the only V/f
# point found. Assumption: this is the floor and 1080 MHz the knee (1080/1410 of f_max,
# kept as a fraction for Hopper); V(f_max) = 0.90 V (bounds 0.85-1.0 V, typical top of a
# 7 nm / 4 nm DVFS range). These put the energy minimum of compute-bound work at the knee.
_V_FLOOR = 0.7125
_V_MAX = 0.90
_KNEE_FRACTION = 1080 / 1410

# Assumption: a kernel takes at least 3 us (launch + ramp; bounds 2-5 us).
_KERNEL_FLOOR_S = 3e-6

# Assumption: memory-bound kernels run at sigma = 0.1 (bounds 0-0.2) of the SM-clock
# sensitivity of compute (memory clock fixed; fewer loads in flight at low SM clocks):
# 5.7% slower at 900 vs 1410 MHz on A100.
_MEMORY_CLOCK_SENSITIVITY = 0.1

# Assumption: about 4 pJ/bit of HBM traffic (HBM2, O'Connor et al., "Fine-Grained DRAM",
# MICRO 2017; bounds 3-7 pJ/bit with PHY and controllers). Used for HBM2e/HBM3/HBM3e alike.
_HBM_PJ_PER_BIT = 4.0

# SM switching activity of a bandwidth-bound kernel relative to a GEMM (scaled by the
# bandwidth it achieves). Calibrated once from CAL (arXiv 2605.11999): on H200, locking
# the SM clock saved up to 32% of the energy of memory-bound decode; 0.18 gives a pure HBM
# stream on sim:h200 a 32% saving at its best clock. Used for all presets (no other data).
_MEMORY_SM_ACTIVITY = 0.18

# CAL (NVIDIA/nccl issue 1225; NVIDIA developer forum post 339078 for H100): NCCL runs a
# collective on 24 channels, one CTA each, and CTAs do not share an SM with compute.
_NCCL_CHANNELS = 24

# NCCL_BUFFSIZE default (4 MiB, NCCL environment-variable docs). Assumption: the ring pays
# one extra pass over the first group_size * 4 MiB of bus bytes (pipeline fill). With this
# shape the A100 all-reduce sweep (CAL, ml-engineering) is met within 10% from 32 KiB and
# 64 MiB up, and the H200 sweep within 5%; the 1 MiB and 8 MiB A100 points are not
# (protocol switches are not modelled; the tests state those tolerances).
_NCCL_BUFFER_BYTES = 4 << 20

# Assumption: each bus byte costs 2 bytes of HBM traffic (source read + destination write;
# bounds 1-4). With HBM shared in proportion to the SMs issuing requests, an A100
# all-reduce overlapped with a bandwidth-bound kernel slows about 1.6x, within CAL's
# "communication up to 2x slower" (NVIDIA/nccl issue 1433).
_COMM_HBM_BYTES_PER_BUS_BYTE = 2.0

# CAL (NVIDIA/nccl issue 1551): switching clocks every ~50 ms caused significant NCCL delays.
_MIN_SWITCH_INTERVAL_S = 0.05


def _knee(max_mhz: int, step: int) -> int:
    return round(max_mhz * _KNEE_FRACTION / step) * step


# ---------------------------------------------------------------------------------------

# Constants every preset shares; each is defined and cited above.
_SHARED = {
    "gemm_efficiency": _GEMM_EFFICIENCY,
    "kernel_floor_s": _KERNEL_FLOOR_S,
    "memory_clock_sensitivity": _MEMORY_CLOCK_SENSITIVITY,
    "hbm_pj_per_bit": _HBM_PJ_PER_BIT,
    "v_floor": _V_FLOOR,
    "v_max": _V_MAX,
    "memory_sm_activity": _MEMORY_SM_ACTIVITY,
    "min_switch_interval_s": _MIN_SWITCH_INTERVAL_S,
    "default_comm_sms": _NCCL_CHANNELS,
    "nccl_buffer_bytes": _NCCL_BUFFER_BYTES,
    "comm_hbm_bytes_per_bus_byte": _COMM_HBM_BYTES_PER_BUS_BYTE,
}

A100_SXM4_40GB = GPUSpec(
    **_SHARED,
    name="sim:a100-sxm4-40gb",
    sm_count=108,  # REF s3
    flop_per_clk=221_184,  # CAL: 108 SMs x 2048 FLOP/clk (NVIDIA developer forum)
    # CAL (zzc0721/torch-performance-test-data): square bf16 matmul 264.5 TFLOP/s, between
    # the 8192^3 random-input 257-258 (thonking.ai) and the best-shape 271.2 (ml-engineering).
    # Derived sustained clock 1265 MHz; CAL: DGEMM at 400 W sustains about 1305 MHz.
    measured_gemm_tflops=264.5,
    hbm_bytes_per_s=1.555e12,  # REF s3
    # CAL (PTsolvers/gpu-workshop-JuliaCon23 issue 7): 1.355 TB/s memcpy on A100 40GB.
    hbm_efficiency=1.355 / 1.555,
    tdp_w=400.0,  # REF s3; CAL (nvidia-docker 1648): default = max power limit 400 W
    static_power_w=85.0,  # REF s1: blocked in communication, the method's P_static
    knee_mhz=1080,  # CAL (nvidia-docker 1648), see _V_FLOOR
    # CAL (casys-kaist EnvPipe, gpu_max_memory_clock_frequencies.csv): 210-1410 step 15.
    min_clock_mhz=210,
    max_clock_mhz=1410,
    clock_step_mhz=15,
    search_min_mhz=900,  # REF s1: the method searches 1410..900 step 30 (18 clocks)
    search_step_mhz=30,
    # CAL (ml-energy/zeus issue 29): an NVML set-clock call costs about 10-20 ms.
    clock_switch_s=0.015,
    # CAL (ml-engineering network/README.md): 8x A100 all-reduce 16 GiB at 234.9 GB/s bus
    # bandwidth (ceiling 230-240, nccl-tests issues 149/175). Assumption: all-gather,
    # reduce-scatter and all-to-all run at the same per-link rate (a ring all-reduce is a
    # reduce-scatter then an all-gather); no A100 figure for them was found.
    bus_bytes_per_s=dict.fromkeys(COLLECTIVE_KINDS, 234.9e9),
    # CAL (NVIDIA/nccl issue 1703): about 2 CTAs per NVLink saturate large messages;
    # A100 has 12 NVLinks. Below that, bus bandwidth is assumed linear in the CTA count.
    saturating_comm_sms=24,
    # CAL (ml-engineering): 8x A100 all-reduce of 32 KiB takes 43.8 us, of which ~0.5 us
    # is transfer: 43.3 us over 2(8-1) = 14 ring steps.
    ring_step_latency_s=43.3e-6 / 14,
)

H100_SXM = GPUSpec(
    **_SHARED,
    name="sim:h100-sxm",
    sm_count=132,  # REF s3
    flop_per_clk=540_672,  # CAL (NVIDIA developer forum); x 1830 MHz = the 989 TFLOP/s peak
    # CAL (zzc0721): H100 80GB HBM3 square bf16 matmul 789.2 TFLOP/s (ml-engineering
    # best shape: 794.5). Derived sustained clock 1544 MHz.
    measured_gemm_tflops=789.2,
    hbm_bytes_per_s=3.35e12,  # REF s3
    # CAL (ml-engineering network/README.md; NVIDIA/nccl issue 1264): 2.49-2.53 TB/s copy.
    hbm_efficiency=2.51 / 3.35,
    tdp_w=700.0,  # REF s3
    # CAL (wilicc/gpu-burn issue 114): idle in P0 with memory allocated, 140-145 W: the
    # state of a GPU blocked inside a job. No blocked-in-NCCL figure exists for Hopper;
    # bounds 100-145 W (REF s3 idle 71-75 W plus 26-50 W for a CUDA context).
    static_power_w=140.0,
    knee_mhz=_knee(1980, 15),  # 1515 MHz, see _V_FLOOR
    # Assumption from H200 (same GH100 die; awslabs/amazon-eks-ami PR 1985): idles at
    # 345 MHz, default and maximum application clock 1980 MHz; 15 MHz steps as on A100.
    min_clock_mhz=345,
    max_clock_mhz=1980,
    clock_step_mhz=15,
    # Assumption: 18 clocks like the method, 1980..1215 in 45 MHz steps (0.61-1.0 of f_max,
    # A100's range is 0.64-1.0) so the search reaches well below the ~1545 MHz at which
    # GEMMs are power-capped.
    search_min_mhz=1215,
    search_step_mhz=45,
    # CAL (PowerWeave citing arXiv 2502.20075): Hopper clock transitions take about
    # 10-100 ms; assumed 30 ms (their geometric mean).
    clock_switch_s=0.03,
    # CAL (NVIDIA/nccl-tests issues 212, 290): NVLS all-reduce about 476-480 GB/s (NCCL's
    # default on NVSwitch Hopper); ring collectives about 370 GB/s. All-to-all assumed at
    # the ring rate.
    bus_bytes_per_s={
        "all_reduce": 478e9,
        "all_gather": 370e9,
        "reduce_scatter": 370e9,
        "all_to_all": 370e9,
    },
    # Assumption: saturates at NCCL's 24 default channels (bounds 16: NVLS needs at most
    # 16, NVIDIA/nccl issue 1041; to 36: 2 CTAs per each of 18 NVLinks). CAL (uccl issue
    # 205): capping channels to 8 cuts H100 bandwidth "significantly" - linear gives 1/3.
    saturating_comm_sms=24,
    # CAL (ByteDance-Seed/Triton-distributed issue 57): 128 B all-reduce via
    # torch.distributed on 8x H100 takes 19.2 us: 14 ring steps.
    ring_step_latency_s=19.2e-6 / 14,
)

H200 = dataclasses.replace(
    H100_SXM,  # same GH100 die, SMs, clocks, TDP and NVLink (REF s3)
    name="sim:h200",
    measured_gemm_tflops=790.3,  # CAL (zzc0721): square bf16 matmul; derived 1546 MHz
    hbm_bytes_per_s=4.8e12,  # REF s3; no measured H200 copy bandwidth (CAL gaps):
    # hbm_efficiency stays H100's 75% of datasheet (assumption).
    # CAL (NVIDIA/cuda-samples issue 311): idle in P0, nothing allocated, 115 W. Bounds
    # 80 W (another idle report) to 137 W (CAL: the lowest power of memory-bound decode).
    static_power_w=115.0,
    # CAL (ml-engineering): 8x H200 16 GiB all-reduce NVLS 480.0, all-gather 361.4,
    # reduce-scatter 362.9 GB/s. All-to-all assumed at the all-gather rate.
    bus_bytes_per_s={
        "all_reduce": 480.0e9,
        "all_gather": 361.4e9,
        "reduce_scatter": 362.9e9,
        "all_to_all": 361.4e9,
    },
    # CAL (ml-engineering): a 32 KiB all-reduce on 8x H200 takes about 40 us: 14 steps.
    ring_step_latency_s=40e-6 / 14,
)

PRESETS: dict[str, GPUSpec] = {s.name: s for s in (A100_SXM4_40GB, H100_SXM, H200)}


def preset_names() -> tuple[str, ...]:
    return tuple(PRESETS)


def load_preset(name_or_path: str | os.PathLike[str]) -> GPUSpec:
    """A preset by name (``sim:h200``) or a custom GPU from a JSON file."""
    key = os.fspath(name_or_path)
    if key in PRESETS:
        return PRESETS[key]
    if key.endswith(".json") or os.path.isfile(key):
        return spec_from_json(key)
    raise GPUSpecError(
        f"unknown simulated GPU {key!r}: use one of {', '.join(PRESETS)} or a .json file"
    )


def spec_from_json(path: str | os.PathLike[str]) -> GPUSpec:
    """Load a custom GPU; errors name the file and the bad or missing keys."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise GPUSpecError(f"cannot read GPU spec {os.fspath(path)!r}: {e}") from e
    if not isinstance(data, dict):
        raise GPUSpecError(f"GPU spec {os.fspath(path)!r} must be a JSON object")
    base_name = data.pop("base", None)
    unknown = sorted(set(data) - set(_FIELDS))
    if unknown:
        raise GPUSpecError(
            f"GPU spec {os.fspath(path)!r}: unknown keys {unknown}; "
            f"valid keys are 'base' and {sorted(_FIELDS)}"
        )
    if base_name is None:
        missing = sorted(set(_FIELDS) - set(data))
        if missing:
            raise GPUSpecError(
                f"GPU spec {os.fspath(path)!r}: missing keys {missing} "
                f'(or give "base": one of {list(PRESETS)})'
            )
        fields = data
    elif base_name in PRESETS:
        if "name" not in data:
            raise GPUSpecError(f"GPU spec {os.fspath(path)!r}: missing key ['name']")
        fields = {**dataclasses.asdict(PRESETS[base_name]), **data}
    else:
        raise GPUSpecError(
            f"GPU spec {os.fspath(path)!r}: unknown base {base_name!r}; use one of {list(PRESETS)}"
        )
    try:
        return GPUSpec(**fields)
    except GPUSpecError as e:
        raise GPUSpecError(f"{os.fspath(path)!r}: {e}") from e
