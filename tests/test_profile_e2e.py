"""Profiling under torch.distributed: 2 gloo processes, the kareus backend, a simulated GPU.

Every rank of a partition's group ends with the same frontiers, also when one rank is slow
to compile and to measure; a second compile with the same store measures nothing; a rank
that does not profile costs the other no wait.
"""

import time

import pytest
import torch
import torch.distributed as dist
from gloo import AllReduceBlock, leave, report, run_ranks

pytestmark = pytest.mark.slow


def _worker(rank, port, out_dir, cache_dir, profile, delay_s, measure_delay_s):
    import kareus
    from kareus.profiler import profile as profiling

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        calls = []
        measure = profiling.measure_batch

        def slow_measure(device, workloads, clock_mhz, **kwargs):
            calls.extend([clock_mhz] * len(workloads))
            time.sleep(measure_delay_s[rank] * len(workloads))
            return measure(device, workloads, clock_mhz, **kwargs)

        profiling.measure_batch = slow_measure
        torch.manual_seed(0)
        model = AllReduceBlock(hidden=32)
        time.sleep(delay_s[rank])
        options = {
            "nanobatches": 2, "lowering": "eager", "device": "sim:a100-sxm4-40gb",
            "cache_dir": cache_dir, "profile": profile[rank], "search_budget": 12,
            "agreement_timeout_s": 60.0,
        }
        started = time.monotonic()
        compiled = torch.compile(model, backend="kareus", options=options)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
        compiled(x).sum().backward()
        reports = [(r.kind, r.nanobatches, r.profiles, r.notes) for r in kareus.graph_reports()]
        result = (reports, len(calls), time.monotonic() - started)
        report(out_dir, rank, result)
        dist.barrier()  # every rank done before any tears down (see kareus.demo._worker)
    finally:
        dist.destroy_process_group()
    leave()


def _run(cache_dir, profile=("auto", "auto"), delay_s=(0.0, 0.0), measure_delay_s=(0.0, 0.0)):
    return run_ranks(_worker, str(cache_dir), profile, delay_s, measure_delay_s)


def _frontiers(reports):
    return [
        (kind, p.key, p.evaluations, p.stopped, p.frontier, p.effective_frontier)
        for kind, _, profiles, _ in reports
        for p in profiles
    ]


def test_a_slow_rank_reaches_the_same_frontiers_and_a_second_run_measures_nothing(tmp_path):
    first = _run(tmp_path, delay_s=(0.0, 2.0), measure_delay_s=(0.0, 0.02))
    (reports0, calls0, _), (reports1, calls1, _) = first
    # both graphs profiled at 2 nanobatches; the plan, alike on both ranks, runs them split
    # or keeps one unrewritten where splitting does not pay
    assert [kind for kind, _, profiles, _ in reports0 if profiles] == ["forward", "backward"]
    assert [k for _, k, _, _ in reports0] == [k for _, k, _, _ in reports1]
    assert {k for _, k, _, _ in reports0} <= {1, 2}
    assert _frontiers(reports0) == _frontiers(reports1)
    assert _frontiers(reports0) and all(f for *_, f, _ in _frontiers(reports0))
    assert calls0 == calls1 > 0  # every evaluation measured on both ranks, in lockstep
    assert sum(p.measured for _, _, ps, _ in reports0 for p in ps) == calls0  # the leader's

    again = _run(tmp_path)
    for (reports, calls, _), before in zip(again, first, strict=True):
        assert calls == 0
        assert _frontiers(reports) == _frontiers(before[0])


def test_a_rank_that_does_not_profile_costs_no_wait(tmp_path):
    results = _run(tmp_path, profile=("auto", "off"))
    for reports, calls, seconds in results:
        assert calls == 0 and seconds < 30  # the agreement timeout is 60 s
        assert [(kind, k) for kind, k, _, _ in reports] == [("forward", 2), ("backward", 2)]
    (reports0, _, _), _ = results
    assert all(not profiles for _, _, profiles, _ in reports0)
    assert all(any("not profiled or planned: the ranks do not all profile" in n for n in notes)
               for _, _, _, notes in reports0)


def _nvml_worker(rank, port, out_dir, cache_dir):
    """A real device's path on each rank (the NVML meter on a fake driver, dry run)."""
    from fake_pynvml import FakeNvml
    from torch._subclasses.fake_tensor import FakeTensor

    import kareus
    from kareus.devices.nvml.gpu import NvmlGPU
    from kareus.profiler import workloads

    real_inputs = []  # whether each input a variant got was a real tensor
    random_like = workloads._random_like

    def recording(*args):
        tensor = random_like(*args)
        real_inputs.append(not isinstance(tensor, FakeTensor))
        return tensor

    workloads._random_like = recording
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        gpu = NvmlGPU(nvml_module=FakeNvml(), dry_run=True, cuda=False, min_window_s=0.02,
                      settle_s=0.0, reset_at_exit=False)
        backend = kareus.KareusBackend(
            {"nanobatches": 2, "lowering": "eager", "cache_dir": cache_dir, "search_budget": 3,
             "agreement_timeout_s": 60.0},
            device=gpu,
        )
        torch.manual_seed(0)
        model = AllReduceBlock()
        torch.compile(model, backend=backend)(torch.randn(4, 8)).sum().backward()
        report(out_dir, rank, ([r.profiles for r in backend.reports()], any(real_inputs)))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    leave()


def test_ranks_on_a_real_gpu_run_each_variant_together(tmp_path):
    """The variants run for real on both ranks, with their all-reduce, in windows each
    rank would size differently alone: they agree on every count, measure off the
    compiling thread (on it, the first warm-up's collective blocked both ranks), and
    reach the same frontiers."""
    (profiles0, real0), (profiles1, real1) = run_ranks(_nvml_worker, str(tmp_path))
    assert real0 and real1  # run on real tensors, not the compile's fake ones
    fronts = [[(p.key, p.stopped, p.frontier, p.effective_frontier) for p in graph]
              for graph in profiles0]
    assert fronts == [[(p.key, p.stopped, p.frontier, p.effective_frontier) for p in graph]
                      for graph in profiles1]
    assert [(p.error, p.evaluations) for graph in profiles0 for p in graph] == [(None, 3)] * 2
