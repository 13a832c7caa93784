"""A user's path from a training job to a saving: the name alone plans, options from the
environment, one process without torch.distributed, and errors when the backend is built."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import torch.distributed as dist

import kareus
from kareus import KareusBackend
from kareus.devices.errors import GPUSpecError
from kareus.options import KareusOptionError, KareusOptions
from kareus.planner.budget import BudgetError
from kareus.planner.plan import PlanError


class Wide(torch.nn.Module):
    """Big enough that a clock below the top saves energy on the simulated A100."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(1024, 4096)
        self.down = torch.nn.Linear(4096, 1024)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _step(options, *, backend=None):
    """One process, no process group: compile ``Wide`` and run two steps against eager."""
    assert not dist.is_initialized()
    torch.manual_seed(0)
    model, reference = Wide(), Wide()
    reference.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend=backend or KareusBackend(options))
    x = torch.randn(512, 1024)
    for _ in range(2):
        compiled(x).square().mean().backward()
        reference(x).square().mean().backward()
    torch.testing.assert_close(compiled(x), reference(x), rtol=0, atol=0)
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=0, atol=0)
    return kareus.current_plan()


ON_A100 = {"device": "sim:a100-sxm4-40gb", "lowering": "eager"}


@pytest.mark.parametrize("budget", [{"time_budget": 1.2}, {"energy_budget": 0.97},
                                    {"time_budget": "1 s"}, {"energy_time_tradeoff": 0.5},
                                    {"energy_time_tradeoff": 0.0}, {}])
def test_one_process_without_distributed_plans_every_budget(fresh_runtime, budget):
    plan = _step({**ON_A100, **budget})
    assert plan is not None, "nothing planned"
    predicted, baseline = plan.predicted, plan.baseline
    kind = plan.budget.kind
    if kind == "time":
        limit = plan.budget.value or plan.budget.fraction * baseline.time_s
        assert predicted.time_s <= limit
    elif kind == "energy":
        assert predicted.energy_j <= plan.budget.fraction * baseline.energy_j
    else:  # a trade-off is never worse than the baseline in both time and energy
        assert kind == "tradeoff"
        assert predicted.time_s <= baseline.time_s or predicted.energy_j <= baseline.energy_j
    assert predicted.energy_j <= baseline.energy_j or kind == "tradeoff"


def test_the_bare_name_plans_the_least_energy_at_the_baselines_time(fresh_runtime, caplog):
    with caplog.at_level(logging.INFO, logger="kareus"):
        model = Wide()
        torch.compile(model, backend="kareus")(torch.randn(64, 1024)).sum().backward()
    plan = kareus.current_plan()
    assert plan is not None
    assert (plan.budget.kind, plan.budget.fraction) == ("time", 1.0)
    assert plan.predicted.time_s <= plan.baseline.time_s
    assert plan.predicted.energy_j <= plan.baseline.energy_j
    said = [r for r in caplog.records if "change it with" in r.getMessage()]
    assert len(said) == 1, "said once"
    assert said[0].levelno == logging.WARNING  # nothing was asked: say it loudly
    assert "the least energy with time <= 1 of the baseline" in said[0].getMessage()
    assert "KAREUS_OPTIONS" in said[0].getMessage()


def test_without_profiling_and_nanobatches_it_is_plain_inductor(fresh_runtime):
    backend = KareusBackend({"nanobatches": 1, "profile": "off"})
    torch.compile(Wide(), backend=backend)(torch.randn(8, 1024)).sum().backward()
    reports = backend.reports()
    assert [r.kind for r in reports] == ["forward", "backward"]
    assert all(r.choice.nanobatches == 1 and r.choice.clock_mhz == 0 and not r.notes
               for r in reports)
    # the defaults follow: profiling off alone plans nothing and asks for no budget
    assert KareusOptions(profile="off").nanobatches == 1
    assert KareusOptions(profile="off").budget.kind == "fastest"


def test_world_size_one_with_a_process_group_plans(fresh_runtime, tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1),
                            rank=0, world_size=1)
    try:
        model = Wide()
        compiled = torch.compile(model, backend=KareusBackend({**ON_A100, "time_budget": 1.2}))
        compiled(torch.randn(512, 1024)).sum().backward()
    finally:
        dist.destroy_process_group()
    assert kareus.current_plan() is not None


# -- options without code ---------------------------------------------------------------


def test_environment_options_layer_under_code(tmp_path):
    file = tmp_path / "kareus.toml"
    file.write_text('lowering = "eager"\nsearch_budget = 8\ntime_budget = 1.1\n')
    environ = {"KAREUS_OPTIONS_FILE": str(file),
               "KAREUS_OPTIONS": json.dumps({"search_budget": 16, "seed": 3})}
    options = KareusOptions.resolve({"seed": 4, "energy_budget": 0.9}, environ=environ)
    assert (options.lowering, options.search_budget, options.seed) == ("eager", 16, 4)
    # a budget given in code replaces the file's (two budgets are no error across layers)
    assert (options.energy_budget, options.time_budget) == (0.9, None)
    assert options.sources["lowering"] == f"$KAREUS_OPTIONS_FILE ({file})"
    assert options.sources["search_budget"] == "$KAREUS_OPTIONS"
    assert options.sources["seed"] == options.sources["energy_budget"] == "code"
    assert options.sources["profile"] == "default"
    json_file = tmp_path / "kareus.json"
    json_file.write_text('{"nanobatches": 2}')
    assert KareusOptions.resolve(
        None, environ={"KAREUS_OPTIONS_FILE": str(json_file)}).nanobatches == 2


@pytest.mark.parametrize("environ, message", [
    ({"KAREUS_OPTIONS": '{"nanobatches": 3}'},
     "$KAREUS_OPTIONS: kareus option 'nanobatches': got 3 (int)"),
    ({"KAREUS_OPTIONS": '{"nanobatchs": 2}'},
     "$KAREUS_OPTIONS: unknown kareus option 'nanobatchs'"),
    ({"KAREUS_OPTIONS": '{"seed": 1'},
     "$KAREUS_OPTIONS: not valid JSON: Expecting ',' delimiter"),
    ({"KAREUS_OPTIONS": '[1]'}, "$KAREUS_OPTIONS: kareus options must be a dict, got list"),
    ({"KAREUS_OPTIONS_FILE": "{dir}/missing.toml"},
     "$KAREUS_OPTIONS_FILE ({dir}/missing.toml): cannot read it: No such file"),
    ({"KAREUS_OPTIONS_FILE": "{dir}/bad.toml"},
     "$KAREUS_OPTIONS_FILE ({dir}/bad.toml): not valid TOML"),
    ({"KAREUS_OPTIONS_FILE": "{dir}/bad.toml", "KAREUS_OPTIONS": '{"profile": "off"}'},
     "$KAREUS_OPTIONS_FILE ({dir}/bad.toml): not valid TOML"),
    ({"KAREUS_OPTIONS": '{"profile": "off", "time_budget": 1.1}'},
     ("a budget needs a plan, and none is made with profile=\"off\" (planning needs the "
      "profiles); given: profile ($KAREUS_OPTIONS), time_budget ($KAREUS_OPTIONS)")),
])
def test_environment_errors_name_the_variable_or_file_and_key(tmp_path, environ, message):
    (tmp_path / "bad.toml").write_text("nanobatches = [\n")
    environ = {k: v.replace("{dir}", str(tmp_path)) for k, v in environ.items()}
    with pytest.raises(KareusOptionError) as raised:
        KareusOptions.resolve({}, environ=environ)
    assert message.replace("{dir}", str(tmp_path)) in str(raised.value)


def test_the_name_reads_the_environment(fresh_runtime, monkeypatch):
    monkeypatch.setenv("KAREUS_OPTIONS", json.dumps({**ON_A100, "energy_budget": 0.97}))
    model = Wide()
    torch.compile(model, backend="kareus")(torch.randn(512, 1024)).sum().backward()
    plan = kareus.current_plan()
    assert (plan.budget.kind, plan.device) == ("energy", "sim:a100-sxm4-40gb")


@pytest.mark.parametrize("mode, expected", [
    ("max-autotune", {"search_budget": 64, "autotune": True}),
    ("max-autotune-no-cudagraphs", {"search_budget": 64, "autotune": True}),
    ("default", {"search_budget": 32, "autotune": False}),
])
def test_torch_compile_modes_preset_options(mode, expected):
    options = KareusOptions.resolve(None, mode=mode, environ={})
    assert {k: getattr(options, k) for k in expected} == expected
    # an option given anywhere wins over the mode's preset
    assert KareusOptions.resolve({"search_budget": 8}, mode=mode, environ={}).search_budget == 8


# -- errors when the backend is built -----------------------------------------------------


def test_mode_that_does_not_fit_is_refused_at_the_first_graph_as_itself():
    compiled = torch.compile(torch.sin, backend="kareus", mode="reduce-overhead")
    with pytest.raises(KareusOptionError, match="mode 'reduce-overhead' does not fit kareus"):
        compiled(torch.randn(3))


def test_environment_error_reaches_the_user_as_itself(monkeypatch):
    monkeypatch.setenv("KAREUS_OPTIONS", '{"search_budget": 0}')
    with pytest.raises(KareusOptionError) as raised:
        torch.compile(torch.sin, backend="kareus")(torch.randn(3))
    assert not isinstance(raised.value, torch._dynamo.exc.BackendCompilerFailed)
    assert str(raised.value).startswith("$KAREUS_OPTIONS: kareus option 'search_budget'")


def test_a_binary_device_file_is_refused_when_the_backend_is_built(tmp_path):
    path = tmp_path / "gpu.json"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00")
    with pytest.raises(GPUSpecError, match="gpu.json"):
        KareusBackend({"device": str(path)})


def test_a_plan_for_another_device_is_refused_when_the_backend_is_built(fresh_runtime, tmp_path):
    _step({**ON_A100, "time_budget": 1.2})
    path = tmp_path / "plan.json"
    path.write_text(kareus.current_plan().to_json())
    with pytest.raises(PlanError, match="the plan was made on .*a100.*this is .*h200"):
        KareusBackend({"plan": str(path), "device": "sim:h200", "microbatches": 1})
    KareusBackend({"plan": str(path), "device": "sim:a100-sxm4-40gb"})  # its own device takes it


def test_mode_or_options_beside_a_backend_object_say_where_they_go():
    compiled = torch.compile(torch.sin, backend=KareusBackend({"lowering": "eager"}),
                             mode="max-autotune")
    with pytest.raises(Exception, match=r"give them to it, KareusBackend\(options, mode=...\)"):
        compiled(torch.randn(3))


def test_explain_says_where_each_option_came_from(fresh_runtime, monkeypatch, capsys):
    monkeypatch.setenv("KAREUS_OPTIONS", '{"seed": 7}')
    backend = KareusBackend({"explain": True, "lowering": "eager", "profile": "off"})
    torch.compile(torch.sin, backend=backend)(torch.randn(3))
    table = capsys.readouterr().out
    assert "kareus options" in table
    rows = {line.split("│")[1].strip(): line for line in table.splitlines() if "│" in line}
    assert "$KAREUS_OPTIONS" in rows["seed"] and "7" in rows["seed"]
    assert "code" in rows["lowering"] and "default" in rows["device"]


@pytest.mark.parametrize("given", [False, True])
def test_a_default_budget_no_plan_meets_runs_the_fastest_a_given_one_fails(
        fresh_runtime, monkeypatch, caplog, given):
    """On a real GPU the plans and the baseline are measured apart, and may disagree so far
    that no plan meets even the baseline's time: a job that asked for no budget then runs the
    fastest plan, one that asked for it is told no plan meets it."""
    monkeypatch.setattr("kareus.planner.budget.limit_of", lambda budget, baseline: 0.0)
    options = {**ON_A100, **({"time_budget": 1.0} if given else {})}
    if given:
        with pytest.raises(BudgetError, match="no plan meets the time budget 1"):
            _step(options)
        return
    with caplog.at_level(logging.WARNING, logger="kareus"):
        plan = _step(options)
    assert plan.predicted == plan.frontier[0]  # the fastest
    assert any("no budget was given (the default is time_budget=1.0), so the fastest plan "
               "runs" in r.getMessage() for r in caplog.records)


def test_the_plan_records_where_its_options_came_from_and_show_prints_it(
        fresh_runtime, monkeypatch, tmp_path):
    from rich.console import Console

    from kareus.show import show

    monkeypatch.setenv("KAREUS_OPTIONS", '{"energy_budget": 0.97}')
    plan = _step(ON_A100)
    assert plan.option_sources == {"device": "code", "lowering": "code",
                                   "energy_budget": "$KAREUS_OPTIONS"}
    path = plan.save(tmp_path / "plan.json")
    out = Console(record=True, width=300)
    show(path, console=out)
    assert ("options given: device='sim:a100-sxm4-40gb' (code); energy_budget=0.97 "
            "($KAREUS_OPTIONS); lowering='eager' (code)") in out.export_text()


@pytest.mark.parametrize("mode, autotuned", [("max-autotune", True), (None, False)])
def test_max_autotune_reaches_inductors_config(monkeypatch, mode, autotuned):
    import kareus.backend

    patches = []
    real = kareus.backend.compile_fx

    def recording(gm, inputs, **kwargs):
        patches.append(kwargs["config_patches"])
        return real(gm, inputs, **kwargs)

    monkeypatch.setattr(kareus.backend, "compile_fx", recording)
    backend = KareusBackend({"lowering": "eager", "profile": "off"}, mode=mode)
    torch.compile(torch.sin, backend=backend)(torch.randn(3))
    assert [p.get("max_autotune", False) for p in patches] == [autotuned]
