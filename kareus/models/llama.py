"""A Llama-family decoder and its tensor-parallel plans.

Used by ``kareus demo``, the tests, the benchmarks and offline planning
(``kareus.offline``): RMSNorm, rotary embeddings, attention through
``scaled_dot_product_attention`` (multi-head, or grouped-query with fewer key/value heads
than query heads, as Llama 3 and Qwen3 have; optionally Qwen3's RMS norm of each query and
key head before the rotation) and a SwiGLU MLP, sharded with PyTorch's own
tensor-parallel API so the compiled graphs carry real functional collectives.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kareus.errors import KareusError


class TensorParallelDegreeError(KareusError, ValueError):
    """The model's heads or FFN width do not split evenly over the tensor-parallel ranks."""


class ModelConfigError(KareusError, ValueError):
    """A model shape the Llama cannot be built or run with."""


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
    def parameters(self) -> int:
        """Weights in the model: embeddings, output, norms, and per layer attention and MLP."""
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        attention = 2 * self.dim * q + 2 * self.dim * kv + (2 * self.head_dim if self.qk_norm
                                                             else 0)
        layer = attention + 3 * self.dim * self.ffn_dim + 2 * self.dim
        return 2 * self.vocab_size * self.dim + self.dim + self.n_layers * layer


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
    heads, as repeating it that many times along the heads would)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        self.wq = nn.Linear(cfg.dim, q, bias=False)
        self.wk = nn.Linear(cfg.dim, kv, bias=False)
        self.wv = nn.Linear(cfg.dim, kv, bias=False)
        self.wo = nn.Linear(q, cfg.dim, bias=False)
        self.inner = CausalAttention(cfg.n_kv_heads < cfg.n_heads)
        # None where unused (no weights): a plain Llama's state dict is as it was.
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        bsz, seq = x.shape[0], x.shape[1]
        # -1 heads: under tensor parallelism each rank holds only its local heads.
        q = self.wq(x).view(bsz, seq, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.inner(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), positions)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, positions)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
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


def parallelize_llama(model: Llama, mesh, *, sequence_parallel: bool = False) -> Llama:
    """Shard ``model`` in place over the 1-D ``mesh`` the way torchtitan does for Llama.

    Attention heads (query and key/value alike) and the MLP hidden dim are split across
    ranks (column-wise in, row-wise out); with ``sequence_parallel`` the norms and residual
    stream are also split along the sequence, turning all-reduces into all-gather /
    reduce-scatter pairs. Qwen3's per-head query and key norms see their rank's heads
    (torchtitan's plan for Qwen3: sequence-parallel over the heads dim), so their weights'
    gradients are summed over the ranks.
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
    parallelize_module(
        model,
        mesh,
        {
            "tok_embeddings": RowwiseParallel(
                input_layouts=Replicate(), output_layouts=residual
            ),
            "output": ColwiseParallel(input_layouts=residual, output_layouts=Replicate()),
            **({"norm": SequenceParallel()} if sequence_parallel else {}),
        },
    )
    for block in model.layers:
        plan = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=residual),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
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
    cfg: LlamaConfig, tp: int, *, sequence_parallel: bool = False
) -> Iterator[Llama]:
    """A bf16 ``Llama(cfg)`` over fake tensors (nothing allocated), tensor-parallel over the
    first ``tp`` ranks of the default group (a fake one will do; ``parallelize_llama``'s
    plan); costing and tracing a large model on a CPU. Inside, fake mode is on and bf16 is
    the default dtype."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (tp,))  # outside fake mode: it reads its rank map
    default_dtype = torch.get_default_dtype()
    try:
        with FakeTensorMode():
            torch.set_default_dtype(torch.bfloat16)  # fake parameters cannot be cast later
            yield parallelize_llama(Llama(cfg), mesh, sequence_parallel=sequence_parallel)
    finally:
        torch.set_default_dtype(default_dtype)
