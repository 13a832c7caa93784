"""End to end on 2 gloo processes: the kareus-compiled TP Llama trains like eager."""

import pytest

from kareus.demo import DemoConfig, run
from kareus.models.llama import LlamaConfig

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    "lowering, sequence_parallel",
    [("inductor", False), ("eager", False), ("inductor", True)],
    ids=["tp-inductor", "tp-eager", "sp-inductor"],
)
def test_training_matches_eager(lowering, sequence_parallel):
    steps = 3
    cfg = DemoConfig(
        steps=steps,
        model=LlamaConfig(n_layers=2),
        sequence_parallel=sequence_parallel,
        options={"lowering": lowering},
        compare_eager=True,
    )
    results = run(cfg)
    assert [r.rank for r in results] == [0, 1]
    for r in results:
        assert len(r.losses) == steps
        for compiled, eager in zip(r.losses, r.eager_losses):
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
