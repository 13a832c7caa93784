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
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from kareus.devices.errors import GPUSpecError

COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")

MODEL_VERSION = "sim-gpu-3"
"""The version of the model (simulated.py's equations and this table). Every simulated
measurement records it; a change to either needs new independent data and a new version."""

TENSOR_TIME_SCALE = {"float32": 2.0, "float64": 16.0}
"""Tensor-core time of a matmul in this dtype relative to bf16/fp16 (others: 1).

float32 matmuls run on TF32 tensor cores only when PyTorch allows TF32 for matmuls
(``torch.backends.cuda.matmul.allow_tf32``; off by default): then at half the bf16 rate
(datasheets: A100 156 vs 312, H100 495 vs 989 dense TFLOP/s). Otherwise they run on the
FP32 CUDA cores (``fp32_flop_per_clk``). float64 runs on FP64 tensor cores (A100
datasheet: 19.5 vs 312).
"""


@dataclass(frozen=True)
class GPUSpec:
    """One simulated GPU model (and its NVLink peers); units are SI unless the name says."""

    name: str
    model_version: str  # MODEL_VERSION for presets; recorded in every measurement
    # -- compute
    sm_count: int
    flop_per_clk: float  # dense bf16 tensor-core FLOP per SM clock, whole GPU
    gemm_efficiency: float  # achieved / peak FLOP/s of a large GEMM at a fixed clock
    measured_gemm_tflops: float  # large bf16 GEMM at default clocks (power-limited)
    reference_power_w: float  # the power limit that GEMM was measured under
    gemm_tile_m: int  # output tile of one CTA (one SM) of a large GEMM: wave quantisation
    gemm_tile_n: int
    attention_fwd_efficiency: float  # achieved / peak FLOP/s of fused attention, forward
    attention_bwd_efficiency: float  # the same, backward
    attention_block: int  # query (forward) or key (backward) rows per attention CTA
    fp32_flop_per_clk: float  # FP32 CUDA-core FLOP per SM clock, whole GPU (no TF32)
    fp32_efficiency: float  # achieved / peak of an fp32 matmul without TF32
    fp32_activity: float  # switching power of that matmul relative to a bf16 GEMM's
    kernel_floor_s: float  # shortest time any kernel takes
    launch_overhead_s: float  # GPU idle between two kernels of one stream
    # -- memory
    memory_bytes: float  # datasheet HBM capacity: what a workload's state must fit in
    hbm_bytes_per_s: float  # datasheet HBM bandwidth
    hbm_efficiency: float  # measured device-local copy (half read, half write) / datasheet
    hbm_read_only_factor: float  # read-only stream bandwidth / copy bandwidth
    hbm_write_only_factor: float  # write-only stream bandwidth / copy bandwidth
    memory_clock_sensitivity: float  # sigma in t_mem * (1 + sigma * (f_max / f - 1))
    hbm_pj_per_bit: float  # dynamic energy of HBM traffic
    # -- power
    tdp_w: float  # the enforced power limit (a lower value throttles the clock)
    power_window_s: float  # the limit holds the power averaged over this window
    static_power_w: float  # blocked in a collective: the method's P_static
    idle_power_w: float  # bare idle, nothing running (reported; not in any timeline)
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
    saturating_comm_sms: Mapping[str, int]  # per kind: CTAs at which bus bandwidth saturates
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
    def hbm_copy_bytes_per_s(self) -> float:
        """Achieved HBM traffic of a device-local copy (half read, half written)."""
        return self.hbm_efficiency * self.hbm_bytes_per_s

    def hbm_capacity(self, read_share: float) -> float:
        """Achievable HBM traffic of a stream that reads ``read_share`` of its bytes:
        piecewise linear through write-only (0), copy (0.5) and read-only (1)."""
        copy = self.hbm_copy_bytes_per_s
        if read_share <= 0.5:
            end, x = self.hbm_write_only_factor * copy, 1.0 - 2.0 * read_share
        else:
            end, x = self.hbm_read_only_factor * copy, 2.0 * read_share - 1.0
        return copy + (end - copy) * x

    @property
    def sustained_gemm_mhz(self) -> float:
        """Clock at which the measured GEMM throughput is reached (the power-capped clock)."""
        return self.measured_gemm_tflops * 1e12 / (
            self.gemm_efficiency * self.flop_per_clk * 1e6
        )

    @property
    def sm_power_coeff(self) -> float:
        """C of P_sm = activity * C * f[MHz] * V^2, calibrated once: a large GEMM (activity
        1) at the sustained clock draws exactly the reference power. Its small HBM power is
        neglected here, so a simulated GEMM settles a clock step or so below that clock.
        It does not depend on ``tdp_w``: a lower limit throttles, it does not rescale."""
        f = self.sustained_gemm_mhz
        return (self.reference_power_w - self.static_power_w) / (f * self.voltage(f) ** 2)


_FIELDS = {f.name: f for f in dataclasses.fields(GPUSpec)}


@dataclass(frozen=True)
class _Range:
    """Accepted values of a numeric field: never a bool, ``low`` < (or <=) value <=
    ``high`` (finite, so NaN and infinities fail too); ``integer`` for counts, clocks and
    sizes. Every ``high`` is an order of magnitude or more above today's parts: it refuses
    typos and absurd values, not future GPUs."""

    low: float
    high: float
    low_open: bool = True  # value > low (else value >= low)
    integer: bool = False

    def accepts(self, value: object) -> bool:
        if isinstance(value, bool) or not isinstance(value, int if self.integer else (int, float)):
            return False
        # Comparisons, not math.isfinite: an int too large for a float compares exactly.
        above = value > self.low if self.low_open else value >= self.low
        return above and value <= self.high

    def describe(self) -> str:
        if self.integer:
            low = self.low + 1 if self.low_open else self.low
            return f"an integer in [{int(low)}, {int(self.high)}]"
        return f"a finite number in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}]"


def _count(high: int) -> _Range:
    """SMs, clocks in MHz, bytes: integers >= 1."""
    return _Range(0, high, integer=True)


def _positive(high: float) -> _Range:
    """Divides somewhere, or is a scale whose 0 means no device."""
    return _Range(0, high)


def _non_negative(high: float) -> _Range:
    """An added cost that may be zero."""
    return _Range(0, high, low_open=False)


_FRACTION = _Range(0, 1)  # an efficiency or a share
# B200 (the largest part today) has 148 SMs: a few thousand leaves 25x.
_SMS = _count(4096)
# B200's dense bf16 peak, 2.25 PFLOP/s at about 1.96 GHz, is 1.1e6 FLOP per clock.
_FLOP_PER_CLK = _positive(1e8)
# The most a GPU draws today is about 1.4 kW (GB300); 5 kW for one GPU is out of reach of
# any board's power delivery and cooling.
_WATTS = _positive(5000)
_IDLE_WATTS = _non_negative(5000)
# Silicon clocks stay below 10 GHz (GPUs: about 2 GHz).
_MHZ = _count(10_000)
# HBM3e reaches 8 TB/s (B200), NVLink 5 1.8 TB/s per GPU: 100 TB/s bounds both.
_BYTES_PER_S = _positive(1e14)
# B200 holds 192 GB of HBM (GB300: 288); 10 TB is out of reach of any package.
_MEMORY_BYTES = _positive(1e13)
# cuBLAS and FlashAttention tiles are 64-256 rows: one CTA's shared memory holds no more
# than a few thousand rows.
_TILE = _count(4096)
# Kernel launches, gaps and ring steps take microseconds: 10 ms is 1000x that.
_SHORT_S = _positive(1e-2)
_SHORT_GAP_S = _non_negative(1e-2)
# Power windows, clock transitions and switch spacings are 10 ms to 1 s: a minute is
# longer than any step a plan is made for.
_LONG_S = _positive(60)
_LONG_GAP_S = _non_negative(60)
# Today's parts run at 0.7-1.0 V; 2 V would break down a 4-7 nm gate.
_VOLTS = _positive(2)
# Stream bandwidths relative to a copy's (0.79 and 0.87 on H200), HBM bytes per bus byte
# (2 assumed, bounds 1-4): a few times their values.
_RATIO = _positive(16)
_NON_NEGATIVE_RATIO = _non_negative(16)

_RANGES: dict[str, _Range] = {
    "sm_count": _SMS,
    "flop_per_clk": _FLOP_PER_CLK,
    "gemm_efficiency": _FRACTION,
    "measured_gemm_tflops": _positive(1e5),  # 1e5 TFLOP/s: 1e8 FLOP/clk at 1 GHz
    "reference_power_w": _WATTS,
    "gemm_tile_m": _TILE,
    "gemm_tile_n": _TILE,
    "attention_fwd_efficiency": _FRACTION,
    "attention_bwd_efficiency": _FRACTION,
    "attention_block": _TILE,
    "fp32_flop_per_clk": _FLOP_PER_CLK,
    "fp32_efficiency": _FRACTION,
    "fp32_activity": _FRACTION,
    "kernel_floor_s": _SHORT_S,  # a kernel's bytes are divided by its duration
    "launch_overhead_s": _SHORT_GAP_S,
    "memory_bytes": _MEMORY_BYTES,
    "hbm_bytes_per_s": _BYTES_PER_S,
    "hbm_efficiency": _FRACTION,
    "hbm_read_only_factor": _RATIO,
    "hbm_write_only_factor": _RATIO,
    # sigma = 1: memory-bound kernels slow with the clock as much as compute does.
    "memory_clock_sensitivity": _non_negative(1),
    # HBM takes about 4 pJ/bit, off-package DDR about 20: 100 bounds any memory.
    "hbm_pj_per_bit": _non_negative(100),
    "tdp_w": _WATTS,
    "power_window_s": _LONG_S,
    "static_power_w": _IDLE_WATTS,
    "idle_power_w": _IDLE_WATTS,
    "v_floor": _VOLTS,
    "v_max": _VOLTS,
    "knee_mhz": _MHZ,
    "memory_sm_activity": _FRACTION,
    "min_clock_mhz": _MHZ,
    "max_clock_mhz": _MHZ,
    "clock_step_mhz": _MHZ,
    "search_min_mhz": _MHZ,
    "search_step_mhz": _MHZ,
    "clock_switch_s": _LONG_GAP_S,
    "min_switch_interval_s": _LONG_GAP_S,
    "bus_bytes_per_s": _BYTES_PER_S,  # each value; a collective's bytes are divided by it
    "default_comm_sms": _SMS,
    "saturating_comm_sms": _SMS,  # each value
    "ring_step_latency_s": _SHORT_S,  # a collective's HBM bytes are divided by its time
    # NCCL_BUFFSIZE defaults to 4 MiB; 1 GiB is more than a GPU gives one channel.
    "nccl_buffer_bytes": _count(1 << 30),
    "comm_hbm_bytes_per_bus_byte": _NON_NEGATIVE_RATIO,
}
MAX_CLOCKS = 1000
"""The most SM clocks a spec may have (``supported_clocks``; ``search_clocks`` are some of
them): NVML lists 81 on A100 and 110 on H100, and the simulator, the search and a plan
visit every clock."""
_PER_KIND = ("bus_bytes_per_s", "saturating_comm_sms")  # a value per collective kind
assert set(_RANGES) == set(_FIELDS) - {"name", "model_version"}, (
    "every numeric GPUSpec field needs a range"
)


def _check_range(spec_name: object, field: str, value: object, accepted: _Range) -> None:
    if not accepted.accepts(value):
        raise GPUSpecError(
            f"GPU spec {spec_name!r}: {field} must be {accepted.describe()}, got {value!r}"
        )


def _terms(relation: str) -> list[str]:
    """The words of a relation, in order (the spec's fields and properties among them)."""
    return list(dict.fromkeys(re.findall(r"[a-z_]+", relation)))


def _validate(spec: GPUSpec) -> None:
    """Reject values the model cannot use, naming the field, the value and the range."""
    for text in ("name", "model_version"):
        if not isinstance(getattr(spec, text), str) or not getattr(spec, text):
            raise GPUSpecError(
                f"GPU spec {spec.name!r}: {text} must be a non-empty string, "
                f"got {getattr(spec, text)!r}"
            )
    for name in _PER_KIND:
        value = getattr(spec, name)
        kinds = value.keys() if isinstance(value, Mapping) else ()
        if set(kinds) != set(COLLECTIVE_KINDS):
            raise GPUSpecError(
                f"GPU spec {spec.name!r}: {name} must map each of {COLLECTIVE_KINDS} "
                f"to a positive number, got {value!r}"
            )
    for name, accepted in _RANGES.items():
        value = getattr(spec, name)
        if name in _PER_KIND:
            for kind in COLLECTIVE_KINDS:
                _check_range(spec.name, f"{name}[{kind!r}]", value[kind], accepted)
        else:
            _check_range(spec.name, name, value, accepted)
    # Relations between fields (each field is now finite and in its range): the field
    # blamed, the relation it breaks, whether it holds.
    checks = [
        ("measured_gemm_tflops", "sustained_gemm_mhz <= max_clock_mhz",
         spec.sustained_gemm_mhz <= spec.max_clock_mhz),
        ("tdp_w", "tdp_w > static_power_w", spec.tdp_w > spec.static_power_w),
        ("reference_power_w", "reference_power_w > static_power_w",
         spec.reference_power_w > spec.static_power_w),
        ("idle_power_w", "idle_power_w <= static_power_w",
         spec.idle_power_w <= spec.static_power_w),
        ("v_floor", "v_floor <= v_max", spec.v_floor <= spec.v_max),
        ("min_clock_mhz", "min_clock_mhz <= max_clock_mhz",
         spec.min_clock_mhz <= spec.max_clock_mhz),
        ("clock_step_mhz", "(max_clock_mhz - min_clock_mhz) % clock_step_mhz == 0",
         (spec.max_clock_mhz - spec.min_clock_mhz) % spec.clock_step_mhz == 0),
        ("knee_mhz", "min_clock_mhz <= knee_mhz < max_clock_mhz",
         spec.min_clock_mhz <= spec.knee_mhz < spec.max_clock_mhz),
        ("search_step_mhz", "search_step_mhz % clock_step_mhz == 0",
         spec.search_step_mhz % spec.clock_step_mhz == 0),
        ("search_min_mhz", "min_clock_mhz <= search_min_mhz <= max_clock_mhz",
         spec.min_clock_mhz <= spec.search_min_mhz <= spec.max_clock_mhz),
        ("default_comm_sms", "default_comm_sms < sm_count",
         spec.default_comm_sms < spec.sm_count),
        ("saturating_comm_sms", "every saturating_comm_sms < sm_count",
         max(spec.saturating_comm_sms.values()) < spec.sm_count),
    ]
    bad = [(name, relation) for name, relation, ok in checks if not ok]
    if bad:
        raise GPUSpecError(f"GPU spec {spec.name!r}: " + "; ".join(
            f"invalid {name}={getattr(spec, name)!r}: needs {relation} ("
            + ", ".join(f"{term}={getattr(spec, term)!r}" for term in _terms(relation)
                        if term != name and hasattr(spec, term)) + ")"
            for name, relation in bad))
    clocks = (spec.max_clock_mhz - spec.min_clock_mhz) // spec.clock_step_mhz + 1
    if clocks > MAX_CLOCKS:
        raise GPUSpecError(
            f"GPU spec {spec.name!r}: {spec.min_clock_mhz}..{spec.max_clock_mhz} MHz in "
            f"{spec.clock_step_mhz} MHz steps is {clocks:,} clocks; at most {MAX_CLOCKS:,} "
            "(a real GPU has about 100): raise clock_step_mhz or narrow the range"
        )


# ---------------------------------------------------------------------------------------
# Constants shared by several presets (one citation each).

# CAL (thonking.ai, H. He): an 8192^3 bf16 matmul on A100 reaches 295 TFLOP/s with all-zero
# inputs (low switching power, so not power-limited: it runs at 1410 MHz) against 312 peak.
# Assumed to hold for Hopper's tensor cores too (no unthrottled H100 figure found).
_GEMM_EFFICIENCY = 295 / 312

# NVIDIA, "Matrix Multiplication Background User's Guide" (DU-09799-001) s2.3 and s3.2:
# cuBLAS runs large half-precision GEMMs on 256x128 / 128x256 tiles, one CTA per SM, and a
# GEMM takes whole waves of them. Assumption: 128x256 (or 256x128, whichever gives fewer
# waves) for every large GEMM; bounds 128x128 to 256x128. Split-K is modelled for GEMMs
# with fewer tiles than SMs (simulated.py).
_GEMM_TILE = (128, 256)

# arXiv 2307.08691 (FlashAttention-2), s1 and s4.1 (A100 80GB, hidden 2048, head dim 64 or
# 128, seq 512-16k): forward 50-73% of peak, backward up to 63%. Forward: the middle of the
# published range; backward: the same scaled by the ratio of the maxima (63/73).
_A100_ATTENTION_FWD = (0.50 + 0.73) / 2
_A100_ATTENTION_BWD = _A100_ATTENTION_FWD * 63 / 73
# arXiv 2407.08608 (FlashAttention-3) abstract: FlashAttention-2 reaches about 35% of peak
# on H100 (PyTorch's flash backend is FlashAttention-2). Its figure 5 (head dim 128) gives
# FlashAttention-2 backward at most 322 vs forward 370 TFLOP/s: the same ratio for the
# backward. Used for H200 too (same die).
_HOPPER_ATTENTION_FWD = 0.35
_HOPPER_ATTENTION_BWD = _HOPPER_ATTENTION_FWD * 322 / 370
# FlashAttention-2's CTA covers 128 query rows (forward) or key rows (backward) for head
# dims up to 128 (arXiv 2307.08691 s3.3, block sizes {64, 128} x {64, 128}).
_ATTENTION_BLOCK = 128

# gpu-fryer issue 4 (huggingface): an FP32 burn on H100 SXM draws 580-650 W at its 700 W
# limit, i.e. below it: an fp32 (no TF32) matmul at 1980 MHz draws about 615 W. With H100's
# C and V(1980) that is 40% of a bf16 GEMM's switching power (615 - 140) / 1193 W. Used for
# every preset (no A100 figure).
_FP32_ACTIVITY = 0.40

# tritonbench PR 1017 (meta-pytorch): launching an empty kernel takes about 3.0 us, the
# shortest a kernel can take.
_KERNEL_FLOOR_S = 3e-6
# Assumption: 1 us of GPU idle between two kernels queued on one stream (bounds 0.5-7 us;
# 7 us is autoparallel's per-op floor fitted on H100 for eager, CPU-bound launches,
# meta-pytorch/autoparallel PR 146).
_LAUNCH_OVERHEAD_S = 1e-6

# CAL (tile-ai/TileOPs hbm_peak.csv, H200, 2 GiB): copy_ 4255, read-only sum 3684,
# write-only zero_ 3370 GB/s of HBM traffic. Their ratios to the copy are used for every
# preset (assumption: no A100/H100 figures; same HBM controller generation for Hopper).
_HBM_READ_ONLY_FACTOR = 3684 / 4255
_HBM_WRITE_ONLY_FACTOR = 3370 / 4255

# Voltage. CAL (NVIDIA/nvidia-docker 1648): A100 idle at 1080 MHz runs 712.5 mV; CAL
# (thamada/nvidia-smi): A100-80GB idles at 210 MHz at 0.706 V, so the voltage is flat at
# about 0.71 V from 210 to 1080 MHz: the floor. Assumption: 1080 MHz is A100's knee.
# V(f_max) = 0.95 V (bounds 0.85-1.0 V, the top of a 7 nm / 4 nm DVFS range), calibrated
# once: with it the forward of Perseus's GPT-3 175B stage (ml-energy/zeus sosp24_data,
# A100) loses 19 / 26 / 24% of its energy at 1200 / 1050 / 900 MHz as measured (within
# 0.02; 0.90 V gives 15 / 21 / 17%). Those three points are inputs in calibration.py; the
# same stage's backward, BLOOM's and the method's attention partition check it.
_A100_V_FLOOR = 0.7125
_V_MAX = 0.95
# CAL (thamada/nvidia-smi): H100 idles at 345 MHz at 0.685 V, Hopper's floor. No Hopper
# point above the floor was found: the knee is an assumption, A100's fraction of f_max
# (1080/1410), bounded by HOPPER_KNEE_BOUNDS; benchmarks/knee_sensitivity.py shows how the
# energy-optimal clocks move across the bounds.
_HOPPER_V_FLOOR = 0.685
_KNEE_FRACTION = 1080 / 1410
HOPPER_KNEE_BOUNDS = (0.60, 0.85)
"""Fractions of f_max the Hopper knee is assumed to lie between (A100: 0.77): below 0.6
the floor voltage would hold at clocks where H100 draws near its TDP on GEMMs; above 0.85
the voltage would have to rise steeply to reach V(f_max) inside the top 15% of the range."""

# Assumption: memory-bound kernels run at sigma = 0.1 (bounds 0-0.2) of the SM-clock
# sensitivity of compute (memory clock fixed; fewer loads in flight at low SM clocks):
# 5.7% slower at 900 vs 1410 MHz on A100.
_MEMORY_CLOCK_SENSITIVITY = 0.1

# Assumption: about 4 pJ/bit of HBM traffic (HBM2, O'Connor et al., "Fine-Grained DRAM",
# MICRO 2017; bounds 3-7 pJ/bit with PHY and controllers). Used for HBM2e/HBM3/HBM3e alike.
_HBM_PJ_PER_BIT = 4.0

# SM switching activity of a bandwidth-bound kernel relative to a GEMM (scaled by the
# bandwidth it achieves). CAL (arXiv 2605.11999): H200 memory-bound decode draws 137-300
# W. Calibrated once: a pure HBM copy on sim:h200 at the default clock draws 300 W, the top
# of that range (a copy streams harder than decode). The same paper's "locking SM clocks
# saved up to 32%" is then a fidelity point the model does not meet (calibration.py).
_MEMORY_SM_ACTIVITY = 0.04

# NVML nvmlDeviceGetPowerUsage (NVML API reference): on Ampere (except GA100) and newer the
# power reading is averaged over 1 s. Assumption: the power-limit controller holds that
# 1 s average (bounds 1/6 s, torch.cuda.power_draw's shortest sample period, to 1 s);
# bursts inside the window do not throttle. No source states the enforcement time constant.
_POWER_WINDOW_S = 1.0

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


def _knee(max_mhz: int, step: int, fraction: float = _KNEE_FRACTION) -> int:
    return round(max_mhz * fraction / step) * step


# ---------------------------------------------------------------------------------------

# Constants every preset shares; each is defined and cited above.
_SHARED = {
    "model_version": MODEL_VERSION,
    "gemm_efficiency": _GEMM_EFFICIENCY,
    "gemm_tile_m": _GEMM_TILE[0],
    "gemm_tile_n": _GEMM_TILE[1],
    "attention_block": _ATTENTION_BLOCK,
    "fp32_activity": _FP32_ACTIVITY,
    "kernel_floor_s": _KERNEL_FLOOR_S,
    "launch_overhead_s": _LAUNCH_OVERHEAD_S,
    "hbm_read_only_factor": _HBM_READ_ONLY_FACTOR,
    "hbm_write_only_factor": _HBM_WRITE_ONLY_FACTOR,
    "memory_clock_sensitivity": _MEMORY_CLOCK_SENSITIVITY,
    "hbm_pj_per_bit": _HBM_PJ_PER_BIT,
    "power_window_s": _POWER_WINDOW_S,
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
    reference_power_w=400.0,  # CAL (nvidia-docker 1648): default = max power limit 400 W
    attention_fwd_efficiency=_A100_ATTENTION_FWD,
    attention_bwd_efficiency=_A100_ATTENTION_BWD,
    # A100 datasheet FP32 19.5 TFLOP/s = 108 SMs x 64 FP32 lanes x 2 x 1410 MHz. CAL
    # (zzc0721): fp32 matmul with TF32 off 19.2 TFLOP/s at default clocks (not power-capped
    # in the model): 98.5% of that peak.
    fp32_flop_per_clk=108 * 64 * 2,
    fp32_efficiency=19.2e12 / (108 * 64 * 2 * 1410e6),
    memory_bytes=40e9,  # REF s3 (A100 SXM4 40GB)
    hbm_bytes_per_s=1.555e12,  # REF s3
    # CAL (PTsolvers/gpu-workshop-JuliaCon23 issue 7): 1.355 TB/s memcpy on A100 40GB.
    hbm_efficiency=1.355 / 1.555,
    tdp_w=400.0,  # REF s3; CAL (nvidia-docker 1648): default = max power limit 400 W
    static_power_w=85.0,  # REF s1: blocked in communication, the method's P_static
    idle_power_w=45.0,  # CAL (Slusheeking/nextgen SYSTEM_HARDWARE.md): A100 40GB bare idle
    v_floor=_A100_V_FLOOR,
    knee_mhz=1080,  # CAL (nvidia-docker 1648), see _A100_V_FLOOR
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
    # A100 has 12 NVLinks, and every kind rings over them. Below that, bus bandwidth is
    # assumed linear in the CTA count.
    saturating_comm_sms=dict.fromkeys(COLLECTIVE_KINDS, 24),
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
    reference_power_w=700.0,  # REF s3: the TDP, H100 SXM's default power limit
    attention_fwd_efficiency=_HOPPER_ATTENTION_FWD,
    attention_bwd_efficiency=_HOPPER_ATTENTION_BWD,
    # H100 SXM datasheet FP32 67 TFLOP/s = 132 SMs x 128 FP32 lanes x 2 x 1980 MHz. CAL
    # (zzc0721): fp32 matmul with TF32 off 52.1 TFLOP/s at default clocks: 78% of that.
    fp32_flop_per_clk=132 * 128 * 2,
    fp32_efficiency=52.1e12 / (132 * 128 * 2 * 1980e6),
    memory_bytes=80e9,  # REF s3 (H100 SXM5 80GB)
    hbm_bytes_per_s=3.35e12,  # REF s3
    # CAL (ml-engineering network/README.md; NVIDIA/nccl issue 1264): 2.49-2.53 TB/s copy.
    hbm_efficiency=2.51 / 3.35,
    tdp_w=700.0,  # REF s3
    # CAL (wilicc/gpu-burn issue 114): idle in P0 with memory allocated, 140-145 W: the
    # state of a GPU blocked inside a job. No blocked-in-NCCL figure exists for Hopper;
    # bounds 100-145 W (bare idle below plus 26-50 W for a CUDA context).
    static_power_w=140.0,
    # CAL (thamada/nvidia-smi nvsim/H100SXMx8_smi.py): bare idle 75-100 W, mean 85 W.
    idle_power_w=85.0,
    v_floor=_HOPPER_V_FLOOR,
    knee_mhz=_knee(1980, 15),  # 1515 MHz, see _HOPPER_V_FLOOR
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
    # CAL (NVIDIA/nccl issue 1041): NVLS all-reduce needs at most 16 channels. Ring kinds:
    # NCCL's 24 default channels (assumption, bounds 16-36: 2 CTAs per each of 18 NVLinks).
    # CAL (uccl issue 205): capping channels to 8 cuts H100 bandwidth "significantly".
    saturating_comm_sms={
        "all_reduce": 16,
        "all_gather": 24,
        "reduce_scatter": 24,
        "all_to_all": 24,
    },
    # 32 KiB all-reduce on 8 Hopper GPUs: 24.03 us with NCCL (CAL, yifuwang/symm-mem-recipes
    # PR 3), 22.7 us via torch.distributed (CAL, ByteDance-Seed/Triton-distributed issue
    # 57): their mean over 14 ring steps. (The 19.2 us of a 128 B message runs NCCL's
    # low-latency protocol, not modelled: a fidelity miss.)
    ring_step_latency_s=(24.03e-6 + 22.7e-6) / 2 / 14,
)

H200 = dataclasses.replace(
    H100_SXM,  # same GH100 die, SMs, clocks, TDP and NVLink (REF s3)
    name="sim:h200",
    measured_gemm_tflops=790.3,  # CAL (zzc0721): square bf16 matmul; derived 1546 MHz
    memory_bytes=141e9,  # REF s3 (H200 SXM 141GB)
    hbm_bytes_per_s=4.8e12,  # REF s3
    # CAL (tile-ai/TileOPs hbm_peak.csv): copy_ of 2 GiB moves 4255 GB/s of HBM traffic.
    hbm_efficiency=4.255 / 4.8,
    # CAL (NVIDIA/cuda-samples issue 311): idle in P0, nothing allocated, 115 W: a GPU
    # inside a job with nothing to run. Bounds 80 W (another idle report) to 137 W (CAL:
    # the lowest power of memory-bound decode).
    static_power_w=115.0,
    idle_power_w=80.0,  # CAL: "about 80 W idle" (lower-confidence benchmark site)
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


MAX_SPEC_BYTES = 1 << 20
"""The largest custom GPU file read: a spec is about 2 kB, so anything near this is not one."""


def spec_from_json(path: str | os.PathLike[str]) -> GPUSpec:
    """Load a custom GPU; errors name the file and the bad or missing keys."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_SPEC_BYTES + 1)
    except OSError as e:
        raise GPUSpecError(f"cannot read GPU spec {os.fspath(path)!r}: {e}") from e
    if len(raw) > MAX_SPEC_BYTES:
        raise GPUSpecError(
            f"cannot read GPU spec {os.fspath(path)!r}: larger than {MAX_SPEC_BYTES:,} bytes, "
            "so not a GPU spec (one is a JSON object of about 2 kB)"
        )
    try:
        data = json.loads(raw.decode("utf-8"))
    # Not UTF-8 (UnicodeDecodeError), not JSON, an integer of too many digits (ValueError)
    # or arrays nested too deep (RecursionError).
    except (ValueError, RecursionError) as e:
        raise GPUSpecError(
            f"cannot read GPU spec {os.fspath(path)!r}: not a UTF-8 JSON file ({e})"
        ) from e
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
