"""How NVML's energy counter behaves on this GPU, and what it means for kareus's estimates.

kareus measures variants' energy through ``nvmlDeviceGetTotalEnergyConsumption`` (mJ).
Nobody has published how that counter behaves on an H200: how often it updates, and
whether it integrates the power continuously or samples part of each update period, as
the instant power reading does on A100/H100 (25 ms of every 100 ms: Yang et al., SC'24,
arXiv 2312.02741). On a lent GPU, at its default clocks and in about two minutes, this
script measures:

1. the update intervals of the energy counter and of the power readings
   (``nvmlDeviceGetPowerUsage``; the instant and average power fields of
   ``nvmlDeviceGetFieldValues`` where pynvml has them), idle and under a GEMM loop;
2. the square-wave test (``kareus.devices.nvml.counter.probe_counter``, once per wave
   period from 40 to 200 ms, at several phases): the swing of the windows' average power
   across phases, over the busy-idle power difference (~0: integrates);
3. a warm-up curve: power and temperature every 0.5 s for 30 s under load;
4. multiplexed estimates (``NvmlEnergyMeter.measure_many``) of four synthetic variants (a
   large and a small GEMM, a device-to-device copy, tiny kernels) against a long (5 s)
   single-window reference of each: the counter's power between two of its updates, well
   inside a stretch of that variant alone, so neither its lag nor its period matters;
5. today's protocol (a 0.1 s settle, then ``NvmlEnergyMeter.measure`` with windows of at
   least 0.5 s, 3 times, medians) against the same references;
6. CUDA-graph replay (``kareus.devices.nvml.replay``, as ``NvmlGPU`` measures): each
   variant's CUDA-event time per run eager and replayed, and an NCCL all-reduce and a
   functional one (as compiled graphs issue them; a group of this process alone) captured
   and replayed.

Nothing here may change the GPU: the NVML module is wrapped so that every setter
(``nvmlDeviceSet*``, ``nvmlDeviceReset*``, ``nvmlDeviceClear*``, any function
``gpu_measure.is_setter`` names) raises ``NvmlSetterError`` before reaching the driver, and
the module's own setters are replaced for the run as ``gpu_measure.setters_refused`` does.

Without a GPU (torch sees no CUDA device, or NVML does not open) the same analysis runs on
fake counters (``tests/fake_pynvml.py``): a continuous one (100 ms updates, read 30 ms
late, with noise) and a sampled one (25 ms of every 100 ms), loaded by
``BusyTimeline.spin``. Sections 1-3 run on a fake clock (instant, exact), sections 4-5 on
the real clock (the multiplexer polls from a thread); the table's title and the JSON say
loudly that it is fake data, not a measurement.

    python benchmarks/nvml_counter_check.py                  # on a GPU: ~2 min
    python benchmarks/nvml_counter_check.py --fake           # fake counters: ~25 s
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import math
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from gpu_measure import NvmlSetterError, is_setter, setters_refused
from rich.console import Console
from rich.table import Table

from kareus.devices.errors import CounterProbeError
from kareus.devices.nvml import counter as counter_module
from kareus.devices.nvml.energy import NvmlEnergyMeter
from kareus.devices.nvml.multiplex import TickRecorder, run_timed, runs_to_fill
from kareus.devices.nvml.replay import CudaGraphs, nccl_version, replayable

FAKE_NOTE = "no GPU: fake counters, not a measurement"
OUT = Path(__file__).resolve().parent / "results" / "nvml_counter_check.json"
TESTS = Path(__file__).resolve().parents[1] / "tests"
WAVES_MS = (40, 60, 100, 150, 200)
POLL_S = 0.001
SETTLE_S = 0.1
"""Today's protocol: the settle after a clock change (``profiler.measure``)."""
PROTOCOL_WINDOW_S = 0.5
"""Today's protocol: windows of at least this (sized to 110% of it: 0.55 s)."""
_SETTER_PREFIXES = ("nvmlDeviceSet", "nvmlDeviceReset", "nvmlDeviceClear", "nvmlSet")


# -- the setter guard -------------------------------------------------------------------


def refuses(name: str) -> bool:
    """Whether the guard refuses the NVML function ``name``: anything that changes state."""
    return name.startswith(_SETTER_PREFIXES) or is_setter(name)


class GuardedNvml:
    """The pynvml module (or a stand-in), every setter of which raises ``NvmlSetterError``
    without reaching the driver, whether or not the module has it; readers, constants and
    ``NVMLError`` pass through unchanged. ``refused`` lists the setters called."""

    def __init__(self, module: Any) -> None:
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "refused", [])

    def __getattr__(self, name: str) -> Any:
        if refuses(name):
            return self._refusing(name)
        return getattr(self._module, name)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"the guarded NVML module is read-only ({name})")

    def _refusing(self, name: str) -> Callable[..., None]:
        def refuse(*args: object, **kwargs: object) -> None:
            self.refused.append(name)
            raise NvmlSetterError(
                f"{name} was called: nvml_counter_check measures at the default clocks and "
                "must never change the GPU's state"
            )

        return refuse


# -- acquisition: what a rig is and how it is read --------------------------------------


@dataclass
class Rig:
    """One GPU (real or fake) and how to load it: what the acquisition functions drive."""

    label: str
    fake: bool
    nvml: GuardedNvml
    handle: object
    gpu: str
    driver: str
    timer: Callable[[], float]
    busy: Callable[[float], None]
    """Keep the GPU loaded for about this many seconds of ``timer``, then return."""
    idle: Callable[[float], None]
    cuda: bool
    variants: dict[str, Callable[[], object]] = field(default_factory=dict)
    counter: dict[str, Any] = field(default_factory=dict)
    """How a fake counter was made (empty on a GPU)."""

    def read_mj(self) -> int:
        return self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)

    def power_sources(self) -> dict[str, Callable[[], float]]:
        """The power readings this NVML has (W), by name: ``GetPowerUsage`` and, where
        pynvml has ``nvmlDeviceGetFieldValues`` and the fields, instant and average power."""
        nvml, handle = self.nvml, self.handle
        sources = {"power_usage": lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0}
        if not hasattr(nvml, "nvmlDeviceGetFieldValues"):
            return sources
        for name, attr in (("field_power_instant", "NVML_FI_DEV_POWER_INSTANT"),
                           ("field_power_average", "NVML_FI_DEV_POWER_AVERAGE")):
            if not hasattr(nvml, attr):
                continue
            read = _field_reader(nvml, handle, getattr(nvml, attr))
            with contextlib.suppress(Exception):  # a field this GPU or driver does not give
                read()
                sources[name] = read
        return sources

    def temperature_c(self) -> float | None:
        nvml = self.nvml
        if not hasattr(nvml, "nvmlDeviceGetTemperature"):
            return None
        try:
            return float(nvml.nvmlDeviceGetTemperature(self.handle, nvml.NVML_TEMPERATURE_GPU))
        except Exception:  # noqa: BLE001 - not readable here
            return None


def _field_reader(nvml: Any, handle: object, field_id: int) -> Callable[[], float]:
    def read() -> float:
        value = nvml.nvmlDeviceGetFieldValues(handle, [field_id])[0]
        if getattr(value, "nvmlReturn", 0) != 0:
            raise RuntimeError(f"field {field_id}: NVML return {value.nvmlReturn}")
        return float(value.value.uiVal) / 1000.0

    return read


def poll_changes(rig: Rig, seconds: float, loaded: bool) -> dict[str, Any]:
    """Read the counter and every power source about every ``POLL_S`` for ``seconds``,
    busy or idle in between: per source, the times its value changed."""
    sources: dict[str, Callable[[], float]] = {"energy_counter": rig.read_mj,
                                               **rig.power_sources()}
    last = {name: read() for name, read in sources.items()}
    changes: dict[str, list[float]] = {name: [] for name in sources}
    begin = rig.timer()
    polls = 0
    while rig.timer() - begin < seconds:
        (rig.busy if loaded else rig.idle)(POLL_S)
        polls += 1
        for name, read in sources.items():
            value = read()
            if value != last[name]:
                changes[name].append(rig.timer())
                last[name] = value
    return {"polls": polls, "seconds": rig.timer() - begin, "changes": changes}


def square_waves(
    rig: Rig, period_s: float, waves_ms: Sequence[float], phases: int, window_updates: int,
    seed: int,
) -> list[dict[str, Any]]:
    """``probe_counter`` once per square-wave period (in ms; as a multiple of the update
    period ``period_s``): its swing and verdict at that period alone."""
    rows = []
    rng = random.Random(seed)
    for wave_ms in waves_ms:
        row: dict[str, Any] = {"wave_ms": wave_ms, "multiple": wave_ms / 1000.0 / period_s}
        try:
            b = counter_module.probe_counter(
                rig.read_mj, busy=rig.busy, idle=rig.idle, timer=rig.timer, gpu=rig.gpu,
                driver=rig.driver, periods=(row["multiple"],), phases=phases,
                window_updates=window_updates, rng=rng,
            )
        except CounterProbeError as exc:
            row["error"] = str(exc)
        else:
            row.update(swing=b.swing, integrates=b.integrates,
                       update_period_ms=1000.0 * b.update_period_s, probe_s=b.probe_s,
                       update_noise_mj=b.update_noise_mj, lag_s=b.lag_s)
        rows.append(row)
    return rows


def warm_up(rig: Rig, seconds: float, step_s: float = 0.5) -> list[dict[str, Any]]:
    """Under load, every ``step_s``: power reading, temperature, and the counter."""
    samples = []
    begin = rig.timer()
    while True:
        now = rig.timer()
        samples.append({"t_s": now - begin, "power_w": rig.power_sources()["power_usage"](),
                        "temperature_c": rig.temperature_c(), "counter_mj": rig.read_mj()})
        if now - begin >= seconds:
            return samples
        rig.busy(step_s)


def reference(rig: Rig, run: Callable[[], object], seconds: float, lead_s: float,
              ) -> dict[str, Any]:
    """Run ``run`` alone for ``seconds`` plus ``lead_s`` either side while the counter is
    polled: its ticks, the stretch, the runs and their CUDA-event (else wall) time."""
    per_run_s = _time_one(rig, run)
    chunk = runs_to_fill(per_run_s, 0.05)
    runs, busy_s = 0, 0.0
    with TickRecorder(rig.read_mj, rig.timer, POLL_S) as recorder:
        start = rig.timer()
        while rig.timer() - start < seconds + 2 * lead_s:
            _, _, stream_s = run_timed(run, chunk, rig.timer, rig.cuda)
            runs += chunk
            busy_s += stream_s or 0.0
        end = rig.timer()
        recorder.wait(lambda ticks: bool(ticks) and ticks[-1].time_s > end, 2.0)
    ticks = [(t.time_s, t.mj) for t in recorder.ticks]
    return {"start_s": start, "end_s": end, "runs": runs, "lead_s": lead_s,
            "stream_s": busy_s if rig.cuda else None, "ticks": ticks}


def _time_one(rig: Rig, run: Callable[[], object]) -> float:
    run_timed(run, 3, rig.timer, rig.cuda)  # warm: allocator, cuBLAS heuristics
    start, end, _ = run_timed(run, 5, rig.timer, rig.cuda)
    return (end - start) / 5


def multiplexed(rig: Rig, period_s: float, seed: int, noise_mj: float | None,
                lag_s: float | None) -> dict[str, Any]:
    """``NvmlEnergyMeter.measure_many`` of every variant together (the first: control), on
    the counter's noise per update and lag as the probe measured them (as the default
    protocol)."""
    meter = NvmlEnergyMeter(rig.nvml, rig.handle, gpu=rig.gpu, cuda=rig.cuda, timer=rig.timer)
    names = list(rig.variants)
    rig.idle(SETTLE_S)
    began = rig.timer()
    result = meter.measure_many([rig.variants[n] for n in names], seed=seed, period_s=period_s,
                                noise_mj=noise_mj, lag_s=lag_s)
    took = rig.timer() - began
    return {
        "seconds": took, "rounds": result.rounds, "lag_s": result.lag_s,
        "control_drift": result.control_drift,
        "estimates": {n: {"power_w": e.power_w, "energy_j": e.energy_j, "time_s": e.time_s,
                          "stated_error": e.error, "runs": e.runs, "blocks": e.blocks}
                      for n, e in zip(names, result.estimates)},
    }


def protocol(rig: Rig, run: Callable[[], object], repeats: int, window_s: float,
             ) -> dict[str, Any]:
    """Today's protocol: a settle, then ``repeats`` windows of at least ``window_s``."""
    meter = NvmlEnergyMeter(rig.nvml, rig.handle, gpu=rig.gpu, cuda=rig.cuda, timer=rig.timer,
                            min_window_s=window_s)
    began = rig.timer()
    rig.idle(SETTLE_S)
    windows = [meter.measure(run) for _ in range(repeats)]
    return {
        "seconds": rig.timer() - began,
        "windows": [{"runs": w.runs, "wall_s": w.wall_s, "energy_j": w.energy_j,
                     "time_s": w.time_s} for w in windows],
    }


def replay_times(variants: dict[str, Callable[[], object]], cuda: CudaGraphs,
                 timer: Callable[[], float], *, timed: bool, runs: int = 20,
                 collectives: bool = False) -> dict[str, dict[str, Any]]:
    """Section 6: each variant captured and replayed as ``NvmlGPU`` measures it, and its
    time per run (CUDA events where ``timed``, else wall), eager and replayed: the launch
    gaps replay removes; why it runs eagerly where it cannot be captured."""
    pool = cuda.graph_pool_handle()
    out = {}
    for name, run in variants.items():
        replay = replayable(run, cuda, pool=pool, collectives=collectives,
                            nccl=nccl_version())
        row: dict[str, Any] = {"replayed": replay.replayed,
                               "eager": None if replay.eager is None else str(replay.eager)}
        for how, call in (("eager", run), ("replay", replay.run)):
            if how == "replay" and not replay.replayed:
                continue
            run_timed(call, 3, timer, timed)
            start, end, stream_s = run_timed(call, runs, timer, timed)
            row[f"{how}_ms"] = 1000.0 * (stream_s if stream_s is not None else end - start) / runs
        out[name] = row
    return out


def nccl_variants(device: torch.device) -> dict[str, Callable[[], object]] | str:
    """An NCCL all-reduce of 64 MiB and the functional one compiled graphs issue, in a
    process group of this process alone (its NCCL runs them as on a node's group); why
    not, where torch has no NCCL."""
    import torch.distributed as dist

    if not dist.is_nccl_available():
        return "torch has no NCCL"
    if not dist.is_initialized():
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                                device_id=device)
    x = torch.ones(1 << 24, device=device)
    group = dist.group.WORLD.group_name

    def all_reduce() -> None:
        dist.all_reduce(x)

    def functional() -> None:
        ops = torch.ops._c10d_functional
        ops.wait_tensor(ops.all_reduce(x, "sum", group))

    return {"nccl_all_reduce_64mib": all_reduce, "funcol_all_reduce_64mib": functional}


def replay_check(rig: Rig) -> dict[str, Any]:
    """Section 6 on this GPU: the synthetic variants, then the collectives."""
    device = torch.device("cuda", torch.cuda.current_device())
    out = {"variants": replay_times(rig.variants, torch.cuda, rig.timer, timed=True),
           "nccl": ".".join(map(str, nccl_version() or ())) or None}
    collectives = nccl_variants(device)
    if isinstance(collectives, str):
        out["collectives"] = collectives
    else:
        try:
            out["collectives"] = replay_times(collectives, torch.cuda, rig.timer, timed=True,
                                              collectives=True)
        finally:
            torch.distributed.destroy_process_group()
    return out


# -- analysis: pure functions of what was acquired --------------------------------------


def intervals(times: Sequence[float]) -> dict[str, Any]:
    """Statistics (ms) of the gaps between consecutive change times."""
    gaps = [1000.0 * (b - a) for a, b in itertools.pairwise(times)]
    if len(gaps) < 2:
        return {"changes": len(times), "median_ms": None, "p10_ms": None, "p90_ms": None,
                "min_ms": None, "max_ms": None}
    deciles = statistics.quantiles(gaps, n=10)
    return {"changes": len(times), "median_ms": statistics.median(gaps),
            "p10_ms": deciles[0], "p90_ms": deciles[-1], "min_ms": min(gaps),
            "max_ms": max(gaps)}


def swing_summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The worst swing over the wave periods and the verdict ``probe_counter`` would give
    (all periods together)."""
    swings = [r["swing"] for r in rows if "swing" in r]
    worst = max(swings) if swings else None
    return {"worst_swing": worst, "swing_limit": counter_module.SWING_LIMIT,
            "integrates": None if worst is None else worst < counter_module.SWING_LIMIT}


def warmup_summary(samples: Sequence[dict[str, Any]], edge_s: float) -> dict[str, Any]:
    """Power and temperature at the start and end, and the counter's average power over
    the first ``edge_s`` (from the second sample: the first counts the idle before) and
    the last: the drift a long measurement would see."""

    def counter_w(first: dict[str, Any], last: dict[str, Any]) -> float | None:
        span = last["t_s"] - first["t_s"]
        return (last["counter_mj"] - first["counter_mj"]) / 1000.0 / span if span > 0 else None

    end = samples[-1]["t_s"]
    head = [s for s in samples[1:] if s["t_s"] <= edge_s + samples[1]["t_s"]]
    tail = [s for s in samples if s["t_s"] >= end - edge_s]
    early, late = counter_w(head[0], head[-1]), counter_w(tail[0], tail[-1])
    return {
        "seconds": end,
        "power_w_first": samples[1]["power_w"] if len(samples) > 1 else None,
        "power_w_last": samples[-1]["power_w"],
        "temperature_c_first": samples[0]["temperature_c"],
        "temperature_c_last": samples[-1]["temperature_c"],
        "counter_w_early": early, "counter_w_late": late,
        "drift_pct": pct(late, early) if early and late else None,
    }


def reference_power(acquired: dict[str, Any], period_s: float) -> dict[str, Any]:
    """A reference's power: the counter's energy between the first tick at least
    ``lead_s`` into the stretch and the last at least ``lead_s`` before its end (both read
    while the variant ran, its lag and period long past), over the time between them."""
    lo, hi = acquired["start_s"] + acquired["lead_s"], acquired["end_s"] - acquired["lead_s"]
    inside = [(t, mj) for t, mj in acquired["ticks"] if lo <= t <= hi]
    if len(inside) < 2:
        return {"power_w": None, "energy_j": None, "time_s": None, "span_s": 0.0}
    (t0, e0), (t1, e1) = inside[0], inside[-1]
    power = (e1 - e0) / 1000.0 / (t1 - t0)
    wall_per_run = (acquired["end_s"] - acquired["start_s"]) / acquired["runs"]
    busy = acquired["stream_s"]
    return {"power_w": power, "energy_j": power * wall_per_run,
            "time_s": (busy if busy is not None else acquired["end_s"] - acquired["start_s"])
            / acquired["runs"],
            "span_s": t1 - t0, "updates": round((t1 - t0) / period_s)}


def protocol_estimate(acquired: dict[str, Any]) -> dict[str, Any]:
    """Today's protocol's numbers: medians of the windows' per-run energy, time, power."""
    windows = acquired["windows"]
    energy = statistics.median(w["energy_j"] / w["runs"] for w in windows)
    power = statistics.median(w["energy_j"] / w["wall_s"] for w in windows)
    spread = (max(w["energy_j"] / w["runs"] for w in windows)
              - min(w["energy_j"] / w["runs"] for w in windows)) / energy if energy else None
    return {"energy_j": energy, "power_w": power,
            "time_s": statistics.median(w["time_s"] for w in windows),
            "spread": spread, "seconds": acquired["seconds"]}


def pct(value: float | None, against: float | None) -> float | None:
    """Relative error of ``value`` against ``against``, in %."""
    if value is None or against is None or against == 0 or math.isnan(value):
        return None
    return 100.0 * (value - against) / against


def compare(estimates: dict[str, dict[str, Any]], references: dict[str, dict[str, Any]],
            ) -> dict[str, dict[str, Any]]:
    """Each estimate's power and energy per run against its reference, errors in %."""
    out = {}
    for name, est in estimates.items():
        ref = references[name]
        out[name] = {**est, "power_error_pct": pct(est["power_w"], ref["power_w"]),
                     "energy_error_pct": pct(est["energy_j"], ref["energy_j"])}
    return out


# -- the rigs ----------------------------------------------------------------------------


def gpu_available() -> str | None:
    """None where this process has a GPU NVML reads; else why not."""
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False"
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - no bindings, no driver
        return f"NVML does not open ({exc})"
    return None


def gpu_rig(nvml: GuardedNvml) -> Rig:
    """This process's CUDA device, loaded by bf16 GEMMs; never a setter."""
    device = torch.device("cuda", torch.cuda.current_device())
    nvml.nvmlInit()
    handle = _nvml_handle(nvml, device)
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    out = torch.empty_like(a)
    torch.matmul(a, a, out=out)
    torch.cuda.synchronize()
    events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    events[0].record()
    for _ in range(20):
        torch.matmul(a, a, out=out)
    events[1].record()
    torch.cuda.synchronize()
    gemm_s = events[0].elapsed_time(events[1]) / 1000.0 / 20

    def busy(seconds: float) -> None:
        for _ in range(max(1, round(seconds / gemm_s))):
            torch.matmul(a, a, out=out)
        torch.cuda.synchronize()

    def idle(seconds: float) -> None:
        torch.cuda.synchronize()
        time.sleep(seconds)

    driver = nvml.nvmlSystemGetDriverVersion()
    return Rig(
        label=f"{nvml.nvmlDeviceGetName(handle)} (driver {driver}, default clocks)",
        fake=False, nvml=nvml, handle=handle, gpu=str(nvml.nvmlDeviceGetName(handle)),
        driver=str(driver), timer=time.perf_counter, busy=busy, idle=idle, cuda=True,
        variants=gpu_variants(device),
    )


def _nvml_handle(nvml: GuardedNvml, device: torch.device) -> object:
    """The NVML handle of torch's ``device`` (matched by UUID; else NVML index 0)."""
    uuid = str(getattr(torch.cuda.get_device_properties(device), "uuid", ""))
    for index in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        if uuid and uuid in str(nvml.nvmlDeviceGetUUID(handle)):
            return handle
    return nvml.nvmlDeviceGetHandleByIndex(0)


def gpu_variants(device: torch.device) -> dict[str, Callable[[], object]]:
    """Four synthetic variants of distinct power: a large and a small bf16 GEMM, a 1 GiB
    device-to-device copy, 200 tiny elementwise kernels."""
    big = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    big_out = torch.empty_like(big)
    small = torch.randn(2048, 2048, device=device, dtype=torch.bfloat16)
    small_out = torch.empty_like(small)
    src = torch.empty(1 << 30, device=device, dtype=torch.uint8)
    dst = torch.empty_like(src)
    tiny = torch.zeros(1024, device=device)

    def gemm_8192() -> None:
        torch.matmul(big, big, out=big_out)

    def gemm_2048() -> None:
        for _ in range(8):
            torch.matmul(small, small, out=small_out)

    def copy_1gib() -> None:
        dst.copy_(src)

    def tiny_kernels() -> None:
        for _ in range(200):
            tiny.add_(1.0)

    return {"gemm_8192": gemm_8192, "gemm_2048x8": gemm_2048, "copy_1gib": copy_1gib,
            "tiny_x200": tiny_kernels}


FAKE_COUNTERS: dict[str, dict[str, float]] = {
    "continuous": {"counter_period_s": 0.1, "counter_lag_s": 0.03, "counter_noise_mj": 100.0},
    "sampled": {"counter_period_s": 0.1, "counter_sample_s": 0.025},
}
"""The fake counters: a continuous one (100 ms updates read 30 ms late, 0.1 J noise per
update) and one sampling 25 ms of every 100 ms (as A100/H100 power readings do)."""

FAKE_DUTY = {"gemm_8192": (0.004, 1.0), "gemm_2048x8": (0.003, 0.75),
             "copy_1gib": (0.005, 0.5), "tiny_x200": (0.004, 0.35)}
"""The fake variants: (seconds a run lasts, busy fraction of it). The idle rest of a run
stretches when the OS deschedules this process (a loaded CI machine), moving its energy;
busy shares of at least a third keep that small."""


def fake_rig(kind: str, clock: Callable[[], float] | None = None, seed: int = 0) -> Rig:
    """A fake GPU with the ``kind`` of counter of ``FAKE_COUNTERS``, on ``clock`` (a
    ``FakeClock`` when None), its load a ``BusyTimeline``."""
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    from fake_pynvml import BusyTimeline, FakeClock, FakeGpu, FakeNvml, FakePowerModel

    from kareus.devices.sim.presets import H200

    clock = clock or FakeClock()
    timeline = BusyTimeline(clock)
    top = 1980
    gpu = FakeGpu(name=f"NVIDIA H200 (fake, {kind} counter)", memory_clock=2619,
                  graphics_clocks={2619: tuple(range(top, 344, -15))},
                  default_power_limit_mw=700_000,
                  power_model=FakePowerModel.of(H200, cpu_time=timeline.busy_until_now),
                  counter_seed=seed, **FAKE_COUNTERS[kind])
    fake = FakeNvml([gpu], clock=clock)
    nvml = GuardedNvml(fake)
    nvml.nvmlInit()
    handle = nvml.nvmlDeviceGetHandleByIndex(0)

    def wait(seconds: float) -> None:  # idle, but as exactly timed as a spin
        end = clock() + seconds
        if hasattr(clock, "advance"):
            clock.advance(seconds)
        while clock() < end:
            pass

    def variant(run_s: float, duty: float) -> Callable[[], None]:
        """Busy for the first ``duty`` of ``run_s`` (recorded as such, as a GPU would run a
        queued kernel whatever the host does), then waiting for the rest: a busy share that
        neither the counter's reads from another thread (holding the GIL) nor the OS
        descheduling this process stretch; only the wait can overrun."""

        def run() -> None:
            start = clock()
            timeline.add(start, start + run_s * duty)
            wait(max(start + run_s - clock(), 0.0))

        return run

    return Rig(
        label=gpu.name, fake=True, nvml=nvml, handle=handle, gpu=gpu.name,
        driver=str(nvml.nvmlSystemGetDriverVersion()), timer=clock, busy=timeline.spin,
        idle=timeline.idle, cuda=False,
        variants={name: variant(*d) for name, d in FAKE_DUTY.items()},
        counter={"kind": kind, **FAKE_COUNTERS[kind]},
    )


# -- the check ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    poll_s: float = 1.0
    """Seconds of each of the idle and the loaded polls (section 1)."""
    waves_ms: tuple[float, ...] = WAVES_MS
    phases: int = 3
    window_updates: int = 8
    warmup_s: float = 30.0
    reference_s: float = 5.0
    protocol_repeats: int = 3
    protocol_window_s: float = PROTOCOL_WINDOW_S
    seed: int = 0


def characterise(rig: Rig, settings: Settings, *, warmup: bool) -> dict[str, Any]:
    """Sections 1-3 on one rig: intervals, square waves, (warm-up)."""
    polled = {state: poll_changes(rig, settings.poll_s, loaded=state == "loaded")
              for state in ("idle", "loaded")}
    table = {state: {name: intervals(times) for name, times in p["changes"].items()}
             for state, p in polled.items()}
    period_ms = table["loaded"]["energy_counter"]["median_ms"] or 100.0
    waves = square_waves(rig, period_ms / 1000.0, settings.waves_ms, settings.phases,
                         settings.window_updates, settings.seed)
    out: dict[str, Any] = {
        "label": rig.label, "counter": rig.counter,
        "intervals": table, "polls": {s: p["polls"] for s, p in polled.items()},
        "update_period_ms": period_ms,
        **{field: next((w[field] for w in waves if w.get(field) is not None), None)
           for field in ("update_noise_mj", "lag_s")},
        "square_wave": {"waves": waves, **swing_summary(waves)},
    }
    if warmup:
        samples = warm_up(rig, settings.warmup_s)
        out["warmup"] = {"samples": samples,
                         **warmup_summary(samples, min(5.0, settings.warmup_s / 3))}
    return out


def estimate(
    rig: Rig, settings: Settings, period_s: float, noise_mj: float | None,
    lag_s: float | None,
) -> dict[str, Any]:
    """Sections 4-5 on one rig: references, multiplexed estimates, today's protocol."""
    lead_s = max(0.3, 3 * period_s)
    began = rig.timer()
    acquired = {n: reference(rig, run, settings.reference_s, lead_s)
                for n, run in rig.variants.items()}
    references = {n: reference_power(a, period_s) for n, a in acquired.items()}
    references_s = rig.timer() - began
    mux = multiplexed(rig, period_s, settings.seed, noise_mj, lag_s)
    today = {n: protocol_estimate(protocol(rig, run, settings.protocol_repeats,
                                           settings.protocol_window_s))
             for n, run in rig.variants.items()}
    return {
        "references": references, "references_s": references_s,
        "multiplexed": {**{k: v for k, v in mux.items() if k != "estimates"},
                        "estimates": compare(mux["estimates"], references)},
        "protocol": {"repeats": settings.protocol_repeats,
                     "min_window_s": settings.protocol_window_s, "settle_s": SETTLE_S,
                     "seconds": sum(t["seconds"] for t in today.values()),
                     "estimates": compare(today, references)},
    }


def check_gpu(settings: Settings) -> dict[str, Any]:
    import pynvml

    nvml = GuardedNvml(pynvml)
    with setters_refused(pynvml) as refused:
        rig = gpu_rig(nvml)
        counters = [characterise(rig, settings, warmup=True)]
        period_s = counters[0]["update_period_ms"] / 1000.0
        estimates = estimate(rig, settings, period_s, counters[0]["update_noise_mj"],
                             counters[0]["lag_s"])
        replay = replay_check(rig)
    return {"fake": False, "note": None, "device": rig.label, "gpu": rig.gpu,
            "driver": rig.driver, "counters": counters, **estimates, "replay": replay,
            "setters_refused": [*nvml.refused, *refused]}


def check_fake(settings: Settings) -> dict[str, Any]:
    counters, refused = [], []
    for kind in FAKE_COUNTERS:
        rig = fake_rig(kind, seed=settings.seed)
        counters.append(characterise(rig, settings, warmup=kind == "continuous"))
        refused += rig.nvml.refused
    live = fake_rig("continuous", clock=time.monotonic, seed=settings.seed)
    estimates = estimate(live, settings, counters[0]["update_period_ms"] / 1000.0,
                         counters[0]["update_noise_mj"], counters[0]["lag_s"])
    return {"fake": True, "note": FAKE_NOTE, "device": f"fake NVML ({FAKE_NOTE})",
            "gpu": live.gpu, "driver": live.driver, "counters": counters,
            "estimates_on": live.label, **estimates,
            "replay": {"skipped": "no GPU: a CUDA graph needs one"},
            "setters_refused": [*refused, *live.nvml.refused]}


def run_check(settings: Settings, *, fake: bool | None = None) -> dict[str, Any]:
    """The whole check: on this GPU, or on fake counters where there is none (``fake``
    None: decide from what this machine has)."""
    why = None
    if fake is None:
        why = gpu_available()
        fake = why is not None
    began = time.monotonic()
    result = check_fake(settings) if fake else check_gpu(settings)
    return {"check": "nvml_counter_check", "host": platform.node(), "torch": torch.__version__,
            "no_gpu_reason": why, "settings": dataclasses.asdict(settings), **result,
            "elapsed_s": time.monotonic() - began}


# -- the report --------------------------------------------------------------------------


def _f(value: float | None, spec: str = ".1f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def tables(result: dict[str, Any]) -> list[Table]:
    warn = f"[bold red]{FAKE_NOTE.upper()}[/]: " if result["fake"] else ""
    out = []
    t = Table(title=f"{warn}update intervals (ms) on {result['device']}", title_justify="left")
    for column in ("counter", "source", "state", "changes", "median", "p10", "p90", "min",
                   "max"):
        t.add_column(column, justify="left" if column in ("counter", "source", "state")
                     else "right")
    for c in result["counters"]:
        for state, sources in c["intervals"].items():
            for source, s in sources.items():
                t.add_row(c["label"], source, state, str(s["changes"]), _f(s["median_ms"]),
                          _f(s["p10_ms"]), _f(s["p90_ms"]), _f(s["min_ms"]), _f(s["max_ms"]))
        t.add_section()
    out.append(t)

    t = Table(title=f"{warn}square waves (50% duty): swing across phases over busy-idle power"
              f" (integrating below {counter_module.SWING_LIMIT})", title_justify="left")
    for column in ("counter", "wave ms", "x update", "swing", "integrates", "probe s"):
        t.add_column(column, justify="left" if column == "counter" else "right")
    for c in result["counters"]:
        for w in c["square_wave"]["waves"]:
            t.add_row(c["label"], f"{w['wave_ms']:g}", f"{w['multiple']:.2f}",
                      _f(w.get("swing"), ".3f"), str(w.get("integrates", w.get("error"))),
                      _f(w.get("probe_s")))
        sq = c["square_wave"]
        t.add_row(c["label"], "worst", "", _f(sq["worst_swing"], ".3f"),
                  f"[bold]{sq['integrates']}[/]", "")
        t.add_section()
    out.append(t)

    t = Table(title=f"{warn}warm-up under load", title_justify="left")
    for column in ("counter", "s", "power W first/last", "temp C first/last",
                   "counter W early/late", "drift"):
        t.add_column(column, justify="left" if column == "counter" else "right")
    for c in result["counters"]:
        w = c.get("warmup")
        if w:
            t.add_row(c["label"], _f(w["seconds"]),
                      f"{_f(w['power_w_first'])} / {_f(w['power_w_last'])}",
                      f"{_f(w['temperature_c_first'], '.0f')} / "
                      f"{_f(w['temperature_c_last'], '.0f')}",
                      f"{_f(w['counter_w_early'])} / {_f(w['counter_w_late'])}",
                      _f(w["drift_pct"], "+.1f", "%"))
    out.append(t)

    mux, today = result["multiplexed"], result["protocol"]
    t = Table(title=(
        f"{warn}estimates vs {result['settings']['reference_s']:g} s references"
        f"{' on ' + result['estimates_on'] if result.get('estimates_on') else ''}: multiplexed"
        f" ({mux['seconds']:.1f} s, {mux['rounds']} rounds, lag {1000 * mux['lag_s']:.0f} ms)"
        f" and today's protocol ({today['repeats']} x >= {today['min_window_s']:g} s windows,"
        f" {today['seconds']:.1f} s)"), title_justify="left")
    for column in ("variant", "ref W", "ref mJ/run", "mux W", "mux err", "mux stated",
                   "mux energy err", "today W", "today err", "today energy err",
                   "today spread"):
        t.add_column(column, justify="left" if column == "variant" else "right")
    for name, ref in result["references"].items():
        m, p = mux["estimates"][name], today["estimates"][name]
        t.add_row(name, _f(ref["power_w"]), _f(_mj(ref["energy_j"]), ".3f"),
                  _f(m["power_w"]), _f(m["power_error_pct"], "+.2f", "%"),
                  _f(100 * m["stated_error"], ".2f", "%"), _f(m["energy_error_pct"], "+.2f", "%"),
                  _f(p["power_w"]), _f(p["power_error_pct"], "+.2f", "%"),
                  _f(p["energy_error_pct"], "+.2f", "%"), _f(100 * (p["spread"] or 0), ".1f", "%"))
    t.caption = (f"references took {result['references_s']:.1f} s; setters refused: "
                 f"{result['setters_refused'] or 'none'}; whole check {result['elapsed_s']:.1f} s")
    out.append(t)
    out.append(replay_table(result["replay"]))
    return out


def replay_table(replay: dict[str, Any]) -> Table:
    """Section 6: ms per run, eager and replayed, or why a variant is not replayed."""
    nccl = f", NCCL {replay['nccl']}" if replay.get("nccl") else ""
    t = Table(title=f"CUDA-graph replay: ms per run (CUDA events){nccl}", title_justify="left")
    for column in ("variant", "eager ms", "replay ms", "gap removed", "eager because"):
        t.add_column(column, justify="right" if column.endswith(("ms", "removed")) else "left")
    if "skipped" in replay:
        t.add_row(replay["skipped"], "", "", "", "")
        return t
    rows = dict(replay["variants"])
    if isinstance(replay["collectives"], str):
        t.caption = f"collectives not captured: {replay['collectives']}"
    else:
        rows.update(replay["collectives"])
    for name, row in rows.items():
        gap = (None if row.get("replay_ms") is None
               else 100.0 * (1.0 - row["replay_ms"] / row["eager_ms"]))
        t.add_row(name, _f(row["eager_ms"], ".3f"), _f(row.get("replay_ms"), ".3f"),
                  _f(gap, "+.1f", "%"), row["eager"] or "")
    return t


def _mj(joules: float | None) -> float | None:
    return None if joules is None else 1000.0 * joules


@contextlib.contextmanager
def _quiet_kareus() -> Iterator[None]:
    import logging

    logger = logging.getLogger("kareus")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fake", action="store_true",
                        help="fake counters even where there is a GPU")
    parser.add_argument("--poll-s", type=float, default=Settings.poll_s)
    parser.add_argument("--waves-ms", type=float, nargs="+", default=list(WAVES_MS))
    parser.add_argument("--phases", type=int, default=Settings.phases)
    parser.add_argument("--window-updates", type=int, default=Settings.window_updates)
    parser.add_argument("--warmup-s", type=float, default=None,
                        help="default: 30 on a GPU, 3 on fake counters")
    parser.add_argument("--reference-s", type=float, default=None,
                        help="default: 5 on a GPU, 2 on fake counters")
    parser.add_argument("--protocol-repeats", type=int, default=Settings.protocol_repeats)
    parser.add_argument("--protocol-window-s", type=float, default=Settings.protocol_window_s)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    fake = True if args.fake else None
    no_gpu = args.fake or gpu_available() is not None
    settings = Settings(
        poll_s=args.poll_s, waves_ms=tuple(args.waves_ms), phases=args.phases,
        window_updates=args.window_updates,
        warmup_s=args.warmup_s if args.warmup_s is not None else (3.0 if no_gpu else 30.0),
        reference_s=args.reference_s if args.reference_s is not None else (
            2.0 if no_gpu else 5.0),
        protocol_repeats=args.protocol_repeats, protocol_window_s=args.protocol_window_s,
        seed=args.seed,
    )
    console = Console(width=160)
    with _quiet_kareus():
        result = run_check(settings, fake=fake)
    for t in tables(result):
        console.print(t)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    console.print(f"wrote {args.out}", markup=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
