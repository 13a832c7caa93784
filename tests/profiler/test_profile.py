"""Partition profiling on one process (fake process group, simulated GPU): searched once per
structural key, committed to the store as measured, read back instead of measured again."""

import itertools
import logging
import shutil
import subprocess
import sys
import time

import pytest
import torch
from conftest import analysed, tp_llama
from gloo import AllReduceBlock

from kareus import KareusBackend
from kareus.devices import SimulatedGPU
from kareus.profiler import profile as profiling
from kareus.profiler.profile import Settings, profile_graph
from kareus.profiler.store import FILENAME, LOCK_WAIT_S, ProfileKey, ProfileStore

GPU = "sim:a100-sxm4-40gb"


@pytest.fixture
def counted(monkeypatch):
    """Every measurement the profiler takes, as (workload, clock)."""
    calls = []
    measure = profiling.measure_batch

    def counting(device, workloads, clock_mhz, **kwargs):
        calls.extend((workload.name, clock_mhz) for workload in workloads)
        return measure(device, workloads, clock_mhz, **kwargs)

    monkeypatch.setattr(profiling, "measure_batch", counting)
    return calls


@pytest.fixture
def graphs(fake_pg):
    return [a for _, a in analysed(tp_llama(1), torch.randint(0, 100, (4, 16)))]


def _profile(graphs, store, **settings):
    gpu = SimulatedGPU(GPU)
    return [
        p for a in graphs
        for p in profile_graph(a, (2,), gpu, store, Settings(**settings), prefix=a.label)
    ]


def test_each_distinct_partition_is_searched_once_into_the_store(graphs, tmp_path, counted):
    with ProfileStore(cache_dir=tmp_path) as store:
        profiles = _profile(graphs, store, budget=10)
        keys = [p.key for p in profiles]
        assert len(keys) == len(set(keys)) and any(len(p.partitions) > 1 for p in profiles)
        assert sum(p.measured for p in profiles) == len(counted) == sum(
            p.evaluations for p in profiles
        )
        for p in profiles:
            assert p.error is None and 0 < p.evaluations <= 10 and p.frontier
            recorded = store.keys()
            (key,) = [k for k in recorded if k.partition_key == p.key]
            stored = store.evaluations(key)
            assert len(stored) == p.evaluations  # committed as measured
            # the frontier is that of everything measured, each point with its knobs
            times = {e.knobs: e.measurement.time_s for e in stored}
            assert [f.time_s for f in p.frontier] == sorted(times[f.knobs] for f in p.frontier)
            assert p.model_version == "sim-gpu-3 sim:a100-sxm4-40gb"
            assert key == ProfileKey(p.key, GPU, p.model_version, key.clocks, 2)


def test_a_grid_measures_every_variant_once_and_is_replayed_from_the_store(
    graphs, tmp_path, counted
):
    with ProfileStore(cache_dir=tmp_path) as store:
        profiles = _profile(graphs, store, budget=3, strategy="grid")
        assert all(p.error is None and p.stopped == "exhausted" for p in profiles)
        assert [p.evaluations for p in profiles] == [p.space_size for p in profiles]
        assert len(counted) == len(set(counted)) == sum(p.space_size for p in profiles)
        assert any(p.space_size > 3 for p in profiles)  # the budget is not the grid's
        measured = len(counted)
        again = _profile(graphs, store, budget=3, strategy="grid")
        assert len(counted) == measured and all(p.measured == 0 for p in again)
        assert [p.frontier for p in again] == [p.frontier for p in profiles]


def test_a_search_measures_every_third_clock_and_the_last_the_grid_every_clock(
    graphs, tmp_path, counted
):
    """A Bayesian search measures at ``partition_clocks`` only (the planner predicts the
    clocks between and costs what it composes as whole graphs); the grid, the ground
    truth, at every clock."""
    clocks = SimulatedGPU(GPU).search_clocks()
    coarse = profiling.partition_clocks(clocks)
    assert coarse == (*clocks[::3], clocks[-1]) or coarse == clocks[::3]
    assert coarse[0] == clocks[0] and coarse[-1] == clocks[-1] and len(coarse) < len(clocks)
    assert profiling.partition_clocks((1410, 1380, 1350)) == (1410, 1350)
    with ProfileStore(cache_dir=tmp_path / "search") as store:
        searched = _profile(graphs, store, budget=40)
    measured_at = {clock for _, clock in counted}
    assert measured_at <= set(coarse) and {clocks[0], clocks[-1]} <= measured_at
    assert all(p.space_size % len(coarse) == 0 for p in searched)
    counted.clear()
    with ProfileStore(cache_dir=tmp_path / "grid") as store:
        _profile(graphs, store, budget=3, strategy="grid")
    assert {clock for _, clock in counted} == set(clocks)


def test_a_second_profile_with_the_same_store_measures_nothing(graphs, tmp_path, counted):
    with ProfileStore(cache_dir=tmp_path) as store:
        first = _profile(graphs, store, budget=10)
    measured = len(counted)
    with ProfileStore(cache_dir=tmp_path) as store:
        again = _profile(graphs, store, budget=10)
    assert len(counted) == measured and all(p.measured == 0 for p in again)
    assert [(p.key, p.frontier, p.effective_frontier) for p in again] == [
        (p.key, p.frontier, p.effective_frontier) for p in first
    ]
    with ProfileStore(cache_dir=tmp_path) as store:
        refreshed = _profile(graphs, store, budget=10, mode="refresh")
    assert len(counted) == 2 * measured and sum(p.measured for p in refreshed) == measured


def test_a_search_cut_short_resumes_from_the_store(graphs, tmp_path, counted, monkeypatch):
    graph = graphs[:1]
    with ProfileStore(cache_dir=tmp_path) as store:
        complete = _profile(graph, store, budget=10, seed=1)
    total = len(counted)
    resumed_dir = tmp_path / "crash"
    with ProfileStore(cache_dir=resumed_dir) as store:
        measure = profiling.measure_batch

        def failing(*args, **kwargs):
            if len(counted) >= total + 4:
                raise RuntimeError("GPU fell off the bus")
            return measure(*args, **kwargs)

        monkeypatch.setattr(profiling, "measure_batch", failing)
        crashed = _profile(graph, store, budget=10, seed=1)
    before = len(counted) - total  # the rounds measured before the crash: at least 4
    assert before >= 4
    assert all(p.error == "RuntimeError: GPU fell off the bus" and not p.frontier
               for p in crashed)
    monkeypatch.setattr(profiling, "measure_batch", measure)
    with ProfileStore(cache_dir=resumed_dir) as store:
        resumed = _profile(graph, store, budget=10, seed=1)
    assert len(counted) == 2 * total  # some before the crash, the rest after it
    assert sum(p.measured for p in resumed) == sum(p.evaluations for p in complete) - before
    assert [p.frontier for p in resumed] == [p.frontier for p in complete]


def test_off_and_unsplit_counts_profile_nothing(graphs, tmp_path, counted):
    with ProfileStore(cache_dir=tmp_path) as store:
        assert _profile(graphs, store, mode="off") == []
        gpu = SimulatedGPU(GPU)
        assert profile_graph(graphs[0], (1,), gpu, store, Settings(), prefix="x") == ()
    assert counted == []


def test_frontiers_are_pareto_sets_of_measured_points(graphs, tmp_path):
    with ProfileStore(cache_dir=tmp_path) as store:
        for p in _profile(graphs, store, budget=12):
            for front, energy in ((p.frontier, "energy_j"), (p.effective_frontier,
                                                             "effective_energy_j")):
                values = [(f.time_s, getattr(f, energy)) for f in front]
                assert values == sorted(values)
                assert all(e0 > e1 for (_, e0), (_, e1) in itertools.pairwise(values))


def test_a_profiled_store_is_whole_in_its_file(graphs, tmp_path):
    """Profiled and closed, the store is its .sqlite file alone, though another rank still
    has it open: copied without its -wal, it holds every evaluation."""
    with ProfileStore(cache_dir=tmp_path) as other_rank:
        with ProfileStore(cache_dir=tmp_path) as store:
            profiles = _profile(graphs, store, budget=4)
        (tmp_path / "copy").mkdir()
        shutil.copy2(tmp_path / FILENAME, tmp_path / "copy" / FILENAME)
        other_rank.keys()
    with ProfileStore(cache_dir=tmp_path / "copy") as moved:
        keys = moved.keys()
        assert sorted(k.partition_key for k in keys) == sorted(p.key for p in profiles)
        assert sum(len(moved.evaluations(k)) for k in keys) == sum(
            p.evaluations for p in profiles
        ) > 0


_HOLDER = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN EXCLUSIVE")
print("held", flush=True)
sys.stdin.read()
"""


def test_a_locked_store_is_said_once_and_profiling_goes_on_without_it(
    graphs, tmp_path, counted, caplog
):
    """Another process holding the store's write lock costs one wait for the whole graph,
    not one per partition (30 s each, before): every partition is measured, nothing is
    kept."""
    path = tmp_path / FILENAME
    ProfileStore(path).close()
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(path)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    waited = []
    try:
        assert holder.stdout.readline() == "held\n"
        with caplog.at_level(logging.WARNING, logger="kareus"), ProfileStore(path) as store:
            for name in ("lookup", "record", "search", "record_search"):
                method = getattr(store, name)

                def timed(*args, _method=method, **kwargs):
                    start = time.monotonic()
                    try:
                        return _method(*args, **kwargs)
                    finally:
                        waited.append(time.monotonic() - start)

                setattr(store, name, timed)
            profiles = _profile(graphs, store, budget=4)
    finally:
        holder.communicate(timeout=30)
    assert len(profiles) > 1 and all(p.error is None and p.frontier for p in profiles)
    assert sum(p.measured for p in profiles) == len(counted) > 0
    assert LOCK_WAIT_S <= sum(waited) < LOCK_WAIT_S + 2
    [warning] = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert f"profile store {path} is locked by process {holder.pid}" in warning
    with ProfileStore(path) as store:
        assert store.keys() == []


def test_the_backend_profiles_once_per_store(fake_pg, tmp_path, counted):
    options = {"nanobatches": 2, "lowering": "eager", "device": GPU,
               "cache_dir": str(tmp_path), "search_budget": 8, "seed": 5}
    x = torch.randint(0, 100, (4, 16))

    def compile_and_run(**extra):
        backend = KareusBackend({**options, **extra})
        torch.compile(tp_llama(1), backend=backend)(x).sum().backward()
        torch._dynamo.reset()
        return backend.reports()

    first = compile_and_run()
    profiles = [p for r in first for p in r.profiles]
    assert profiles and all(p.evaluations <= 8 and p.error is None for p in profiles)
    assert len(counted) == sum(p.measured for p in profiles) > 0
    measured = len(counted)
    second = compile_and_run()
    assert len(counted) == measured
    assert [r.profiles for r in second] == [
        tuple(pr.__class__(**{**vars(pr), "measured": 0, "gpu_s": 0.0}) for pr in r.profiles)
        for r in first
    ]
    assert all(p.gpu_s > 0 for r in first for p in r.profiles)
    assert all(not r.profiles for r in compile_and_run(profile="off"))
    assert len(counted) == measured


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
def test_a_real_gpu_runs_each_variant_under_the_protocol(graphs, tmp_path, lowering):
    """The NVML path on a fake driver: each variant is lowered, run on real tensors in
    windows the energy counter is read around, repeated, at clocks the controller locks;
    the clocks are back at default afterwards."""
    from fake_pynvml import FakeNvml

    from kareus.codegen.lowering import lower
    from kareus.devices.nvml.gpu import NvmlGPU
    from kareus.profiler.measure import Protocol

    fake = FakeNvml()
    with NvmlGPU(nvml_module=fake, cuda=False, min_window_s=0.002, settle_s=0.0,
                 reset_at_exit=False) as gpu, ProfileStore(cache_dir=tmp_path) as store:
        windows = []
        measure = gpu.measure

        def measured(workload, clock_mhz, **kwargs):
            windows.append(clock_mhz)
            return measure(workload, clock_mhz, **kwargs)

        gpu.measure = measured
        settings = Settings(budget=3, protocol=Protocol(repeats=2, max_spread=10.0))
        profiles = profile_graph(
            graphs[0], (2,), gpu, store, settings, prefix="fw",
            lower=lambda gm, inputs: lower(gm, inputs, lowering),
        )
        gpu.clock_controller().reset()
        assert all(p.error is None and p.evaluations == 3 for p in profiles)
        assert len(windows) == 2 * 3 * len(profiles)  # two repeats per evaluation
        locked = [c.args[1] for c in fake.calls if c.name == "nvmlDeviceSetGpuLockedClocks"]
        assert set(windows) - {1410} <= set(locked) <= set(windows)  # 1410: the default
        assert fake.gpus[0].locked is None  # back at default clocks
        for point in (point for p in profiles for point in p.frontier):
            # the fake board draws 300 W: energy is the counter read around real runs
            assert point.energy_j / point.time_s == pytest.approx(2 * 300.0, rel=0.25)


def test_the_backend_compiles_and_measures_variants_on_a_real_gpu(fake_pg, tmp_path,
                                                                  fresh_runtime):
    """Variants are compiled by Inductor while a training graph compiles (a nested
    compile with its own context) and run for real on the NVML path (fake driver)."""
    from fake_pynvml import FakeNvml

    from kareus.devices.nvml.gpu import NvmlGPU
    from kareus.passes.ops import DEFAULT_CLOCK_MHZ
    from kareus.profiler.measure import Protocol

    fake = FakeNvml()
    with NvmlGPU(nvml_module=fake, cuda=False, min_window_s=0.002, settle_s=0.0,
                 reset_at_exit=False) as gpu:
        windows = []
        measure = gpu.measure
        gpu.measure = lambda *args, **kwargs: windows.append(args) or measure(*args, **kwargs)
        backend = KareusBackend(
            {"nanobatches": 2, "cache_dir": str(tmp_path), "search_budget": 2}, device=gpu,
            protocol=Protocol(repeats=2, max_spread=10.0),
            clock_mhz=DEFAULT_CLOCK_MHZ,  # a policy in code: profiled, not planned
        )
        model, x = AllReduceBlock(), torch.randn(4, 8)
        torch.compile(model, backend=backend)(x).sum().backward()
        profiles = [p for r in backend.reports() for p in r.profiles]
        assert [p.error for p in profiles] == [None, None]  # forward and backward
        assert all(p.measured == 2 and p.device == "nvml:NVIDIA A100-SXM4-40GB"
                   for p in profiles)
        assert len(windows) == 2 * 2 * 2  # the backend's protocol: 2 repeats
        assert fake.gpus[0].locked is None  # profiling left the default clocks


def test_a_real_gpu_measures_a_capped_collective_on_a_capped_communicator(fake_pg, tmp_path,
                                                                          monkeypatch):
    """Where the backend can cap a collective's CTAs (NCCL), a real GPU searches the caps:
    each is a sub-communicator the team makes when it first measures it, and the variant's
    collective is issued on it."""
    import torch.distributed as dist
    from fake_pynvml import FakeNvml

    from kareus.devices.nvml.gpu import NvmlGPU
    from kareus.passes import variants
    from kareus.profiler.measure import Protocol
    from kareus.runtime.communicators import Communicators

    monkeypatch.setattr(variants, "resource_choices", lambda kind, backend: (None, 4))
    (_, analysis), _ = analysed(AllReduceBlock(), torch.randn(4, 8))
    made = []

    def make_group(group_name, max_ctas):
        made.append((group_name, max_ctas))
        return dist.new_group([0, 1], use_local_synchronization=True).group_name

    issued_on = []
    run_workload = profiling.partition_workload

    def recording(*args, group_name=None, **kwargs):
        issued_on.append(group_name)
        return run_workload(*args, group_name=group_name, **kwargs)

    monkeypatch.setattr(profiling, "partition_workload", recording)
    with NvmlGPU(nvml_module=FakeNvml(), cuda=False, min_window_s=0.002, settle_s=0.0,
                 reset_at_exit=False) as gpu, ProfileStore(cache_dir=tmp_path) as store:
        settings = Settings(budget=12, protocol=Protocol(repeats=1))
        (profile,) = profile_graph(analysis, (2,), gpu, store, settings, prefix="fw",
                                   communicators=Communicators(make_group))
        gpu.clock_controller().reset()
        (key,) = store.keys()
        caps = [sms for e in store.evaluations(key) for _, sms in e.knobs.resources]
    assert profile.error is None and profile.measured == 12
    clocks = profiling.partition_clocks(gpu.search_clocks())
    assert profile.space_size == 2 * 2 * len(clocks)  # slots x caps x clocks
    assert made == [(analysis.collectives[0].group_name, 4)]  # made once, when first measured
    (capped,) = {name for name in issued_on if name is not None}
    assert capped != analysis.collectives[0].group_name and caps and set(caps) == {4}


def test_a_partition_whose_variant_cannot_be_built_is_given_up_alone(graphs, tmp_path,
                                                                     monkeypatch):
    build, broken = profiling.partition_workload, []

    def failing(partition, *args, **kwargs):
        broken[:] = broken or [partition]  # the first partition built
        if partition is broken[0]:
            raise ValueError("no variant at this slot")
        return build(partition, *args, **kwargs)

    monkeypatch.setattr(profiling, "partition_workload", failing)
    with ProfileStore(cache_dir=tmp_path) as store:
        profiles = profile_graph(graphs[0], (2,), SimulatedGPU(GPU), store, Settings(budget=4),
                                 prefix="fw")
    failed = [p for p in profiles if p.error is not None]
    assert len(failed) == 1 and failed[0].error == "ValueError: no variant at this slot"
    assert not failed[0].frontier and failed[0].stopped == "failed"
    others = [p for p in profiles if p.error is None]
    assert others and all(p.frontier and p.evaluations == 4 for p in others)


def test_graphs_searched_together_share_rounds_and_find_what_each_finds_alone(
        graphs, tmp_path, monkeypatch):
    """A step's graphs searched side by side (as on a real GPU at their first calls): a
    round at one clock holds every graph's proposals there, each search finds what it finds
    alone, and a partition two graphs hold is searched once (the second reads it back)."""
    rounds = []
    measure = profiling.measure_batch

    def counting(device, workloads, clock_mhz, **kwargs):
        rounds.append(clock_mhz)
        return measure(device, workloads, clock_mhz, **kwargs)

    monkeypatch.setattr(profiling, "measure_batch", counting)
    gpu, settings = SimulatedGPU(GPU), Settings(budget=6)
    alone = []
    for i, a in enumerate(graphs):
        with ProfileStore(cache_dir=tmp_path / f"alone{i}") as store:
            alone.append(profile_graph(a, (2,), gpu, store, settings, prefix=a.label))
    separate = len(rounds)
    rounds.clear()
    searched = [profiling.Searched(a, (2,)) for a in graphs]
    with ProfileStore(cache_dir=tmp_path / "together") as store:
        together = profiling.profile_graphs(searched, gpu, store, settings, prefix="step")
    assert [[p.frontier for p in ps] for ps in together] == [[p.frontier for p in ps]
                                                              for ps in alone]
    assert [[p.measured for p in ps] for ps in together] == [[p.measured for p in ps]
                                                              for ps in alone]
    assert len(rounds) < separate
    # the same graph twice: its partitions searched once, the second time read back
    rounds.clear()
    with ProfileStore(cache_dir=tmp_path / "twice") as store:
        first, second = profiling.profile_graphs(searched[:1] * 2, gpu, store, settings,
                                                 prefix="twice")
    assert [p.frontier for p in first] == [p.frontier for p in second]
    assert sum(p.measured for p in first) > 0 and sum(p.measured for p in second) == 0


@pytest.mark.parametrize("cuda", [True, False])
def test_searches_run_on_the_callers_cuda_device(monkeypatch, cuda):
    """torch keeps the current CUDA device per thread: the searches' thread takes the
    compiling thread's, else its streams, events and synchronizes would be device 0's."""
    import threading

    local = threading.local()  # each thread's current device, as CUDA keeps it
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: getattr(local, "device", 0))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: setattr(local, "device", d))
    torch.cuda.set_device(3)  # the rank's GPU, set on the compiling thread
    seen = []

    def searches():
        seen.append((threading.current_thread().name, torch.cuda.current_device()))
        return [()]

    assert profiling._outside_the_compile(searches) == [()]
    assert seen == [("kareus-profile", 3 if cuda else 0)]
