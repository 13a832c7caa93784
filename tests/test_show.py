"""``kareus show`` prints what a plan chose or a profile store holds, and plots it."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sqlite3

import pytest
from matplotlib import colormaps
from matplotlib.colors import to_rgba
from rich.console import Console

from kareus import KareusError
from kareus.cli import main
from kareus.devices.base import Measurement
from kareus.passes.decide import Choice
from kareus.planner.budget import Budget
from kareus.planner.pipeline import one_f_one_b, schedule
from kareus.planner.plan import (
    GraphPlan,
    InstructionGraph,
    InstructionPlan,
    PipelineLayout,
    Plan,
    PlanError,
    StepCost,
)
from kareus.profiler.store import FILENAME, SCHEMA_VERSION, Knobs, ProfileKey, ProfileStore
from kareus.show import CLOCK_COLORMAP, DEFAULT_CLOCK_COLOR, ShowError, _plan_figure, show

PNG_SIGNATURE = b"\x89PNG"

KEY_A = ProfileKey("3f" * 32, "sim:h200", "sim-v2", (1980, 1500, 1200), 2, "0.1.0")
KEY_B = ProfileKey("a7" * 32, "sim:h200", "sim-v2", (1980, 1500, 1200), 4, "0.1.0")

# (time ms, energy mJ, clock): the third is slower and costlier than the second, so three
# of the four are on the frontier.
POINTS_A = [(1.0, 5.0, 1980), (2.0, 3.0, 1500), (3.0, 4.0, 1500), (4.0, 1.0, 1200)]


def console() -> Console:
    return Console(record=True, width=200)


def knobs(slot: int, clock_mhz: int, nanobatches: int = 2) -> Knobs:
    return Knobs(slot, (("all_reduce_3", 16),), clock_mhz, nanobatches)


def measurement(time_ms: float, energy_mj: float, clock_mhz: int) -> Measurement:
    return Measurement(time_ms * 1e-3, energy_mj * 1e-3, 110.5, clock_mhz, "simulated")


def make_plan() -> Plan:
    graphs = (
        GraphPlan("region0/forward", "h" * 16, Choice(2, 1410, ((1, 16),)), 4e-3, 0.5),
        GraphPlan("region0/backward", "g" * 16, Choice(1, 1980, ((0, None),)), 8e-3, 1.25),
    )
    return Plan(
        graphs=graphs,
        predicted=StepCost(0.0125, 2.5),
        baseline=StepCost(0.012, 3.2),
        frontier=(StepCost(0.0118, 3.4), StepCost(0.0125, 2.5), StepCost(0.015, 2.1)),
        frequency_only=(StepCost(0.012, 3.2), StepCost(0.014, 2.9)),
        budget=Budget("energy", fraction=0.8),
        device="sim:h200",
        model_version="sim-v2",
        static_power_w=110.5,
        options={"energy_budget": 0.8},
        kareus_version="0.1.0",
    )


@pytest.fixture
def store_file(tmp_path):
    path = tmp_path / FILENAME
    with ProfileStore(path) as store:
        for slot, (t, e, clock) in enumerate(POINTS_A):
            store.record(KEY_A, knobs(slot, clock), measurement(t, e, clock))
        store.record(KEY_B, knobs(0, 1980, 1), measurement(2.0, 9.0, 1980))
        store.record(KEY_B, knobs(0, 1500, 2), measurement(2.5, 8.0, 1500))
    return path


def assert_png(path) -> None:
    assert path.is_file()
    assert path.read_bytes().startswith(PNG_SIGNATURE)


def row(text: str, prefix: str) -> list[str]:
    """The cells of the table row starting with ``prefix``."""
    line = next(line for line in text.splitlines() if prefix in line)
    return [cell.strip() for cell in line.split("│")[1:-1]]


# -- a plan ---------------------------------------------------------------------------------


def test_plan_table_summary_and_plot(tmp_path):
    path = make_plan().save(tmp_path / "plan.json")
    out = console()
    png = show(path, console=out)
    assert png == tmp_path / "plan.png"
    assert_png(png)
    text = out.export_text()
    assert row(text, "region0/forward")[:5] == ["region0/forward", "2", "1410", "1", "16"]
    assert row(text, "region0/backward")[:5] == ["region0/backward", "1", "1980", "0", "default"]
    assert "time 1.042x, energy 0.781x of the baseline" in text  # 12.5/12 ms, 2.5/3.2 J
    assert "predicted step (per GPU): 12.5 ms, 2.5 J; baseline 12 ms, 3.2 J" in text
    assert "energy <= 0.8 of the baseline" in text
    assert "sim:h200" in text
    assert text.rstrip().endswith(f"wrote {png}")


def test_plan_to_a_given_png(tmp_path):
    path = make_plan().save(tmp_path / "plan.json")
    png = show(str(path), out=tmp_path / "figures" / "chosen.png", console=console())
    assert png == tmp_path / "figures" / "chosen.png"
    assert_png(png)


def test_the_png_said_is_the_png_written(tmp_path):
    """A trailing separator names a directory (made); a name without a suffix gets .png,
    as matplotlib writes it: the path printed exists."""
    path = make_plan().save(tmp_path / "plan.json")
    into = show(str(path), out=f"{tmp_path / 'dir' / 'sub'}/", console=console())
    assert into == tmp_path / "dir" / "sub" / "plan.png"
    assert_png(into)
    bare = show(str(path), out=str(tmp_path / "dir" / "plot"), console=console())
    assert bare == tmp_path / "dir" / "plot.png"
    assert_png(bare)
    assert sorted(p.name for p in (tmp_path / "dir").iterdir()) == ["plot.png", "sub"]


# -- a pipeline's plan ----------------------------------------------------------------------

FORWARD_S, BACKWARD_S = 2e-3, 4e-3
# (stage, kind) -> clock; stage 0's backwards run at the default clocks
CLOCKS = {(0, "forward"): 1410, (0, "backward"): 0, (1, "forward"): 1200,
          (1, "backward"): 1980}
# 2 stages x 4 microbatches of 1F1B, 2 ms forwards and 4 ms backwards, by hand: (start ms,
# stage, microbatch, kind), ties in stage order; the iteration ends at 30 ms.
TIMELINE = [
    (0, 0, 0, "forward"), (2, 0, 1, "forward"), (2, 1, 0, "forward"),
    (4, 1, 0, "backward"), (8, 0, 0, "backward"), (8, 1, 1, "forward"),
    (10, 1, 1, "backward"), (12, 0, 2, "forward"), (14, 0, 1, "backward"),
    (14, 1, 2, "forward"), (16, 1, 2, "backward"), (18, 0, 3, "forward"),
    (20, 0, 2, "backward"), (20, 1, 3, "forward"), (22, 1, 3, "backward"),
    (26, 0, 3, "backward"),
]


def make_pipeline_plan(device: str = "sim:h200", model_version: str | None = "sim-v2",
                       stages: int = 2) -> Plan:
    dag = one_f_one_b(stages, 4)
    durations = [FORWARD_S if i.kind == "forward" else BACKWARD_S for i in dag.instructions]
    starts, makespan = schedule(dag, durations)
    instructions = []
    for i, start, time_s in zip(dag.instructions, starts, durations, strict=True):
        clock = CLOCKS.get((i.stage, i.kind), 0)
        k, calls = (2, 4) if i.kind == "forward" else (1, 2)
        graph = InstructionGraph(f"region0/{i.kind}", i.kind[0] * 16, calls,
                                 Choice(k, clock, ((1, 16),) if k > 1 else ()))
        instructions.append(InstructionPlan(i.stage, i.microbatch, i.kind, clock, (graph,),
                                            start, time_s, 0.25 * time_s * 1e3))
    return dataclasses.replace(
        make_plan(),
        predicted=StepCost(makespan, 9.0),
        baseline=StepCost(0.028, 10.0),
        frontier=(StepCost(0.028, 10.0), StepCost(makespan, 9.0)),
        frequency_only=(StepCost(0.028, 10.0),),
        device=device,
        model_version=model_version,
        pipeline=PipelineLayout("1f1b", stages, stages, 4),
        instructions=tuple(instructions),
    )


def table_rows(text: str, header: str) -> list[list[str]]:
    """The cells of every row of the table whose header row starts with ``header``."""
    lines = iter(text.splitlines())
    next(line for line in lines if line.startswith("┃") and line[1:].strip().startswith(header))
    next(lines)  # the line under the header
    rows = []
    for line in lines:
        if not line.startswith("│"):
            return rows
        rows.append([cell.strip() for cell in line.split("│")[1:-1]])
    return rows


def test_pipeline_plan_shows_its_instructions_in_start_order(tmp_path):
    path = make_pipeline_plan().save(tmp_path / "plan.json")
    out = console()
    png = show(path, console=out)
    assert_png(png)
    text = out.export_text()
    assert ("2 graphs, 16 instructions (1f1b pipeline: 2 stages on 2 ranks, 4 microbatches)"
            in text)
    assert row(text, "region0/forward")[:3] == ["region0/forward", "2", "1410"]
    rows = table_rows(text, "stage")
    # stage, rank, microbatch, kind, clock, start ms
    assert [r[:6] for r in rows] == [
        [str(s), str(s), str(m), kind,
         "default" if CLOCKS[s, kind] == 0 else str(CLOCKS[s, kind]), f"{start:g}"]
        for start, s, m, kind in TIMELINE
    ]
    forward, backward = rows[0], rows[3]
    assert forward[6:] == ["2", "500", "region0/forward k=2 x4"]  # ms, mJ, graphs
    assert backward[6:] == ["4", "1000", "region0/backward k=1 x2"]
    # 30 ms against 28 ms, 9 J against 10 J
    assert ("predicted iteration (one pipeline replica, all its GPUs): 30 ms, 9 J; baseline "
            "28 ms, 10 J: time 1.071x, energy 0.900x of the baseline") in text


def test_pipeline_plan_draws_its_timeline_beside_its_frontier():
    plan = make_pipeline_plan()
    fig = _plan_figure(plan)
    timeline, frontier, colorbar = fig.axes
    assert colorbar.get_ylabel() == "clock (MHz)"
    assert colorbar.get_ylim() == (1200, 1980)
    bars = timeline.patches
    assert len(bars) == len(plan.instructions) == 16
    spans = sorted((round(b.get_x(), 9), round(b.get_y() + b.get_height() / 2), b.get_width())
                   for b in bars)
    assert spans == sorted((start, s, 2.0 if kind == "forward" else 4.0)
                           for start, s, _, kind in TIMELINE)  # (start ms, rank, ms)
    hatched = [b for b in bars if b.get_hatch()]
    assert len(hatched) == 8 and all(b.get_width() == 4.0 for b in hatched)  # backwards
    grey = [b for b in bars if b.get_facecolor() == to_rgba(DEFAULT_CLOCK_COLOR)]
    assert len(grey) == 4  # stage 0's backwards, at the default clocks
    assert [t.get_text() for t in timeline.get_yticklabels()] == ["rank 0\nstage 0",
                                                                  "rank 1\nstage 1"]
    assert {t.get_text() for t in timeline.texts} <= {f"{k}{m}" for k in "FB" for m in range(4)}
    assert "F0" in {t.get_text() for t in timeline.texts}
    assert timeline.get_xlabel() == "time from the iteration's start (ms)"
    assert frontier.get_xlabel() == "iteration time (ms)"
    assert "predicted (modelled: the device is simulated)" in fig.get_suptitle()


def test_one_clock_is_the_middle_of_its_colorbar():
    plan = make_pipeline_plan()
    plan = dataclasses.replace(plan, instructions=tuple(
        dataclasses.replace(i, clock_mhz=1410) for i in plan.instructions))
    timeline, _, colorbar = _plan_figure(plan).axes
    assert colorbar.get_ylim() == (1409, 1411) and list(colorbar.get_yticks()) == [1410]
    middle = to_rgba(colormaps[CLOCK_COLORMAP](0.5))
    assert {b.get_facecolor() for b in timeline.patches} == {middle}


def test_a_measured_devices_pipeline_plan_is_not_called_modelled():
    fig = _plan_figure(make_pipeline_plan("NVIDIA H200", None))
    assert fig.get_suptitle() == "1f1b pipeline plan on NVIDIA H200: predicted"


def test_interleaved_ranks_run_every_ranks_th_stage_at_default_clocks(tmp_path):
    plan = make_pipeline_plan(stages=4)
    plan = dataclasses.replace(
        plan, pipeline=PipelineLayout("interleaved_1f1b", 4, 2, 4),
        instructions=tuple(dataclasses.replace(i, clock_mhz=0) for i in plan.instructions))
    fig = _plan_figure(plan)
    assert len(fig.axes) == 2  # no clock but the default: no colorbar
    timeline = fig.axes[0]
    assert [t.get_text() for t in timeline.get_yticklabels()] == ["rank 0\nstages 0, 2",
                                                                  "rank 1\nstages 1, 3"]
    out = console()
    show(plan.save(tmp_path / "plan.json"), console=out)
    rows = table_rows(out.export_text(), "stage")
    assert {(r[0], r[1]) for r in rows} == {("0", "0"), ("2", "0"), ("1", "1"), ("3", "1")}
    assert {r[4] for r in rows} == {"default"}


def test_a_plan_without_a_pipeline_draws_its_frontier_alone():
    fig = _plan_figure(make_plan())
    (ax,) = fig.axes
    assert not ax.patches and ax.get_title() == "plan on sim:h200"
    assert ax.get_xlabel() == "step time (ms)"


def test_a_pipeline_plan_round_trips(tmp_path):
    plan = make_pipeline_plan()
    loaded = Plan.load(plan.save(tmp_path / "plan.json"))
    assert loaded == plan
    assert loaded.instruction(1, 2, "backward") == plan.instructions[
        next(n for n, i in enumerate(plan.instructions)
             if (i.stage, i.microbatch, i.kind) == (1, 2, "backward"))]


def test_a_pipeline_plan_missing_instructions_is_refused_by_load_and_show(tmp_path):
    """A plan hand-cut to 3 of its 16 instructions would still say the whole iteration's
    time and energy: refused, saying what is missing (and what is stray or twice)."""
    raw = json.loads(make_pipeline_plan().to_json())
    raw["instructions"] = raw["instructions"][:3]
    path = tmp_path / "cut.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(PlanError, match=r"cut.json: instructions: a pipeline of 2 stages and 4 "
                       r"microbatches runs 16 instructions .* the plan holds 3: missing 13: "):
        Plan.load(path)
    with pytest.raises(ShowError, match="the plan holds 3: missing 13"):
        show(path, console=console())
    raw = json.loads(make_pipeline_plan().to_json())
    raw["instructions"][1] = dict(raw["instructions"][0])
    path.write_text(json.dumps(raw))
    with pytest.raises(PlanError, match=r"missing 1: .*; given twice 1: \[\(0, 0, 'forward'\)"):
        Plan.load(path)
    raw = json.loads(make_plan().to_json())
    raw["instructions"] = json.loads(make_pipeline_plan().to_json())["instructions"][:1]
    path.write_text(json.dumps(raw))
    with pytest.raises(PlanError, match="instructions: 1 without a pipeline layout"):
        Plan.load(path)


@pytest.mark.parametrize("field, value, problem", [
    ("kind", "sideways", "instructions[0].kind: 'sideways' is not \"forward\" or \"backward\""),
    ("start_s", -1e-3, "instructions[0].start_s: -0.001 is not a finite number >= 0"),
])
def test_a_malformed_instruction_is_refused_naming_its_field(tmp_path, field, value, problem):
    raw = json.loads(make_pipeline_plan().to_json())
    raw["instructions"][0][field] = value
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(PlanError) as loaded:
        Plan.load(path)
    assert str(loaded.value) == f"{path}: {problem}"
    with pytest.raises(ShowError) as shown:
        show(path, console=console())
    assert str(shown.value) == str(loaded.value)
    assert not (tmp_path / "plan.png").exists()


# -- a profile store ------------------------------------------------------------------------


@pytest.mark.parametrize("given", ["directory", "file"])
def test_store_table_and_plot(tmp_path, store_file, given):
    out = console()
    png = show(tmp_path if given == "directory" else store_file, console=out)
    assert png == tmp_path / "profiles.png"
    assert_png(png)
    text = out.export_text()
    assert "2 keys" in text and "left out" not in text
    # partition, device, group, k, evaluations, frontier, fastest, least energy
    assert row(text, "3f" * 6) == [
        "3f" * 6, "sim:h200", "2", "2", "4", "3",
        "1 ms, 5 mJ @ 1980 MHz", "4 ms, 1 mJ @ 1200 MHz",
    ]
    assert row(text, "a7" * 6)[:6] == ["a7" * 6, "sim:h200", "4", "1, 2", "2", "2"]


def test_store_says_how_many_keys_are_not_plotted(tmp_path, store_file, monkeypatch):
    monkeypatch.setattr("kareus.show.MAX_PLOTS", 1)
    out = console()
    assert_png(show(store_file, console=out))
    assert "2 keys (plotted the first 1, 1 left out)" in out.export_text()


def test_empty_store_is_refused(tmp_path):
    ProfileStore(tmp_path / FILENAME).close()
    with pytest.raises(ShowError, match="holds no profiles"):
        show(tmp_path, console=console())


def test_foreign_sqlite_file_is_refused_and_kept(tmp_path):
    path = tmp_path / "other.sqlite"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE t (x)")
    with pytest.raises(ShowError, match="not a kareus profile store"):
        show(path, console=console())
    assert [p.name for p in tmp_path.iterdir()] == ["other.sqlite"]  # not set aside


def listing(directory) -> dict[str, bytes]:
    """Every file in ``directory`` and its bytes."""
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def _sql(statement: str):
    def damage(path) -> None:
        with sqlite3.connect(path) as conn:
            conn.execute(statement)
        conn.close()

    return damage


def _truncated(path) -> None:
    path.write_bytes(path.read_bytes()[: 3 * 4096 + 100])


@pytest.mark.parametrize("damage, problem", [
    (_sql("DROP TABLE evaluations"),
     f"does not hold schema {SCHEMA_VERSION}'s tables (no table evaluations)"),
    (_sql(f"PRAGMA user_version = {SCHEMA_VERSION + 5}"), f"schema version {SCHEMA_VERSION + 5}"),
    (_truncated, "is corrupt"),
    (lambda path: path.write_bytes(b""), "is an empty file"),
])
def test_a_damaged_store_is_refused_and_left_as_it_is(tmp_path, store_file, damage, problem):
    damage(store_file)
    before = listing(tmp_path)
    with pytest.raises(KareusError) as info:
        show(tmp_path, console=console())
    assert listing(tmp_path) == before  # nothing set aside, created, migrated or written
    assert isinstance(info.value, ShowError)
    assert str(store_file) in str(info.value) and problem in str(info.value)
    assert main(["show", str(store_file)]) == 2
    assert listing(tmp_path) == before


def test_a_copied_store_shows_whole_and_nothing_is_added(tmp_path, store_file):
    """The store is its one file: copied alone, it shows every row, and showing it adds no
    lock file or WAL companion; a live store's rows still in its -wal show too."""
    copy = tmp_path / "copy"
    copy.mkdir()
    shutil.copy2(store_file, copy / FILENAME)
    before = listing(copy)
    text = console()
    show(copy / FILENAME, out=tmp_path / "copy.png", console=text)
    assert "2 keys" in text.export_text() and listing(copy) == before
    with ProfileStore(store_file) as live:
        live.record(KEY_B, knobs(1, 1200, 4), measurement(3.0, 7.0, 1200))
        files = sorted(p.name for p in tmp_path.iterdir())
        text = console()
        show(store_file, out=tmp_path / "live.png", console=text)
        assert row(text.export_text(), "a7" * 6)[:6] == ["a7" * 6, "sim:h200", "4", "1, 2, 4",
                                                         "3", "3"]
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*files, "live.png"])


# -- errors ---------------------------------------------------------------------------------


def test_missing_path(tmp_path):
    with pytest.raises(KareusError, match="no such file or directory") as info:
        show(tmp_path / "nothing.json", console=console())
    assert str(tmp_path / "nothing.json") in str(info.value)


def test_json_that_is_not_a_plan(tmp_path):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"x": 1}))
    with pytest.raises(KareusError) as info:
        show(path, console=console())
    assert isinstance(info.value, ShowError)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_binary_file_that_is_neither(tmp_path):
    path = tmp_path / "blob.bin"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ShowError) as info:
        show(path, console=console())
    assert str(info.value) == (f"{path}: not a kareus plan: not UTF-8 text (byte 0 is "
                               "b'\\xff'; a binary file?)")


def test_a_plan_with_a_bad_field_is_named_as_the_plan_option_names_it(tmp_path, capsys):
    """show reads a plan as the ``plan`` option does: the loader's one line, the file and
    the field; the command line prints it as one line and exits 2."""
    raw = json.loads(make_plan().to_json())
    raw["graphs"][1]["label"] = 7
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(PlanError) as loaded:
        Plan.load(path)
    with pytest.raises(ShowError) as shown:
        show(path, console=console())
    assert str(shown.value) == str(loaded.value) == (
        f"{path}: graphs[1].label: 7 is not a non-empty string"
    )
    assert not (tmp_path / "plan.png").exists()
    assert main(["show", str(path)]) == 2
    printed = " ".join(capsys.readouterr().out.split())  # however the console wraps it
    assert "graphs[1].label: 7 is not a non-empty string" in printed


def test_directory_without_a_store_creates_none(tmp_path):
    with pytest.raises(ShowError, match=f"holds no {FILENAME}") as info:
        show(tmp_path, console=console())
    assert str(tmp_path) in str(info.value)
    assert list(tmp_path.iterdir()) == []


# -- paths ----------------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["", "  "])
def test_an_empty_target_is_refused_not_taken_for_the_current_directory(target):
    with pytest.raises(ShowError, match="target: an empty path"):
        show(target, console=console())


def test_an_empty_out_is_refused(tmp_path):
    path = make_plan().save(tmp_path / "plan.json")
    with pytest.raises(ShowError, match="--out: an empty path"):
        show(path, out="", console=console())


def test_out_to_a_directory_writes_into_it(tmp_path, store_file):
    path = make_plan().save(tmp_path / "plan.json")
    figures = tmp_path / "figures"
    figures.mkdir()
    assert show(path, out=figures, console=console()) == figures / "plan.png"
    assert_png(figures / "plan.png")
    assert not (tmp_path / "figures.png").exists()
    assert show(store_file.parent, out=figures, console=console()) == figures / "profiles.png"
    assert_png(figures / "profiles.png")


@pytest.mark.parametrize("where", ["under_a_file", "unknown_format"])
def test_an_unwritable_out_is_one_error_naming_it(tmp_path, where):
    path = make_plan().save(tmp_path / "plan.json")
    (tmp_path / "blocker").write_text("a file, not a directory")
    out = tmp_path / "blocker" / "plot.png" if where == "under_a_file" else tmp_path / "plot.xyz"
    with pytest.raises(ShowError) as info:
        show(path, out=out, console=console())
    message = str(info.value)
    assert message.startswith(f"{out}: cannot write the plot there") and "\n" not in message
