"""Whether a workload fits its GPU: the most loaded stage's model state and activations."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kareus.cli import main
from kareus.devices.sim.presets import load_preset
from kareus.models.llama import LlamaConfig
from kareus.offline.memory import MODEL_STATE_BYTES, estimate, record, warning
from kareus.offline.workload import Workload

MODEL = LlamaConfig(vocab_size=1000, dim=64, n_layers=4, n_heads=4, n_kv_heads=2,
                    ffn_dim=96, max_seq_len=128)


def test_model_state_and_activations_are_counted_per_gpu_of_the_fullest_stage():
    one = estimate(Workload(MODEL, "m", tp=2, microbatches=4, microbatch_size=2, seq=128))
    assert one.stage == 0 and one.in_flight == 1
    assert one.model_state_bytes == MODEL_STATE_BYTES * MODEL.parameters / 2
    sb, q, kv = 2 * 128, 64, 32
    layer = 8 * sb * 64 + 2 * sb * (2 * q + 2 * kv) / 2 + 6 * sb * 96 / 2
    assert one.activation_bytes == 4 * layer + 4 * sb * 1000 / 2  # layers and logits
    small_vocab = dataclasses.replace(MODEL, vocab_size=64)
    piped = Workload(small_vocab, "m", tp=2, pp=2, microbatches=4, microbatch_size=2, seq=128)
    # 1F1B: the first stage holds a microbatch per stage (here the fullest); GPipe all
    assert (estimate(piped).stage, estimate(piped).in_flight) == (0, 2)
    assert estimate(piped, "gpipe").in_flight == 4
    shorter = estimate(Workload(MODEL, "m", tp=2, microbatches=4, microbatch_size=2, seq=128,
                                recompute="full"))
    assert shorter.activation_bytes == 4 * 2 * sb * 64 + 4 * sb * 1000 / 2
    sharded = estimate(Workload(MODEL, "m", tp=2, microbatches=4, microbatch_size=2, seq=128,
                                sp=True))
    assert sharded.activation_bytes < one.activation_bytes


def test_a_huge_vocabulary_does_not_fit_an_a100_and_says_by_how_much():
    huge = LlamaConfig(vocab_size=2_000_000_000, dim=2048, n_layers=2, n_heads=16,
                       ffn_dim=8192, max_seq_len=4096)
    found = estimate(Workload(huge, "huge", tp=8, microbatch_size=1, seq=256))
    short = found.shortfall(load_preset("sim:a100-sxm4-40gb").memory_bytes)
    assert short is not None and short.startswith("it needs about ")
    assert f"{found.total_bytes / 40e9:.1f}x the GPU's 40 GB" in short
    assert found.model_state_bytes > 8e12  # the embedding and the output, 16 bytes each
    small = estimate(Workload(MODEL, "m", tp=2, microbatch_size=2, seq=128))
    assert small.shortfall(40e9) is None


def test_kareus_plan_warns_where_the_workload_does_not_fit(tmp_path, capsys):
    gpu = tmp_path / "small.json"
    gpu.write_text(json.dumps({"base": "sim:a100-sxm4-40gb", "name": "small",
                               "memory_bytes": 1e9}))
    assert main(["plan", "llama3.2-1b", "--tp", "2", "--seq-len", "128", "--microbatch-size",
                 "1", "--microbatches", "2", "--device", str(gpu), "--cache-dir",
                 str(tmp_path / "c"), "--json", str(tmp_path / "r.json")]) == 0
    warned = [line for line in capsys.readouterr().out.splitlines()
              if line.startswith("warning:")]
    assert len(warned) == 1
    assert warned[0].startswith("warning: llama3.2-1b does not fit the GPU's memory: it needs")
    assert warned[0].endswith("planned as asked") and (tmp_path / "r.json").exists()


@pytest.mark.parametrize("name", ["sim:a100-sxm4-40gb", "sim:h100-sxm", "sim:h200"])
def test_the_presets_hold_their_datasheet_memory(name):
    assert load_preset(name).memory_bytes == {"sim:a100-sxm4-40gb": 40e9, "sim:h100-sxm": 80e9,
                                              "sim:h200": 141e9}[name]


def test_the_warning_and_the_record_a_result_keeps(tmp_path):
    gpu = tmp_path / "small.json"
    gpu.write_text(json.dumps({"base": "sim:a100-sxm4-40gb", "name": "small",
                               "memory_bytes": 1e6}))
    workload = Workload(MODEL, "m", tp=2, microbatch_size=2, seq=128)
    found, capacity, line = warning(workload, str(gpu))
    assert capacity == 1e6 and line.startswith("warning: m does not fit the GPU's memory: ")
    assert line.endswith("; planned as asked")
    assert record(found, capacity)["fits"] is False
    assert warning(workload, "sim:a100-sxm4-40gb")[2] is None
