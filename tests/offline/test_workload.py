"""Workloads: checked when made, each error naming its field; stages' shares of the
layers, evenly or with the first stage's given (Megatron's
num_layers_in_first_pipeline_stage); the layout traced."""

from __future__ import annotations

import re

import pytest

from kareus.errors import KareusError
from kareus.models.llama import LlamaConfig
from kareus.offline.workload import Workload, WorkloadError, stage_layers

MODEL = LlamaConfig(dim=64, n_heads=8, n_kv_heads=2, ffn_dim=96, n_layers=4, max_seq_len=64)


def _workload(**fields):
    return Workload(MODEL, **{"name": "tiny", "tp": 2, "seq": 16, **fields})


@pytest.mark.parametrize("fields, message", [
    ({"tp": 4}, "workload tp=4: KV heads (2) must be divisible by the tensor-parallel degree 4"),
    ({"tp": 3}, "workload tp=3: heads (8) and KV heads (2) must be divisible by the tensor"),
    ({"pp": 5, "microbatches": 5}, "workload pp=5 is more than tiny's 4 layers"),
    ({"pp": 2, "microbatches": 1}, "workload microbatches=1 is fewer than pp=2: the 1F1B"),
    ({"seq": 65}, "workload seq=65 is more than tiny's max_seq_len 64"),
    ({"sp": True, "seq": 15}, ("workload seq=15 with sp: sequence parallelism splits the "
                              "sequence over the tp=2 ranks")),
    ({"tp": 0}, "workload tp must be an integer >= 1, got 0"),
    ({"pp": 0}, "workload pp must be an integer >= 1, got 0"),
    ({"microbatches": 0}, "workload microbatches must be an integer >= 1, got 0"),
    ({"microbatch_size": 2.0}, "workload microbatch_size must be an integer >= 1, got 2.0"),
    ({"seq": True}, "workload seq must be an integer >= 1, got True"),
    ({"sp": 1}, "workload sp must be True or False, got 1"),
    ({"recompute": "selective"}, "workload recompute must be one of 'none', 'full'"),
    ({"name": ""}, "workload name must be a non-empty string"),
    ({"layout": "nemo"}, "workload layout must be one of 'torchtitan', 'megatron', got 'nemo'"),
    ({"first_stage_layers": 0, "pp": 2, "microbatches": 2},
     "workload first_stage_layers must be an integer >= 1 or None, got 0"),
    ({"first_stage_layers": True, "pp": 2, "microbatches": 2},
     "workload first_stage_layers must be an integer >= 1 or None, got True"),
    ({"first_stage_layers": 2}, "workload first_stage_layers=2 needs pp >= 2"),
    ({"first_stage_layers": 4, "pp": 2, "microbatches": 2},
     "workload first_stage_layers=4 leaves 0 of tiny's 4 layers for the 1 later stage(s)"),
    ({"first_stage_layers": 1, "pp": 3, "microbatches": 3},
     ("workload first_stage_layers=1 leaves 3 of tiny's 4 layers for the 2 later stage(s): "
      "each needs at least one, and they split them evenly")),
])
def test_a_workload_that_cannot_be_laid_out_is_refused_naming_the_field(fields, message):
    with pytest.raises(WorkloadError, match=re.escape(message)):
        _workload(**fields)
    assert issubclass(WorkloadError, KareusError) and issubclass(WorkloadError, ValueError)


def test_a_workload_needs_a_model_config():
    with pytest.raises(WorkloadError, match="workload model must be a LlamaConfig, got str"):
        Workload("llama3.2-3b", "x")


@pytest.mark.parametrize("n_layers, pp, shares", [
    (4, 1, [4]),
    (4, 4, [1, 1, 1, 1]),
    (28, 3, [10, 9, 9]),
    (80, 6, [14, 14, 13, 13, 13, 13]),
])
def test_stages_split_the_layers_evenly_the_first_taking_the_extra_ones(n_layers, pp, shares):
    stages = stage_layers(n_layers, pp)
    assert [len(r) for r in stages] == shares
    assert [i for r in stages for i in r] == list(range(n_layers))


def test_the_traced_model_is_as_long_as_the_sequence():
    w = _workload(pp=2, microbatches=2)
    assert w.traced_model.max_seq_len == 16 and w.model.max_seq_len == 64
    assert w.stage_layers == (range(2), range(2, 4))


def test_a_workload_of_a_preset():
    w = Workload.of("llama3.2-3b", tp=8, pp=2, microbatches=8, microbatch_size=8, seq=4096)
    assert (w.name, w.model.n_kv_heads, len(w.stage_layers[0])) == ("llama3.2-3b", 8, 14)


@pytest.mark.parametrize("n_layers, pp, first, shares", [
    (28, 2, 15, [15, 13]),
    (28, 2, None, [14, 14]),
    (28, 3, 10, [10, 9, 9]),
    (10, 4, 4, [4, 2, 2, 2]),
    (4, 1, None, [4]),
])
def test_the_first_stage_holds_the_layers_given_and_the_others_split_the_rest(
    n_layers, pp, first, shares
):
    stages = stage_layers(n_layers, pp, first)
    assert [len(r) for r in stages] == shares
    assert [i for r in stages for i in r] == list(range(n_layers))


def test_a_workload_splits_its_stages_as_given_and_says_what_it_traces():
    w = Workload.of("llama3.2-3b", tp=8, pp=2, microbatches=8, microbatch_size=8, seq=4096,
                    layout="megatron", first_stage_layers=15)
    assert [len(r) for r in w.stage_layers] == [15, 13]
    assert w.vocab_parallel_loss
    assert w.describe().items() >= {"layout": "megatron", "loss": "vocab-parallel",
                                    "first_stage_layers": 15, "stage_layers": [15, 13]}.items()
    plain = Workload.of("llama3.2-3b", tp=8, pp=2, microbatches=8, seq=4096)
    assert (plain.layout, plain.vocab_parallel_loss) == ("torchtitan", False)
    assert plain.describe()["loss"] == "replicated logits"
