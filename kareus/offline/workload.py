"""What is planned offline: a model, its parallel layout and its microbatches.

A ``Workload`` is checked when it is made, each error naming the field: tensor
parallelism must split the query heads, the key/value heads and the FFN width evenly
(the plan shards them), pipeline parallelism needs a layer per stage, 1F1B needs at least
one microbatch per stage, and sequence parallelism splits the sequence over the
tensor-parallel ranks.

Stage ``s`` of ``pp`` holds a contiguous share of the layers, split as evenly as possible,
the first stages taking one more where they do not divide (``stage_layers``); or, given
``first_stage_layers`` (Megatron's ``num_layers_in_first_pipeline_stage``), the first stage
holds that many and the later stages split the rest evenly, which must divide as Megatron
requires. The first stage also holds the token embedding, the last the final norm, the
output projection and the loss.

``layout`` says how the model is written (``kareus.models.llama.LAYOUTS``): "megatron" as
Megatron-LM runs it (fused QKV and gate-up projections: 2 all-reduces per block forward and
2 backward; the logits sharded on the vocabulary and a vocab-parallel cross-entropy), or
"torchtitan" as torchtitan and Hugging Face write it (separate projections: 5 all-reduces
per block backward; the logits all-gathered and a replicated cross-entropy, as Hugging
Face's ``colwise_rep`` output and torchtitan with its loss parallelism off).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kareus.errors import KareusError
from kareus.models.llama import (
    LAYOUTS,
    LlamaConfig,
    TensorParallelDegreeError,
    check_tensor_parallel,
)

RECOMPUTE = ("none", "full")
REGIONS = ("block", "stage")
"""How the model is compiled (``trace``'s module docstring): a region per transformer block,
as torchtitan compiles, or one per pipeline stage."""


class WorkloadError(KareusError, ValueError):
    """A workload that cannot be laid out as given (the message names the field)."""


@dataclass(frozen=True)
class Workload:
    """One training step's shape on the cluster: ``model`` (named ``name``) over ``tp``
    tensor-parallel ranks (``sp``: sequence parallel too) and ``pp`` pipeline stages,
    ``microbatches`` of ``microbatch_size`` sequences of ``seq`` tokens each per step,
    ``recompute``: "none", or "full" (every layer's forward recomputed in its backward),
    ``layout``: how the model is written, "torchtitan" or "megatron" (the module docstring),
    ``first_stage_layers``: the first pipeline stage's layers (None: an even split), and
    ``regions``: how it is compiled, a region per "block" or per "stage" (``REGIONS``)."""

    model: LlamaConfig
    name: str
    tp: int = 1
    pp: int = 1
    microbatches: int = 1
    microbatch_size: int = 1
    seq: int = 4096
    sp: bool = False
    recompute: str = "none"
    layout: str = "torchtitan"
    first_stage_layers: int | None = None
    regions: str = "block"

    def __post_init__(self) -> None:
        if not isinstance(self.model, LlamaConfig):
            raise WorkloadError(
                f"workload model must be a LlamaConfig, got {type(self.model).__name__}"
            )
        if not isinstance(self.name, str) or not self.name:
            raise WorkloadError(f"workload name must be a non-empty string, got {self.name!r}")
        for name in ("tp", "pp", "microbatches", "microbatch_size", "seq"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise WorkloadError(f"workload {name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.sp, bool):
            raise WorkloadError(f"workload sp must be True or False, got {self.sp!r}")
        if self.recompute not in RECOMPUTE:
            raise WorkloadError(
                f"workload recompute must be one of {', '.join(map(repr, RECOMPUTE))}, "
                f"got {self.recompute!r}"
            )
        if self.regions not in REGIONS:
            raise WorkloadError(
                f"workload regions must be one of {', '.join(map(repr, REGIONS))}, "
                f"got {self.regions!r}"
            )
        if self.layout not in LAYOUTS:
            raise WorkloadError(
                f"workload layout must be one of {', '.join(map(repr, LAYOUTS))}, "
                f"got {self.layout!r}"
            )
        self._check_layout()
        self._check_stages()

    def _check_layout(self) -> None:
        model = self.model
        try:
            check_tensor_parallel(model, self.tp)
        except TensorParallelDegreeError as exc:
            raise WorkloadError(f"workload tp={self.tp}: {exc}") from exc
        if self.pp > model.n_layers:
            raise WorkloadError(
                f"workload pp={self.pp} is more than {self.name}'s {model.n_layers} layers: "
                "every pipeline stage holds at least one"
            )
        if self.microbatches < self.pp:
            raise WorkloadError(
                f"workload microbatches={self.microbatches} is fewer than pp={self.pp}: the "
                "1F1B schedule needs at least one microbatch per stage to fill the pipeline"
            )
        if self.seq > model.max_seq_len:
            raise WorkloadError(
                f"workload seq={self.seq} is more than {self.name}'s max_seq_len "
                f"{model.max_seq_len}"
            )
        if self.sp and self.seq % self.tp:
            raise WorkloadError(
                f"workload seq={self.seq} with sp: sequence parallelism splits the sequence "
                f"over the tp={self.tp} ranks; it must divide evenly"
            )

    def _check_stages(self) -> None:
        first = self.first_stage_layers
        if first is None:
            return
        if isinstance(first, bool) or not isinstance(first, int) or first < 1:
            raise WorkloadError(
                f"workload first_stage_layers must be an integer >= 1 or None, got {first!r}"
            )
        if self.pp == 1:
            raise WorkloadError(
                f"workload first_stage_layers={first} needs pp >= 2: with one stage it holds "
                "every layer"
            )
        rest, later = self.model.n_layers - first, self.pp - 1
        if rest < later or rest % later:
            raise WorkloadError(
                f"workload first_stage_layers={first} leaves {rest} of {self.name}'s "
                f"{self.model.n_layers} layers for the {later} later stage(s): each needs at "
                "least one, and they split them evenly (as Megatron's "
                "num_layers_in_first_pipeline_stage requires)"
            )

    @classmethod
    def of(cls, model: str | Path, **fields: Any) -> Workload:
        """The workload of a preset's name or a Hugging Face ``config.json`` path
        (``offline.models.resolve_model``) and the other fields."""
        from kareus.offline.models import resolve_model

        name, config = resolve_model(model)
        return cls(config, name, **fields)

    @property
    def traced_model(self) -> LlamaConfig:
        """The model as traced: its rotary tables as long as the sequence."""
        return dataclasses.replace(self.model, max_seq_len=self.seq)

    @property
    def vocab_parallel_loss(self) -> bool:
        """Whether the logits stay sharded on the vocabulary for a vocab-parallel
        cross-entropy (the Megatron layout), rather than all-gathered."""
        return self.layout == "megatron"

    @property
    def stage_layers(self) -> tuple[range, ...]:
        """The layers each pipeline stage holds, in order."""
        return stage_layers(self.model.n_layers, self.pp, self.first_stage_layers)

    def describe(self) -> dict[str, Any]:
        """What the trace models beyond the shapes, for the result JSON: the layout, its
        loss and each stage's layers."""
        return {
            "layout": self.layout,
            "loss": "vocab-parallel" if self.vocab_parallel_loss else "replicated logits",
            "first_stage_layers": self.first_stage_layers,
            "regions": self.regions,
            "stage_layers": [len(r) for r in self.stage_layers],
        }


def stage_layers(n_layers: int, pp: int, first: int | None = None) -> tuple[range, ...]:
    """``n_layers`` split into ``pp`` contiguous shares as evenly as possible, the first
    stages taking one more where ``pp`` does not divide ``n_layers``; or, with ``first``,
    ``first`` layers in the first stage and the rest split so among the others."""
    if first is not None and pp > 1:
        return (range(first), *(range(first + r.start, first + r.stop)
                                for r in stage_layers(n_layers - first, pp - 1)))
    share, extra = divmod(n_layers, pp)
    bounds = [0]
    for s in range(pp):
        bounds.append(bounds[-1] + share + (s < extra))
    return tuple(range(a, b) for a, b in itertools.pairwise(bounds))
