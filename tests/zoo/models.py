"""Third-party Llama-family models under their own tensor-parallel plans, at tiny sizes,
and torch's own context parallelism on kareus's Llama.

Each builder takes a ``ZooSetup`` (this rank, the world size, a 1-D CPU mesh over the
world, a scratch directory shared by the ranks) and returns a ``ZooModel``: the model,
the batches it trains on and how its loss is computed. Every call of a builder returns
the same weights (fixed seeds, or one checkpoint written once), on every rank, so a
compiled copy and an eager copy start identical. Libraries are imported inside the
builders: importing this module costs nothing.

Sizes: hidden 64, FFN 64, 2 layers, 4 heads (2 KV heads where the model has GQA),
vocab 128, batch 4 x sequence 16.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

DIM = 64
FFN = 64
LAYERS = 2
HEADS = 4
KV_HEADS = 2
VOCAB = 128
BATCH = 4
SEQ = 16
SEED = 0

Batch = tuple[torch.Tensor, ...]  # (input ids, labels[, attention mask])


@dataclass(frozen=True)
class ZooSetup:
    rank: int
    world_size: int
    mesh: object  # torch.distributed.device_mesh.DeviceMesh, 1-D over the world, "cpu", dim "tp"
    scratch: Path  # the same directory on every rank (checkpoints)


@dataclass
class ZooModel:
    model: torch.nn.Module
    batch: Callable[[int], Batch]  # step -> (input ids, labels, ...), identical on every rank
    loss: Callable[[torch.nn.Module, Batch], torch.Tensor]  # runs the (compiled) model
    # Forward and backward run inside this context (loss parallel needs it around both).
    context: Callable[[], contextlib.AbstractContextManager] = field(default=contextlib.nullcontext)
    # torch._dynamo.config values the model needs to compile well (patched around training).
    dynamo_config: dict[str, object] = field(default_factory=dict)


def make_batch(step: int, *, shifted: bool) -> Batch:
    """Sequences that follow a fixed random successor table (learnable, same on every rank).

    ``shifted``: labels are the next tokens (the loss is computed outside the model);
    otherwise labels equal the inputs (Hugging Face shifts them inside ``forward``).
    """
    gen = torch.Generator().manual_seed(SEED + 1)
    successor = torch.randperm(VOCAB, generator=gen)
    gen.manual_seed(SEED + 100 + step)
    tokens = [torch.randint(0, VOCAB, (BATCH,), generator=gen)]
    for _ in range(SEQ):
        tokens.append(successor[tokens[-1]])
    seq = torch.stack(tokens, dim=1)
    if shifted:
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
    return seq[:, :-1].contiguous(), seq[:, :-1].contiguous()


# --- torchtitan -------------------------------------------------------------------------


def titan_llama3(setup: ZooSetup, *, loss_parallel: bool = False) -> ZooModel:
    """torchtitan 0.2.2 Llama 3 with its own ``apply_tp`` (TP + sequence parallel).

    torchtitan picks its device type at import (``cuda`` when there is no accelerator):
    its ``ParallelDims`` is pointed at "cpu" before it builds the mesh. The attention is
    its SDPA module (the flex default of other flavours has no CPU backward).
    """
    import torchtitan.distributed.parallel_dims as parallel_dims_mod
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3 import Transformer, TransformerModelArgs
    from torchtitan.models.llama3.infra.parallelize import apply_tp

    parallel_dims_mod.device_type = "cpu"
    dims = ParallelDims(
        dp_replicate=1, dp_shard=1, cp=1, tp=setup.world_size, pp=1, ep=1, etp=1,
        world_size=setup.world_size,
    )
    args = TransformerModelArgs(
        dim=DIM, n_layers=LAYERS, n_heads=HEADS, n_kv_heads=KV_HEADS, vocab_size=VOCAB,
        # FeedForward's hidden size: int(2 * 4 * dim / 3) = 170, x 0.38 -> 64, rounded to 64
        ffn_dim_multiplier=0.38, multiple_of=64, max_seq_len=SEQ, attn_type="sdpa",
        rope_theta=500000,
    )
    torch.manual_seed(SEED)
    model = Transformer(args)
    with torch.no_grad():  # as torchtitan's trainer calls it
        model.init_weights()
    apply_tp(
        model, dims.get_mesh("tp"), loss_parallel=loss_parallel,
        enable_float8_tensorwise_tp=False,
    )

    def loss(m: torch.nn.Module, batch: Batch) -> torch.Tensor:
        inputs, labels = batch
        logits = m(inputs)
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

    context = contextlib.nullcontext
    if loss_parallel:
        from torch.distributed.tensor.parallel import loss_parallel as loss_parallel_context

        context = loss_parallel_context
    return ZooModel(model, lambda step: make_batch(step, shifted=True), loss, context)


# --- Hugging Face transformers ----------------------------------------------------------


def _hf_checkpoint(setup: ZooSetup, name: str, make_model: Callable[[], torch.nn.Module]) -> Path:
    """A tiny random checkpoint, written once by rank 0 (the other ranks wait for it)."""
    _quiet_hf()
    path = setup.scratch / name
    if setup.rank == 0 and not (path / "config.json").exists():
        torch.manual_seed(SEED)
        make_model().save_pretrained(path)
    dist.barrier()
    return path


def _quiet_hf() -> None:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def _hf_loss(m: torch.nn.Module, batch: Batch) -> torch.Tensor:
    inputs, labels, *mask = batch
    return m(input_ids=inputs, labels=labels, attention_mask=mask[0] if mask else None).loss


def _padded_batch(step: int) -> Batch:
    """Right padding as a tokenizer makes it: rows 1 and 3 end 5 and 9 tokens early (mask 0,
    label -100), so the 4-D attention mask varies over the batch. From the second step on
    the batch has 6 rows, not 4 (batching by a token budget varies it), so Dynamo compiles
    graphs with a symbolic batch size, which k = 4 cuts unevenly (1, 2, 1, 2 rows)."""
    inputs, labels = make_batch(step, shifted=False)
    mask = torch.ones_like(inputs)
    for row, pad in ((1, 5), (3, 9)):
        mask[row, -pad:] = 0
    batch = inputs.masked_fill(mask == 0, 0), labels.masked_fill(mask == 0, -100), mask
    return tuple(torch.cat([t, t[:2]]) for t in batch) if step else batch


def _hf_from_pretrained(cls, path: Path, distributed_config) -> torch.nn.Module:
    """Sharded at load by transformers' own plans. The default process group exists already,
    so HF uses it; it builds its own CPU meshes from it ((pp, dp_replicate, fsdp, tp) and
    (pp, dp_replicate, efsdp, ep)). ``tp_plan="auto"`` without ``tp_size`` would take
    tp_size from the WORLD_SIZE variable and silently not shard at all without it."""
    model = cls.from_pretrained(
        path, distributed_config=distributed_config, attn_implementation="sdpa",
        dtype=torch.float32,
    )
    model.train()
    return model


def _llama_config(*, tied: bool = False):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=DIM, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=4 * SEQ,
        tie_word_embeddings=tied, attention_dropout=0.0,
    )


def hf_llama_auto(setup: ZooSetup, *, tied: bool = False, padded: bool = False) -> ZooModel:
    """``LlamaForCausalLM.from_pretrained(..., DistributedConfig(tp_plan="auto"))``.

    ``padded``: batches with right padding and an attention mask (HF then materialises a
    per-sample 4-D mask and SDPA takes the repeat_kv path for the KV heads). At kareus
    347e274 this variant trained wrong with eager lowering and k = 2 or 4.
    """
    from transformers import LlamaForCausalLM
    from transformers.distributed import DistributedConfig

    config = _llama_config(tied=tied)
    path = _hf_checkpoint(
        setup, "llama-tied" if tied else "llama", lambda: LlamaForCausalLM(config)
    )
    model = _hf_from_pretrained(
        LlamaForCausalLM, path,
        DistributedConfig(tp_plan="auto", tp_size=setup.world_size),
    )
    batch = _padded_batch if padded else (lambda step: make_batch(step, shifted=False))
    return ZooModel(model, batch, _hf_loss)


def hf_llama_colrow(setup: ZooSetup) -> ZooModel:
    """The same HF Llama, parallelised by hand with PyTorch's ``parallelize_module``."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    from transformers import LlamaForCausalLM

    config = _llama_config()
    path = _hf_checkpoint(setup, "llama", lambda: LlamaForCausalLM(config))
    model = LlamaForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float32)
    model.train()
    plan = {
        **{f"self_attn.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")},
        "self_attn.o_proj": RowwiseParallel(),
        **{f"mlp.{p}": ColwiseParallel() for p in ("gate_proj", "up_proj")},
        "mlp.down_proj": RowwiseParallel(),
    }
    # HF attention views its projections as (batch, seq, -1, head_dim): local heads follow.
    # Embedding and LM head stay replicated (plain tensors).
    for layer in model.model.layers:
        parallelize_module(layer, setup.mesh, plan)
    return ZooModel(model, lambda step: make_batch(step, shifted=False), _hf_loss)


def hf_qwen3_auto(setup: ZooSetup) -> ZooModel:
    """``Qwen3ForCausalLM`` (QK-norm, replicated q/k norm weights with all-reduced grads)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from transformers.distributed import DistributedConfig

    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=DIM, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=DIM // HEADS,
        max_position_embeddings=4 * SEQ, tie_word_embeddings=False, attention_dropout=0.0,
    )
    path = _hf_checkpoint(setup, "qwen3", lambda: Qwen3ForCausalLM(config))
    model = _hf_from_pretrained(
        Qwen3ForCausalLM, path,
        DistributedConfig(tp_plan="auto", tp_size=setup.world_size),
    )
    return ZooModel(model, lambda step: make_batch(step, shifted=False), _hf_loss)


def hf_mixtral_ep(
    setup: ZooSetup, *, capture_scalars: bool = False, ep_implementation: str = "all_to_all"
) -> ZooModel:
    """A tiny Mixtral (4 experts, top-2): TP 2 on attention, EP 2 on the experts.

    ``DistributedConfig(tp_size=2, ep_size=2)`` applies ``base_model_tp_plan`` to the
    attention and ``base_model_ep_plan`` to the experts (2 whole experts per rank,
    ``grouped_gemm`` weights behind ``ep_dispatch_experts``; EP rules replace the TP rules
    of the experts). ``ep_implementation="all_to_all"`` (what "auto" picks in training):
    each TP rank keeps half the tokens, sends each (token, expert) pair to the expert's
    rank with ``all_to_all_single`` (split sizes read back to the host with ``.tolist()``),
    gets the results back with a second one, and all-gathers the halves over TP. The
    experts run transformers' default "grouped_mm" implementation (``torch._grouped_mm``,
    which works on CPU).

    ``capture_scalars``: by default the ``.tolist()`` breaks the graph at every MoE layer;
    with ``capture_scalar_outputs`` the split sizes become unbacked symbols and the token
    all-to-alls land in the graphs with data-dependent sizes.

    ``ep_implementation="all_reduce"``: transformers' other EP for a batch the EP group
    shares (EP = TP here): every rank runs its experts on all tokens, routes to the other
    rank's experts masked, and an all-reduce sums the outputs. No tokens move and no size is
    read back, so the step is one forward and one backward graph.
    """
    from transformers import MixtralConfig, MixtralForCausalLM
    from transformers.distributed import DistributedConfig

    config = MixtralConfig(
        vocab_size=VOCAB, hidden_size=DIM, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=4 * SEQ,
        num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False,
        attention_dropout=0.0, router_jitter_noise=0.0, output_router_logits=False,
    )
    path = _hf_checkpoint(setup, "mixtral", lambda: MixtralForCausalLM(config))
    model = _hf_from_pretrained(
        MixtralForCausalLM, path,
        DistributedConfig(
            tp_size=setup.world_size, ep_size=setup.world_size,
            ep_implementation=ep_implementation,
        ),
    )
    return ZooModel(
        model, lambda step: make_batch(step, shifted=False), _hf_loss,
        dynamo_config={"capture_scalar_outputs": True} if capture_scalars else {},
    )


# --- torch's context parallelism ---------------------------------------------------------


def torch_cp_llama(setup: ZooSetup) -> ZooModel:
    """kareus's Llama (GQA) under torch's context parallelism, CP 2: the all-gather plan
    torchtitan applies for flex attention (``_ContextParallel``), on an SDPA kernel masked
    by the queries' positions (``kareus.models.llama.context_parallel_llama``).

    No third-party model trains with context parallelism on CPU: flex attention has no CPU
    backward (torchtitan's CP), and the SDPA form (``context_parallel``, which
    accelerate's ``ParallelismConfig`` uses) has no CPU strategy. Each rank trains on its
    contiguous half of every sequence: its gradients are its tokens' share of the mean
    loss's, and the loss it reports is the mean over all tokens (summed over the ranks, as
    torchtitan logs it).
    """
    from kareus.models.llama import (
        Llama,
        LlamaConfig,
        context_parallel_inputs,
        context_parallel_llama,
    )

    cfg = LlamaConfig(vocab_size=VOCAB, dim=DIM, n_layers=LAYERS, n_heads=HEADS,
                      n_kv_heads=KV_HEADS, ffn_dim=FFN, max_seq_len=SEQ)
    torch.manual_seed(SEED)
    model = context_parallel_llama(Llama(cfg), setup.mesh)

    def loss(m: torch.nn.Module, batch: Batch) -> torch.Tensor:
        inputs, labels = batch
        tokens, targets, positions = context_parallel_inputs(setup.mesh, inputs, labels)
        logits = m(tokens, positions)
        share = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
        share = share / labels.numel()
        whole = share.detach().clone()
        dist.all_reduce(whole)
        return share + (whole - share.detach())

    return ZooModel(model, lambda step: make_batch(step, shifted=True), loss)


BUILDERS: dict[str, Callable[[ZooSetup], ZooModel]] = {
    "titan-llama3": titan_llama3,
    "titan-llama3-lossparallel": lambda setup: titan_llama3(setup, loss_parallel=True),
    "hf-llama-auto": hf_llama_auto,
    "hf-llama-auto-tied": lambda setup: hf_llama_auto(setup, tied=True),
    "hf-llama-auto-padded": lambda setup: hf_llama_auto(setup, padded=True),
    "hf-llama-colrow": hf_llama_colrow,
    "hf-qwen3-auto": hf_qwen3_auto,
    "hf-mixtral-ep": hf_mixtral_ep,
    "hf-mixtral-ep-scalars": lambda setup: hf_mixtral_ep(setup, capture_scalars=True),
    "hf-mixtral-ep-allreduce": lambda setup: hf_mixtral_ep(setup, ep_implementation="all_reduce"),
    "torch-cp-llama": torch_cp_llama,
}

# What each model needs installed (tests skip when it is missing).
REQUIRES: dict[str, tuple[str, ...]] = {
    name: ("torchtitan", "triton") if name.startswith("titan")
    else () if name.startswith("torch") else ("transformers", "accelerate")
    for name in BUILDERS
}


def build(name: str, setup: ZooSetup) -> ZooModel:
    try:
        builder = BUILDERS[name]
    except KeyError:
        raise ValueError(f"unknown zoo model {name!r}; known: {', '.join(BUILDERS)}") from None
    return builder(setup)


def set_distributed_env(rank: int, world_size: int, port: int) -> None:
    """What torchrun would export; Hugging Face reads WORLD_SIZE to size tp_plan="auto"."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        HF_HUB_OFFLINE="1",  # checkpoints are local; never ask the Hub
    )
