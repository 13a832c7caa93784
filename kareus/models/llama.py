"""A Llama-family decoder and its tensor-parallel plans.

Used by ``kareus demo``, the tests, the benchmarks and offline planning
(``kareus.offline``): RMSNorm, rotary embeddings, attention through
``scaled_dot_product_attention`` (multi-head, or grouped-query with fewer key/value heads
than query heads, as Llama 3 and Qwen3 have; optionally Qwen3's RMS norm of each query and
key head before the rotation) and a SwiGLU MLP, sharded with PyTorch's own
tensor-parallel API so the compiled graphs carry real functional collectives.

Two layouts of the same function (``LAYOUTS``; ``Llama(cfg, layout=...)``):

- "torchtitan" (the default): separate query, key and value projections and separate gate
  (``w1``) and up (``w3``) projections, as torchtitan and Hugging Face write Llama. Under
  tensor parallelism without sequence parallelism the backward all-reduces the block
  input's gradient once per column-parallel projection: 5 all-reduces per block.
- "megatron": one column-parallel QKV projection (``wqkv``) and one gate-up projection
  (``w13``), as Megatron-Core's ``linear_qkv`` and gated ``linear_fc1``: 2 all-reduces per
  block forward and 2 backward (one per column-parallel input). ``megatron_state_dict``
  rearranges a torchtitan layout's weights into it; the two compute the same function.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kareus.errors import KareusError


class TensorParallelDegreeError(KareusError, ValueError):
    """The model's heads or FFN width do not split evenly over the tensor-parallel ranks."""


class ModelConfigError(KareusError, ValueError):
    """A model shape the Llama cannot be built or run with."""


LAYOUTS = ("torchtitan", "megatron")
"""How a block's projections are laid out (the module docstring says what each is)."""


def check_layout(layout: object) -> str:
    """``layout`` if it is one of ``LAYOUTS``; a ``ModelConfigError`` naming it otherwise."""
    if layout not in LAYOUTS:
        raise ModelConfigError(
            f"Llama layout must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}"
        )
    return layout  # type: ignore[return-value]


@dataclass(frozen=True)
class LlamaConfig:
    """A Llama-family model's shapes.

    ``n_kv_heads``: the key/value heads (None: ``n_heads``, multi-head attention; fewer:
    grouped-query attention, each key/value head shared by ``n_heads // n_kv_heads`` query
    heads). ``head_dim``: each head's width (None: ``dim // n_heads``; Qwen3 gives its own,
    so ``n_heads * head_dim`` may differ from ``dim``). ``qk_norm``: RMS-norm each query and
    key head before the rotation (Qwen3). Both Nones are resolved when the config is made,
    so a ``dataclasses.replace`` that changes ``n_heads`` or ``dim`` keeps the resolved
    values: give them again.
    """

    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    ffn_dim: int = 128
    max_seq_len: int = 64
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    n_kv_heads: int | None = None
    head_dim: int | None = None
    qk_norm: bool = False

    def __post_init__(self) -> None:
        # Here, not at the first forward: a shape that cannot run fails where it is given.
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "ffn_dim", "max_seq_len"):
            _check_count(name, getattr(self, name))
        for name in ("n_kv_heads", "head_dim"):
            if getattr(self, name) is not None:
                _check_count(name, getattr(self, name))
        for name in ("norm_eps", "rope_theta"):
            value = getattr(self, name)
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not 0 < value < math.inf):
                raise ModelConfigError(f"Llama {name} must be a finite number > 0, got {value!r}")
        if not isinstance(self.qk_norm, bool):
            raise ModelConfigError(f"Llama qk_norm must be True or False, got {self.qk_norm!r}")
        if self.head_dim is None:
            if self.dim % self.n_heads or self.dim // self.n_heads % 2:
                raise ModelConfigError(
                    f"Llama dim {self.dim} must split into {self.n_heads} heads of an even width "
                    "(rotary embeddings rotate pairs of a head's channels)"
                )
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        elif self.head_dim % 2:
            raise ModelConfigError(
                f"Llama head_dim {self.head_dim} must be even "
                "(rotary embeddings rotate pairs of a head's channels)"
            )
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        elif self.n_heads % self.n_kv_heads:
            raise ModelConfigError(
                f"Llama n_heads {self.n_heads} must be a multiple of n_kv_heads "
                f"{self.n_kv_heads} (each key/value head serves a group of query heads)"
            )

    @property
    def layer_parameters(self) -> int:
        """Weights in one decoder layer: attention (and its q/k norms), MLP, two norms."""
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        attention = 2 * self.dim * q + 2 * self.dim * kv + (2 * self.head_dim if self.qk_norm
                                                             else 0)
        return attention + 3 * self.dim * self.ffn_dim + 2 * self.dim

    @property
    def parameters(self) -> int:
        """Weights in the model: embeddings, output, final norm, and every layer's."""
        return 2 * self.vocab_size * self.dim + self.dim + self.n_layers * self.layer_parameters


def _check_count(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelConfigError(f"Llama {name} must be an integer >= 1, got {value!r}")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary_tables(cfg: LlamaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    head_dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(cfg.max_seq_len).float(), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on ``x`` of shape (batch, seq, heads, head_dim): tables of the
    positions 0, 1, ... (seq, head_dim), or of each row's own positions (batch, seq,
    head_dim)."""
    seq = x.shape[1]
    if cos.ndim == 3:
        cos, sin = cos[:, :, None, :].to(x.dtype), sin[:, :, None, :].to(x.dtype)
    else:
        cos, sin = cos[:seq, None, :].to(x.dtype), sin[:seq, None, :].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class CausalAttention(nn.Module):
    """The attention kernel on (batch, heads, seq, head_dim) queries, keys and values.

    ``positions`` (batch, seq): where each query sits in its sequence, when the queries
    are one rank's part of it while the keys and values are the whole sequence (context
    parallelism, ``context_parallel_llama``, gathers them before this module runs): a
    query then sees the keys at or before its position. Without them, plain causal.
    """

    def __init__(self, grouped: bool) -> None:
        super().__init__()
        self.grouped = grouped

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if positions is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                  enable_gqa=self.grouped)
        keys = torch.arange(k.shape[2], device=k.device)
        visible = positions[:, None, :, None] >= keys  # (batch, 1, queries, keys)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible,
                                              enable_gqa=self.grouped)


class Attention(nn.Module):
    """Causal self-attention; grouped-query where ``cfg.n_kv_heads < cfg.n_heads`` (SDPA's
    ``enable_gqa``: each key/value head serves ``n_heads // n_kv_heads`` consecutive query
    heads, as repeating it that many times along the heads would).

    ``layout`` "torchtitan": ``wq``, ``wk`` and ``wv``. "megatron": one ``wqkv`` whose rows
    are grouped by key/value head as Megatron-Core lays out ``linear_qkv``
    (``SelfAttention.get_query_key_value_tensors`` in megatron/core/transformer/attention.py
    views its output as [..., groups, (heads_per_group + 2) * head_dim] and splits it into
    query, key and value): per key/value head, the rows of its query heads, then its key
    rows, then its value rows. A contiguous shard over any tensor-parallel degree dividing
    the key/value heads then holds whole groups, so a column-wise shard of the one weight
    gives each rank its own query heads with their keys and values."""

    def __init__(self, cfg: LlamaConfig, layout: str = "torchtitan") -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.group = cfg.n_heads // cfg.n_kv_heads  # query heads per key/value head
        q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        self.layout = check_layout(layout)
        if layout == "megatron":
            self.wqkv = nn.Linear(cfg.dim, q + 2 * kv, bias=False)
        else:
            self.wq = nn.Linear(cfg.dim, q, bias=False)
            self.wk = nn.Linear(cfg.dim, kv, bias=False)
            self.wv = nn.Linear(cfg.dim, kv, bias=False)
        self.wo = nn.Linear(q, cfg.dim, bias=False)
        self.inner = CausalAttention(cfg.n_kv_heads < cfg.n_heads)
        # None where unused (no weights): a plain Llama's state dict is as it was.
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values of ``x``, each (batch, seq, heads, head_dim); -1 heads:
        under tensor parallelism each rank holds only its local heads (or groups)."""
        bsz, seq = x.shape[0], x.shape[1]
        if self.layout == "torchtitan":
            return tuple(w(x).view(bsz, seq, -1, self.head_dim)  # type: ignore[return-value]
                         for w in (self.wq, self.wk, self.wv))
        # (batch, seq, groups, group + 2, head_dim): a group's query heads, its key, its value
        qkv = self.wqkv(x).view(bsz, seq, -1, self.group + 2, self.head_dim)
        q, k, v = qkv.split((self.group, 1, 1), dim=3)
        return q.flatten(2, 3), k.flatten(2, 3), v.flatten(2, 3)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        bsz, seq = x.shape[0], x.shape[1]
        q, k, v = self.project(x)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.inner(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), positions)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(gate) * up)``.

    ``layout`` "torchtitan": gate ``w1`` and up ``w3``. "megatron": one ``w13`` (Megatron's
    gated ``linear_fc1``) whose rows interleave them channel by channel (gate of channel 0,
    up of channel 0, gate of channel 1, ...). Megatron chunks each rank's fc1 output into a
    gate half and an up half, so its unsharded weight is laid out per rank and differs with
    the tensor-parallel degree; interleaving channel by channel is the one layout whose
    contiguous shards hold matching gate and up channels for every degree dividing
    ``ffn_dim``, so one weight and a plain column-wise shard serve them all. The local
    output is viewed (..., channels, 2): the same bytes and flops as Megatron's halves."""

    def __init__(self, cfg: LlamaConfig, layout: str = "torchtitan") -> None:
        super().__init__()
        self.layout = check_layout(layout)
        # Registered in the order they always were (w1, w2, w3): a torchtitan layout's
        # parameters, so its graphs' inputs and hashes, are as before.
        if layout == "megatron":
            self.w13 = nn.Linear(cfg.dim, 2 * cfg.ffn_dim, bias=False)
        else:
            self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        if layout == "torchtitan":
            self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.layout == "torchtitan":
            # In this order (gate, its SiLU, then up), as it always ran: the simulated GPU
            # fuses adjacent pointwise ops, so the order is part of the traced cost.
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        gate, up = self.w13(x).unflatten(-1, (-1, 2)).unbind(-1)
        return self.w2(F.silu(gate) * up)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig, layout: str = "torchtitan") -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg, layout)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg, layout)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, positions)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """The decoder of ``cfg``'s shapes, its blocks' projections laid out as ``layout`` says
    (``LAYOUTS``; the module docstring)."""

    def __init__(self, cfg: LlamaConfig, layout: str = "torchtitan") -> None:
        super().__init__()
        self.cfg = cfg
        self.layout = check_layout(layout)
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg, layout) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = rotary_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """``positions`` (batch, seq): each token's place in its sequence, where ``tokens``
        are one rank's part of it (context parallelism); None: 0, 1, ..."""
        h = self.tok_embeddings(tokens)
        cos, sin = self.rope_cos, self.rope_sin
        if positions is not None:
            cos, sin = cos[positions], sin[positions]
        for layer in self.layers:
            h = layer(h, cos, sin, positions)
        return self.output(self.norm(h))


def megatron_state_dict(
    state: Mapping[str, torch.Tensor], cfg: LlamaConfig
) -> dict[str, torch.Tensor]:
    """A torchtitan layout's (unsharded) weights rearranged for the Megatron layout of the
    same ``cfg``: each block's ``wq``, ``wk`` and ``wv`` into ``wqkv`` grouped by key/value
    head, ``w1`` and ``w3`` into ``w13`` interleaved by channel (``Attention`` and
    ``FeedForward`` say why); every other weight as it is. ``Llama(cfg, "megatron")`` loaded
    with it computes what ``Llama(cfg)`` loaded with ``state`` does."""
    out: dict[str, torch.Tensor] = {}
    group, d = cfg.n_heads // cfg.n_kv_heads, cfg.head_dim
    for name, weight in state.items():
        base, _, module = name.removesuffix(".weight").rpartition(".")
        if module == "wq":
            q = weight.view(cfg.n_kv_heads, group * d, -1)
            k = state[f"{base}.wk.weight"].view(cfg.n_kv_heads, d, -1)
            v = state[f"{base}.wv.weight"].view(cfg.n_kv_heads, d, -1)
            out[f"{base}.wqkv.weight"] = torch.cat([q, k, v], dim=1).flatten(0, 1)
        elif module == "w1":
            up = state[f"{base}.w3.weight"]
            out[f"{base}.w13.weight"] = torch.stack([weight, up], dim=1).flatten(0, 1)
        elif module not in ("wk", "wv", "w3"):
            out[name] = weight
    return out


def check_tensor_parallel(cfg: LlamaConfig, degree: int) -> None:
    """Refuse a degree the query heads, key/value heads or FFN width do not split evenly
    over (the plan shards q, k and v column-wise by heads, the MLP by its hidden width),
    naming which."""
    widths = (("heads", cfg.n_heads), ("KV heads", cfg.n_kv_heads), ("ffn_dim", cfg.ffn_dim))
    uneven = [f"{name} ({n})" for name, n in widths if n % degree]
    if uneven:
        listed = ", ".join(uneven[:-1]) + " and " + uneven[-1] if len(uneven) > 1 else uneven[0]
        raise TensorParallelDegreeError(
            f"{listed} must be divisible by the tensor-parallel degree {degree}"
        )


def parallelize_llama(
    model: Llama, mesh, *, sequence_parallel: bool = False, loss_parallel: bool = False
) -> Llama:
    """Shard ``model`` in place over the 1-D ``mesh`` the way torchtitan does for Llama (and
    Megatron-LM for its layout: the same column-wise and row-wise shards of the fused
    projections).

    Attention heads (query and key/value alike) and the MLP hidden dim are split across
    ranks (column-wise in, row-wise out); with ``sequence_parallel`` the norms and residual
    stream are also split along the sequence, turning all-reduces into all-gather /
    reduce-scatter pairs. Qwen3's per-head query and key norms see their rank's heads
    (torchtitan's plan for Qwen3: sequence-parallel over the heads dim), so their weights'
    gradients are summed over the ranks (outside the block's graphs, once per step:
    DTensor leaves them partial, and Megatron all-reduces them in ``finalize_model_grads``).

    Without sequence parallelism a block all-reduces once after each row-wise projection
    (2 forward) and once for the input gradient of each column-wise one: 5 backward in the
    torchtitan layout, 2 in the Megatron layout's fused projections.

    ``loss_parallel``: the output projection's logits stay sharded on the vocabulary
    (``DTensor`` ``Shard(-1)``), for a vocab-parallel cross-entropy under torch's
    ``loss_parallel()`` (Megatron's ``vocab_parallel_cross_entropy``; torchtitan's default);
    without it they are all-gathered and replicated (as Hugging Face's ``colwise_rep``).
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    check_tensor_parallel(model.cfg, mesh.size())
    residual = Shard(1) if sequence_parallel else Replicate()
    output = (ColwiseParallel(input_layouts=residual, output_layouts=Shard(-1),
                              use_local_output=False) if loss_parallel
              else ColwiseParallel(input_layouts=residual, output_layouts=Replicate()))
    parallelize_module(
        model,
        mesh,
        {
            "tok_embeddings": RowwiseParallel(
                input_layouts=Replicate(), output_layouts=residual
            ),
            "output": output,
            **({"norm": SequenceParallel()} if sequence_parallel else {}),
        },
    )
    column = (("attention.wqkv", "feed_forward.w13") if model.layout == "megatron" else
              ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1",
               "feed_forward.w3"))
    for block in model.layers:
        plan = {
            **{name: ColwiseParallel() for name in column},
            "attention.wo": RowwiseParallel(output_layouts=residual),
            "feed_forward.w2": RowwiseParallel(output_layouts=residual),
        }
        if model.cfg.qk_norm:
            plan |= {
                name: SequenceParallel(sequence_dim=2, use_local_output=True)
                for name in ("attention.q_norm", "attention.k_norm")
            }
        if sequence_parallel:
            plan |= {
                "attention_norm": SequenceParallel(),
                "ffn_norm": SequenceParallel(),
                "attention": PrepareModuleInput(  # (x, cos, sin, positions)
                    input_layouts=(Shard(1), None, None, None),
                    desired_input_layouts=(Replicate(), None, None, None),
                ),
                "feed_forward": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
            }
        parallelize_module(block, mesh, plan)
    return model


def context_parallel_llama(model: Llama, mesh) -> Llama:
    """Context parallelism over the 1-D ``mesh``, in place, with torch's all-gather of keys
    and values (the plan torchtitan applies for flex attention,
    ``_ContextParallel(seq_dim=2, FLEX)``): each rank holds a contiguous part of every
    sequence (``context_parallel_inputs``), and every attention kernel gathers all ranks'
    keys and values before it runs (``cplib::flex_cp_allgather``; its backward
    reduce-scatters their gradients). The kernel stays SDPA, masked by the queries'
    positions; torch's SDPA form of context parallelism instead routes the kernel through
    DTensor's ring attention, which has CUDA kernels only. Composes with
    ``parallelize_llama`` on another mesh dim (CP x TP). No load balancing: the mask
    takes the gathered keys in rank order, as ``context_parallel_inputs`` cuts them."""
    from torch.distributed.tensor.experimental._attention import _ContextParallel
    from torch.distributed.tensor.parallel import parallelize_module

    plan = _ContextParallel(seq_dim=2, attention_type=_ContextParallel.AttentionType.FLEX)
    for block in model.layers:
        parallelize_module(block.attention.inner, mesh, plan)
    return model


def context_parallel_inputs(
    mesh, tokens: torch.Tensor, *others: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """This rank's contiguous part of the (batch, seq) ``tokens`` and ``others`` (labels),
    and the positions of its tokens (the model's ``positions``), as torch's
    ``_context_parallel_shard`` cuts them without load balancing."""
    from torch.distributed.tensor.experimental._attention import _context_parallel_shard

    positions = torch.arange(tokens.shape[1], device=tokens.device).repeat(tokens.shape[0], 1)
    buffers = [tokens, *others, positions]
    return tuple(_context_parallel_shard(mesh, buffers, [1] * len(buffers)))


@contextlib.contextmanager
def fake_parallel_llama(
    cfg: LlamaConfig, tp: int, *, sequence_parallel: bool = False, layout: str = "torchtitan",
    loss_parallel: bool = False,
) -> Iterator[Llama]:
    """A bf16 ``Llama(cfg, layout)`` over fake tensors (nothing allocated), tensor-parallel
    over the first ``tp`` ranks of the default group (a fake one will do;
    ``parallelize_llama``'s plan, its logits vocab-sharded with ``loss_parallel``); costing
    and tracing a large model on a CPU. Inside, fake mode is on and bf16 is the default
    dtype."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh

    check_layout(layout)
    mesh = init_device_mesh("cpu", (tp,))  # outside fake mode: it reads its rank map
    default_dtype = torch.get_default_dtype()
    try:
        with FakeTensorMode():
            torch.set_default_dtype(torch.bfloat16)  # fake parameters cannot be cast later
            yield parallelize_llama(Llama(cfg, layout), mesh, sequence_parallel=sequence_parallel,
                                    loss_parallel=loss_parallel)
    finally:
        torch.set_default_dtype(default_dtype)
