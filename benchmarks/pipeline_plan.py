"""A pipeline planned as one against its stages planned alone, on the same pipeline and budget.

The scenario of the pipeline issue: PP2 x TP2 on 4 gloo ranks of this CPU,
``torch.distributed.pipelining`` (``PipelineStage``, ``Schedule1F1B`` or ``ScheduleGPipe``,
4 microbatches), each stage a tensor-parallel MLP block compiled with kareus on a
simulated GPU. kareus plans the iteration once across the stages (``pipeline_step``);
beside it, what the iteration costs when each stage plans alone (what kareus did before:
one choice per graph for its own step, ``pipeline_step.per_stage``), priced on the same
DAG, and the baseline. Every figure is the simulator's, per iteration of the pipeline
(energy summed over its 4 GPUs).

    python benchmarks/pipeline_plan.py [--device sim:h200] [--budget 1.1] [--schedule 1f1b]

Prints a table and writes ``benchmarks/results/pipeline_plan.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.multiprocessing as mp

RESULTS = Path(__file__).parent / "results" / "pipeline_plan.json"
MICROBATCHES, TOKENS, DIM = 4, 64, 512


class Block(torch.nn.Module):
    """A column-then-row parallel MLP: one all-reduce over the TP group per forward."""

    def __init__(self, group):
        super().__init__()
        self.up, self.down = torch.nn.Linear(DIM, 2 * DIM), torch.nn.Linear(2 * DIM, DIM)
        self.group = group

    def forward(self, x):
        return x + funcol.all_reduce(self.down(torch.relu(self.up(x))), "sum", self.group)


def _worker(rank: int, port: int, out: str, options: dict, schedule: str) -> None:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from kareus.backend import backend_for
    from kareus.planner.pipeline_step import per_stage

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=4)
    mesh = dist.device_mesh.init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    stage_index = mesh.get_local_rank("pp")
    torch.manual_seed(stage_index)
    module = torch.compile(Block(mesh.get_group("tp")), backend="kareus", options=options)
    stage = PipelineStage(module, stage_index, 2, torch.device("cpu"),
                          group=mesh.get_group("pp"))
    kind = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule]
    pipeline = kind(stage, n_microbatches=MICROBATCHES, loss_fn=lambda y, t: ((y - t) ** 2).mean())
    x = torch.randn(MICROBATCHES * TOKENS, DIM, generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        if stage_index == 0:
            pipeline.step(x)
        else:
            pipeline.step(target=torch.zeros_like(x), losses=[])
    backend = backend_for(options)
    planning, plan = backend.pipeline, backend.planner.plan
    result = None
    if rank == 0 and plan is not None and planning is not None and planning.posted:
        alone = per_stage(planning.shape, planning.posted, backend.options.budget,
                          backend.device)
        result = {"plan": json.loads(plan.to_json()),
                  "per_stage": {"time_s": alone.time_s, "energy_j": alone.energy_j}}
    Path(out, str(rank)).write_bytes(pickle.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="sim:h200")
    parser.add_argument("--budget", type=float, default=1.1,
                        help="time budget, a fraction of the baseline iteration")
    parser.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as out:
        options = {"device": args.device, "nanobatches": 2, "time_budget": args.budget,
                   "lowering": "eager", "cache_dir": cache, "search_budget": 8}
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(_worker, args=(port, out, options, args.schedule), nprocs=4,
                           start_method="spawn")
        result = pickle.loads(Path(out, "0").read_bytes())
    if result is None:
        print("the pipeline was not planned (see the log)", file=sys.stderr)
        return 1
    plan = result["plan"]
    rows = {"baseline (default clocks, unrewritten)": plan["baseline"],
            "each stage planned alone": result["per_stage"],
            "kareus: the pipeline planned as one": plan["predicted"]}
    base = plan["baseline"]
    print(f"PP2 x TP2, {args.schedule}, {MICROBATCHES} microbatches, time budget "
          f"{args.budget:g} of the baseline, on {plan['device']} (modelled)")
    print(f"{'plan':42} {'iteration ms':>13} {'energy J':>10} {'time':>7} {'energy':>7}")
    for name, cost in rows.items():
        print(f"{name:42} {cost['time_s'] * 1e3:13.4f} {cost['energy_j']:10.4f} "
              f"{cost['time_s'] / base['time_s']:7.3f} {cost['energy_j'] / base['energy_j']:7.3f}")
    clocks = sorted({i["clock_mhz"] for i in plan["instructions"]})
    counts = sorted({g["choice"]["nanobatches"] for i in plan["instructions"] for g in i["graphs"]})
    print(f"clocks of the instructions: {clocks} MHz (0: default); their k: {counts}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "scenario": {"pp": 2, "tp": 2, "schedule": args.schedule, "microbatches": MICROBATCHES,
                     "tokens_per_microbatch": TOKENS, "dim": DIM, "time_budget": args.budget,
                     "device": args.device, "modelled": "every figure is the simulated GPU's"},
        "baseline": plan["baseline"], "per_stage": result["per_stage"],
        "pipeline": plan["predicted"], "plan": plan,
    }, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
