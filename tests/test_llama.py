"""The bundled Llama's shapes: grouped-query attention and Qwen3's query/key norms against
reference computations on real tensors, the config's checks, and the tensor-parallel
degrees it refuses; the Megatron layout against the torchtitan one (the same function,
sharded alike, Megatron's collectives per block) and the vocab-parallel logits."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import analysed, init_fake_pg, skip_unless_fake_collectives_compute

from kareus.models.llama import (
    Attention,
    Llama,
    LlamaConfig,
    ModelConfigError,
    TensorParallelDegreeError,
    apply_rotary,
    check_tensor_parallel,
    megatron_state_dict,
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


# The Megatron layout: fused QKV grouped by key/value head, fused gate-up interleaved by
# channel; the same function as the torchtitan layout given the same weights rearranged.

LAYOUT_CONFIGS = [
    LlamaConfig(dim=64, n_heads=8, n_kv_heads=2, ffn_dim=96, n_layers=2, max_seq_len=16),
    LlamaConfig(dim=64, n_heads=4, n_kv_heads=1, head_dim=32, n_layers=1, max_seq_len=16),
    LlamaConfig(dim=64, n_heads=4, n_kv_heads=2, head_dim=24, qk_norm=True, n_layers=2,
                max_seq_len=16),
    LlamaConfig(dim=64, n_heads=4, ffn_dim=96, n_layers=1, max_seq_len=16),
]
LAYOUT_IDS = ["gqa", "mqa-wide-heads", "qwen3-like", "mha"]


def _pair(cfg: LlamaConfig) -> tuple[Llama, Llama]:
    """A torchtitan-layout Llama with random weights (norms too) and the Megatron-layout
    one loaded with them rearranged."""
    torch.manual_seed(0)
    titan = Llama(cfg)
    for name, p in titan.named_parameters():
        if "norm" in name:
            p.data.uniform_(0.5, 1.5)
    megatron = Llama(cfg, "megatron")
    megatron.load_state_dict(megatron_state_dict(titan.state_dict(), cfg))
    return titan, megatron


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    def local(g):
        return g.to_local() if hasattr(g, "to_local") else g

    return {n: local(p.grad) for n, p in model.named_parameters()}


@pytest.mark.parametrize("cfg", LAYOUT_CONFIGS, ids=LAYOUT_IDS)
def test_the_megatron_layout_computes_the_torchtitan_layouts_function(cfg):
    titan, megatron = _pair(cfg)
    names = set(dict(megatron.named_parameters()))
    assert {"layers.0.attention.wqkv.weight", "layers.0.feed_forward.w13.weight"} <= names
    assert not any(f".{w}." in n for n in names for w in ("wq", "wk", "wv", "w1", "w3"))
    assert cfg.parameters == sum(p.numel() for p in megatron.parameters())
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    expected, got = titan(tokens), megatron(tokens)
    torch.testing.assert_close(got, expected)
    F.cross_entropy(expected.flatten(0, 1), tokens.flatten()).backward()
    F.cross_entropy(got.flatten(0, 1), tokens.flatten()).backward()
    want = megatron_state_dict(_grads(titan), cfg)
    assert want.keys() == _grads(megatron).keys()
    for name, grad in _grads(megatron).items():
        torch.testing.assert_close(grad, want[name], msg=name)


def test_the_fused_qkv_rows_are_grouped_by_key_value_head_as_megatron_lays_them():
    """Per key/value head: its query heads' rows, its key rows, its value rows (Megatron-
    Core's linear_qkv, split by get_query_key_value_tensors)."""
    cfg = LlamaConfig(dim=8, n_heads=4, n_kv_heads=2, head_dim=2, ffn_dim=3, n_layers=1)
    rows = {name: torch.arange(n, dtype=torch.float)[:, None].expand(n, cfg.dim) + base
            for name, n, base in (("wq", 8, 100), ("wk", 4, 200), ("wv", 4, 300),
                                  ("w1", 3, 400), ("w3", 3, 500))}
    state = {f"layers.0.{'attention' if n[1] in 'qkv' else 'feed_forward'}.{n}.weight": w
             for n, w in rows.items()}
    fused = megatron_state_dict(state, cfg)
    assert fused["layers.0.attention.wqkv.weight"][:, 0].tolist() == [
        100, 101, 102, 103, 200, 201, 300, 301,  # group 0: query heads 0-1, key 0, value 0
        104, 105, 106, 107, 202, 203, 302, 303,  # group 1: query heads 2-3, key 1, value 1
    ]
    assert fused["layers.0.feed_forward.w13.weight"][:, 0].tolist() == [
        400, 500, 401, 501, 402, 502]  # gate and up of each channel, channel by channel


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_a_contiguous_shard_of_the_fused_weights_holds_its_ranks_heads_and_channels(tp):
    """For every degree dividing the key/value heads and the FFN width, rank r's contiguous
    shard of ``wqkv`` and ``w13`` is the fusion of rank r's torchtitan shards: one weight
    layout serves every tensor-parallel degree."""
    cfg = LlamaConfig(dim=16, n_heads=16, n_kv_heads=8, head_dim=4, ffn_dim=24, n_layers=1)
    titan, _ = _pair(cfg)
    full = megatron_state_dict(titan.state_dict(), cfg)
    local_cfg = LlamaConfig(dim=16, n_heads=16 // tp, n_kv_heads=8 // tp, head_dim=4,
                            ffn_dim=24 // tp, n_layers=1)
    for rank in range(tp):
        local = {n: w.chunk(tp)[rank] if any(f".{k}." in n for k in ("wq", "wk", "wv", "w1",
                                                                       "w3")) else w
                 for n, w in titan.state_dict().items()}
        fused = megatron_state_dict(local, local_cfg)
        for name in ("layers.0.attention.wqkv.weight", "layers.0.feed_forward.w13.weight"):
            torch.testing.assert_close(fused[name], full[name].chunk(tp)[rank])


@pytest.mark.parametrize("cfg", [LAYOUT_CONFIGS[i] for i in (0, 2, 3)],
                         ids=[LAYOUT_IDS[i] for i in (0, 2, 3)])
def test_the_sharded_layouts_compute_the_same_on_a_fake_group(cfg, fake_pg_numbers):
    """Sharded over a fake group of 2 ranks (its all-reduces return this rank's part, its
    all-gathers repeat it), rank 0 of each layout computes from the same query heads, keys,
    values and FFN channels, so the same output; its local gradients are the rearranged
    ones of the torchtitan shards."""
    from torch.distributed.device_mesh import init_device_mesh

    titan, megatron = _pair(cfg)
    mesh = init_device_mesh("cpu", (2,))
    for model in (titan, megatron):
        parallelize_llama(model, mesh)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    expected, got = titan(tokens), megatron(tokens)
    torch.testing.assert_close(got, expected)
    for logits in (expected, got):
        F.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    half = LlamaConfig(dim=cfg.dim, n_heads=cfg.n_heads // 2, n_kv_heads=cfg.n_kv_heads // 2,
                       head_dim=cfg.head_dim, ffn_dim=cfg.ffn_dim // 2, n_layers=cfg.n_layers,
                       qk_norm=cfg.qk_norm)
    want = megatron_state_dict(_grads(titan), half)
    for name, grad in _grads(megatron).items():  # summed in another order: float rounding
        scale = want[name].abs().max().item()
        torch.testing.assert_close(grad, want[name], rtol=1e-5, atol=1e-6 * scale, msg=name)


def _per_block(graphs) -> dict[str, dict[str, int]]:
    counts: dict[str, dict[str, int]] = {}
    for _, a in graphs:
        kinds = counts.setdefault(a.kind, {})
        for c in a.collectives:
            kinds[c.kind] = kinds.get(c.kind, 0) + 1
    return counts


@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qwen3"])
@pytest.mark.parametrize("layout, sp, forward, backward", [
    ("megatron", False, {"all_reduce": 2}, {"all_reduce": 2}),
    ("torchtitan", False, {"all_reduce": 2}, {"all_reduce": 5}),
    ("megatron", True, {"all_gather": 2, "reduce_scatter": 2},
     {"all_gather": 2, "reduce_scatter": 2}),
])
def test_a_tensor_parallel_block_runs_megatrons_collectives_in_the_megatron_layout(
    layout, sp, forward, backward, qk_norm, fake_pg
):
    """Without sequence parallelism Megatron all-reduces twice per block forward (after
    the attention and MLP output projections) and twice backward (the input gradients of
    its two column-parallel projections); torchtitan's separate projections all-reduce five
    input gradients. Counted in the graphs traced on a fake group of 2 ranks."""
    from kareus.models.llama import fake_parallel_llama

    cfg = LlamaConfig(dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128, n_layers=1,
                      max_seq_len=16, qk_norm=qk_norm)
    with fake_parallel_llama(cfg, 2, sequence_parallel=sp, layout=layout) as llama:
        h = torch.empty(2, 8 if sp else 16, cfg.dim, requires_grad=True)
        graphs = analysed(llama.layers[0], h, llama.rope_cos, llama.rope_sin)
    assert _per_block(graphs) == {"forward": forward, "backward": backward}


def test_vocab_parallel_logits_stay_sharded_and_give_the_same_loss():
    """With ``loss_parallel`` the output projection leaves its logits sharded on the
    vocabulary (a DTensor), and the cross-entropy under torch's ``loss_parallel()`` is the
    replicated one's (over a fake group of one rank)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import loss_parallel

    cfg = LAYOUT_CONFIGS[0]
    _, plain = _pair(cfg)
    _, sharded = _pair(cfg)
    init_fake_pg(1)
    try:
        parallelize_llama(sharded, init_device_mesh("cpu", (1,)), loss_parallel=True)
        tokens = torch.randint(0, cfg.vocab_size, (2, 16))
        logits = sharded(tokens)
        assert logits.placements == (Shard(2),)
        expected = F.cross_entropy(plain(tokens).flatten(0, 1), tokens.flatten())
        with loss_parallel():
            got = F.cross_entropy(logits.flatten(0, 1), tokens.flatten())
            got.backward()
        torch.testing.assert_close(got.full_tensor(), expected)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("build", [
    lambda: Llama(GQA, "nemo"),
    lambda: Attention(GQA, layout="Megatron"),
])
def test_an_unknown_layout_is_refused_naming_it(build):
    with pytest.raises(ModelConfigError, match="Llama layout must be one of 'torchtitan', "
                       "'megatron', got '(nemo|Megatron)'"):
        build()
