"""What is planned offline: a model, its parallel layout and its microbatches.

A ``Workload`` is checked when it is made, each error naming the field: tensor
parallelism must split the query heads, the key/value heads and the FFN width evenly
(the plan shards them), pipeline parallelism needs a layer per stage, 1F1B needs at least
one microbatch per stage, and sequence parallelism splits the sequence over the
tensor-parallel ranks.

Stage ``s`` of ``pp`` holds a contiguous share of the layers, split as evenly as possible,
the first stages taking one more where they do not divide (``stage_layers``); the first
stage also holds the token embedding, the last the final norm, the output projection and
the loss.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kareus.errors import KareusError
from kareus.models.llama import LlamaConfig, TensorParallelDegreeError, check_tensor_parallel

RECOMPUTE = ("none", "full")


class WorkloadError(KareusError, ValueError):
    """A workload that cannot be laid out as given (the message names the field)."""


@dataclass(frozen=True)
class Workload:
    """One training step's shape on the cluster: ``model`` (named ``name``) over ``tp``
    tensor-parallel ranks (``sp``: sequence parallel too) and ``pp`` pipeline stages,
    ``microbatches`` of ``microbatch_size`` sequences of ``seq`` tokens each per step, and
    ``recompute``: "none", or "full" (every layer's forward recomputed in its backward)."""

    model: LlamaConfig
    name: str
    tp: int = 1
    pp: int = 1
    microbatches: int = 1
    microbatch_size: int = 1
    seq: int = 4096
    sp: bool = False
    recompute: str = "none"

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
        self._check_layout()

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
    def stage_layers(self) -> tuple[range, ...]:
        """The layers each pipeline stage holds, in order."""
        return stage_layers(self.model.n_layers, self.pp)


def stage_layers(n_layers: int, pp: int) -> tuple[range, ...]:
    """``n_layers`` split into ``pp`` contiguous shares as evenly as possible, the first
    stages taking one more where ``pp`` does not divide ``n_layers``."""
    share, extra = divmod(n_layers, pp)
    bounds = [0]
    for s in range(pp):
        bounds.append(bounds[-1] + share + (s < extra))
    return tuple(range(a, b) for a, b in itertools.pairwise(bounds))
