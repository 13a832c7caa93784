"""Offline planning of a paper-sized model on a simulated GPU, without a cluster.

``models``: presets and Hugging Face configs read into ``LlamaConfig`` shapes;
``workload``: the model's parallel layout and microbatches (``Workload``); ``trace``: each
pipeline stage's graphs traced for one rank over fake tensors under a fake process group,
costed into frontiers (``trace_stages``). Glue above the planner: it may use every stage
of the pipeline, the bundled model and the backend.

Importing this package imports neither torch's compiler nor transformers; ``trace`` does.
"""

from kareus.offline.models import (
    PRESETS,
    HFConfigError,
    MissingDependencyError,
    UnknownModelError,
    from_hf_config,
    preset,
    resolve_model,
)
from kareus.offline.workload import Workload, WorkloadError, stage_layers

__all__ = [
    "PRESETS",
    "HFConfigError",
    "MissingDependencyError",
    "UnknownModelError",
    "Workload",
    "WorkloadError",
    "from_hf_config",
    "preset",
    "resolve_model",
    "stage_layers",
]
