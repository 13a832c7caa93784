"""Models planned offline: the presets' published shapes, unknown names, and Hugging Face
config files read (or refused, naming the file)."""

from __future__ import annotations

import sys

import pytest

from kareus.offline.models import (
    PRESETS,
    HFConfigError,
    MissingDependencyError,
    UnknownModelError,
    artifact_first_stage_layers,
    from_hf_config,
    preset,
    resolve_model,
)

# name: hidden, heads, KV heads, head dim, FFN, layers, vocab, rope theta, qk norm
PUBLISHED = {
    "llama3.2-1b": (2048, 32, 8, 64, 8192, 16, 128256, 500000.0, False),
    "llama3.2-3b": (3072, 24, 8, 128, 8192, 28, 128256, 500000.0, False),
    "llama3.1-8b": (4096, 32, 8, 128, 14336, 32, 128256, 500000.0, False),
    "llama3.1-70b": (8192, 64, 8, 128, 28672, 80, 128256, 500000.0, False),
    "qwen3-1.7b": (2048, 16, 8, 128, 6144, 28, 151936, 1000000.0, True),
    "qwen3-8b": (4096, 32, 8, 128, 12288, 36, 151936, 1000000.0, True),
}


def _shapes(cfg):
    return (cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim, cfg.n_layers,
            cfg.vocab_size, cfg.rope_theta, cfg.qk_norm)


@pytest.mark.regression
@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_have_their_published_shapes(name):
    assert _shapes(preset(name)) == PUBLISHED[name]
    assert set(PRESETS) == set(PUBLISHED)


@pytest.mark.parametrize("name, billions", [
    ("llama3.1-8b", 8.03), ("llama3.1-70b", 70.55), ("qwen3-8b", 8.19),
])
def test_untied_presets_count_their_published_parameters(name, billions):
    """The shapes make the model its authors count (a check of head_dim and GQA in the
    count, not only a read-back); the tied 1B/3B/1.7B models count their output twice."""
    assert preset(name).parameters / 1e9 == pytest.approx(billions, abs=0.01)


@pytest.mark.parametrize("spec", ["llama-3-8b", "/no/such/config.json"])
def test_an_unknown_model_lists_the_presets(spec):
    with pytest.raises(UnknownModelError) as raised:
        resolve_model(spec)
    assert spec in str(raised.value)
    assert all(name in str(raised.value) for name in PRESETS)
    with pytest.raises(UnknownModelError, match="presets: llama3.2-1b"):
        preset(spec)


@pytest.mark.parametrize("name, pp, first", [
    ("llama3.2-3b", 2, 15), ("qwen3-1.7b", 2, 15), ("llama3.2-3b", 4, None),
    ("llama3.1-8b", 2, None),
])
def test_the_artifacts_stage_split_is_known_where_it_ran_the_preset(name, pp, first):
    """Its Megatron configs give num_layers_in_first_pipeline_stage: 15 for both 28-layer
    models at PP2 (ml-energy/kareus tests/artifact/conf/megatron_*_config.yaml)."""
    assert artifact_first_stage_layers(name, pp) == first


def test_a_preset_resolves_by_name():
    assert resolve_model("qwen3-8b") == ("qwen3-8b", PRESETS["qwen3-8b"])


@pytest.fixture
def transformers():
    return pytest.importorskip("transformers")


def test_a_llama_config_json_is_read(transformers, tmp_path):
    transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_attention_heads=8, num_key_value_heads=2,
        num_hidden_layers=3, vocab_size=128, rope_theta=50000.0, max_position_embeddings=256,
    ).save_pretrained(tmp_path)
    for path in (tmp_path / "config.json", tmp_path):
        cfg = from_hf_config(path)
        assert _shapes(cfg) == (64, 8, 2, 8, 96, 3, 128, 50000.0, False)
        assert cfg.max_seq_len == 256
    assert resolve_model(str(tmp_path / "config.json"))[1] == cfg


def test_a_qwen3_config_json_is_read_with_its_head_dim_and_query_key_norms(
    transformers, tmp_path
):
    transformers.Qwen3Config(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, num_hidden_layers=2, vocab_size=128, rms_norm_eps=1e-6,
    ).save_pretrained(tmp_path)
    cfg = from_hf_config(tmp_path / "config.json")
    assert _shapes(cfg) == (64, 4, 2, 32, 96, 2, 128, 10000.0, True)
    assert cfg.norm_eps == 1e-6


def test_a_broken_json_is_refused_naming_the_file(transformers, tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "llama", "hidden_size": ')
    with pytest.raises(HFConfigError, match=f"{path}: transformers cannot build a config"):
        from_hf_config(path)


def test_a_config_without_a_model_type_is_refused_naming_the_file(transformers, tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"hidden_size": 64}')
    with pytest.raises(HFConfigError, match=f"{path}: transformers cannot build"):
        from_hf_config(path)


def test_a_non_decoder_config_is_refused_naming_the_file(transformers, tmp_path):
    transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=96).save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    with pytest.raises(HFConfigError, match=f"{path}: a 'bert' config builds BertLMHeadModel, "
                                            "not a decoder LM with model.layers"):
        from_hf_config(path)


def test_a_config_with_no_layers_is_refused_for_that(transformers, tmp_path):
    transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                             intermediate_size=96, num_hidden_layers=0).save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    with pytest.raises(HFConfigError, match=f"{path}: num_hidden_layers is 0: a model with no "
                                            "decoder layer"):
        from_hf_config(path)


def test_shapes_the_llama_cannot_run_are_refused_naming_the_file(transformers, tmp_path):
    transformers.LlamaConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=3,
                             head_dim=8, num_hidden_layers=1).save_pretrained(tmp_path)
    with pytest.raises(HFConfigError, match="config.json: Llama n_heads 8 must be a multiple"):
        from_hf_config(tmp_path / "config.json")


def test_a_missing_file_is_refused(transformers, tmp_path):
    with pytest.raises(HFConfigError, match="no such file"):
        from_hf_config(tmp_path / "config.json")


def test_without_transformers_reading_a_config_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import fails as if absent
    with pytest.raises(MissingDependencyError, match=r"pip install 'kareus\[zoo\]'"):
        from_hf_config(tmp_path / "config.json")
