"""What the ``verify`` option accepts: outputs judged against their scale, kernel state
skipped (``kareus.verify``). End to end (a wrong rewrite runs unrewritten):
``tests/planner/test_step.py``."""

import operator

import pytest
import torch
import torch.fx

from kareus.verify import outputs_mismatch, scaled_error, state_outputs, tolerance


def _gradient() -> torch.Tensor:
    """A weight gradient's shape of values: large sums and sums whose terms cancel."""
    g = torch.randn(256, 64, generator=torch.Generator().manual_seed(0)) * 1e3
    g[::7] = 1e-3
    return g


def test_a_sum_reordered_passes_where_elementwise_tolerances_fail():
    expected = _gradient()
    got = expected + 1e-6 * expected.abs().max() * torch.randn(expected.shape)
    with pytest.raises(AssertionError):  # the near-zero sums miss any relative tolerance
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert 1e-6 < scaled_error(expected, got) < 1e-5
    assert outputs_mismatch((expected,), (got,)) is None


def test_a_wrong_rewrite_moves_an_output_by_part_of_its_scale():
    expected = _gradient()
    swapped = expected.clone()
    swapped[[0, 1]] = expected[[1, 0]]  # two rows of two nanobatches exchanged
    assert "output 1: largest difference" in outputs_mismatch((1, expected), (1, swapped))
    halved = expected.clone()
    halved[128:] /= 2  # one nanobatch's partial sum dropped
    assert outputs_mismatch((expected,), (halved,)) is not None


def test_low_precision_outputs_get_a_few_rounding_steps():
    expected = _gradient().bfloat16()
    scale = float(expected.float().abs().max())
    rounded = (expected.float() + 2 * 2**-8 * scale).bfloat16()  # 2 bf16 steps at the top
    assert outputs_mismatch((expected,), (rounded,)) is None
    assert outputs_mismatch((expected,), ((expected.float() * 1.1).bfloat16(),)) is not None
    assert tolerance(torch.bfloat16) == 8 * 2**-7 and tolerance(torch.float32) == 1e-4


def test_non_finite_values_and_integers_must_match_exactly():
    expected = _gradient()
    nan = expected.clone()
    nan[3, 3] = float("nan")
    assert scaled_error(expected, nan) == float("inf")
    assert outputs_mismatch((nan,), (nan.clone(),)) is None  # the same NaNs
    assert scaled_error(expected, expected[:-1]) == float("inf")
    indices = torch.arange(8)
    flipped = outputs_mismatch((indices,), (indices.flip(0),))
    assert flipped == "output 0: torch.int64 (8,) not equal"
    assert outputs_mismatch((indices,), (indices,)) is None


def _attention_graph(op: torch._ops.OpOverload, outputs: tuple[int, ...]) -> torch.fx.GraphModule:
    """A graph returning some of a fused attention kernel's results (built, never run: the
    kernels are CUDA's)."""
    graph = torch.fx.Graph()
    q, k, v = (graph.placeholder(name) for name in "qkv")
    call = graph.call_function(op, (q, k, v))
    graph.output(tuple(graph.call_function(operator.getitem, (call, i)) for i in outputs))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def test_the_dropout_state_of_fused_attention_is_not_compared():
    aten = torch.ops.aten
    flash = _attention_graph(aten._scaled_dot_product_flash_attention.default, (0, 1, 6, 7))
    assert state_outputs(flash) == {2, 3}  # rng_state, unused
    efficient = _attention_graph(aten._scaled_dot_product_efficient_attention.default,
                                 (0, 2, 3, 1))
    assert state_outputs(efficient) == {1, 2}  # philox seed and offset
    out = torch.ones(4)
    seed = torch.tensor(140498136222624)  # as an H200's flash kernel left it
    other = torch.tensor(17252883692304)
    assert outputs_mismatch((out, seed), (out, other)) is not None
    assert outputs_mismatch((out, seed), (out, other), state=frozenset({1})) is None
