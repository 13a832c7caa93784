"""Whether a workload fits its GPUs' memory: the most loaded pipeline stage's bytes per GPU.

An offline plan costs a workload from its shapes alone, so nothing else would notice one
that cannot run: a 2e9-token vocabulary planned on a 40 GB A100 (an embedding of about 512
GB per GPU). The estimate, per GPU of a stage under its tensor parallelism:

- model state: 16 bytes per parameter, mixed-precision Adam (bf16 weights and gradients,
  fp32 master weights and two moments: ZeRO, Rajbhandari et al., SC'20, section 3.1), no
  sharding across data-parallel replicas (a distributed optimizer or FSDP needs less);
- activations of one layer and microbatch: the bf16 tensors its backward reads, counted
  from the Llama block (``models.llama``: RMS norms, fused attention, SwiGLU, no dropout;
  the GPT count of Korthikanti et al., MLSys'23, table 2, adds dropout masks and a GELU
  MLP): the two norms' inputs and outputs, ``8 s b h`` (``/ t`` with sequence
  parallelism), the queries, keys and values and the attention's output,
  ``2 s b (2 q + 2 kv) / t``, the gate's and up projection's outputs and their product,
  ``6 s b f / t``; only the layer's input, ``2 s b h`` (``/ t`` with sequence parallelism),
  where every layer recomputes its forward;
- the logits of the last stage, in fp32 for the loss: ``4 s b V / t``;
- the microbatches a stage holds at once: the first stage of a 1F1B pipeline as many as
  there are stages (at most the microbatches), a GPipe stage all of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kareus.devices.sim.presets import load_preset
from kareus.offline.workload import Workload

MODEL_STATE_BYTES = 16
"""Bytes of model state per parameter under mixed-precision Adam (ZeRO, section 3.1)."""


@dataclass(frozen=True)
class MemoryEstimate:
    """One GPU of the most loaded stage: its model state and activations, in bytes."""

    stage: int
    model_state_bytes: float
    activation_bytes: float
    in_flight: int  # microbatches whose activations the stage holds at once

    @property
    def total_bytes(self) -> float:
        return self.model_state_bytes + self.activation_bytes

    def shortfall(self, capacity_bytes: float) -> str | None:
        """Why it does not fit ``capacity_bytes`` (None: it fits), with the figures."""
        if self.total_bytes <= capacity_bytes:
            return None
        return (
            f"it needs about {self.total_bytes / 1e9:,.1f} GB per GPU on stage {self.stage} "
            f"(model state {self.model_state_bytes / 1e9:,.1f} GB at {MODEL_STATE_BYTES} bytes "
            f"a parameter, activations {self.activation_bytes / 1e9:,.1f} GB for "
            f"{self.in_flight} microbatch(es) in flight), {self.total_bytes / capacity_bytes:.1f}x"
            f" the GPU's {capacity_bytes / 1e9:,.0f} GB (the model state unsharded: a "
            "distributed optimizer or FSDP over data-parallel replicas needs less)"
        )


def estimate(workload: Workload, schedule: str = "1f1b") -> MemoryEstimate:
    """The bytes per GPU of ``workload``'s most loaded pipeline stage under ``schedule``
    ("1f1b" or "gpipe"; the module docstring says how)."""
    m, t = workload.model, workload.tp
    q, kv = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
    sb = workload.seq * workload.microbatch_size
    unsharded = t if workload.sp else 1  # what sequence parallelism shards
    if workload.recompute == "full":
        layer_bytes = 2 * sb * m.dim / unsharded
    else:
        layer_bytes = (8 * sb * m.dim / unsharded + 2 * sb * (2 * q + 2 * kv) / t
                       + 6 * sb * m.ffn_dim / t)
    logits = 4 * sb * m.vocab_size / t
    stages = workload.stage_layers
    worst = None
    for stage, layers in enumerate(stages):
        first, last = stage == 0, stage == len(stages) - 1
        params = (len(layers) * m.layer_parameters + m.vocab_size * m.dim * (first + last)
                  + m.dim * last)
        in_flight = (workload.microbatches if schedule == "gpipe"
                     else min(len(stages) - stage, workload.microbatches))
        found = MemoryEstimate(
            stage, MODEL_STATE_BYTES * params / t,
            in_flight * (len(layers) * layer_bytes + (logits if last else 0.0)), in_flight,
        )
        if worst is None or found.total_bytes > worst.total_bytes:
            worst = found
    assert worst is not None  # a workload has a stage
    return worst


def warning(workload: Workload, device: str, schedule: str = "1f1b") -> tuple[
        MemoryEstimate, float, str | None]:
    """``workload``'s estimate on the simulated ``device`` (a preset or a GPU .json), the
    device's memory, and the line to warn with where it does not fit (else None)."""
    found = estimate(workload, schedule)
    capacity = load_preset(device).memory_bytes
    short = found.shortfall(capacity)
    return found, capacity, (None if short is None else
                             f"warning: {workload.name} does not fit the GPU's memory: "
                             f"{short}; planned as asked")


def record(found: MemoryEstimate, capacity_bytes: float) -> dict[str, Any]:
    """What a result JSON keeps of the estimate."""
    return {"stage": found.stage, "model_state_bytes": found.model_state_bytes,
            "activation_bytes": found.activation_bytes, "in_flight": found.in_flight,
            "total_bytes": found.total_bytes, "capacity_bytes": capacity_bytes,
            "fits": found.total_bytes <= capacity_bytes}
