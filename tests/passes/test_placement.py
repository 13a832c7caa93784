"""Placement rules on small traced graphs."""

import pytest
import sympy
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from kareus.passes.ops import OP_TABLE
from kareus.passes.placement import PARTIAL, REPLICATE, Split, Whole, _reshaped, propagate
from kareus.passes.reasons import Reason, ReasonKind
from kareus.passes.sizes import SymbolicSize, SymbolicSizeRead

aten = torch.ops.aten


@pytest.mark.parametrize(
    "src, dst, split, k, expected",
    [
        ((4, 16, 64), (64, 64), Split(0), 2, Split(0)),  # merge batch and sequence
        ((64, 32), (4, 16, 32), Split(0), 2, Split(0)),  # and split them back
        ((4, 16, 64), (4, 16, 4, 16), Split(0), 4, Split(0)),  # heads
        ((1, 4, 16), (4, 16), Split(1), 2, Split(0)),  # leading 1s do not matter
        ((16, 4), (64,), Split(1), 2, ReasonKind.ALONG_SPLIT_DIM),  # split dim is inner
        ((4, 16), (2, 32), Split(0), 4, ReasonKind.ALONG_SPLIT_DIM),  # 2 rows for 4 nanobatches
    ],
)
def test_reshape_follows_the_split_dim(src, dst, split, k, expected):
    result = _reshaped(split, src, dst, k)
    assert (result.kind if isinstance(result, Reason) else result) == expected


_B = SymbolicSize(sympy.Symbol("s0", positive=True, integer=True), 6)  # a dynamic batch


@pytest.mark.parametrize(
    "src, dst, expected",
    [
        ((_B, 16, 64), (16 * _B, 64), Split(0)),  # merge batch and sequence: units of 16 rows
        ((16 * _B, 64), (_B, 16, 64), Split(0)),  # and split them back
        ((16 * _B, 64), (4 * _B, 4, 64), Split(0)),
        ((16 * _B,), (16, _B), ReasonKind.SYMBOLIC_SHAPES),  # would cut inside batch units
        ((_B, 16), (2 * _B, 8), Split(0)),  # a sample as 2 rows of 8
        ((_B, 16), (16, _B), ReasonKind.SYMBOLIC_SHAPES),
    ],
)
def test_a_reshape_cuts_a_symbolic_split_dim_only_in_batch_units(src, dst, expected):
    """Without a guard: a symbolic size is equal to its expression only, never a number."""
    result = _reshaped(Split(0), src, dst, 2)
    assert (result.kind if isinstance(result, Reason) else result) == expected


def test_a_rule_computing_with_a_symbolic_size_ends_the_split_with_its_reason():
    with pytest.raises(SymbolicSizeRead, match="s0"):
        _B % 2
    assert _B == SymbolicSize(_B.expr, 7) and _B != 6 and 2 * _B == _B * 2


def _placements(fn, *args, split_inputs=(0,), k=2):
    gm = make_fx(fn)(*args)
    inputs = list(gm.graph.find_nodes(op="placeholder"))
    result = propagate(gm.graph, {inputs[i]: Split(0) for i in split_inputs}, k, OP_TABLE)
    return gm, {n.name: p for n, p in result.placements.items()}, result


def _barriers(result):
    """(node, kind) of every barrier, in graph order."""
    return [(b.node, b.kind) for b in result.barriers]


def test_matmuls_keep_rows_and_turn_split_contractions_into_partial_sums():
    x, w = torch.randn(8, 4), torch.randn(4, 3)
    _, p, _ = _placements(lambda x, w: (x @ w, x.t() @ (x @ w)), x, w)
    assert p["mm"] == Split(0) and p["t"] == Split(1) and p["mm_2"] == PARTIAL
    assert p["w_1"] == REPLICATE


def test_sums_over_the_batch_are_partial_other_reductions_are_barriers():
    _, p, result = _placements(lambda x: (x.sum(0) * 2, x.mean(0), x.sum(1)), torch.randn(8, 4))
    assert p["sum_1"] == PARTIAL and p["mul"] == PARTIAL and p["sum_2"] == Split(0)
    assert isinstance(p["mean"], Whole) and p["mean"].reason == result.barriers[0]
    assert _barriers(result) == [("mean", ReasonKind.ALONG_SPLIT_DIM)]
    assert result.barriers[0].detail == "reduction over the split dim"  # no node name prefix


def test_broadcasting_and_replicated_operands():
    x, bias, per_row = torch.randn(8, 4), torch.randn(4), torch.randn(8, 1)
    _, p, result = _placements(lambda x, b, r: (x + b) * r, x, bias, per_row)
    # a replicated operand spanning the split dim is sliced, one of size 1 broadcasts
    assert p["mul"] == Split(0) and result.barriers == ()


def test_partial_sums_only_pass_linear_ops():
    _, p, result = _placements(
        lambda x: (x.sum(0) + 1, -x.sum(0), x.sum(0) * x.sum(0)), torch.randn(8, 4)
    )
    assert isinstance(p["add"], Whole) and p["neg"] == PARTIAL
    assert _barriers(result) == [("add", ReasonKind.PARTIAL_SUM), ("mul", ReasonKind.PARTIAL_SUM)]


def test_batch_varying_operands_that_are_not_split_end_the_region():
    """A bias with one row per sample, given whole, where the rule cannot slice it."""
    x, w, per_row = torch.randn(8, 4), torch.randn(4, 3), torch.randn(8, 3)
    _, _, result = _placements(torch.addmm, per_row, x, w, split_inputs=(1,))
    assert _barriers(result) == [("addmm", ReasonKind.BATCH_VARYING_OPERAND)]
    # after a concatenation along the split dim, a whole value cannot be sliced like it
    _, _, result = _placements(lambda x, r: torch.cat([x, x]) + r, x, torch.randn(16, 4))
    assert _barriers(result) == [("add", ReasonKind.BATCH_VARYING_OPERAND)]


def test_operands_split_along_different_dims():
    x = torch.randn(4, 4)
    _, _, result = _placements(lambda x, y: x + y.t(), x, x, split_inputs=(0, 1))
    assert _barriers(result) == [("add", ReasonKind.OPERANDS_SPLIT_APART)]


def test_random_ops_and_ops_without_a_rule_run_on_the_whole_batch():
    _, _, result = _placements(lambda x: (torch.rand_like(x), x.flip(1)), torch.randn(4, 4))
    assert _barriers(result) == [("rand_like", ReasonKind.RANDOM), ("flip", ReasonKind.NO_RULE)]


@pytest.mark.parametrize("mask_batch", [1, 4], ids=["broadcast-mask", "per-sample-mask"])
def test_attention_splits_with_a_broadcast_or_a_per_sample_mask(mask_batch):
    """Hugging Face builds one mask per sample: it is cut per nanobatch, not a barrier."""
    import torch.nn.functional as F

    q = torch.randn(4, 2, 8, 16)
    mask = torch.randn(mask_batch, 1, 8, 8)
    gm, p, result = _placements(
        lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m), q, q, q, mask,
        split_inputs=(0, 1, 2),
    )
    (attention,) = [n for n in gm.graph.nodes if "attention" in str(n.target)]
    assert p[attention.name][0] == Split(0) and result.barriers == ()


# -- rules for the ops of the models people train (one test per rule) ---------------------


def test_complex_rope_keeps_the_batch_split():
    """Llama 3 (torchtitan) rotates pairs as complex numbers: view_as_complex / view_as_real."""
    x, freqs = torch.randn(4, 6, 2, 8), torch.polar(torch.ones(6, 1, 4), torch.randn(6, 1, 4))

    def rope(x, f):
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * f).flatten(3)

    _, p, result = _placements(rope, x, freqs)
    assert p["view_as_complex"] == Split(0) and p["view_as_real"] == Split(0)
    assert result.barriers == ()


def test_gather_by_split_ids_and_padding_off_the_split_dim():
    """Cross-entropy picks each row's target with gather; HF pads the labels by one token."""
    logits, labels = torch.randn(4, 10), torch.randint(0, 10, (4, 1))
    _, p, result = _placements(
        lambda x, y: x.gather(1, torch.nn.functional.pad(y, (0, 1))[:, :1]), logits, labels,
        split_inputs=(0, 1),
    )
    assert p["constant_pad_nd"] == Split(0) and p["gather"] == Split(0) and result.barriers == ()
    _, p, result = _placements(
        lambda y: torch.nn.functional.pad(y, (0, 0, 1, 0)), torch.randn(4, 3)
    )
    assert _barriers(result) == [("constant_pad_nd", ReasonKind.ALONG_SPLIT_DIM)]


def test_table_rows_picked_by_split_positions():
    """A frequency table indexed by (split) positions, torchtitan 0.3's RoPE."""
    _, p, _ = _placements(
        lambda pos, t: t.index_select(0, pos), torch.arange(4), torch.randn(16, 8)
    )
    assert p["index_select"] == Split(0)


@pytest.mark.parametrize("reduction, expected", [("none", Split(0)), ("sum", PARTIAL)])
def test_nll_loss_rows_and_sums(reduction, expected):
    _, p, result = _placements(
        lambda x, y: torch.nn.functional.nll_loss(x, y, reduction=reduction),
        torch.randn(8, 5).log_softmax(-1), torch.randint(0, 5, (8,)), split_inputs=(0, 1),
    )
    (loss,) = [n for n in p if n.startswith("nll_loss_forward")]
    assert p[loss][0] == expected and result.barriers == ()


def test_slice_backward_writes_split_rows():
    src = torch.randn(4, 3)
    _, p, result = _placements(
        lambda s: torch.ops.aten.slice_scatter(torch.zeros(4, 5), s, 1, 1, 4), src
    )
    assert p["slice_scatter"] == Split(0) and result.barriers == ()


def _meta(*shape):
    return torch.empty(*shape, device="meta")


@pytest.mark.parametrize(
    "forward, backward",
    [
        (
            lambda q, k, v: aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True),
            lambda g, q, k, v, o, lse, f: aten._scaled_dot_product_flash_attention_backward(
                g, q, k, v, o, lse, f[2], f[3], 8, 8, 0.0, True, f[6], f[7]
            ),
        ),
        (
            lambda q, k, v: aten._scaled_dot_product_efficient_attention(
                q, k, v, None, True, 0.0, True
            ),
            lambda g, q, k, v, o, lse, f: aten._scaled_dot_product_efficient_attention_backward(
                g, q, k, v, None, o, lse, f[2], f[3], 0.0, [True, True, True, False], True
            ),
        ),
        (
            lambda q, k, v: aten._scaled_dot_product_cudnn_attention(
                q, k, v, None, True, 0.0, True
            ),
            lambda g, q, k, v, o, lse, f: aten._scaled_dot_product_cudnn_attention_backward(
                g, q, k, v, o, lse, f[6], f[7], None, f[2], f[3], 8, 8, 0.0, True
            ),
        ),
    ],
    ids=["flash", "efficient", "cudnn"],
)
def test_gpu_attention_kernels_split_forward_and_backward(forward, backward):
    """The CUDA kernels, traced on meta tensors: outputs, logsumexp and gradients split."""

    def step(q, k, v, g):
        f = forward(q, k, v)
        return f[0], backward(g, q, k, v, f[0], f[1], f)

    q = _meta(4, 2, 8, 16)
    _, p, result = _placements(step, q, q, q, q, split_inputs=(0, 1, 2, 3))
    (fwd,) = [n for n in p if n.startswith("_scaled_dot") and "backward" not in n]
    (bwd,) = [n for n in p if n.startswith("_scaled_dot") and "backward" in n]
    assert p[fwd][:2] == (Split(0), Split(0)) and p[bwd][:3] == (Split(0),) * 3
    assert result.barriers == ()


def test_a_barrier_reading_a_per_nanobatch_value_says_so_and_keeps_its_kind():
    """An attention kernel's seed, read by an op without a rule: joining it keeps one copy."""
    q = _meta(4, 2, 8, 16)
    _, _, result = _placements(
        lambda q: aten._scaled_dot_product_flash_attention(q, q, q, 0.0, True)[6].flip(0), q
    )
    (barrier,) = result.barriers
    assert barrier.kind is ReasonKind.NO_RULE
    assert barrier.detail.endswith("it consumes a per-nanobatch value that cannot be joined")


def test_index_unbind_stack_and_ops_along_another_dim():
    """x[:, idx] with replicated ids; unbind / stack / cumsum / topk off the split dim."""
    x, idx = torch.randn(4, 6, 8), torch.tensor([0, 2, 5])

    def f(x, i):
        a, b = x.unbind(2)[:2]
        top = x.topk(2, dim=-1).values
        return x[:, i], torch.stack([a, b], dim=0), x.cumsum(1), top, x.sort(dim=1).values

    _, p, result = _placements(f, x, idx)
    assert p["index"] == Split(0) and p["stack"] == Split(1) and p["cumsum"] == Split(0)
    assert p["topk"] == (Split(0), Split(0)) and p["sort"] == (Split(0), Split(0))
    assert result.barriers == ()
    _, _, result = _placements(lambda x: x.cumsum(0), x)
    assert _barriers(result) == [("cumsum", ReasonKind.ALONG_SPLIT_DIM)]


def test_select_backward_writes_split_rows():
    _, p, result = _placements(
        lambda s: torch.ops.aten.select_scatter(torch.zeros(4, 5), s, 1, 2), torch.randn(4)
    )
    assert p["select_scatter"] == Split(0) and result.barriers == ()
