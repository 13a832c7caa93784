"""Planning in the backend (one process, fake process group, simulated GPU): the step's plan
under a budget, the forward switching to it at its next call, the stored plan of a second
run, the ``plan`` option, ``verify``."""

import json
import logging

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import kareus
from kareus.models.llama import Llama, LlamaConfig, parallelize_llama
from kareus.passes.reasons import ReasonKind
from kareus.planner.plan import Plan
from kareus.profiler import profile as profiling

# Large enough that the modelled GPU trades time for energy (a smaller one is mostly static
# power: its fastest plan is also its least-energy one).
CONFIG = LlamaConfig(dim=512, n_layers=1, n_heads=8, ffn_dim=1536, max_seq_len=128)
SEQ = 128


def _model():
    torch.manual_seed(0)
    return parallelize_llama(Llama(CONFIG), init_device_mesh("cpu", (2,)))


def _tokens(batch=8):
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, CONFIG.vocab_size, (batch, SEQ), generator=generator)


def _train(options, steps=2, batch=8, backend=None):
    """Losses and the clock switches the graphs asked for, and the backend."""
    torch._dynamo.reset()
    backend = backend or kareus.KareusBackend({"lowering": "eager", "device": "sim:h200",
                                               "search_budget": 8, **options})
    model = _model()
    compiled = torch.compile(model, backend=backend)
    recorder = kareus.RecordingClockController()
    losses = []
    with kareus.use_controller(recorder):
        for _ in range(steps):
            loss = compiled(_tokens(batch)).float().logsumexp(-1).mean()
            loss.backward()
            losses.append(loss.item())
    return losses, [(s.graph, s.mhz) for s in recorder.switches], backend


@pytest.fixture
def counted(monkeypatch):
    calls = []
    measure = profiling.measure_batch

    def counting(device, workloads, clock_mhz, **kwargs):
        calls.extend([clock_mhz] * len(workloads))
        return measure(device, workloads, clock_mhz, **kwargs)

    monkeypatch.setattr(profiling, "measure_batch", counting)
    return calls


def test_the_step_plan_meets_its_budget_and_the_forward_switches_to_it(fake_pg_numbers, tmp_path):
    _, _, fastest = _train({"nanobatches": "auto", "cache_dir": str(tmp_path / "a")}, steps=1)
    baseline = fastest.planner.plan.baseline
    assert fastest.planner.plan.predicted.time_s <= baseline.time_s  # the default: fastest
    # An absolute time budget: the forward alone cannot tell its share, so it starts at the
    # fastest choice, and runs the step plan's from its next call.
    budget_ms = 1.2e3 * baseline.time_s
    losses, switches, backend = _train(
        {"nanobatches": "auto", "cache_dir": str(tmp_path / "b"), "time_budget": f"{budget_ms} ms"},
        steps=3,
    )
    plan = kareus.current_plan()
    assert plan is backend.planner.plan and plan.budget.kind == "time"
    assert plan.measured is None  # a simulated device measures nothing
    assert plan.predicted.time_s <= budget_ms / 1e3
    assert plan.predicted.energy_j < baseline.energy_j  # slower, for less energy
    clock = {g.label: g.choice.clock_mhz for g in plan.graphs}  # 0: the default clocks
    _, backward = plan.graphs
    fw, bw = (g.label for g in plan.graphs)
    assert switches[:2] == [(fw, 0), (bw, clock[bw])]  # the forward started provisionally
    assert switches[2:] == [(fw, clock[fw]), (bw, clock[bw])] * 2
    reports = {r.label: r for r in backend.reports()}
    assert reports[fw].clock_mhz == clock[fw] and reports[bw].clock_mhz == clock[bw]
    # the backward, compiled with the plan, is estimated at its clock as the plan costed it
    # (measured from the default clock, its entry's switch would add a stall)
    estimate = reports[bw].estimate
    assert estimate.clock_mhz == (backward.choice.clock_mhz or 1980)
    assert estimate.time_s == pytest.approx(backward.time_s, rel=1e-9)
    reference, _, _ = _train({"profile": "off"}, steps=3)
    assert losses == pytest.approx(reference, rel=1e-5)


def test_a_second_run_profiles_nothing_and_compiles_only_what_runs(fake_pg, tmp_path,
                                                                 counted, monkeypatch):
    from kareus import backend as backend_module
    from kareus.runtime import materialise

    options = {"nanobatches": "auto", "cache_dir": str(tmp_path), "time_budget": 1.3}
    _train(options)
    assert counted  # the first run measured
    first = kareus.current_plan()
    counted.clear()
    lowered = []
    lower = backend_module.lower

    def counting(gm, inputs, lowering, **kwargs):
        lowered.append(gm)
        return lower(gm, inputs, lowering, **kwargs)

    monkeypatch.setattr(backend_module, "lower", counting)  # as first compiled
    monkeypatch.setattr(materialise, "lower", counting)  # switching to the plan's choice
    _, _, backend = _train(options)
    assert counted == []
    assert len(lowered) == 2  # the forward and the backward, each once: no switch
    second = backend.planner.plan
    assert [(g.graph_hash, g.choice) for g in second.graphs] == [
        (g.graph_hash, g.choice) for g in first.graphs
    ] and second.predicted == first.predicted
    assert all("(the stored plan)" in r.notes[-1] or "(the plan)" in r.notes[-1]
               for r in backend.reports())


def test_the_plan_option_runs_a_saved_plan_and_refuses_one_for_other_graphs(
    fake_pg, tmp_path, counted
):
    _train({"nanobatches": "auto", "cache_dir": str(tmp_path / "made"), "energy_budget": 0.97})
    path = kareus.current_plan().save(tmp_path / "plan.json")
    made = Plan.load(path)
    counted.clear()
    _, _, backend = _train({"plan": str(path), "cache_dir": str(tmp_path / "other")})
    assert counted == []  # nothing profiled: the plan says what runs
    assert kareus.current_plan() == made
    runs = {(r.key, r.choice) for r in backend.reports()}
    assert runs == {(g.graph_hash, g.choice) for g in made.graphs}
    with pytest.raises(Exception, match=r"the plan was made for another graph r\d+/forward: its"
                       r" hash is \w+, this graph \(r\d+/forward\)'s is \w+"):
        _train({"plan": str(path)}, batch=4)  # other shapes: other graphs
    (tmp_path / "bad.json").write_text('{"schema": 3}')
    with pytest.raises(kareus.KareusError, match="bad.json: missing fields graphs, predicted"):
        kareus.KareusBackend({"plan": str(tmp_path / "bad.json")})
    # checked against the device, the options and each graph's space before a graph runs
    with pytest.raises(Exception, match=r"plan.json: the plan was made on sim:h200 \(model "
                       r"sim-gpu-3 sim:h200\), this is sim:a100-sxm4-40gb \(model "):
        _train({"plan": str(path), "device": "sim:a100-sxm4-40gb"})
    with pytest.raises(kareus.KareusOptionError, match=r"microbatches=2 and plan='.*plan.json', "
                       "made with microbatches=1, contradict"):
        kareus.KareusBackend({"plan": str(path), "microbatches": 2})
    forward = next(r for r in backend.reports() if r.kind == "forward")
    k = forward.variants.nanobatches[-1]
    assert k > 1
    raw = json.loads(path.read_text())
    i = next(i for i, g in enumerate(raw["graphs"]) if g["graph_hash"] == forward.key)
    raw["graphs"][i]["choice"] = {"nanobatches": k, "clock_mhz": 0, "partitions": [
        [999, None] for _ in forward.variants.partitions(k)]}
    (tmp_path / "edited.json").write_text(json.dumps(raw))
    with pytest.raises(Exception, match=rf"edited.json: graphs\[{i}\] \(r\d+/forward\)"
                       r"\.choice\.partitions: not a variant of this graph: partition \d+: slot "
                       r"999 outside 0\.\.\d+; make a new plan") as info:
        _train({"plan": str(tmp_path / "edited.json")})
    assert "chooser" not in str(info.value)


def test_a_budget_no_plan_meets_says_what_the_plans_reach(fake_pg, tmp_path):
    with pytest.raises(Exception, match=r"no plan meets the energy budget 0.01 of the "
                       r"baseline's .* J per step: the plans reach .* to .* J"):
        _train({"nanobatches": "auto", "cache_dir": str(tmp_path), "energy_budget": 0.01})


def test_a_budget_every_plan_meets_runs_and_is_logged_as_changing_nothing(fake_pg, tmp_path,
                                                                         caplog):
    with caplog.at_level(logging.WARNING, logger="kareus"):
        _, _, backend = _train({"nanobatches": "auto", "cache_dir": str(tmp_path),
                                "energy_budget": 50}, steps=1)
    plan = backend.planner.plan
    assert plan.predicted == plan.frontier[0]  # the fastest, as without a budget
    assert any(r.getMessage().startswith("the energy budget 50 of the baseline's ")
               and "constrains nothing: every plan meets it" in r.getMessage()
               for r in caplog.records)


def test_verify_runs_a_wrong_rewrite_unrewritten(fake_pg_numbers, tmp_path, monkeypatch,
                                                 caplog):
    from kareus.runtime import materialise

    apply = materialise.apply

    def wrong(gm, analysis, choice, **kwargs):
        new = apply(gm, analysis, choice, **kwargs)
        if choice.variant is not None and analysis.kind == "forward":
            output = next(iter(new.graph.find_nodes(op="output")))
            first = output.args[0][0]
            with new.graph.inserting_before(output):
                doubled = new.graph.call_function(torch.ops.aten.mul.Tensor, (first, 2.0))
            output.args = ((doubled, *output.args[0][1:]),)
            new.recompile()
        return new

    monkeypatch.setattr(materialise, "apply", wrong)
    options = {"nanobatches": 2, "profile": "off", "verify": True}
    with caplog.at_level(logging.ERROR, logger="kareus"):
        losses, _, backend = _train(options, steps=2)
    reference, _, _ = _train({"profile": "off"}, steps=2)
    assert losses == pytest.approx(reference, rel=1e-5)  # the wrong rewrite never counted
    forward = next(r for r in backend.reports() if r.kind == "forward")
    assert forward.fallback.kind is ReasonKind.VERIFY_FAILED
    assert "differs from the unrewritten graph: output 0" in forward.fallback.detail
    assert any("verify" in r.getMessage() for r in caplog.records)
    backward = next(r for r in backend.reports() if r.kind == "backward")
    assert backward.fallback is None and backward.nanobatches == 2  # checked and right


def test_budget_options_are_checked_before_any_graph(fake_pg):
    with pytest.raises(kareus.KareusOptionError, match="give one budget"):
        kareus.KareusBackend({"energy_budget": 0.9, "time_budget": "1 s"})
    with pytest.raises(kareus.KareusOptionError, match="'time_budget': got '1 h'"):
        kareus.KareusBackend({"time_budget": "1 h"})
    assert kareus.KareusOptions.from_dict({"energy_budget": "350 J"}).budget.value == 350.0
    # what asks for a plan where none is made is refused, not ignored
    with pytest.raises(kareus.KareusOptionError, match='a budget needs a plan, and none is '
                       'made with profile="off"'):
        kareus.KareusBackend({"energy_budget": 0.9, "profile": "off"})
    with pytest.raises(kareus.KareusOptionError, match=r'a budget and nanobatches="auto" need '
                       r"a plan, and none is made with plan='p.json'"):
        kareus.KareusOptions(nanobatches="auto", time_budget=1.1, plan="p.json")
    with pytest.raises(kareus.KareusOptionError, match="a chooser or clock_mhz given in code"):
        kareus.KareusBackend({"nanobatches": "auto"}, clock_mhz=1200)
