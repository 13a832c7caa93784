"""The command line refuses what it cannot run before spawning anything."""

import argparse
import itertools
import json
import os
from pathlib import Path

import pytest

from kareus import demo
from kareus.cli import build_parser, main, parser_for_plan
from kareus.devices.sim.presets import preset_names
from kareus.offline.cli import PAPER_WORKLOAD, workload_of
from kareus.version import __version__


@pytest.mark.parametrize(
    "argv, message",
    [
        (["demo", "--steps", "0"], "argument --steps: must be at least 1, got 0"),
        (["demo", "--world-size", "-2"], "argument --world-size: must be at least 1, got -2"),
        (["demo", "--layers", "two"], "argument --layers: 'two' is not an integer"),
        (["demo", "--nanobatches", "3"], "argument --nanobatches: invalid choice: '3'"),
        (["demo", "--time-budget", "1.1", "--energy-budget", "0.9"],
         "argument --energy-budget: not allowed with argument --time-budget"),
    ],
)
def test_bad_demo_arguments_are_refused_with_the_reason(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_kareus_plan_refuses_an_unknown_layout_naming_the_choices(capsys):
    with pytest.raises(SystemExit) as info:
        main(["plan", "llama3.2-1b", "--layout", "nemo"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --layout: invalid choice: 'nemo'" in err
    assert "'megatron'" in err and "'torchtitan'" in err


def test_kareus_plan_help_says_what_each_layout_traces(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "fused QKV and gate-up projections" in out and "vocab-parallel loss" in out
    assert "separate q, k, v, gate and up projections" in out and "logits all-gathered" in out
    assert "num_layers_in_first_pipeline_stage" in out


def test_a_bad_budget_or_target_is_refused_before_anything_runs(capsys, tmp_path):
    assert main(["demo", "--energy-budget", "12 furlongs"]) == 2
    assert "kareus option 'energy_budget': got '12 furlongs'" in capsys.readouterr().out
    assert main(["show", str(tmp_path / "missing.json")]) == 2
    assert "missing.json: no such file or directory" in capsys.readouterr().out


def test_a_cache_dir_that_is_a_file_is_one_line_before_tracing(capsys, tmp_path):
    (tmp_path / "store").write_text("a file")
    assert main(["plan", "llama3.2-1b", "--cache-dir", str(tmp_path / "store"),
                 "--json", str(tmp_path / "r.json")]) == 2
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("kareus plan: kareus option 'cache_dir'")
    assert f"'{tmp_path / 'store'}' is a file, not a directory" in out[0]
    assert not (tmp_path / "r.json").exists()


@pytest.mark.parametrize("device", ["nvml", "nvml-dry-run", "auto"])
def test_kareus_plan_on_a_real_gpu_says_an_offline_plan_needs_a_simulated_one(capsys, tmp_path,
                                                                              device):
    assert main(["plan", "llama3.2-1b", "--device", device,
                 "--json", str(tmp_path / "r.json")]) == 2
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith(f"kareus plan: Bad device '{device}'")
    assert "fake tensors, which no real GPU runs" in out[0] and "Install" not in out[0]


def test_kareus_plan_says_a_budget_that_constrains_nothing(capsys, tmp_path):
    assert main(["plan", "llama3.2-1b", "--tp", "2", "--seq-len", "128", "--microbatch-size",
                 "1", "--microbatches", "2", "--energy-budget", "1 Wh", "--cache-dir",
                 str(tmp_path / "c"), "--json", str(tmp_path / "r.json")]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
    assert notes == [notes[0]] and notes[0].startswith(
        "note: the energy budget 3600 J per iteration constrains nothing: every plan meets it")


def test_ctrl_c_is_one_line_and_status_130(capsys, monkeypatch):
    from kareus.offline import cli as offline

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(offline, "plan_command", interrupted)
    assert main(["plan", "llama3.2-1b"]) == 130
    captured = capsys.readouterr()
    assert captured.err == "kareus plan: interrupted\n" and "Traceback" not in captured.out


def test_solving_shows_a_spinner_with_the_seconds_on_a_terminal_only():
    import io

    from rich.console import Console

    from kareus.models.llama import LlamaConfig
    from kareus.offline.cli import solving
    from kareus.offline.workload import Workload

    workload = Workload(LlamaConfig(), "m", pp=2, microbatches=4, seq=64)
    for terminal in (True, False):
        out = io.StringIO()
        with solving(Console(file=out, force_terminal=terminal, width=120), workload):
            pass
        shown = "solving the plans of 2 stage(s) x 4 microbatches" in out.getvalue()
        assert shown == terminal


def test_show_refuses_an_empty_target_and_an_unwritable_out(capsys, tmp_path):
    assert main(["show", ""]) == 2
    out = capsys.readouterr().out
    assert "kareus show: target: an empty path" in out and len(out.strip().splitlines()) == 1
    from test_show import make_plan

    plan = make_plan().save(tmp_path / "plan.json")
    (tmp_path / "blocker").write_text("a file")
    assert main(["show", str(plan), "--out", str(tmp_path / "blocker" / "plot.png")]) == 2
    out = capsys.readouterr().out.strip()
    assert out.splitlines()[-1].startswith(f"kareus show: {tmp_path / 'blocker' / 'plot.png'}: "
                                           "cannot write the plot there")


@pytest.fixture
def no_workers(monkeypatch):
    """Fail the test if the demo spawns anything: every refusal comes before."""

    def spawn(*args, **kwargs):
        raise AssertionError("workers were spawned")

    monkeypatch.setattr(demo.mp, "start_processes", spawn)


def gpu_file(tmp_path, content: bytes | dict, name: str = "gpu.json") -> str:
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
    return str(path)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--device", "{dir}"], "is a directory, not a GPU .json file"),
        (["--device", "{binary}"], "not a UTF-8 JSON file ('utf-8' codec can't decode byte 0x89"),
        (["--device", "{absurd}"], "tdp_w must be a finite number in (0, 5000], got 1e+300"),
        (["--device", "{clocks}"], "is 10,000 clocks; at most 1,000"),
        (["--dim", "200"], "Llama dim 200 must split into 3 heads of an even width"),
        (["--dim", "65"], "Llama dim 65 must split into 1 heads of an even width"),
        (["--dim", "96"], "must be divisible by the tensor-parallel degree 2"),
        (["--dim", "102400"], "parameter model is more than the demo trains on CPU"),
        (["--microbatch-size", "100000", "--seq-len", "10000"], "elements per activation"),
        (["--sequence-parallel", "--seq-len", "33"], "it must divide evenly"),
        (["--energy-budget", "-1"], "kareus option 'energy_budget'"),
    ],
)
def test_the_demo_refuses_in_one_line_before_spawning_workers(
    argv, message, tmp_path, capsys, no_workers
):
    (tmp_path / "specs").mkdir()
    files = {
        "dir": str(tmp_path / "specs"),
        "binary": gpu_file(tmp_path, b"\x89PNG\r\n\x1a\n\x00"),
        "absurd": gpu_file(tmp_path, {"base": "sim:h200", "name": "x", "tdp_w": 1e300},
                           "absurd.json"),
        "clocks": gpu_file(tmp_path, {"base": "sim:h200", "name": "x", "min_clock_mhz": 1,
                                      "max_clock_mhz": 10_000, "clock_step_mhz": 1,
                                      "knee_mhz": 1500}, "clocks.json"),
    }
    assert main(["demo", *(a.format(**files) for a in argv)]) == 2
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kareus demo: "), captured.out
    assert message in lines[0] and "Traceback" not in captured.err


@pytest.mark.slow
def test_the_demo_plans_trains_with_the_plan_and_writes_it(tmp_path, capsys):
    import json

    out = tmp_path / "plan.png"
    argv = ["demo", "--steps", "3", "--dim", "256", "--microbatch-size", "4", "--seq-len", "64",
            "--layers", "1", "--lowering", "eager", "--time-budget", "1.2", "--out", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    plan = json.loads(out.with_suffix(".json").read_text())
    assert out.read_bytes().startswith(b"\x89PNG")
    assert plan["budget"] == {"kind": "time", "value": None, "fraction": 1.2}
    assert plan["predicted"]["time_s"] <= 1.2 * plan["baseline"]["time_s"]
    assert "of the baseline" in text and "clock switches recorded on rank 0: 6" in text


@pytest.mark.slow
def test_an_impossible_budget_is_one_line_from_the_first_plan(tmp_path, capsys):
    """No plan reaches 5% of the baseline's energy: the first plan, made when the first step
    compiles, says so; the parent prints it once (not each rank's traceback) and exits 2."""
    argv = ["demo", "--steps", "50", "--dim", "256", "--microbatch-size", "4", "--seq-len",
            "64",
            "--layers", "1", "--lowering", "eager", "--device", "sim:h200",
            "--energy-budget", "0.05", "--out", str(tmp_path / "plan.png")]
    assert main(argv) == 2
    captured = capsys.readouterr()
    last = captured.out.strip().splitlines()[-1]
    assert last.startswith("kareus demo: rank 0: no plan meets the energy budget 0.05 of the "
                           "baseline's"), captured.out
    assert "Traceback" not in captured.out + captured.err
    assert "loss curve" not in captured.out and not (tmp_path / "plan.json").exists()


# -- the options themselves ----------------------------------------------------------------


def subcommands() -> dict[str, argparse.ArgumentParser]:
    (sub,) = (a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def help_text(parser: argparse.ArgumentParser) -> str:
    return " ".join(parser.format_help().split())  # however argparse wraps it


def option_help(parser: argparse.ArgumentParser, option: str) -> str:
    """One option's entry in the help, its lines joined without the wrapping's spaces
    (argparse also breaks lines after a hyphen)."""
    lines = iter(parser.format_help().splitlines())
    entry = [next(line for line in lines if line.lstrip().startswith(option + " "))]
    entry += [line for line in itertools.takewhile(
        lambda line: len(line) - len(line.lstrip()) > 4, lines)]  # its help's lines
    return "".join("".join(entry).split())


@pytest.mark.parametrize("command", ["demo", "plan", "bench", "show"])
def test_every_option_has_help_and_shows_its_default(command):
    """Each option says what it is; one with a default to show (not None, not a flag's
    False) shows it, or says it in its own words ("default: beside --json")."""
    parser = subcommands()[command]
    for action in parser._actions:
        if action.help == argparse.SUPPRESS:  # an earlier spelling: its option is shown
            assert any(a.dest == action.dest and a.help != argparse.SUPPRESS
                       for a in parser._actions), action.option_strings
            continue
        assert action.help, f"{command} {action.option_strings or action.dest}: no help"
        if action.option_strings and action.default not in (None, False, argparse.SUPPRESS):
            entry = option_help(parser, action.option_strings[-1])
            assert (f"(default:{action.default})" in entry
                    or "default" in action.help), (command, entry)


def test_kareus_plan_help_shows_the_defaults_the_issue_named(capsys):
    with pytest.raises(SystemExit) as info:
        main(["plan", "--help"])
    assert info.value.code == 0
    assert capsys.readouterr().out == subcommands()["plan"].format_help()
    for option, default in [("--tp", "8"), ("--pp", "1"), ("--seq-len", "4096"),
                            ("--microbatches", "8"), ("--device", "sim:a100-sxm4-40gb"),
                            ("--search", "grid")]:
        entry = option_help(subcommands()["plan"], option)
        assert entry.endswith(f"(default:{default})"), entry
    # --plan-json is written with or without pipeline parallelism (costs per GPU, or per
    # iteration of one replica), as --pp 2 shows
    plan_json = option_help(subcommands()["plan"], "--plan-json")
    assert "withpipelineparallelismperiterationofonereplica" in plan_json
    assert "withoutpipeline" not in plan_json


def test_kareus_version_prints_the_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"kareus {__version__}\n"


@pytest.mark.parametrize("argv", [
    ["--microbatch-size", "3", "--seq-len", "64", "--sequence-parallel"],
    ["--batch", "3", "--seq", "64", "--sp"],  # the earlier spellings, hidden
])
def test_demo_and_plan_name_the_shape_alike(argv):
    """--microbatch-size, --seq-len, --sequence-parallel in both, into the same fields; the
    earlier --batch, --seq and --sp still parse but are not in the help."""
    parsers = subcommands()
    for command, args in (("demo", argv), ("plan", ["llama3.2-1b", *argv])):
        parsed = parsers[command].parse_args(args)
        assert (parsed.microbatch_size, parsed.seq_len, parsed.sequence_parallel) == (
            3, 64, True), command
        text = help_text(parsers[command])
        assert all(f"[{name}" in text for name in ("--microbatch-size", "--seq-len",
                                                   "--sequence-parallel")), command
        assert not any(f"[{name} " in text or f"[{name}]" in text
                       for name in ("--batch", "--seq", "--sp")), command
    workload = workload_of(parser_for_plan().parse_args(["llama3.2-1b", "--tp", "2", *argv]))
    assert (workload.microbatch_size, workload.seq, workload.sp) == (3, 64, True)
    assert "--seq-len" in PAPER_WORKLOAD and "--seq " not in PAPER_WORKLOAD


@pytest.mark.parametrize("command", ["demo", "plan"])
def test_device_help_lists_the_simulated_presets(command):
    entry = option_help(subcommands()[command], "--device")
    assert all(name in entry for name in preset_names()), entry


def test_the_demo_refuses_an_out_the_file_system_refuses_before_spawning(
    monkeypatch, capsys, no_workers
):
    """Run as root, os.access says yes to /proc; opening a file there says no."""
    if not Path("/proc/self").is_dir():
        pytest.skip("no /proc")
    monkeypatch.setattr(os, "access", lambda *args, **kwargs: True)
    assert main(["demo", "--out", "/proc/kareus-test.png"]) == 2
    out = capsys.readouterr().out
    assert out.startswith("kareus demo: /proc/kareus-test.png: cannot write there")
    assert out.count("\n") == 1
