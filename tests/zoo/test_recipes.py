"""The recipes a user follows from their framework, each as the user types it, on CPU:
torchtitan's own per-block compile with ``backend = "kareus"``, a Hugging Face ``Trainer``
given a model compiled with kareus, and ``examples/train_tp.py`` under torchrun. Options
come from ``$KAREUS_OPTIONS`` alone, never from code; each recipe trains like its
uncompiled self.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kareus

from .models import BATCH, DIM, HEADS, KV_HEADS, LAYERS, SEQ, VOCAB, make_batch

REPO = Path(__file__).resolve().parents[2]
# What the user exports; each value but the device differs from its default (on a machine
# without a GPU), so the plan shows it was read. A small search keeps the tests short.
OPTIONS = {"lowering": "eager", "device": "sim:h200", "nanobatches": "auto", "time_budget": 1.05,
           "search_budget": 4}
# The zoo's tolerances (tests/zoo/test_zoo.py): measured loss rel diff <= 2e-7. Gradients
# are compared relative to their largest magnitude (measured: 4e-7 on the fake group).
LOSS_REL, LOSS_ABS, GRAD_REL = 1e-5, 1e-6, 1e-5


def _assert_planned_from_environment() -> None:
    plan = kareus.current_plan()
    assert plan is not None, "nothing planned"
    assert {k: plan.options[k] for k in OPTIONS} == OPTIONS
    assert (plan.device, plan.budget.kind, plan.budget.fraction) == ("sim:h200", "time", 1.05)
    assert plan.predicted.time_s <= 1.05 * plan.baseline.time_s
    assert plan.predicted.energy_j <= plan.baseline.energy_j


# --- torchtitan -------------------------------------------------------------------------

TITAN_TOML = """
[model]
name = "llama3_kareus"
[compile]
enable = true
backend = "kareus"
[activation_checkpoint]
mode = "none"
[parallelism]
tensor_parallel_degree = 2
data_parallel_shard_degree = 1
[training]
seq_len = 16
"""


def _wait_for_the_embedding(model: torch.nn.Module) -> torch.nn.Module:
    """The recipe's workaround. torchtitan 0.2.2's TP embedding (``RowwiseParallel``, async
    reduce-scatter) hands block 0 an ``AsyncCollectiveTensor``; on torch 2.13 a compiled
    block fed one returns a plain tensor where the redistribute's backward expects a
    DTensor (``'Tensor' object has no attribute '_local_tensor'``), with Inductor and
    aot_eager alike. Waiting for it first gives the block a plain tensor."""
    import torch.distributed._functional_collectives as funcol

    def wait(module, inputs, out):
        return funcol.wait_tensor(out) if isinstance(out, funcol.AsyncCollectiveTensor) else out

    model.tok_embeddings.register_forward_hook(wait)
    return model


def _register_llama3_kareus() -> None:
    """What the user's ``--experimental.custom_import`` module does: llama3's train spec,
    its ``parallelize_fn`` (TP, then ``apply_compile`` per block) followed by the wait."""
    from torchtitan.protocols import train_spec as specs

    if "llama3_kareus" in specs._extra_train_specs:
        return
    llama3 = specs.get_train_spec("llama3")

    def parallelize(model, parallel_dims, job_config):
        return _wait_for_the_embedding(llama3.parallelize_fn(model, parallel_dims, job_config))

    specs.register_train_spec(
        "llama3_kareus", dataclasses.replace(llama3, parallelize_fn=parallelize)
    )


@pytest.mark.zoo
def test_torchtitan_compiles_its_blocks_with_kareus_from_its_config(
    fake_pg_numbers, fresh_runtime, monkeypatch, tmp_path
):
    """One process on a fake group of 2 ranks: both copies see the same (fake) collectives,
    so the compiled model must compute what the eager one does. The fake collectives do
    not sum across ranks, so training drifts far from a real run's (gradients of 1e5 by
    the second step): gradients are compared relative to their size."""
    pytest.importorskip("torchtitan")
    import torchtitan.distributed.parallel_dims as parallel_dims_mod
    from torchtitan.config import ConfigManager
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.utils import get_train_context
    from torchtitan.models.llama3 import TransformerModelArgs
    from torchtitan.protocols.train_spec import get_train_spec

    monkeypatch.setenv("KAREUS_OPTIONS", json.dumps(OPTIONS))
    monkeypatch.setattr(parallel_dims_mod, "device_type", "cpu")  # it picked "cuda" at import
    _register_llama3_kareus()
    config_file = tmp_path / "llama3_kareus.toml"
    config_file.write_text(TITAN_TOML)
    job = ConfigManager().parse_args(["--job.config_file", str(config_file)])
    flags = ConfigManager().parse_args(["--compile.enable", "--compile.backend", "kareus"])
    assert job.compile == flags.compile  # the TOML and the command line say the same
    eager_job = copy.deepcopy(job)
    eager_job.compile.enable = False

    p = job.parallelism
    dims = ParallelDims(
        dp_replicate=p.data_parallel_replicate_degree, dp_shard=p.data_parallel_shard_degree,
        cp=p.context_parallel_degree, tp=p.tensor_parallel_degree,
        pp=p.pipeline_parallel_degree, ep=p.expert_parallel_degree,
        etp=p.expert_tensor_parallel_degree, world_size=fake_pg_numbers,
    )
    spec = get_train_spec(job.model.name)
    args = TransformerModelArgs(
        dim=DIM, n_layers=LAYERS, n_heads=HEADS, n_kv_heads=KV_HEADS, vocab_size=VOCAB,
        ffn_dim_multiplier=0.38, multiple_of=64, max_seq_len=SEQ, attn_type="sdpa",
        rope_theta=500000,
    )
    args.update_from_config(job)
    torch.manual_seed(0)
    model = spec.model_cls(args)
    with torch.no_grad():
        model.init_weights()
    reference = copy.deepcopy(model)
    model = spec.parallelize_fn(model, dims, job)
    reference = spec.parallelize_fn(reference, dims, eager_job)
    assert all(isinstance(block, torch._dynamo.eval_frame.OptimizedModule)
               for block in model.layers.values()), "torchtitan's apply_compile did not run"

    runs = [(model, spec.build_loss_fn(job)), (reference, spec.build_loss_fn(eager_job))]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m, _ in runs]
    train_context = get_train_context(not job.parallelism.disable_loss_parallel)
    for step in range(2):
        inputs, labels = make_batch(step, shifted=True)
        losses = []
        for (m, loss_fn), opt in zip(runs, optimizers, strict=True):
            opt.zero_grad(set_to_none=True)
            with train_context():
                loss = loss_fn(m(inputs), labels) / labels.numel()
                loss.backward()
            losses.append(loss.full_tensor().item())
        assert losses[0] == pytest.approx(losses[1], rel=LOSS_REL, abs=LOSS_ABS), step
        for (name, a), b in zip(model.named_parameters(), reference.parameters(), strict=True):
            ours, eager = a.grad.to_local(), b.grad.to_local()
            diff = (ours - eager).abs().max().item()
            scale = max(eager.abs().max().item(), 1.0)
            assert diff <= GRAD_REL * scale, f"step {step}: {name} gradients differ by {diff}"
        for opt in optimizers:
            opt.step()

    reports = kareus.graph_reports()
    assert {r.kind for r in reports} == {"forward", "backward"}
    assert all(r.device == "sim:h200" for r in reports)
    assert any(c.kind in ("all_gather", "reduce_scatter") for r in reports
               for c in r.collectives), "no TP collective reached kareus"
    _assert_planned_from_environment()


# --- Hugging Face Trainer ---------------------------------------------------------------


def _trainer(model: torch.nn.Module, out: Path, **arguments):
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    ids = torch.randint(0, VOCAB, (2 * BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    args = TrainingArguments(
        output_dir=str(out), max_steps=2, per_device_train_batch_size=BATCH,
        learning_rate=1e-3, logging_steps=1, use_cpu=True, report_to=[], save_strategy="no",
        seed=0, disable_tqdm=True, **arguments,
    )
    return Trainer(model=model, args=args, train_dataset=data)


def _tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4 * SEQ,
        attention_dropout=0.0,
    ))


def _train(model: torch.nn.Module, out: Path) -> list[float]:
    trainer = _trainer(model, out, remove_unused_columns=False)
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


@pytest.mark.zoo
def test_hugging_face_trainer_trains_a_model_compiled_with_kareus(
    fresh_runtime, monkeypatch, tmp_path
):
    pytest.importorskip("transformers")
    pytest.importorskip("datasets")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    monkeypatch.setenv("KAREUS_OPTIONS", json.dumps(OPTIONS))
    eager = _train(_tiny_llama(), tmp_path / "eager")
    compiled = torch.compile(_tiny_llama(), backend="kareus")
    losses = _train(compiled, tmp_path / "kareus")
    assert len(losses) == len(eager) == 2
    assert losses == pytest.approx(eager, rel=1e-6), (losses, eager)
    reports = kareus.graph_reports()
    assert [r.kind for r in reports] == ["forward", "backward"]
    _assert_planned_from_environment()
    # Without remove_unused_columns=False the Trainer reads the compiled module's
    # signature, (*args, **kwargs), and drops every column.
    with pytest.raises(ValueError, match="No columns in the dataset match"):
        _trainer(compiled, tmp_path / "default").get_train_dataloader()


# --- torchrun with DTensor TP -----------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PLAN_LINE = re.compile(
    r"plan on sim:h200, time budget 1\.05, per GPU and step: (?P<time>[\d.e+-]+) ms, "
    r"(?P<energy>[\d.e+-]+) J; baseline (?P<base_time>[\d.e+-]+) ms, "
    r"(?P<base_energy>[\d.e+-]+) J \([+-][\d.]+% energy, [+-][\d.]+% time\)"
)


@pytest.mark.slow
def test_torchrun_example_plans_from_the_environment_and_trains_exactly(tmp_path):
    env = {
        **os.environ,
        "KAREUS_OPTIONS": json.dumps(OPTIONS),
        "KAREUS_CACHE_DIR": str(tmp_path / "cache"),
    }
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-port", str(_free_port()), "examples/train_tp.py",
        "--steps", "2", "--dim", "64", "--seq-len", "16", "--microbatch-size", "4", "--check",
    ]
    done = subprocess.run(command, check=False, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=240)
    out = done.stdout
    assert done.returncode == 0, f"{out}\n{done.stderr[-4000:]}"
    assert re.search(r"^check: first loss [\d.]+, eager [\d.]+: exact$", out, re.MULTILINE), out
    assert len(re.findall(r"^step \d: loss [\d.]+$", out, re.MULTILINE)) == 2, out
    (line,) = [m for m in PLAN_LINE.finditer(out)]  # printed once: on rank 0
    cost = {k: float(v) for k, v in line.groupdict().items()}
    assert cost["time"] <= 1.05 * cost["base_time"] * 1.001  # printed to 4 digits
    assert cost["energy"] <= cost["base_energy"]
