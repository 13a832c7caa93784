"""The bundled Llama's shapes: grouped-query attention and Qwen3's query/key norms against
reference computations on real tensors, the config's checks, and the tensor-parallel
degrees it refuses."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import init_fake_pg, skip_unless_fake_collectives_compute

from kareus.models.llama import (
    Attention,
    Llama,
    LlamaConfig,
    ModelConfigError,
    TensorParallelDegreeError,
    apply_rotary,
    check_tensor_parallel,
    parallelize_llama,
    rotary_tables,
)

GQA = LlamaConfig(dim=64, n_heads=8, n_kv_heads=2, n_layers=1, ffn_dim=96, max_seq_len=16)


def _reference(attn: Attention, cfg: LlamaConfig, x: torch.Tensor) -> torch.Tensor:
    """Attention written out: each key/value head repeated for its group of query heads."""
    bsz, seq, _ = x.shape
    cos, sin = rotary_tables(cfg)
    q = (x @ attn.wq.weight.T).view(bsz, seq, cfg.n_heads, cfg.head_dim)
    k = (x @ attn.wk.weight.T).view(bsz, seq, cfg.n_kv_heads, cfg.head_dim)
    v = (x @ attn.wv.weight.T).view(bsz, seq, cfg.n_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        def rms(t, w):
            return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * w
        q, k = rms(q, attn.q_norm.weight), rms(k, attn.k_norm.weight)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    group = cfg.n_heads // cfg.n_kv_heads
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = (q.transpose(1, 2) @ k.transpose(1, 2).transpose(-1, -2)) / cfg.head_dim ** 0.5
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    out = (probs @ v.transpose(1, 2)).transpose(1, 2).reshape(bsz, seq, -1)
    return out @ attn.wo.weight.T


@pytest.mark.parametrize("cfg", [
    GQA,
    LlamaConfig(dim=64, n_heads=4, n_kv_heads=1, head_dim=32, n_layers=1, max_seq_len=16),
    LlamaConfig(dim=64, n_heads=4, n_kv_heads=2, head_dim=24, qk_norm=True, n_layers=1,
                max_seq_len=16),
], ids=["gqa", "mqa-wide-heads", "qwen3-like"])
def test_grouped_query_attention_matches_repeated_keys_and_values(cfg):
    torch.manual_seed(0)
    attn = Attention(cfg)
    if cfg.qk_norm:  # not the ones they start as: the norms must be applied per head
        for norm in (attn.q_norm, attn.k_norm):
            norm.weight.data.uniform_(0.5, 1.5)
    x = torch.randn(2, 16, cfg.dim)
    cos, sin = rotary_tables(cfg)
    assert attn.wk.weight.shape == (cfg.n_kv_heads * cfg.head_dim, cfg.dim)
    torch.testing.assert_close(attn(x, cos, sin), _reference(attn, cfg, x))


def test_a_multi_head_config_resolves_as_before():
    cfg = LlamaConfig()
    assert (cfg.n_kv_heads, cfg.head_dim, cfg.qk_norm) == (cfg.n_heads, cfg.dim // cfg.n_heads,
                                                          False)
    names = set(Llama(cfg).state_dict())
    assert not any("q_norm" in n or "k_norm" in n for n in names)
    assert cfg.parameters == sum(p.numel() for p in Llama(cfg).parameters())


@pytest.mark.parametrize("cfg", [
    GQA, LlamaConfig(dim=64, n_heads=4, n_kv_heads=2, head_dim=24, qk_norm=True),
], ids=["gqa", "qwen3-like"])
def test_parameters_counts_the_built_model(cfg):
    assert cfg.parameters == sum(p.numel() for p in Llama(cfg).parameters())


@pytest.mark.parametrize("fields, message", [
    ({"n_heads": 8, "n_kv_heads": 3}, "n_heads 8 must be a multiple of n_kv_heads 3"),
    ({"n_heads": 4, "n_kv_heads": 8}, "n_heads 4 must be a multiple of n_kv_heads 8"),
    ({"head_dim": 15}, "head_dim 15 must be even"),
    ({"n_kv_heads": 0}, "n_kv_heads must be an integer >= 1, got 0"),
    ({"qk_norm": 1}, "qk_norm must be True or False, got 1"),
    ({"rope_theta": 0.0}, "rope_theta must be a finite number > 0, got 0.0"),
    ({"dim": 200, "n_heads": 3}, "Llama dim 200 must split into 3 heads of an even width"),
])
def test_a_config_that_cannot_run_is_refused_where_it_is_made(fields, message):
    with pytest.raises(ModelConfigError, match=message):
        LlamaConfig(**fields)


def test_explicit_head_dim_need_not_split_dim():
    cfg = LlamaConfig(dim=64, n_heads=4, head_dim=32)
    assert Attention(cfg).wo.weight.shape == (64, 4 * 32)


@pytest.mark.parametrize("cfg, degree, names, not_named", [
    (LlamaConfig(n_heads=8, n_kv_heads=2, ffn_dim=128), 4, "KV heads (2)", "heads (8)"),
    (LlamaConfig(n_heads=4, ffn_dim=100), 8, "heads (4), KV heads (4) and ffn_dim (100)", None),
    (LlamaConfig(n_heads=8, n_kv_heads=8, ffn_dim=100), 8, "ffn_dim (100)", "heads"),
])
def test_tensor_parallel_degrees_that_do_not_split_are_refused_naming_which(
    cfg, degree, names, not_named
):
    with pytest.raises(TensorParallelDegreeError) as raised:
        check_tensor_parallel(cfg, degree)
    message = str(raised.value)
    assert f"{names} must be divisible by the tensor-parallel degree {degree}" in message
    if not_named:
        assert not_named not in message


def test_the_parallel_plan_of_query_and_key_norms_computes_the_same():
    """Sharded over one rank (a fake group of one: its collectives are what one rank
    does), the plan's DTensor layouts of the per-head norms give the unsharded model's
    output and gradients."""
    from torch.distributed.device_mesh import init_device_mesh

    cfg = LlamaConfig(dim=64, n_heads=4, n_kv_heads=2, head_dim=24, qk_norm=True, n_layers=1,
                      max_seq_len=16)
    torch.manual_seed(0)
    plain = Llama(cfg)
    sharded = Llama(cfg)
    sharded.load_state_dict(plain.state_dict())
    init_fake_pg(1)
    try:
        skip_unless_fake_collectives_compute()
        parallelize_llama(sharded, init_device_mesh("cpu", (1,)))
        tokens = torch.randint(0, cfg.vocab_size, (2, 16))
        expected, got = plain(tokens), sharded(tokens)
        torch.testing.assert_close(got, expected)
        F.mse_loss(expected, torch.zeros_like(expected)).backward()
        F.mse_loss(got, torch.zeros_like(got)).backward()
        q_norm = sharded.layers[0].attention.q_norm.weight.grad
        q_norm = q_norm.full_tensor() if hasattr(q_norm, "full_tensor") else q_norm
        torch.testing.assert_close(q_norm, plain.layers[0].attention.q_norm.weight.grad)
    finally:
        dist.destroy_process_group()
