"""Data-parallel replicas share their partition searches: 2 gloo processes, each a replica
whose collective runs over a process group of its own (tensor parallelism of one rank, the
smallest team), the kareus backend on a simulated GPU.

Each search is measured on one replica only and every replica ends with the same frontiers;
a replica that compiles late measures nothing; a second run measures nothing either. On a
device that must run a graph to cost it (as a real GPU), the whole graphs' clocks are dealt
among the replicas too, the chosen point is checked once, and both plan alike.
"""

import time
from typing import ClassVar

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from gloo import leave, report, run_ranks

pytestmark = pytest.mark.slow


class OwnGroupBlock(torch.nn.Module):
    """A block whose all-reduce runs over this rank's own group: each rank a replica."""

    def __init__(self, group: dist.ProcessGroup):
        super().__init__()
        self.group = group
        self.a, self.b = torch.nn.Linear(8, 32), torch.nn.Linear(32, 8)

    def forward(self, x):
        return self.b(torch.relu(funcol.all_reduce(self.a(x), "sum", self.group)))


def _worker(rank, port, out_dir, cache_dir, delay_s, measures_graphs=False):
    import kareus
    from kareus.devices import SimulatedGPU
    from kareus.profiler import profile as profiling

    class MeasuringGPU(SimulatedGPU):
        """Costs a graph only by running it, as a real GPU; logs what it runs."""

        costs_graphs = False
        log: ClassVar[list[tuple[str, int, bool]]] = []  # (variant, clock, a check)

        def estimate(self, gm, world_size=1):
            return None

        def estimate_at(self, gm, clocks, world_size=1):
            return None

        checking = False

        def measure(self, workload, clock_mhz, *, resources=None):
            self.log.append((workload.name, clock_mhz, self.checking))
            return super().measure(workload, clock_mhz, resources=resources)

        def check(self, workload, clock_mhz):
            self.checking = True
            try:
                return super().check(workload, clock_mhz)
            finally:
                self.checking = False

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        groups = [dist.new_group([r]) for r in range(2)]  # every rank makes every group
        calls = []
        measure = profiling.measure_batch

        def counting(device, workloads, clock_mhz, **kwargs):
            calls.extend([clock_mhz] * len(workloads))
            time.sleep(0.01 * len(workloads))  # both replicas are searching at once
            return measure(device, workloads, clock_mhz, **kwargs)

        profiling.measure_batch = counting
        torch.manual_seed(0)
        model = OwnGroupBlock(groups[rank])
        time.sleep(delay_s[rank])
        options = {
            "nanobatches": "auto", "lowering": "eager", "device": "sim:a100-sxm4-40gb",
            "cache_dir": f"{cache_dir}/{rank}", "search_budget": 12,
            "agreement_timeout_s": 60.0,
        }
        if measures_graphs:
            del options["device"]
            device = MeasuringGPU("sim:a100-sxm4-40gb")
            backend = kareus.KareusBackend(options, device=device)
        else:
            backend = "kareus"
        compiled = torch.compile(model, backend=backend,
                                 options=None if measures_graphs else options)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
        compiled(x).sum().backward()
        compiled(x).sum().backward()  # the first call measured and planned; this one runs it
        profiles = [(r.kind, p.key, p.nanobatches, p.evaluations, p.measured, p.frontier)
                    for r in kareus.graph_reports() for p in r.profiles]
        if measures_graphs:
            whole = [m for m in MeasuringGPU.log if not m[0].startswith("partition ")]
            plan = kareus.current_plan()
            report(out_dir, rank, (profiles, len(calls), whole,
                                   [(g.label, g.choice) for g in plan.graphs]))
        else:
            report(out_dir, rank, (profiles, len(calls)))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    leave()


def _frontiers(profiles):
    return [(kind, key, k, evaluations, frontier)
            for kind, key, k, evaluations, _, frontier in profiles]


def test_replicas_measure_disjoint_searches_and_end_with_the_same_frontiers(tmp_path):
    (profiles0, calls0), (profiles1, calls1) = run_ranks(_worker, str(tmp_path), (0.0, 0.0))
    assert _frontiers(profiles0) == _frontiers(profiles1)
    assert len(profiles0) >= 4 and all(p[-1] for p in profiles0)  # k=2 and k=4, fwd and bwd
    for mine, theirs in zip(profiles0, profiles1, strict=True):
        evaluations = mine[3]
        assert sorted([mine[4], theirs[4]]) == [0, evaluations]  # one replica measured it
    total = sum(p[3] for p in profiles0)
    assert calls0 + calls1 == total and calls0 and calls1  # shared, nothing twice

    # a replica that compiles late claims what is left (searches join a schedule at a
    # pass's start), and still nothing is measured twice; each store now holds its
    # searches, so a second run measures nothing
    (late0, c0), (late1, c1) = run_ranks(_worker, str(tmp_path / "late"), (0.0, 3.0))
    assert c0 + c1 == total and c0 >= c1
    assert _frontiers(late0) == _frontiers(late1) == _frontiers(profiles0)
    again = run_ranks(_worker, str(tmp_path / "late"), (0.0, 0.0))
    assert [calls for _, calls in again] == [0, 0]


def test_replicas_deal_whole_graph_clocks_and_check_the_chosen_point_once(tmp_path):
    results = run_ranks(_worker, str(tmp_path), (0.0, 0.0), True)
    (profiles0, _, whole0, plan0), (profiles1, _, whole1, plan1) = results
    assert _frontiers(profiles0) == _frontiers(profiles1)
    assert plan0 == plan1 and plan0  # every replica plans from the same measurements
    # both measured, and no variant at any clock (nor any chosen point's check) was
    # measured by both
    assert whole0 and whole1 and any(check for *_, check in whole0 + whole1)
    assert not set(whole0) & set(whole1), sorted(set(whole0) & set(whole1))
