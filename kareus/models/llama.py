"""A small Llama-style decoder and its tensor-parallel plans.

Used by ``kareus demo``, the tests and the benchmarks: RMSNorm, rotary embeddings,
multi-head attention through ``scaled_dot_product_attention`` and a SwiGLU MLP, sharded
with PyTorch's own tensor-parallel API so the compiled graphs carry real functional
collectives.
"""

from __future__ import annotations

import contextlib
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
    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    ffn_dim: int = 128
    max_seq_len: int = 64
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        # Here, not at the first forward: a shape that cannot run fails where it is given.
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "ffn_dim", "max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ModelConfigError(f"Llama {name} must be an integer >= 1, got {value!r}")
        if self.dim % self.n_heads or self.dim // self.n_heads % 2:
            raise ModelConfigError(
                f"Llama dim {self.dim} must split into {self.n_heads} heads of an even width "
                "(rotary embeddings rotate pairs of a head's channels)"
            )

    @property
    def parameters(self) -> int:
        """Weights in the model: embeddings, output, norms, and per layer attention and MLP."""
        layer = 4 * self.dim * self.dim + 3 * self.dim * self.ffn_dim + 2 * self.dim
        return 2 * self.vocab_size * self.dim + self.dim + self.n_layers * layer


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary_tables(cfg: LlamaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    head_dim = cfg.dim // cfg.n_heads
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(cfg.max_seq_len).float(), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on ``x`` of shape (batch, seq, heads, head_dim)."""
    seq = x.shape[1]
    cos, sin = cos[:seq, None, :].to(x.dtype), sin[:seq, None, :].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bsz, seq = x.shape[0], x.shape[1]
        # -1 heads: under tensor parallelism each rank holds only its local heads.
        q = self.wq(x).view(bsz, seq, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
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

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
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

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.rope_cos, self.rope_sin)
        return self.output(self.norm(h))


def check_tensor_parallel(cfg: LlamaConfig, degree: int) -> None:
    """Refuse a degree the heads or the FFN width do not split evenly over."""
    if cfg.n_heads % degree or cfg.ffn_dim % degree:
        raise TensorParallelDegreeError(
            f"heads ({cfg.n_heads}) and ffn_dim ({cfg.ffn_dim}) must be "
            f"divisible by the tensor-parallel degree {degree}"
        )


def parallelize_llama(model: Llama, mesh, *, sequence_parallel: bool = False) -> Llama:
    """Shard ``model`` in place over the 1-D ``mesh`` the way torchtitan does for Llama.

    Attention heads and the MLP hidden dim are split across ranks (column-wise in,
    row-wise out); with ``sequence_parallel`` the norms and residual stream are also
    split along the sequence, turning all-reduces into all-gather / reduce-scatter pairs.
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
        if sequence_parallel:
            plan |= {
                "attention_norm": SequenceParallel(),
                "ffn_norm": SequenceParallel(),
                "attention": PrepareModuleInput(
                    input_layouts=(Shard(1), None, None),
                    desired_input_layouts=(Replicate(), None, None),
                ),
                "feed_forward": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
            }
        parallelize_module(block, mesh, plan)
    return model


@contextlib.contextmanager
def fake_parallel_llama(cfg: LlamaConfig, tp: int) -> Iterator[Llama]:
    """A bf16 ``Llama(cfg)`` over fake tensors (nothing allocated), tensor-parallel over the
    first ``tp`` ranks of the default group (a fake one will do); costing and tracing a
    large model on a CPU. Inside, fake mode is on and bf16 is the default dtype."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (tp,))  # outside fake mode: it reads its rank map
    default_dtype = torch.get_default_dtype()
    try:
        with FakeTensorMode():
            torch.set_default_dtype(torch.bfloat16)  # fake parameters cannot be cast later
            yield parallelize_llama(Llama(cfg), mesh)
    finally:
        torch.set_default_dtype(default_dtype)
