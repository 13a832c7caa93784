"""The models planned offline: presets by name, or a Hugging Face ``config.json``.

Either way the result is a ``LlamaConfig``: kareus traces its own Llama-family block
(``kareus.models.llama``: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU MLP,
optionally Qwen3's per-head query and key norms) with the model's shapes, laid out as
Megatron-LM or torchtitan writes it (a workload's ``layout``) and sharded with PyTorch's
tensor-parallel API, not the Hugging Face module itself. What the shapes do not carry is
not modelled: RoPE scaling (Llama 3.1's long context) changes no shape or cost,
attention biases (Qwen2) and tied embeddings are left out, and a family whose block
differs (mixture of experts, sliding windows, other norms) is traced as the dense Llama
block of its shapes, with a warning.

Hugging Face ``transformers`` is optional (the ``zoo`` extra), imported when a config file
is read.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from kareus.errors import KareusError
from kareus.models.llama import LlamaConfig, ModelConfigError

log = logging.getLogger("kareus")


class UnknownModelError(ModelConfigError):
    """A model name that is no preset (the message lists the presets)."""


class HFConfigError(ModelConfigError):
    """A Hugging Face config file that cannot be read, or is not a decoder LM kareus traces."""


class MissingDependencyError(KareusError, ImportError):
    """An optional library a feature needs is not installed (the message says how to)."""


# Published shapes, from each model's config.json on the Hugging Face hub. max_seq_len is
# its max_position_embeddings (a workload sets its own sequence length, at most this).
PRESETS: Mapping[str, LlamaConfig] = MappingProxyType({
    # meta-llama/Llama-3.2-1B (tie_word_embeddings: true; rope_scaling llama3, factor 32)
    "llama3.2-1b": LlamaConfig(
        dim=2048, n_heads=32, n_kv_heads=8, head_dim=64, ffn_dim=8192, n_layers=16,
        vocab_size=128256, rope_theta=500000.0, norm_eps=1e-5, max_seq_len=131072,
    ),
    # meta-llama/Llama-3.2-3B (tie_word_embeddings: true; rope_scaling llama3, factor 32)
    "llama3.2-3b": LlamaConfig(
        dim=3072, n_heads=24, n_kv_heads=8, head_dim=128, ffn_dim=8192, n_layers=28,
        vocab_size=128256, rope_theta=500000.0, norm_eps=1e-5, max_seq_len=131072,
    ),
    # meta-llama/Llama-3.1-8B (rope_scaling llama3, factor 8)
    "llama3.1-8b": LlamaConfig(
        dim=4096, n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=14336, n_layers=32,
        vocab_size=128256, rope_theta=500000.0, norm_eps=1e-5, max_seq_len=131072,
    ),
    # meta-llama/Llama-3.1-70B (rope_scaling llama3, factor 8)
    "llama3.1-70b": LlamaConfig(
        dim=8192, n_heads=64, n_kv_heads=8, head_dim=128, ffn_dim=28672, n_layers=80,
        vocab_size=128256, rope_theta=500000.0, norm_eps=1e-5, max_seq_len=131072,
    ),
    # Qwen/Qwen3-1.7B (tie_word_embeddings: true; 16 x 128 query channels for hidden 2048)
    "qwen3-1.7b": LlamaConfig(
        dim=2048, n_heads=16, n_kv_heads=8, head_dim=128, ffn_dim=6144, n_layers=28,
        vocab_size=151936, rope_theta=1000000.0, norm_eps=1e-6, max_seq_len=40960,
        qk_norm=True,
    ),
    # Qwen/Qwen3-8B
    "qwen3-8b": LlamaConfig(
        dim=4096, n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=12288, n_layers=36,
        vocab_size=151936, rope_theta=1000000.0, norm_eps=1e-6, max_seq_len=40960,
        qk_norm=True,
    ),
})

ARTIFACT_FIRST_STAGE_LAYERS: Mapping[tuple[str, int], int] = MappingProxyType({
    ("llama3.2-3b", 2): 15,
    ("qwen3-1.7b", 2): 15,
})
"""The first pipeline stage's layers where the method's artifact (ml-energy/kareus) ran a
preset, by (preset, pp): both 28-layer models at PP2 split 15/13. Its Megatron configs say
``num_layers_in_first_pipeline_stage: 15`` (tests/artifact/conf/
megatron_llama3.2_3b_config.yaml and megatron_qwen3_1.7b_config.yaml; the launch scripts
tests/artifact/run_*.sh override TP, CP, microbatch and sequence only), and its partition
profiler's registry the same 15 first and 13 last (tests/bayesian/common/model_config.py)."""


def artifact_first_stage_layers(name: str, pp: int) -> int | None:
    """The artifact's first-stage layers for preset ``name`` at ``pp`` stages; None where it
    did not run it so (an even split then)."""
    return ARTIFACT_FIRST_STAGE_LAYERS.get((name, pp))


# Hugging Face model types whose block is kareus's Llama block (up to what the module
# docstring says), and whether they norm query and key heads.
_LLAMA_FAMILY: Mapping[str, bool] = MappingProxyType(
    {"llama": False, "mistral": False, "qwen2": False, "qwen3": True}
)


def preset(name: str) -> LlamaConfig:
    """The preset ``name``'s shapes (an ``UnknownModelError`` listing the presets)."""
    try:
        return PRESETS[name]
    except (KeyError, TypeError):
        raise UnknownModelError(
            f"unknown model {name!r}; presets: {', '.join(PRESETS)} "
            "(or give a Hugging Face config.json path)"
        ) from None


def resolve_model(spec: str | Path) -> tuple[str, LlamaConfig]:
    """A model named by a preset, or by the path of a Hugging Face ``config.json`` (or of
    the directory holding it): its name (the preset's, or the path) and shapes."""
    if isinstance(spec, str) and spec in PRESETS:
        return spec, PRESETS[spec]
    path = Path(spec)
    if path.exists():
        return str(path), from_hf_config(path)
    raise UnknownModelError(
        f"unknown model {str(spec)!r}: no preset and no such file; presets: "
        f"{', '.join(PRESETS)} (or give a Hugging Face config.json path)"
    )


def from_hf_config(path: str | Path) -> LlamaConfig:
    """The shapes of the decoder LM a Hugging Face ``config.json`` (or a directory holding
    one) describes. It is checked to build a causal LM with ``model.layers`` (on the meta
    device: nothing is allocated); an ``HFConfigError`` names the file and why not."""
    transformers = _transformers()
    path = Path(path)
    if not path.exists():
        raise HFConfigError(f"{path}: no such file")
    try:
        cfg = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:
        raise HFConfigError(
            f"{path}: transformers cannot build a config from it: {type(exc).__name__}: {exc}"
        ) from exc
    _check_decoder(path, cfg, transformers)
    if cfg.model_type not in _LLAMA_FAMILY:
        log.warning("%s: model type %r is traced as kareus's Llama block of its shapes "
                    "(modelled alike: %s)", path, cfg.model_type, ", ".join(_LLAMA_FAMILY))
    try:
        return LlamaConfig(
            vocab_size=_field(path, cfg, "vocab_size"),
            dim=_field(path, cfg, "hidden_size"),
            n_layers=_field(path, cfg, "num_hidden_layers"),
            n_heads=_field(path, cfg, "num_attention_heads"),
            n_kv_heads=getattr(cfg, "num_key_value_heads", None),
            head_dim=getattr(cfg, "head_dim", None),
            ffn_dim=_field(path, cfg, "intermediate_size"),
            max_seq_len=_field(path, cfg, "max_position_embeddings"),
            norm_eps=float(getattr(cfg, "rms_norm_eps", 1e-5)),
            rope_theta=float(_rope_theta(path, cfg)),
            qk_norm=_LLAMA_FAMILY.get(cfg.model_type, False),
        )
    except ModelConfigError as exc:
        raise HFConfigError(f"{path}: {exc}") from exc


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise MissingDependencyError(
            "reading a Hugging Face config.json needs transformers: "
            "pip install 'kareus[zoo]' (or pip install transformers)"
        ) from exc
    return transformers


def _check_decoder(path: Path, cfg: Any, transformers: Any) -> None:
    """Refuse a config that does not build a causal LM whose decoder layers are
    ``model.layers`` (an encoder, an encoder-decoder, a vision model...)."""
    import torch

    try:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(cfg)
    except Exception as exc:
        raise HFConfigError(
            f"{path}: a {cfg.model_type!r} config does not build a causal LM: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    layers = getattr(getattr(model, "model", None), "layers", None)
    if isinstance(layers, torch.nn.ModuleList) and not len(layers):
        raise HFConfigError(
            f"{path}: num_hidden_layers is {getattr(cfg, 'num_hidden_layers', 0)!r}: a model "
            "with no decoder layer has nothing to overlap"
        )
    if not isinstance(layers, torch.nn.ModuleList):
        raise HFConfigError(
            f"{path}: a {cfg.model_type!r} config builds {type(model).__name__}, not a "
            "decoder LM with model.layers (kareus traces Llama-family decoders)"
        )


def _field(path: Path, cfg: Any, name: str) -> Any:
    value = getattr(cfg, name, None)
    if value is None:
        raise HFConfigError(f"{path}: no {name} (kareus reads the model's shapes from it)")
    return value


def _rope_theta(path: Path, cfg: Any) -> float:
    """The rotary base: transformers 5 keeps it in ``rope_parameters`` (older configs have
    ``rope_theta`` at the top, which it moves there)."""
    params = getattr(cfg, "rope_parameters", None)
    if isinstance(params, Mapping) and "rope_theta" in params:
        return params["rope_theta"]
    theta = getattr(cfg, "rope_theta", None)
    if theta is None:
        raise HFConfigError(f"{path}: no rope_theta (in rope_parameters or at the top)")
    return theta
