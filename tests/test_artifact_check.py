"""The method's frontier files as benchmarks/artifact_check.py transcribes them: they must
reproduce the figures published from them (REFERENCE.md section 8) through kareus's own
metrics, step 1 ms per solver iteration as lowtime does, and lie on the artifact's clock grid
in kareus's 1F1B order; and the iteration the script evaluates on them must be the 1F1B
critical path. A wrong digit in a cost, an iteration or a clock fails one of these. No
tracing: the comparison with the simulator is benchmarks/artifact_check.py's report."""

from __future__ import annotations

import artifact_check as ac  # benchmarks/ is on sys.path (conftest.py)
import pytest

from kareus.offline.metrics import reductions

LLAMA, QWEN_8, QWEN_16 = ("llama3.2-3b", 8, 4096), ("qwen3-1.7b", 8, 4096), ("qwen3-1.7b", 16, 4096)


@pytest.mark.parametrize("config, time_s, energy_kj", [
    (LLAMA, 5.113, 22.5), (QWEN_8, 3.314, 13.6), (QWEN_16, 6.257, 26.7),
])
def test_perseus_fastest_point(config, time_s, energy_kj):
    fastest = ac.plans_of("perseus", config)[-1]
    assert round(fastest.time_s, 3) == time_s
    assert round(fastest.energy_j / 1e3, 1) == energy_kj


@pytest.mark.parametrize("config, fastest_pct, iso_time_pct, iso_energy_pct", [
    (LLAMA, -9.5, 19.8, 17.8), (QWEN_8, -8.7, 18.9, 19.4), (QWEN_16, -11.3, 21.2, 21.5),
])
def test_nanobatching_against_perseus(config, fastest_pct, iso_time_pct, iso_energy_pct):
    """The published reductions of Nanobatching + Perseus against Perseus: its fastest
    point's time, the energy it saves at Perseus's fastest point (iso-time) and the time it
    saves at Perseus's least-energy point (iso-energy)."""
    perseus = ac.plans_of("perseus", config)
    nbp = ac.plans_of("nanobatch_perseus", config)
    assert round(100 * (nbp[-1].time_s / perseus[-1].time_s - 1), 1) == fastest_pct
    at_fastest, at_least = reductions(nbp, [perseus[-1], min(perseus, key=lambda p: p.energy_j)])
    assert round(100 * at_fastest.energy_at_iso_time, 1) == iso_time_pct
    assert round(100 * at_least.time_at_iso_energy, 1) == iso_energy_pct


@pytest.mark.parametrize("method", list(ac.METHODS))
@pytest.mark.parametrize("config", ac.CONFIGS)
def test_files_step_one_millisecond_per_iteration(method, config):
    plans = ac.plans_of(method, config)
    assert len(plans) == 10
    assert ac.solver_step_deviation(method, config) < 1e-9
    grid = set(ac.ARTIFACT_CLOCKS)
    for p in plans:
        assert [len(c) for c in p.clocks] == [len(k) for k in ac.ARTIFACT_ORDER]
        assert {f for c in p.clocks for f in c} <= grid, p.path


def test_slowest_plan_inferred():
    slowest, *files = ac.measured_points("perseus", LLAMA)
    assert slowest.inferred and files[-1].label == "fastest"
    assert slowest.time_s == pytest.approx(5.113 + 1.901)
    assert ac._steady(slowest.clocks) == "F930/B900|F1020/B1020"


def test_simulated_iteration_is_the_1f1b_critical_path():
    """With stage 0 the slower, 2 stages x 8 microbatches of 1F1B take stage 0's first
    forward, its steady pairs and last backward, and stage 1's first and last pairs:
    7 (F0 + B0) + 2 (F1 + B1); energy is 8 GPUs x (effective + 2 stages x 85 W x T)."""
    dag = ac._dag()
    per = {(0, "forward"): (1.0, 10.0), (0, "backward"): (3.0, 30.0),
           (1, "forward"): (0.9, 9.0), (1, "backward"): (2.7, 27.0)}
    costs = {key: dict.fromkeys(ac.ARTIFACT_CLOCKS, value) for key, value in per.items()}
    clocks = [[1410] * len(k) for k in ac.ARTIFACT_ORDER]
    result = ac.simulate(dag, costs, clocks)
    assert result["time_s"] == pytest.approx(7 * 4.0 + 2 * 3.6)
    assert result["critical"] == [14, 4]
    effective = 8 * (10.0 + 30.0 + 9.0 + 27.0)
    assert result["effective_j"] == pytest.approx(effective)
    assert result["energy_j"] == pytest.approx(8 * (effective + 2 * 85.0 * result["time_s"]))
