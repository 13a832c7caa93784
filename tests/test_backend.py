import copy
import logging
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import analysed, tp_llama
from torch._inductor.utils import run_and_get_code
from torch.testing import FileCheck

import kareus
from kareus import KareusBackend, RecordingClockController, use_controller
from kareus.backend import backend_for
from kareus.codegen.apply import apply
from kareus.passes.decide import DecisionError, Policy, decide
from kareus.passes.ops import SET_CLOCK
from kareus.passes.variants import Variant


def test_backend_name_resolves_in_a_fresh_process_without_importing_kareus():
    script = textwrap.dedent(
        """
        import sys, torch
        assert "kareus" not in sys.modules
        f = torch.compile(
            lambda x: torch.sin(x) + 1, backend="kareus", options={"lowering": "eager"}
        )
        x = torch.randn(5)
        torch.testing.assert_close(f(x), torch.sin(x) + 1)
        import kareus
        print([r.kind for r in kareus.graph_reports()])
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['inference']"


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _ops(gm: torch.fx.GraphModule) -> list[str]:
    return [
        str(n.target)
        for n in gm.graph.nodes
        if n.op == "call_function" and n.target is not SET_CLOCK
    ]


@pytest.mark.parametrize("lowering", ["inductor", "eager"])
def test_model_without_collectives_compiles_unchanged(lowering):
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(3, 8)
    for g, a in analysed(copy.deepcopy(model), x):
        applied = apply(g.gm, a, decide(a, Policy()).choice)
        assert _ops(applied) == _ops(g.gm), "only the clock switch is added"
        FileCheck().check("torch.ops.kareus.set_clock.default").check("torch.ops.aten").run(applied.code)
        FileCheck().check_count("kareus.set_clock", 1, exactly=True).run(applied.code)

    ref_model = copy.deepcopy(model)
    backend = KareusBackend({"lowering": lowering, "nanobatches": 1, "profile": "off"})
    out = torch.compile(model, backend=backend)(x)
    out.sum().backward()
    ref = ref_model(x)
    ref.sum().backward()
    torch.testing.assert_close(out, ref)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    assert [r.kind for r in backend.reports()] == ["forward", "backward"]
    for report in backend.reports():
        assert report.collectives == () and report.partitions == () and report.notes == ()


def test_a_pipeline_schedule_without_a_pipeline_is_said_to_do_nothing_once(caplog):
    backend = KareusBackend({"lowering": "eager", "nanobatches": 1, "profile": "off",
                             "pipeline_schedule": "1f1b"})
    model = torch.compile(MLP(), backend=backend)
    with caplog.at_level(logging.WARNING, logger="kareus"):
        model(torch.randn(3, 8)).sum().backward()
        torch.compile(MLP(), backend=backend)(torch.randn(3, 8))
    said = [r.getMessage() for r in caplog.records if "pipeline_schedule" in r.getMessage()]
    assert said == [("kareus options: pipeline_schedule='1f1b' does nothing for region "
                    f"{said[0].split('region ')[1].split(':')[0]}: it compiles outside any "
                    "pipeline stage (torch.distributed.pipelining)")]


def test_clock_switch_is_pinned_at_graph_entry_in_inductor_code(fake_pg):
    model = torch.compile(tp_llama(2), backend="kareus",
                          options={"nanobatches": 1, "profile": "off"})
    tokens = torch.randint(0, 256, (4, 16))
    recorder = RecordingClockController()
    with use_controller(recorder):
        out, (fw_code,) = run_and_get_code(model, tokens)
        _, (bw_code,) = run_and_get_code(lambda: out.sum().backward())
    labels = [r.label for r in kareus.graph_reports()]
    assert [label.split("/")[1] for label in labels] == ["forward", "backward"]
    for code, label in zip((fw_code, bw_code), labels):
        (
            FileCheck()
            .check("def call(")
            .check_not("extern_kernels.")
            .check_not("cpp_fused_")
            .check_not("_c10d_functional")
            .check(f"torch.ops.kareus.set_clock.default('{label}', 0)")
            .check("_c10d_functional.all_reduce")
            .run(code)
        )
        FileCheck().check_count("torch.ops.kareus.set_clock.default", 1, exactly=True).run(code)
    assert [s.graph for s in recorder.switches] == labels


def test_one_switch_per_graph_execution_in_order():
    model = torch.compile(MLP(), backend="kareus", options={"lowering": "eager"})
    recorder = RecordingClockController()
    with use_controller(recorder):
        for _ in range(3):
            model(torch.randn(2, 8)).sum().backward()
        with torch.no_grad():
            model(torch.randn(2, 8))
    forward, backward, inference = kareus.graph_reports()
    assert (forward.kind, backward.kind, inference.kind) == ("forward", "backward", "inference")
    expected = [forward.label, backward.label] * 3 + [inference.label]
    assert [s.graph for s in recorder.switches] == expected
    assert [s.order for s in recorder.switches] == list(range(7))
    assert recorder.resets == 1  # use_controller restores default clocks on exit


def test_explain_prints_a_table_and_logs(fake_pg, capsys, caplog):
    caplog.set_level(logging.INFO, logger="kareus")
    model = torch.compile(
        tp_llama(1), backend="kareus", options={"explain": True, "lowering": "eager"}
    )
    model(torch.randint(0, 256, (2, 8)))
    printed = capsys.readouterr().out
    (report,) = kareus.graph_reports()
    assert f"kareus {report.label}: forward graph" in printed and "all_reduce" in printed
    assert "launch slots" in printed
    assert any(
        f"{report.label}: 4 collectives, 4 partitions, 1 nanobatches" in r.getMessage()
        for r in caplog.records
    )


def test_reports_serialise(fake_pg):
    import json

    torch.compile(tp_llama(1), backend="kareus", options={"lowering": "eager", "nanobatches": 4})(
        torch.randint(0, 256, (6, 8))
    )
    (report,) = kareus.graph_reports()
    data = json.loads(json.dumps(report.to_dict(), default=str))
    assert data["kind"] == "forward"
    assert (data["requested"], data["choice"]["nanobatches"]) == (4, 1)
    assert data["key"] == report.key and len(report.key) == 16
    assert [c["kind"] for c in data["collectives"]] == [
        "all_reduce", "all_reduce", "all_reduce", "all_gather"
    ]
    assert data["partitions"][1]["slots"][1]["kind"] == "matmul"
    assert data["variants"]["nanobatches"] == [1, 2]
    # 6 samples do not split in 4: the reason is a record, its kind a plain string
    assert data["fallback"]["kind"] == "not-divisible" and data["fallback"]["node"]
    assert data["variants"]["infeasible"]["4"] == data["fallback"]


def test_no_table_without_explain(fake_pg, capsys):
    torch.compile(tp_llama(1), backend="kareus", options={"lowering": "eager"})(
        torch.randint(0, 256, (2, 8))
    )
    assert "launch slots" not in capsys.readouterr().out


@pytest.mark.parametrize(
    "compile_kwargs, message",
    [
        ({"options": {"nanobatch": 2}}, "unknown kareus option 'nanobatch'"),
        ({"options": {"lowering": "cuda"}}, "kareus option 'lowering': got 'cuda'"),
        ({"mode": "reduce-overhead"}, "mode 'reduce-overhead' does not fit kareus"),
    ],
)
def test_bad_options_and_modes_fail_before_compiling(compile_kwargs, message):
    # Dynamo would wrap a backend's error; the backend's options are ours, raised as such.
    with pytest.raises(kareus.KareusOptionError, match=message) as info:
        torch.compile(MLP(), backend="kareus", **compile_kwargs)(torch.randn(2, 8))
    assert not isinstance(info.value, torch._dynamo.exc.BackendCompilerFailed)
    assert kareus.graph_reports() == []


def test_the_registered_backend_is_one_per_options_value():
    for _ in range(2):
        torch.compile(MLP(), backend="kareus", options={"lowering": "eager"})(torch.randn(2, 8))
        torch._dynamo.reset()
    torch.compile(MLP(), backend="kareus", options={"lowering": "eager", "explain": False})(
        torch.randn(2, 8)
    )
    own = KareusBackend({"lowering": "eager"})
    torch._dynamo.reset()
    torch.compile(MLP(), backend=own)(torch.randn(2, 8))
    reports = kareus.graph_reports()
    assert len(reports) == 4 and reports[-1] == own.reports()[0]
    shared = backend_for({"lowering": "eager"})
    assert shared is not own and len(shared.reports()) == 3  # three compiles, one backend


@pytest.mark.parametrize(
    "chooser, message",
    [
        (
            lambda a, k: Variant(4, *(a.space.default(4).slots, a.space.default(4).resources)),
            "2 nanobatches were asked for",
        ),
        (
            lambda a, k: Variant(
                k, (99,) * len(a.space.partitions(k)), a.space.default(k).resources
            ),
            "slot 99 outside",
        ),
        (lambda a, k: None, "expected a Variant, got NoneType"),
    ],
    ids=["other-count", "slot-out-of-range", "nothing"],
)
def test_a_chooser_outside_the_space_fails_the_compile_clearly(fake_pg, chooser, message):
    backend = KareusBackend({"nanobatches": 2, "lowering": "eager"}, chooser=chooser)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match=message) as info:
        torch.compile(tp_llama(1), backend=backend)(torch.randint(0, 256, (4, 8)))
    assert isinstance(info.value.inner_exception, DecisionError)
    assert isinstance(info.value.inner_exception, kareus.KareusError)
    assert backend.reports() == []


def test_use_controller_routes_each_thread_to_its_own_controller():
    import threading

    model = torch.compile(MLP(), backend=KareusBackend({"lowering": "eager"}))
    model(torch.randn(2, 8))  # compile once, outside the threads
    recorders = [RecordingClockController(), RecordingClockController()]
    inside = threading.Barrier(2)

    def train(recorder, steps):
        with use_controller(recorder):
            inside.wait()  # both controllers installed at once
            for _ in range(steps):
                model(torch.randn(2, 8)).sum().backward()
            inside.wait()

    threads = [threading.Thread(target=train, args=(r, n)) for r, n in zip(recorders, (2, 3))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [len(r.switches) for r in recorders] == [4, 6]  # a forward and a backward per step
    assert [r.resets for r in recorders] == [1, 1]
