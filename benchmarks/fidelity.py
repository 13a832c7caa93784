"""Fidelity report of the simulated GPUs: every published data point, and clock sweeps.

(a) Every point of ``benchmarks/calibration.py``: the published value (or
range), the model's prediction (``probes.predict``), the error (relative to the nearer end
of the published range, absolute for ratios), the tolerance of its quantity's class and the
verdict: PASS, FAIL, or "explained" (a known miss, with its reason). Inputs are constants
read back (regression checks); fidelity points are independent measurements.

(b) Per preset, the modelled clock response of four workloads at every supported clock
from the maximum down to min(search_min_mhz, 0.6 f_max): a bf16 8192^3 GEMM, a 1 GiB bf16
copy, causal SDPA attention forward and backward (FlashAttention-2's benchmark shape: batch
8, seq 2048, 16 heads of 128) and a Llama-3.2-3B-sized block under TP8 forward and backward
(``probes.transformer_layer``: micro-batch 8 x 4096 tokens, as AOT autograd hands the graphs
to Inductor, unrewritten, the two graphs summed): time, average power, energy, t/t_max and
E/E_max, and the energy-optimal clock with its saving and slowdown against the default
(maximum) clock.

(c) Where ``benchmarks/gpu_plan_check.py`` has recorded an H200 (``--h200``, by default
benchmarks/results/h200_default.json; nothing is said where there is no such file): its
graphs and partition workloads as measured through NVML at default clocks, beside the
simulated GPU's estimates stored in the record when it was measured (by the model version
it names) and beside the current model's estimates of the same graphs, rebuilt here: the
check's step captured over fake tensors on this CPU (``plan_check_graphs``), applied and
cut into partition workloads by the check's own functions (``gpu_plan_check.applied_graph``,
``partition_of``). A model change never moves the stored numbers, so this is where its
before and after show. Each ratio is judged by the fidelity tolerances (time 10%, energy
15%), with the geometric means. Each workload says how it was rebuilt: "exact" (a partition
of the recorded structural key), "rebuilt" (same model, sizes and partition structure; the
CPU's graph may name other ops, e.g. its flash attention), "stand-in" (its structure differs
from the measured one, said why: its change mixes the model's with the graph's) or "not
rebuilt" (why; nothing is predicted for it).

(d) Where ``benchmarks/gpu_check.py`` has recorded an H200's kernels (``--h200-kernels``, by
default benchmarks/results/gpu_check_h200.json): one kernel of every class the model
distinguishes, measured at default clocks, beside the stored and the current model's
prediction (``gpu_check.CASES`` traced again), each judged by the fidelity tolerances of its
quantity (``calibration.TOLERANCES``: time 10%, power 15%).

(e) Where ``benchmarks/artifact_check.py`` has recorded the method's A100 iterations
(``--artifact``, by default benchmarks/results/artifact_check.json): fidelity points
(independent measurements), summarised per workload and method: time at the fastest plan,
the clock response T_slow/T_fast and the energy, as that record judged them with the model
version it names. Its trace takes about 2 minutes, so it is re-run only with
``--rerun-artifact``; a record of an older model is said to be stale.

Everything else is traced over fake tensors in an 8-rank fake process group: no GPU is
needed (about 20 s). Writes ``fidelity.json`` and one ``fidelity_<preset>.png`` per preset
(time/t_max, power and E/E_max against the clock). Exits 0 whatever the verdicts: it is a
report.

    python benchmarks/fidelity.py --out-dir benchmarks/results [--preset sim:h200 ...]
        [--rerun-artifact]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import artifact_check
import gpu_check
import matplotlib
import torch
import torch.distributed as dist
import torch.fx
from calibration import POINTS, TOLERANCES, DataPoint
from gpu_measure import H200_KERNELS, H200_RECORD, model_version
from gpu_plan_check import (
    StepGraph,
    applied_graph,
    one_rank_tensor_parallel,
    partition_of,
    partition_rows,
    step_graphs,
)
from probes import (
    attention,
    copy,
    fake_world,
    gemm,
    predict,
    transformer_layer,
)
from rich.console import Console
from rich.table import Table
from torch._inductor import config as inductor_config
from torch._subclasses.fake_tensor import FakeTensorMode

from kareus.codegen.lowering import pinned_schedule_config
from kareus.devices import Measurement, SimulatedGPU, Workload, preset_names
from kareus.models.llama import Llama, LlamaConfig
from kareus.passes.collectives import find_collectives

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after choosing the backend

TP, BATCH, SEQ = 8, 8, 4096  # the layer of overlap_sim.py
LLAMA_3B = {"dim": 3072, "heads": 24, "ffn_dim": 8192}  # MHA stand-in for 24/8 GQA
ATTENTION = {"batch": 8, "seq": 2048, "heads": 16, "head_dim": 128}  # FlashAttention-2's
VERDICT_STYLE = {"PASS": "green", "FAIL": "bold red", "explained": "yellow", "ERROR": "bold red"}
ARTIFACT_RECORD = Path(__file__).resolve().parent / "results" / "artifact_check.json"
"""``artifact_check.py``'s record, which (e) reads."""


# --- (a) the points --------------------------------------------------------------------------


def point_row(point: DataPoint) -> dict[str, Any]:
    """The point, its prediction and verdict (ERROR, with the exception, if it cannot be
    predicted: a report of the model as it stands, not a test)."""
    row: dict[str, Any] = {
        "preset": point.preset,
        "quantity": point.quantity,
        "what": point.what or "-",
        "size_bytes": point.size_bytes,
        "params": {name: value for name, value in point.params},
        "role": point.role,
        "published": point.value,
        "published_range": list(point.published),
        "band": list(point.band),
        "tolerance": point.tolerance.amount,
        "tolerance_relative": point.tolerance.relative,
        "source": point.source,
        "known_miss": point.known_miss,
    }
    try:
        predicted = predict(point)
    except Exception as e:  # noqa: BLE001  (reported, never hidden)
        return {**row, "predicted": None, "error": None, "verdict": "ERROR",
                "exception": f"{type(e).__name__}: {e}"}
    verdict = point.verdict(predicted)
    return {
        **row,
        "predicted": predicted,
        "error": point.error(predicted),
        "verdict": verdict,
        "stale_known_miss": bool(point.known_miss) and verdict == "PASS",
    }


def _number(x: float) -> str:
    return f"{x:.4g}"


def points_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="Published data points against the model", title_justify="left")
    for column in ("preset", "quantity", "size / params", "role", "published", "predicted",
                   "error", "tol", "verdict"):
        table.add_column(column, justify="left" if column in ("quantity", "size / params")
                         else "right")
    for r in rows:
        low, high = r["published_range"]
        published = _number(r["published"]) if low == high else f"{_number(low)}-{_number(high)}"
        relative = r["tolerance_relative"]
        error = "" if r["error"] is None else "in range" if low < high and r["error"] == 0 else (
            f"{100 * r['error']:+.1f}%" if relative else f"{r['error']:+.3f}"
        )
        tol = f"{100 * r['tolerance']:.0f}%" if relative else f"±{r['tolerance']:.2f}"
        verdict = r["verdict"] + (" (stale miss)" if r.get("stale_known_miss") else "")
        table.add_row(
            r["preset"].removeprefix("sim:"), r["quantity"], r["what"], r["role"], published,
            "-" if r["predicted"] is None else _number(r["predicted"]), error, tol,
            f"[{VERDICT_STYLE[r['verdict']]}]{verdict}[/]",
        )
    return table


# --- (b) the clock sweeps --------------------------------------------------------------------


def workloads() -> dict[str, tuple[torch.fx.GraphModule, ...]]:
    """Each sweep workload as the graphs whose times and energies add up to it."""
    return {
        "gemm 8192^3 bf16": (gemm(),),
        "copy 1 GiB bf16": (copy(),),
        "attention causal fwd+bwd": (attention(**ATTENTION, causal=True, backward=True),),
        f"llama-3b layer TP{TP} fwd+bwd": transformer_layer(**LLAMA_3B, batch=BATCH, seq=SEQ),
    }


def sweep_clocks(gpu: SimulatedGPU) -> tuple[int, ...]:
    spec = gpu.spec
    lowest = min(spec.search_min_mhz, 0.6 * spec.max_clock_mhz)
    return tuple(c for c in gpu.supported_clocks() if c >= lowest)


def sweep(gpu: SimulatedGPU, graphs: tuple[torch.fx.GraphModule, ...]) -> dict[str, Any]:
    """Time, power and energy of ``graphs`` run one after the other at each clock."""
    clocks = sweep_clocks(gpu)
    parts = [gpu.sweep(Workload(f"graph{i}", gm, world_size=TP), clocks)
             for i, gm in enumerate(graphs)]
    totals = {c: (sum(p[c].time_s for p in parts), sum(p[c].energy_j for p in parts))
              for c in clocks}
    t_max, e_max = totals[clocks[0]]
    rows = [
        {"clock_mhz": c, "time_s": t, "power_w": e / t, "energy_j": e,
         "time_ratio": t / t_max, "energy_ratio": e / e_max}
        for c, (t, e) in totals.items()
    ]
    best = min(rows, key=lambda r: r["energy_j"])
    return {
        "rows": rows,
        "energy_optimal": {
            "clock_mhz": best["clock_mhz"],
            "energy_saving": 1 - best["energy_ratio"],
            "slowdown": best["time_ratio"] - 1,
        },
    }


def preset_report(preset: str) -> dict[str, Any]:
    """The sweeps of every workload; one the model cannot cost holds its error instead."""
    gpu = SimulatedGPU(preset)
    report: dict[str, Any] = {
        "model_version": getattr(gpu.spec, "model_version", None),
        "max_clock_mhz": gpu.spec.max_clock_mhz,
        "clocks": list(sweep_clocks(gpu)),
        "workloads": {},
        "errors": {},
    }
    for name, graphs in workloads().items():
        try:
            report["workloads"][name] = sweep(gpu, graphs)
        except Exception as e:  # noqa: BLE001  (reported, never hidden)
            report["errors"][name] = f"{type(e).__name__}: {e}"
    return report


def summary_table(preset: str, report: dict[str, Any]) -> Table:
    version = report["model_version"]
    table = Table(
        title=f"{preset} clock response ({len(report['clocks'])} clocks, "
        f"{report['clocks'][-1]}-{report['clocks'][0]} MHz"
        + (f", model {version}" if version else "") + ")",
        title_justify="left",
    )
    for column in ("workload", "time at f_max (ms)", "power (W)", "energy (J)",
                   "E-optimal clock", "E saving", "slowdown"):
        table.add_column(column, justify="left" if column == "workload" else "right")
    for name, w in report["workloads"].items():
        top, best = w["rows"][0], w["energy_optimal"]
        table.add_row(
            name, f"{1e3 * top['time_s']:.3f}", f"{top['power_w']:.0f}", f"{top['energy_j']:.3f}",
            f"{best['clock_mhz']} MHz", f"{100 * best['energy_saving']:.1f}%",
            f"{100 * best['slowdown']:+.1f}%",
        )
    return table


def sweep_table(preset: str, report: dict[str, Any], step_mhz: int) -> Table:
    """t/t_max, power and E/E_max per workload, every ``step_mhz`` from the maximum."""
    table = Table(title=f"{preset}: t/t_max, power (W), E/E_max against the clock "
                  f"(every {step_mhz} MHz; all clocks in the JSON)", title_justify="left")
    table.add_column("MHz", justify="right")
    names = list(report["workloads"])
    for name in names:
        short = name.split()[0]
        for column in ("t/t0", "W", "E/E0"):
            table.add_column(f"{short} {column}", justify="right")
    top = report["clocks"][0]
    for i, clock in enumerate(report["clocks"]):
        if (top - clock) % step_mhz:
            continue
        cells = [str(clock)]
        for name in names:
            r = report["workloads"][name]["rows"][i]
            cells += [f"{r['time_ratio']:.3f}", f"{r['power_w']:.0f}", f"{r['energy_ratio']:.3f}"]
        table.add_row(*cells)
    return table


def plot(preset: str, report: dict[str, Any], path: Path) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = (("time_ratio", "t / t(f_max)"), ("power_w", "average power (W)"),
              ("energy_ratio", "E / E(f_max)"))
    for ax, (key, label) in zip(axes, panels, strict=True):
        for name, w in report["workloads"].items():
            ax.plot([r["clock_mhz"] for r in w["rows"]], [r[key] for r in w["rows"]],
                    marker=".", label=name)
        ax.set_xlabel("SM clock (MHz)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    version = report["model_version"]
    fig.suptitle(f"{preset} (simulated{', model ' + version if version else ''})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- re-predicting a record with the current model --------------------------------------------

TOLERANCE_OF = {"time": "time", "energy": "power", "power": "power"}
"""The tolerance class (``calibration.TOLERANCES``) each measured quantity is judged by:
energy as power (15%), as the calibration points judge it."""
HOW_STYLE = {"exact": "green", "rebuilt": "green", "stand-in": "yellow"}
MOVED = 0.005
"""A re-predicted ratio that differs from the stored one by more than this (relative) is
listed as moved by the model change (or by the rebuilt graph, for a stand-in)."""


@dataclass(frozen=True)
class Rebuilt:
    """A recorded workload's graph rebuilt here, or why it could not be.

    ``how``: "exact" (the same structural key, ``passes.partition.structural_key``, as the
    recorded partition), "rebuilt" (the same model, sizes and partition structure, but no
    key to compare, or another one because the CPU's graph names other ops, e.g. its flash
    attention), "stand-in" (rebuilt, but its structure differs from what was measured, as
    ``note`` says: a change in its prediction mixes the model's change with the graph's) or
    None (not rebuilt: ``note`` says why, and nothing is predicted)."""

    how: str | None
    note: str
    gm: torch.fx.GraphModule | None = None


def _verdict(relative_error: float, kind: str) -> str:
    return "PASS" if abs(relative_error) <= TOLERANCES[TOLERANCE_OF[kind]].amount else "FAIL"


def _judged(
    prefix: str, measured: dict[str, Any], predicted: Measurement | None
) -> dict[str, Any]:
    """``predicted`` beside ``measured`` (a row with measured_time_s, ..._energy_j), as
    ``{prefix}_time_s`` ..., ratios predicted / measured and their verdicts (None where
    nothing was predicted)."""
    if predicted is None:
        return {f"{prefix}_{key}": None for key in (
            "time_s", "energy_j", "power_w", "time_ratio", "energy_ratio", "time_verdict",
            "energy_verdict")}
    time_ratio = predicted.time_s / measured["measured_time_s"]
    energy_ratio = predicted.energy_j / measured["measured_energy_j"]
    return {
        f"{prefix}_time_s": predicted.time_s,
        f"{prefix}_energy_j": predicted.energy_j,
        f"{prefix}_power_w": predicted.average_power_w,
        f"{prefix}_time_ratio": time_ratio,
        f"{prefix}_energy_ratio": energy_ratio,
        f"{prefix}_time_verdict": _verdict(time_ratio - 1, "time"),
        f"{prefix}_energy_verdict": _verdict(energy_ratio - 1, "energy"),
    }


def _moved(rows: list[dict[str, Any]], name: str, quantities: tuple[str, ...]) -> list[str]:
    """Each re-predicted ratio that moved by more than ``MOVED`` from the stored one, as
    "what: stored -> now (toward / away from the measurement)"."""
    lines = []
    for r in rows:
        for q in quantities:
            stored, now = r[f"{q}_ratio"], r.get(f"now_{q}_ratio")
            if now is None or abs(now / stored - 1) <= MOVED:
                continue
            way = "toward" if abs(now - 1) < abs(stored - 1) else "away from"
            stand_in = " (stand-in: the graph differs too)" if r["rebuilt"] == "stand-in" else ""
            lines.append(f"{r[name]} {q} {stored:.3f} -> {now:.3f} ({way} the measurement)"
                         f"{stand_in}")
    return lines


def _cannot(error: BaseException) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())}"


# --- (c) the H200 at default clocks ----------------------------------------------------------


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def plan_check_graphs(setup: dict[str, Any]) -> tuple[StepGraph, StepGraph]:
    """The forward and backward graphs of a ``gpu_plan_check.py`` record's ``setup``, as
    its step captured them (``gpu_plan_check.step_graphs``), but over fake tensors on this
    CPU: nothing is allocated, so the H200-sized model is captured in seconds. Call it in a
    process group of one rank (``fake_world(1)``); the GPU ran on NCCL, whose only bearing
    on the graphs is the collectives' CTA choices, which the default variant leaves alone.

    Fake parameters cannot be cast (``Module.to`` swaps them), so the model is made in its
    dtype and its floating buffers (the RoPE tables, made in fp32) are cast one by one, as
    ``.to(dtype)`` casts them on the GPU."""
    cfg = LlamaConfig(**setup["model"])
    dtype = getattr(torch, setup["dtype"])
    with (inductor_config.patch(pinned_schedule_config()), FakeTensorMode(),
          _default_dtype(dtype)):
        model = Llama(cfg)
        for module in model.modules():
            for name, buffer in list(module.named_buffers(recurse=False)):
                if buffer.is_floating_point():
                    setattr(module, name, buffer.to(dtype))
        model = one_rank_tensor_parallel(model, dist.group.WORLD.group_name)
        tokens = torch.randint(0, cfg.vocab_size, (setup["batch"], setup["seq"]))
        try:
            # a record from before these fields: the whole model, AOT's own partition
            return step_graphs(model, tokens, setup.get("regions", "stage"),
                               setup.get("saved_pieces", 1))
        finally:
            torch._dynamo.reset()


def _partition_rebuilt(row: dict[str, Any], graph: StepGraph,
                       recorded: list[dict[str, Any]]) -> Rebuilt:
    """The recorded partition ``row`` in the rebuilt ``graph``: the partition of the same
    structural key, or else the one of the same index (``gpu_plan_check.partition_rows``:
    the first of each distinct key, at the same slot rule), a stand-in where its slot, its
    number of instances or its launch slots (one more than the k = 1 row's slot, which
    says it for the k = 2 row too) differ from the measured one's."""
    here = [{**h, "workload": "partition"} for h in partition_rows(graph)]
    same_key = next((h for h in here if h["k"] == row["k"] and h["key"] == row["key"]), None)
    if same_key is not None:
        note = "same structural key" + (
            "" if same_key["partition"] == row["partition"]
            else f" (partition {same_key['partition']} here)")
        return Rebuilt("exact", note, partition_of(graph.analysis, same_key).gm)

    def of_index(rows: list[dict[str, Any]], k: int) -> dict[str, Any] | None:
        return next((r for r in rows if r["workload"] == "partition" and r["k"] == k
                     and r["graph"] == row["graph"] and r["partition"] == row["partition"]),
                    None)

    same_index = of_index(here, row["k"])
    if same_index is None:
        return Rebuilt(None, f"the rebuilt {row['graph']} has no partition {row['partition']} "
                       "that is the first of its kind and overlaps its collective")
    differs = [f"{what} {same_index[what]} here, {row[what]} measured"
               for what in ("slot", "instances") if same_index[what] != row[what]]
    last_here, last_there = of_index(here, 1), of_index(recorded, 1)
    if row["k"] != 1 and last_here and last_there and last_here["slot"] != last_there["slot"]:
        differs.append(f"{last_here['slot'] + 1} launch slots here, "
                       f"{last_there['slot'] + 1} measured")
    key = f"key {same_index['key']} here, {row['key']} measured"
    gm = partition_of(graph.analysis, same_index).gm
    if differs:
        return Rebuilt("stand-in", "; ".join([*differs, key]), gm)
    return Rebuilt("rebuilt", f"{key}: the CPU graph's ops; same slots and instances", gm)


def _graph_rebuilt(row: dict[str, Any], graph: StepGraph, record: dict[str, Any],
                   partitions: dict[str, Rebuilt]) -> Rebuilt:
    """A recorded step graph at its count, rebuilt: a stand-in where its collectives or
    any of its recorded partitions (at either count) differ from what was measured."""
    gm = applied_graph(graph, row["k"])
    expected = next((r.get("expected_collectives") for r in record.get("lowering", ())
                     if r["graph"] == row["graph"] and r["k"] == row["k"]), None)
    issued = len(find_collectives(gm.graph))
    differs = [] if expected in (None, issued) else [
        f"{issued} collectives here, {expected} measured"]
    differs += sorted({f"partition {p['partition']} differs (its rows say how)"
                       for p in record["workloads"]
                       if p["workload"] == "partition" and p["graph"] == row["graph"]
                       and partitions[p["name"]].how in ("stand-in", None)})
    if differs:
        return Rebuilt("stand-in", "; ".join(differs), gm)
    return Rebuilt("rebuilt", f"{issued} collectives and the recorded partitions as measured"
                   " (no key of a whole graph is recorded)", gm)


def repredict_plan_check(record: dict[str, Any]) -> dict[str, Any]:
    """The current model's estimate of every workload of a ``gpu_plan_check.py`` record,
    its graphs rebuilt here (``plan_check_graphs``) and applied or cut into partition
    workloads by the functions the check used: ``{model_version, torch, rows: {name:
    (Rebuilt, Measurement | None)}, seconds}``. A workload that cannot be rebuilt is
    predicted nothing, and its Rebuilt says why."""
    start = time.perf_counter()
    sim = SimulatedGPU(record["preset"])
    rows: dict[str, tuple[Rebuilt, Measurement | None]] = {}
    setup = record["setup"]
    try:
        if setup["world_size"] != 1:
            raise ValueError(f"world size {setup['world_size']}: only one rank is rebuilt")
        with fake_world(1):
            graphs = {g.analysis.kind: g for g in plan_check_graphs(setup)}
            partitions = {r["name"]: _partition_rebuilt(r, graphs[r["graph"]],
                                                        record["workloads"])
                          for r in record["workloads"] if r["workload"] == "partition"}
            for r in record["workloads"]:
                rebuilt = partitions.get(r["name"]) or _graph_rebuilt(
                    r, graphs[r["graph"]], record, partitions)
                predicted = None if rebuilt.gm is None else sim.estimate(rebuilt.gm, 1)
                rows[r["name"]] = (rebuilt, predicted)
    except Exception as e:  # noqa: BLE001  (reported, never hidden)
        why = f"the step could not be rebuilt: {_cannot(e)}"
        rows = {r["name"]: (Rebuilt(None, why), None) for r in record["workloads"]}
    return {"model_version": model_version(record["preset"]), "torch": torch.__version__,
            "rows": rows, "seconds": time.perf_counter() - start}


def h200_measured(path: Path) -> dict[str, Any] | None:
    """The workloads ``gpu_plan_check.py`` measured, from its record at ``path``: each as
    measured, as the model predicted it when it was measured (the record's model version)
    and as the current model predicts it now (``repredict_plan_check``; a record with no
    measurement is not rebuilt), with the geometric means of the predicted/measured ratios
    and each ratio judged by the fidelity tolerances; None where there is no record."""
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    keys = ("name", "workload", "graph", "k", "partition", "key", "instances", "slot",
            "measured_time_s", "predicted_time_s", "time_ratio", "measured_power_w",
            "predicted_power_w", "measured_energy_j", "predicted_energy_j", "energy_ratio")
    rows = [{k: r.get(k) for k in keys} for r in record["workloads"]
            if r["time_ratio"] is not None]
    for r in rows:
        r["time_verdict"] = _verdict(r["time_ratio"] - 1, "time")
        r["energy_verdict"] = _verdict(r["energy_ratio"] - 1, "energy")
    now = repredict_plan_check(record) if rows else None
    for r in rows:
        rebuilt, predicted = now["rows"][r["name"]]
        r |= {"rebuilt": rebuilt.how, "rebuilt_note": rebuilt.note,
              **_judged("now", r, predicted)}
    again = [r for r in rows if r["now_time_ratio"] is not None]
    return {
        "path": str(path),
        "gpu": record.get("gpu"),
        "torch": record.get("torch"),
        "mode": record["mode"],
        "preset": record["preset"],
        "model_version": record["model_version"],
        "checks_passed": record["ok"],
        "workloads": rows,
        "time_ratio_geomean": _geomean([r["time_ratio"] for r in rows]),
        "energy_ratio_geomean": _geomean([r["energy_ratio"] for r in rows]),
        "now": None if now is None else {
            "model_version": now["model_version"],
            "torch": now["torch"],
            "how": "graphs rebuilt over fake tensors on the CPU (gpu_plan_check's step, "
                   "applied_graph and partition_of), estimated by the current model",
            "repredicted": len(again),
            "time_ratio_geomean": _geomean([r["now_time_ratio"] for r in again]),
            "energy_ratio_geomean": _geomean([r["now_energy_ratio"] for r in again]),
            "stored_time_ratio_geomean": _geomean([r["time_ratio"] for r in again]),
            "stored_energy_ratio_geomean": _geomean([r["energy_ratio"] for r in again]),
            "moved": _moved(rows, "name", ("time", "energy")),
            "not_rebuilt": {r["name"]: r["rebuilt_note"] for r in rows if r["rebuilt"] is None},
            "stand_ins": {r["name"]: r["rebuilt_note"] for r in rows
                          if r["rebuilt"] == "stand-in"},
            "seconds": now["seconds"],
        },
        "skipped": record["skipped"],
    }


def _geomean(values: list[float]) -> float | None:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def _ratio(value: float | None, verdict: str | None) -> str:
    return "-" if value is None else f"[{VERDICT_STYLE[verdict]}]{value:.3f}[/]"


def _how(how: str | None) -> str:
    return "[bold red]not rebuilt[/]" if how is None else f"[{HOW_STYLE[how]}]{how}[/]"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:.3f}"


def h200_table(measured: dict[str, Any]) -> Table:
    now = measured["now"]
    table = Table(
        title=f"{measured['gpu'] or 'GPU'} at default clocks (NVML, torch {measured['torch']})"
        f" against {measured['preset']} ({measured['path']}; checks "
        f"{'passed' if measured['checks_passed'] else 'FAILED'}): stored = predicted when "
        f"measured ({measured['model_version']}), now = "
        + (f"re-predicted here ({now['model_version']}, torch {now['torch']}, fake tensors)"
           if now else "not re-predicted")
        + "; ratios model/measured, judged at time 10%, energy 15%",
        title_justify="left",
    )
    for column in ("workload", "rebuilt", "ms", "stored ms", "now ms", "t stored", "t now",
                   "W", "stored W", "now W", "E stored", "E now"):
        table.add_column(column, justify="left" if column in ("workload", "rebuilt")
                         else "right")
    for r in measured["workloads"]:
        table.add_row(
            r["name"], _how(r["rebuilt"]), _ms(r["measured_time_s"]),
            _ms(r["predicted_time_s"]), _ms(r["now_time_s"]),
            _ratio(r["time_ratio"], r["time_verdict"]),
            _ratio(r["now_time_ratio"], r["now_time_verdict"]),
            f"{r['measured_power_w']:.0f}", f"{r['predicted_power_w']:.0f}",
            "-" if r["now_power_w"] is None else f"{r['now_power_w']:.0f}",
            _ratio(r["energy_ratio"], r["energy_verdict"]),
            _ratio(r["now_energy_ratio"], r["now_energy_verdict"]),
        )
    return table


def print_h200(console: Console, measured: dict[str, Any]) -> None:
    if not measured["workloads"]:
        skipped = "; ".join(s["what"] for s in measured["skipped"]) or "nothing"
        console.print(f"{measured['path']}: no measurement ({measured['mode']} mode; "
                      f"skipped: {skipped})")
        return
    console.print(h200_table(measured))
    stored = measured["model_version"]
    console.print(f"model/measured, geometric mean of {len(measured['workloads'])}: time "
                  f"x{measured['time_ratio_geomean']:.3f}, energy "
                  f"x{measured['energy_ratio_geomean']:.3f} (stored, {stored})")
    now = measured["now"]
    if now is None:
        return
    if now["repredicted"]:
        console.print(
            f"over the {now['repredicted']} re-predicted: time "
            f"x{now['stored_time_ratio_geomean']:.3f} ({stored}, stored) -> "
            f"x{now['time_ratio_geomean']:.3f} ({now['model_version']}, now); energy "
            f"x{now['stored_energy_ratio_geomean']:.3f} -> x{now['energy_ratio_geomean']:.3f}")
    _print_changes(console, stored, now["model_version"], now["moved"])
    for name, why in now["stand_ins"].items():
        console.print(f"[yellow]stand-in[/] {name}: {why}")
    for name, why in now["not_rebuilt"].items():
        console.print(f"[bold red]not rebuilt[/] {name}: {why}")
    console.print(f"(re-predicted in {now['seconds']:.1f} s)")


def _print_changes(console: Console, stored: str, now: str, moved: list[str]) -> None:
    """The before and after of a model change: what moved between the record's model and
    the current one (with the same version, only the rebuilt graph can move a number)."""
    if stored != now:
        console.print(f"[bold]before -> after[/] (model {stored} when measured -> {now} now), "
                      f"ratios that moved more than {MOVED:.1%}:"
                      + ("" if moved else " none"))
    else:
        console.print(f"stored and now by the same model ({now}): a difference is the "
                      "rebuilt graph's" + ("" if moved else f"; none over {MOVED:.1%}"))
    for line in moved:
        console.print(f"  {line}")


# --- (d) an H200's kernels at default clocks ---------------------------------------------------


def repredict_kernels(record: dict[str, Any]) -> dict[str, tuple[Rebuilt, Measurement | None]]:
    """The current model's estimate of each case of a ``gpu_check.py`` record, by the
    check's own cases (``gpu_check.CASES``, traced over fake tensors as when it was
    recorded): a stand-in where the case's kind, shapes, dtype or settings have changed
    since, not rebuilt where no case of its name is left."""
    cases = {c.name: c for c in gpu_check.CASES}
    gpu = SimulatedGPU(record["preset"])
    clock = gpu.search_clocks()[0]
    found: dict[str, tuple[Rebuilt, Measurement | None]] = {}
    for row in record["cases"]:
        case = cases.get(row["case"])
        if case is None:
            found[row["case"]] = (Rebuilt(None, "no case of that name in gpu_check.CASES"), None)
            continue
        described = gpu_check.describe(case)
        differs = [f"{k} {described[k]} here, {row[k]} measured"
                   for k in ("kind", "shapes", "dtype", "settings") if k in row
                   and described[k] != row[k]]
        rebuilt = Rebuilt("stand-in" if differs else "rebuilt",
                          "; ".join(differs) or "the same case, traced as when measured")
        try:
            predicted = gpu.measure(Workload(case.name, gm=gpu_check.traced(case)), clock)
        except Exception as e:  # noqa: BLE001  (reported, never hidden)
            found[row["case"]] = (Rebuilt(None, f"cannot be predicted: {_cannot(e)}"), None)
            continue
        found[row["case"]] = (rebuilt, predicted)
    return found


def h200_kernels(path: Path) -> dict[str, Any] | None:
    """``gpu_check.py``'s cases from its record at ``path``, each as measured, as predicted
    when measured and as re-predicted now (``repredict_kernels``), time and power judged
    by the fidelity tolerances; None where there is no record."""
    if not path.is_file():
        return None
    start = time.perf_counter()
    record = json.loads(path.read_text())
    now = repredict_kernels(record)
    rows = []
    for case in record["cases"]:
        time_error = case["predicted_time_s"] / case["measured_time_s"] - 1
        power_error = case["predicted_power_w"] / case["measured_power_w"] - 1
        rebuilt, predicted = now[case["case"]]
        row = {
            "case": case["case"], "kind": case["kind"],
            "measured_time_s": case["measured_time_s"],
            "predicted_time_s": case["predicted_time_s"],
            "measured_power_w": case["measured_power_w"],
            "predicted_power_w": case["predicted_power_w"],
            "measured_energy_j": case["measured_energy_j"],
            "time_error": time_error, "power_error": power_error,
            "time_ratio": time_error + 1,
            "energy_ratio": case["predicted_energy_j"] / case["measured_energy_j"],
            "time_verdict": _verdict(time_error, "time"),
            "power_verdict": _verdict(power_error, "power"),
            "rebuilt": rebuilt.how, "rebuilt_note": rebuilt.note,
            **_judged("now", case, predicted),
        }
        row["now_power_error"] = (None if predicted is None
                                  else predicted.average_power_w / case["measured_power_w"] - 1)
        row["now_power_verdict"] = (None if predicted is None
                                    else _verdict(row["now_power_error"], "power"))
        rows.append(row)
    return {"path": str(path), "gpu": record.get("gpu"), "torch": record.get("torch"),
            "preset": record["preset"], "model_version": record["model_version"],
            "idle_power_w": record.get("idle_power_w"), "cases": rows,
            "now": {"model_version": model_version(record["preset"]),
                    "torch": torch.__version__,
                    "moved": _moved(rows, "case", ("time", "energy")),
                    "not_rebuilt": {r["case"]: r["rebuilt_note"] for r in rows
                                    if r["rebuilt"] is None},
                    "stand_ins": {r["case"]: r["rebuilt_note"] for r in rows
                                  if r["rebuilt"] == "stand-in"},
                    "seconds": time.perf_counter() - start}}


def _error(error: float | None, verdict: str | None) -> str:
    return "-" if error is None else f"[{VERDICT_STYLE[verdict]}]{error:+.0%}[/]"


def h200_kernels_table(kernels: dict[str, Any]) -> Table:
    now = kernels["now"]
    table = Table(title=f"{kernels['gpu'] or 'GPU'} kernels at default clocks (NVML, torch "
                  f"{kernels['torch']}) against {kernels['preset']} ({kernels['path']}): "
                  f"stored = predicted when measured ({kernels['model_version']}), now = "
                  f"re-predicted here ({now['model_version']}, torch {now['torch']}); errors "
                  "model/measured - 1, judged at time 10%, power 15%", title_justify="left")
    for column in ("case", "kind", "rebuilt", "ms", "stored ms", "now ms", "t stored",
                   "t now", "W", "stored W", "now W", "P stored", "P now"):
        table.add_column(column, justify="left" if column in ("case", "kind", "rebuilt")
                         else "right")
    for r in kernels["cases"]:
        now_error = None if r["now_time_ratio"] is None else r["now_time_ratio"] - 1
        table.add_row(
            r["case"], r["kind"], _how(r["rebuilt"]), _ms(r["measured_time_s"]),
            _ms(r["predicted_time_s"]), _ms(r["now_time_s"]),
            _error(r["time_error"], r["time_verdict"]),
            _error(now_error, r["now_time_verdict"]),
            f"{r['measured_power_w']:.0f}", f"{r['predicted_power_w']:.0f}",
            "-" if r["now_power_w"] is None else f"{r['now_power_w']:.0f}",
            _error(r["power_error"], r["power_verdict"]),
            _error(r["now_power_error"], r["now_power_verdict"]),
        )
    return table


def print_kernels(console: Console, kernels: dict[str, Any]) -> None:
    console.print(h200_kernels_table(kernels))
    now = kernels["now"]
    _print_changes(console, kernels["model_version"], now["model_version"], now["moved"])
    for name, why in now["stand_ins"].items():
        console.print(f"[yellow]stand-in[/] {name}: {why}")
    for name, why in now["not_rebuilt"].items():
        console.print(f"[bold red]not rebuilt[/] {name}: {why}")


# --- (e) the method's A100 iterations (its public artifact) ----------------------------------


def artifact_points(path: Path) -> dict[str, Any] | None:
    """``artifact_check.py``'s record at ``path``: per workload and method, the fastest
    plan's iteration time and energy and the clock response T_slow/T_fast, measured (the
    artifact's lowtime over its A100 profiles) against the simulated A100, each as judged
    there (``calibration.TOLERANCES``); the count of all its checks; whether the record was
    predicted by another model than the current one. None where there is no record."""
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    current = model_version(artifact_check.DEVICE)
    rows, versions = [], set()
    for res in record["results"]:
        versions.add(res.get("model_version"))
        for method, r in res["methods"].items():
            fast = r["points"][-1]
            rows.append({
                "workload": f"{res['model']} {res['microbatch_size']}x{res['seq']}",
                "method": "NBP" if method == "nanobatch_perseus" else "Perseus",
                "model_version": res.get("model_version"),
                "time_fast": fast["time"],
                "slack": r["slack"],
                "clock_response": r["clock_response"],
                "energy_fast": fast["energy"],
                "effective_fast": fast["effective"],
            })
    counts: Counter[str] = Counter()
    for res in record["results"]:
        counts.update(check["verdict"] for _, check in artifact_check.verdicts(res))
    return {
        "path": str(path),
        "role": "fidelity",
        "what": "independent measurements: the method's A100 iterations (its artifact, "
                f"ml-energy/kareus {record['artifact']['commit'][:12]}) against "
                f"{artifact_check.DEVICE}",
        "date": record.get("date"),
        "model_versions": sorted(v for v in versions if v),
        "current_model_version": current,
        "stale": versions != {current},
        "rows": rows,
        "counts": dict(counts),
        "results": record["results"],
    }


def _check_cells(check: dict[str, Any], scale: float = 1.0, digits: int = 3) -> list[str]:
    """Measured, predicted (a range where the record bounds it) and the coloured error of one
    of ``artifact_check``'s judged comparisons."""
    predicted = check["predicted"]
    shown = (f"{scale * predicted[0]:.{digits}f}-{scale * predicted[1]:.{digits}f}"
             if isinstance(predicted, list) else f"{scale * predicted:.{digits}f}")
    error = (f"{check['error']:+.1%}" if check["relative"] else f"{check['error']:+.3f}")
    return [f"{scale * check['measured']:.{digits}f}", shown,
            f"[{VERDICT_STYLE[check['verdict']]}]{error}[/]"]


def artifact_table(points: dict[str, Any]) -> Table:
    table = Table(title="The method's A100 iterations (art: its lowtime plans over measured "
                  "profiles; NBP: Nanobatching + Perseus) against the simulated A100 (sim): "
                  "time at the fastest plan (1410 MHz), clock response T_slow/T_fast, energy "
                  "of the 16 GPUs at the fastest plan, the fastest plan's slack; time 10%, "
                  "ratios ±0.03, energy 15%", title_justify="left")
    for column in ("workload", "method", "Tfast s", "sim", "err", "Tslow/Tfast", "sim",
                   "err", "E16 kJ", "sim", "err", "slack sim", "err"):
        table.add_column(column, justify="left" if column in ("workload", "method")
                         else "right")
    for r in points["rows"]:
        table.add_row(r["workload"], r["method"], *_check_cells(r["time_fast"]),
                      *_check_cells(r["clock_response"]),
                      *_check_cells(r["energy_fast"], 1e-3, 2),
                      *_check_cells(r["slack"])[1:])
    return table


def print_artifact(console: Console, points: dict[str, Any]) -> None:
    versions = ", ".join(points["model_versions"]) or "unknown"
    console.print(f"[bold]Fidelity points[/]: {points['what']} ({points['path']} of "
                  f"{points['date']}, predicted by {versions})")
    console.print(artifact_table(points))
    counts = points["counts"]
    console.print(f"artifact fidelity checks: {sum(counts.values())} ({counts.get('PASS', 0)} "
                  f"PASS, {counts.get('FAIL', 0)} FAIL), every point and ratio of every plan")
    if points["stale"]:
        console.print(f"[yellow]stale[/]: predicted by {versions}, the model is now "
                      f"{points['current_model_version']}: these are the before; "
                      "--rerun-artifact (about 2 minutes) gives the after")


# --- main -----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", action="append", choices=preset_names(),
                        help="a preset to report (repeatable; default: all)")
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--h200", type=Path, default=H200_RECORD,
                        help="gpu_plan_check.py's record of an H200 (ignored where absent)")
    parser.add_argument("--h200-kernels", type=Path, default=H200_KERNELS,
                        help="gpu_check.py's record of an H200 (ignored where absent)")
    parser.add_argument("--artifact", type=Path, default=ARTIFACT_RECORD,
                        help="artifact_check.py's record (ignored where absent)")
    parser.add_argument("--rerun-artifact", action="store_true",
                        help="re-run artifact_check.py (about 2 minutes) into --artifact "
                        "first, predicting its points with the current model")
    args = parser.parse_args(argv)
    presets = args.preset or list(preset_names())
    start = time.perf_counter()
    console = Console(width=160)
    with fake_world(TP):
        rows = [point_row(p) for p in POINTS if p.preset in presets]
        points_s = time.perf_counter() - start
        reports = {preset: preset_report(preset) for preset in presets}

    console.print(points_table(rows))
    for r in rows:
        if r["verdict"] == "ERROR":
            console.print(f"[red]ERROR[/] {r['preset']} {r['quantity']} {r['what']}: "
                          f"{r['exception']}")
        elif r["known_miss"]:
            console.print(f"[yellow]{r['verdict']}[/] {r['preset']} {r['quantity']} "
                          f"{r['what']}: {r['known_miss']}")
    counts = Counter((r["role"], r["verdict"]) for r in rows)
    for role in ("input", "fidelity"):
        n = sum(c for (r, _), c in counts.items() if r == role)
        line = ", ".join(f"{counts[role, v]} {v}" for v in VERDICT_STYLE if counts[role, v])
        console.print(f"{role} points: {n} ({line})")

    args.out_dir.mkdir(parents=True, exist_ok=True)
    for preset, report in reports.items():
        for name, error in report["errors"].items():
            console.print(f"[red]ERROR[/] {preset} sweep of {name}: {error}")
        if not report["workloads"]:
            continue
        console.print(summary_table(preset, report))
        spec = SimulatedGPU(preset).spec
        console.print(sweep_table(preset, report, spec.search_step_mhz))
        plot(preset, report, args.out_dir / f"fidelity_{preset.removeprefix('sim:')}.png")
    measured = h200_measured(args.h200)
    if measured is not None:
        print_h200(console, measured)
    kernels = h200_kernels(args.h200_kernels)
    if kernels is not None:
        print_kernels(console, kernels)
    if args.rerun_artifact:
        artifact_check.main(["--out", str(args.artifact)])
    artifact = artifact_points(args.artifact)
    if artifact is not None:
        print_artifact(console, artifact)

    elapsed = time.perf_counter() - start
    record = {
        "torch": torch.__version__,
        "model_version": model_version(presets[0]),
        "counts": {f"{role}/{verdict}": n for (role, verdict), n in sorted(counts.items())},
        "points": rows,
        "presets": reports,
        "h200_default": measured,
        "h200_kernels": kernels,
        "artifact": None if artifact is None else {
            k: v for k, v in artifact.items() if k != "results"},
        "seconds": {"points": points_s, "total": elapsed},
    }
    out = args.out_dir / "fidelity.json"
    out.write_text(json.dumps(_jsonable(record), indent=2))
    console.print(f"wrote {out} and {len(reports)} PNG(s) in {elapsed:.1f} s")
    return 0


def _jsonable(record: dict[str, Any]) -> dict[str, Any]:
    """Tuples in params as lists; non-finite numbers as strings (JSON has neither)."""
    def fix(x: Any) -> Any:
        if isinstance(x, float) and not math.isfinite(x):
            return str(x)
        if isinstance(x, (list, tuple)):
            return [fix(v) for v in x]
        if isinstance(x, dict):
            return {k: fix(v) for k, v in x.items()}
        return x

    return fix(record)


if __name__ == "__main__":
    sys.exit(main())
