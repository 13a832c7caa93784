"""End to end on 2 gloo processes: the kareus-compiled TP Llama trains like eager."""

import pytest
from gloo import fork_the_demo

from kareus.demo import DemoConfig, run
from kareus.models.llama import LlamaConfig

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def forked(monkeypatch):
    fork_the_demo(monkeypatch)


@pytest.mark.parametrize(  # with Inductor: the zoo's Llamas (TP and SP), tests/test_backend.py
    "lowering, sequence_parallel",
    [("eager", False)],
    ids=["tp-eager"],
)
def test_training_matches_eager(lowering, sequence_parallel):
    steps = 3
    cfg = DemoConfig(
        steps=steps,
        model=LlamaConfig(n_layers=2),
        sequence_parallel=sequence_parallel,
        # a small search: the numerics and the plan's clock switches are what is tested
        options={"lowering": lowering, "search_budget": 6},
        compare_eager=True,
    )
    results = run(cfg)
    assert [r.rank for r in results] == [0, 1]
    for r in results:
        assert len(r.losses) == steps
        for compiled, eager in zip(r.losses, r.reference_losses):
            assert compiled == pytest.approx(eager, rel=1e-5, abs=1e-6)
        assert max(r.max_grad_diff) < 1e-5, r.max_grad_diff
        forward, backward = r.reports
        assert (forward.kind, backward.kind) == ("forward", "backward")
        assert forward.collectives and backward.collectives and forward.partitions
        # one clock switch per graph execution, in execution order
        assert [graph for graph, _ in r.clock_switches] == [forward.label, backward.label] * steps
    assert results[0].losses == pytest.approx(results[1].losses, rel=1e-6)
    # ranks compiled the same graphs and found the same partitions
    keys = [[p.key for rep in r.reports for p in rep.partitions] for r in results]
    assert keys[0] == keys[1]


@pytest.mark.parametrize(
    "sequence_parallel, k, lowering, seed",
    [  # with Inductor at k = 2: the zoo's Llamas (torchtitan's under SP)
        (False, 4, "eager", 2),
        (True, 2, "eager", 3),
        (True, 4, "eager", 4),
    ],
    ids=["tp-k4-eager", "sp-k2-eager", "sp-k4-eager"],
)
def test_nanobatched_training_matches_unrewritten(sequence_parallel, k, lowering, seed):
    """Random launch slots, forward and backward: outputs and all parameter gradients."""
    steps = 2
    cfg = DemoConfig(
        steps=steps,
        model=LlamaConfig(n_layers=2),
        sequence_parallel=sequence_parallel,
        options={"lowering": lowering, "nanobatches": k, "profile": "off"},  # numerics only
        compare_eager=True,
        # the same compile, unrewritten (profiling on would plan, and might rewrite, it)
        reference_options={"lowering": lowering, "profile": "off"},
        slot_seed=seed,
    )
    results = run(cfg)
    for r in results:
        rewritten = [rep for rep in r.reports if rep.nanobatches == k]
        assert [rep.kind for rep in rewritten] == ["forward", "backward"]
        assert any(any(v.variant.slots) for v in rewritten), "slots were drawn, not all earliest"
        for compiled, reference in zip(r.losses, r.reference_losses):
            assert compiled == pytest.approx(reference, rel=1e-5, abs=1e-6)
        assert max(r.max_grad_diff) < 1e-5, r.max_grad_diff
    # every rank drew the same variant for every graph
    assert [rep.variant for rep in results[0].reports] == [
        rep.variant for rep in results[1].reports
    ]
