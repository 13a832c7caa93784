"""The step's plan under torch.distributed: 2 gloo processes, one slow to compile, make and
run the same plan (the ranks agree on it through the store)."""

import time

import pytest
import torch
import torch.distributed as dist
from gloo import AllReduceBlock, leave, report, run_ranks

pytestmark = pytest.mark.slow


def _worker(rank, port, out_dir, cache_dir):
    import kareus

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = AllReduceBlock(hidden=512)
        time.sleep(2.0 * rank)  # rank 1 compiles late
        options = {
            "nanobatches": "auto", "lowering": "eager", "device": "sim:a100-sxm4-40gb",
            "cache_dir": cache_dir, "search_budget": 8, "time_budget": 1.5,
            "agreement_timeout_s": 60.0,
        }
        compiled = torch.compile(model, backend="kareus", options=options)
        recorder = kareus.RecordingClockController()
        x = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
        with kareus.use_controller(recorder):
            for _ in range(2):
                compiled(x).sum().backward()
        plan = kareus.current_plan()
        reports = [(r.label, r.nanobatches, r.clock_mhz, r.variant) for r in kareus.graph_reports()]
        report(out_dir, rank, (plan.to_json() if plan else None, reports,
                               [(s.graph, s.mhz) for s in recorder.switches]))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    leave()


def test_both_ranks_make_and_run_the_same_plan(tmp_path):
    (plan0, reports0, switches0), (plan1, reports1, switches1) = run_ranks(_worker, str(tmp_path))
    assert plan0 is not None and plan0 == plan1
    assert reports0 == reports1 and switches0 == switches1
    assert '"kind": "time"' in plan0
