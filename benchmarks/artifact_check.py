"""The simulated A100 against the method's own A100 pipeline profiles (its public artifact).

The method's artifact (github ml-energy/kareus, branch osdi26ae, commit ``ARTIFACT_COMMIT``)
ships, for each paper workload, the frontier its Perseus baseline and its Nanobatching +
Perseus baseline were run at: ten ``freqs_pipeline_<iteration>.py`` files per workload under
``tests/perseus/schedules/<model>/<config>/frontier/`` and
``tests/nanobatch_perseus/schedules/<model>/<config>/frontier/`` (written by
``tests/{perseus,nanobatch_perseus}/run_optimization.py``, sampled by
``tests/artifact/create_frontier.sh``; the file one directory up is the fastest of them,
which the run scripts pick). Each file holds every instruction's SM clock (per stage, in
lowtime's ``Synchronous1F1B`` order) and two comments: "total cost" and "total cost with
P2P". These are the only measured-derived numbers of these workloads in the artifact: the
per-instruction profile they were solved from (``profile.csv``: stage, instruction,
frequency, time, energy, made by ``tests/perseus/generate_profile_csv.py`` from a frequency
sweep of Megatron's per-instruction timers and NVML energy polling) is written at run time
under ``tests/artifact/nemo_experiments/`` and was never committed (nor is any
per-instruction profile of these workloads anywhere in the repository's history). So the
comparison is made on whole iterations, at the clock assignments the artifact gives, not per
instruction.

How T and E are recovered (``run_optimization.py`` and lowtime 0.3.0, its solver):

- each profiled option's cost is its measured energy per GPU (the mean over the stage's 8
  GPUs) less 85 W x its time (``GPU_CONFIGS["A100"]["p2p_power_w"]`` in
  ``tests/bayesian/common/model_config.py``): an effective energy; its time is the maximum
  over the stage's GPUs, floored to whole milliseconds (``unit_time`` 1 ms);
- lowtime's Phillips-Dessouky solver walks from every instruction at its slowest
  Pareto-optimal option to the fastest plan, 1 ms per iteration; file ``k`` is the plan
  after ``k + 1`` steps. "total cost" is the sum over the 32 instructions (2 stages x 16) of
  an exponential fit of cost against duration, and "total cost with P2P" adds
  ``2 stages x T x 85 W``. Hence ``T = (with P2P - cost) / (2 x 85 W)``, and the iteration's
  energy on the 16 GPUs is ``8 x with P2P`` (each stage's numbers are per GPU). T is the
  critical path of the 1F1B DAG of instruction durations: no P2P transfers, no optimizer
  step (neither is in an instruction's timer);
- the fastest file's T is exact: the critical path with every instruction on it at its
  fastest option (the solver stops when such a path is critical): 1410 MHz, or in a few
  files 1380 MHz where that measured no slower (the same whole millisecond). So it is
  compared with the simulated DAG at 1410 MHz everywhere. Between the extremes lowtime's
  durations are relaxed: an instruction may be given any whole-millisecond duration between
  two options, runs at the slower-clocked option that fits (the clock in the file) and is
  costed on the fit; so an intermediate T is at least the critical path at the file's
  clocks, by up to one option step on the critical path. Each such point is compared with
  the simulated DAG at the file's clocks and at one 30 MHz step slower (the bracket the
  relaxed T falls in if every 30 MHz clock is a Pareto option);
- the slowest plan (before file 0) is not shipped but follows: its T is the fastest file's
  T + (its iteration + 1) ms, every instruction at its slowest Pareto option, which is the
  lowest clock any file gives that (stage, instruction) (instructions the solver never
  shortened keep it; an inference, marked as such).

Energy like for like: the artifact's per-GPU effective energies (measured less 85 W x t)
against the simulator's (``FrontierPoint.effective_energy_j``: less the preset's static
power x t, restated here at 85 W), both summed over one GPU of each stage, plus
``2 x 85 W x T``, times 8 GPUs per stage: the energy of the 16 GPUs of the iteration, GPU
only, blocked time at 85 W in both (the artifact's P2P power, and the simulated A100's
static power). Every artifact energy is lowtime's exponential fit at each instruction's
duration: on measured options for the fastest file's critical instructions, on relaxed
durations for instructions with slack and between the extremes.

Kareus's side: ``Workload.of(model, tp=8, pp=2, microbatches=8, microbatch_size, seq,
recompute="full")`` traced by ``kareus.offline.trace.trace_stages`` on ``sim:a100-sxm4-40gb``;
each instruction's time and effective energy at a clock is its graphs' ``frequency_only``
point at that clock (the default-clock point stands for 1410 MHz) times their counts, for
Perseus; for Nanobatching + Perseus, each graph's two-nanobatch default variant
(``GraphFrontier.nanobatched``, k = 2: collectives at their earliest slot, the library's SMs)
where the graph has one, else the unrewritten graph. The artifact ran Megatron-LM (NeMo,
Megatron-Core with Transformer Engine's layer spec) with 15 layers on the first stage, fused
QKV and gate-up projections, no sequence parallelism and a vocab-parallel loss; where the
Workload can say so (``layout``, ``first_stage_layers``) the script asks for the same
(``--as-given``: the plain call), and it prints and records what it traced. The CP2 x TP4
workloads of the artifact are not compared (kareus's offline Workload has no context
parallelism).

Verdicts use ``calibration.TOLERANCES``: times 10% relative, energies 15% relative, ratios
0.03 absolute. These are fidelity points: measurements the model was never calibrated on.
Nothing here feeds the simulator; a miss is reported, never fitted.

    python benchmarks/artifact_check.py [--out benchmarks/results/artifact_check.json]
        [--config llama3.2-3b:8:4096 ...] [--as-given]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from calibration import TOLERANCES
from rich.console import Console
from rich.table import Table

ARTIFACT_REPO = "ml-energy/kareus"
ARTIFACT_BRANCH = "osdi26ae"
ARTIFACT_COMMIT = "98f0255823bd993399866c64efdea8ccb1ab5a09"
DEVICE = "sim:a100-sxm4-40gb"
P2P_POWER_W = 85.0  # tests/bayesian/common/model_config.py: GPU_CONFIGS["A100"]["p2p_power_w"]
UNIT_TIME_S = 0.001  # tests/perseus/run_optimization.py: Args.unit_time
STAGES, GPUS_PER_STAGE, MICROBATCHES, TP = 2, 8, 8, 8
MAX_MHZ, MIN_MHZ, STEP_MHZ = 1410, 900, 30  # tests/artifact/README.md: FREQ_START/END/STEP
FIRST_STAGE_LAYERS = 15  # tests/artifact/conf/*.yaml: num_layers_in_first_pipeline_stage
METHODS = {"perseus": "Perseus", "nanobatch_perseus": "Nanobatching + Perseus"}
MODEL_DIRS = {"llama3.2-3b": "megatron_llama3.2_3b", "qwen3-1.7b": "megatron_qwen3_1.7b"}
KINDS = {"F": "forward", "B": "backward"}
ARTIFACT_ORDER = ("FFBFBFBFBFBFBFBB", "FBFBFBFBFBFBFBFB")
"""Every file's instruction kinds per stage: lowtime's Synchronous1F1B for 2 stages and 8
microbatches (the files store (kind, MHz) pairs; the data below keeps the MHz)."""

ARTIFACT_SETTINGS = {
    "source": f"{ARTIFACT_REPO}@{ARTIFACT_COMMIT}",
    "config files": "tests/artifact/conf/megatron_llama3.2_3b_config.yaml, "
                    "tests/artifact/conf/megatron_qwen3_1.7b_config.yaml",
    "framework": "NeMo MegatronGPTModel with mcore_gpt: true, transformer_engine: true "
                 "(3rdparty/NeMo .../megatron_gpt_model.py get_specs: the 'te_gpt' spec)",
    "layer": "TELayerNormColumnParallelLinear for linear_qkv (input RMSNorm fused with one "
             "fused QKV GEMM) and linear_fc1 (fused gate-up, fast-swiglu), "
             "TERowParallelLinear for linear_proj and linear_fc2, TEDotProductAttention "
             "(3rdparty/Megatron-LM/megatron/core/models/gpt/gpt_layer_specs.py): 2 TP "
             "all-reduces per layer forward",
    "loss": "parallel_output=True and cross_entropy_loss_fusion with the 'te' impl: "
            "te_parallel_cross_entropy over the TP group (language_module.py "
            "compute_language_model_loss): vocab-parallel, no all-gather of the logits",
    "sequence_parallel": False,
    "split": "num_layers_in_first_pipeline_stage: 15 (both models; 15/13 of 28 layers; "
             "also tests/bayesian/common/model_config.py MODEL_REGISTRY)",
    "recompute": "activations_checkpoint_granularity: full, method: uniform, num_layers: 1",
    "dropout": "hidden_dropout: 0.1, attention_dropout: 0.0 (dropout kernels on the residual "
               "adds run in training)",
    "other": "bf16, megatron_amp_O2, fused RoPE, bias: false, kv_channels 128, "
             "num_query_groups 8; Llama 3.2 3B untied embeddings; Qwen3 1.7B "
             "share_embeddings_and_output_weights: true, qk_layernorm: true, tokenizer "
             "Qwen/Qwen2.5-1.5B-Instruct; vocab padded to a multiple of 128 x TP",
    "timers": "3rdparty/Megatron-LM/megatron/core/pipeline_parallel/schedules.py: "
              "'forward-compute' wraps forward_step (the loss included on the last stage), "
              "'backward-compute' the backward (the recomputation included); "
              "timers.py: torch.cuda.synchronize() at start and stop, NVML energy counter "
              "polled in a side process, interpolated over each instruction",
    "profile": "tests/artifact/megatron_perseus_run_profiling.sh: every clock 1410..900 "
               "step 30 locked with nvidia-smi, a 30-step run each; generate_profile_csv.py "
               "skips 10 warm-up iterations, averages 20 x 8 microbatches",
}


@dataclass(frozen=True)
class ArtifactPlan:
    """One ``freqs_pipeline_<iteration>.py`` of the artifact: its clocks (MHz per
    instruction, per stage, in ``ARTIFACT_ORDER``) and its two cost comments (joules)."""

    method: str  # a key of METHODS: the artifact's directory under tests/
    model: str  # kareus's preset name
    microbatch_size: int
    seq: int
    iteration: int
    cost_j: float
    cost_with_p2p_j: float
    clocks: tuple[tuple[int, ...], tuple[int, ...]]

    @property
    def config(self) -> tuple[str, int, int]:
        return self.model, self.microbatch_size, self.seq

    @property
    def path(self) -> str:
        return (f"tests/{self.method}/schedules/{MODEL_DIRS[self.model]}/"
                f"cp1_tp{TP}_mbs{self.microbatch_size}_seq{self.seq}/frontier/"
                f"freqs_pipeline_{self.iteration:05d}.py")

    @property
    def time_s(self) -> float:
        """The iteration's time: (with P2P - cost) / (stages x 85 W)."""
        return (self.cost_with_p2p_j - self.cost_j) / (STAGES * P2P_POWER_W)

    @property
    def energy_j(self) -> float:
        """The iteration's energy on the 16 GPUs: 8 x "total cost with P2P"."""
        return GPUS_PER_STAGE * self.cost_with_p2p_j

    @property
    def effective_j(self) -> float:
        """The 32 instructions' effective energy, one GPU of each stage ("total cost")."""
        return self.cost_j

    def instructions(self) -> Iterable[tuple[int, str, int]]:
        """(stage, kind, MHz) of every instruction, in the artifact's order."""
        for stage, (kinds, clocks) in enumerate(zip(ARTIFACT_ORDER, self.clocks, strict=True)):
            for kind, mhz in zip(kinds, clocks, strict=True):
                yield stage, KINDS[kind], mhz


def _plan(method: str, model: str, mbs: int, seq: int, iteration: int, cost: float,
          cost_with_p2p: float, stage0: str, stage1: str) -> ArtifactPlan:
    clocks = tuple(tuple(int(mhz) for mhz in s.split()) for s in (stage0, stage1))
    return ArtifactPlan(method, model, mbs, seq, iteration, cost, cost_with_p2p, clocks)


# Transcribed from the files named in each comment, at ARTIFACT_COMMIT: iteration, "total
# cost", "total cost with P2P", then each stage's clocks (MHz) in the file's order.
PLANS: tuple[ArtifactPlan, ...] = (
    # tests/perseus/schedules/megatron_llama3.2_3b/cp1_tp8_mbs8_seq4096/frontier/
    _plan("perseus", "llama3.2-3b", 8, 4096, 122, 1192.416116588771, 2363.886116588771,
          "1020 930 960 1020 960 1020 960 1020 960 1020 960 1020 960 1020 900 960",
          "1020 1020 1020 1020 1020 1020 1020 1020 1020 1020 1020 1020 1020 1020 1020 1020"),
    _plan("perseus", "llama3.2-3b", 8, 4096, 376, 1205.2777782070439, 2333.567778207044,
          "1020 930 990 1020 990 1020 990 1020 990 1020 990 1020 990 1020 900 990",
          "1020 1020 1020 1020 1020 1020 1020 1020 1020 1020 1020 1020 1020 1020 1020 1020"),
    _plan("perseus", "llama3.2-3b", 8, 4096, 630, 1228.050612121447, 2313.1606121214472,
          "1080 930 1050 1080 1050 1080 1050 1080 1050 1080 1050 1080 1050 1080 900 1050",
          "1020 1020 1020 1020 1020 1020 1020 1020 1020 1020 1020 1020 1020 1020 1020 1020"),
    _plan("perseus", "llama3.2-3b", 8, 4096, 884, 1265.795141437662, 2307.7251414376624,
          "1110 930 1110 1110 1110 1110 1110 1110 1110 1110 1110 1110 1110 1110 900 1110",
          "1110 1080 1020 1020 1020 1020 1020 1020 1020 1020 1020 1020 1020 1020 1110 1080"),
    _plan("perseus", "llama3.2-3b", 8, 4096, 1138, 1333.5380711716682, 2332.288071171668,
          "1230 930 1140 1170 1140 1170 1140 1170 1140 1170 1140 1170 1140 1170 900 1200",
          "1230 1200 1050 1050 1050 1050 1050 1050 1050 1050 1050 1050 1050 1050 1230 1200"),
    _plan("perseus", "llama3.2-3b", 8, 4096, 1392, 1453.7322380641658, 2409.302238064166,
          "1320 930 1200 1230 1200 1230 1200 1230 1200 1230 1200 1230 1200 1230 930 1260",
          "1320 1260 1110 1080 1110 1080 1110 1080 1110 1080 1110 1080 1110 1080 1320 1260"),
    _plan("perseus", "llama3.2-3b", 8, 4096, 1519, 1536.3656637210947, 2470.3456637210948,
          "1350 930 1230 1260 1230 1260 1230 1260 1230 1260 1230 1260 1230 1260 960 1320",
          "1380 1320 1140 1140 1140 1140 1140 1140 1140 1140 1140 1140 1140 1140 1350 1290"),
    _plan("perseus", "llama3.2-3b", 8, 4096, 1646, 1638.8449043081991, 2551.234904308199,
          "1410 930 1260 1320 1260 1320 1260 1320 1260 1320 1260 1320 1260 1320 990 1350",
          "1410 1380 1200 1170 1200 1170 1200 1170 1200 1170 1200 1170 1200 1170 1410 1350"),
    _plan("perseus", "llama3.2-3b", 8, 4096, 1773, 1768.3760606022145, 2659.1760606022144,
          "1410 930 1320 1380 1320 1380 1320 1380 1320 1380 1320 1380 1320 1380 1020 1410",
          "1410 1410 1230 1200 1230 1200 1230 1200 1230 1200 1230 1200 1230 1200 1410 1410"),
    _plan("perseus", "llama3.2-3b", 8, 4096, 1900, 1945.0292962136812, 2814.239296213681,
          "1410 930 1410 1410 1410 1410 1410 1410 1410 1410 1410 1410 1410 1410 1020 1410",
          "1410 1410 1290 1260 1290 1260 1290 1260 1290 1260 1290 1260 1290 1260 1410 1410"),
    # tests/perseus/schedules/megatron_qwen3_1.7b/cp1_tp8_mbs8_seq4096/frontier/
    _plan("perseus", "qwen3-1.7b", 8, 4096, 152, 726.6131982370297, 1462.3731982370298,
          "1020 1020 960 1020 960 1020 960 1020 960 1020 960 1020 960 1020 900 1020",
          "960 960 900 900 900 900 900 900 900 900 900 900 900 900 960 960"),
    _plan("perseus", "qwen3-1.7b", 8, 4096, 308, 736.0236419986853, 1445.2636419986852,
          "1050 1020 1020 1020 1020 1020 1020 1020 1020 1020 1020 1020 1020 1020 900 1050",
          "1020 1020 960 960 960 960 960 960 960 960 960 960 960 960 1020 1020"),
    _plan("perseus", "qwen3-1.7b", 8, 4096, 464, 752.8021576316911, 1435.5221576316912,
          "1110 1020 1050 1050 1050 1050 1050 1050 1050 1050 1050 1050 1050 1050 900 1080",
          "1110 1080 990 990 990 990 990 990 990 990 990 990 990 990 1110 1080"),
    _plan("perseus", "qwen3-1.7b", 8, 4096, 620, 780.845916250098, 1437.045916250098,
          "1170 1020 1080 1110 1080 1110 1080 1110 1080 1110 1080 1110 1080 1110 900 1140",
          "1140 1140 1050 1020 1050 1020 1050 1020 1050 1020 1050 1020 1050 1020 1140 1140"),
    _plan("perseus", "qwen3-1.7b", 8, 4096, 776, 827.4905823646324, 1457.1705823646325,
          "1230 1020 1140 1170 1140 1170 1140 1170 1140 1170 1140 1170 1140 1170 900 1200",
          "1230 1200 1110 1080 1110 1080 1110 1080 1110 1080 1110 1080 1110 1080 1230 1200"),
    _plan("perseus", "qwen3-1.7b", 8, 4096, 854, 861.3610931720864, 1477.7810931720865,
          "1260 1020 1170 1200 1170 1200 1170 1200 1170 1200 1170 1200 1170 1200 900 1230",
          "1290 1230 1140 1110 1140 1110 1140 1110 1110 1110 1110 1110 1110 1110 1290 1230"),
    _plan("perseus", "qwen3-1.7b", 8, 4096, 932, 905.0973803209642, 1508.2573803209643,
          "1290 1020 1200 1230 1200 1230 1200 1230 1200 1230 1200 1230 1200 1230 960 1260",
          "1320 1290 1170 1140 1170 1140 1140 1140 1140 1140 1140 1140 1140 1140 1320 1260"),
    _plan("perseus", "qwen3-1.7b", 8, 4096, 1010, 961.646348846609, 1551.546348846609,
          "1380 1020 1260 1260 1260 1260 1260 1260 1260 1260 1260 1260 1260 1260 960 1320",
          "1410 1320 1200 1170 1200 1170 1200 1170 1200 1170 1200 1170 1200 1170 1410 1320"),
    _plan("perseus", "qwen3-1.7b", 8, 4096, 1088, 1035.9128314770007, 1612.5528314770008,
          "1410 1020 1290 1320 1290 1320 1290 1320 1290 1320 1290 1320 1290 1320 960 1410",
          "1410 1410 1230 1200 1230 1200 1230 1200 1230 1200 1230 1200 1230 1200 1410 1410"),
    _plan("perseus", "qwen3-1.7b", 8, 4096, 1166, 1141.2955609528865, 1704.6755609528864,
          "1410 1020 1410 1410 1410 1410 1410 1410 1410 1410 1410 1410 1410 1410 960 1410",
          "1410 1410 1320 1260 1320 1260 1320 1260 1320 1260 1320 1260 1320 1260 1410 1410"),
    # tests/perseus/schedules/megatron_qwen3_1.7b/cp1_tp8_mbs16_seq4096/frontier/
    _plan("perseus", "qwen3-1.7b", 16, 4096, 295, 1486.6009833493226, 2888.420983349323,
          "960 900 960 960 960 960 960 960 960 960 960 960 960 960 900 960",
          "960 960 900 900 900 900 900 900 900 900 900 900 900 900 960 960"),
    _plan("perseus", "qwen3-1.7b", 16, 4096, 601, 1500.2325905697844, 2850.0325905697846,
          "1020 900 990 1020 990 1020 990 1020 990 1020 990 1020 990 1020 900 1020",
          "1080 1020 960 960 960 960 960 960 960 960 960 960 960 960 1080 1020"),
    _plan("perseus", "qwen3-1.7b", 16, 4096, 907, 1527.2972572219965, 2825.0772572219967,
          "1080 900 1020 1050 1020 1050 1020 1050 1020 1050 1020 1050 1020 1050 900 1050",
          "1080 1050 990 960 990 960 990 960 990 960 990 960 990 960 1080 1050"),
    _plan("perseus", "qwen3-1.7b", 16, 4096, 1213, 1574.8069708344801, 2820.5669708344803,
          "1140 900 1080 1080 1080 1080 1080 1080 1080 1080 1080 1080 1080 1080 900 1110",
          "1140 1110 1080 1020 1080 1020 1080 1020 1080 1020 1080 1020 1080 1020 1140 1110"),
    _plan("perseus", "qwen3-1.7b", 16, 4096, 1519, 1658.2322611895509, 2851.972261189551,
          "1200 900 1140 1140 1140 1140 1140 1140 1140 1140 1140 1140 1140 1140 900 1200",
          "1200 1170 1080 1050 1080 1050 1080 1050 1080 1050 1080 1050 1080 1050 1200 1170"),
    _plan("perseus", "qwen3-1.7b", 16, 4096, 1672, 1721.235845407107, 2888.965845407107,
          "1260 900 1170 1200 1170 1200 1170 1200 1170 1200 1170 1200 1170 1200 900 1230",
          "1230 1200 1110 1080 1110 1080 1110 1080 1110 1080 1110 1080 1110 1080 1230 1200"),
    _plan("perseus", "qwen3-1.7b", 16, 4096, 1825, 1804.7151768342928, 2946.435176834293,
          "1290 900 1200 1230 1200 1230 1200 1230 1200 1230 1200 1230 1200 1230 900 1260",
          "1290 1260 1170 1110 1170 1110 1170 1110 1170 1110 1170 1110 1170 1110 1290 1260"),
    _plan("perseus", "qwen3-1.7b", 16, 4096, 1978, 1915.351973783991, 3031.061973783991,
          "1350 900 1230 1260 1230 1260 1230 1260 1230 1260 1230 1260 1230 1260 900 1320",
          "1350 1290 1200 1170 1200 1170 1200 1170 1200 1170 1200 1170 1200 1170 1350 1290"),
    _plan("perseus", "qwen3-1.7b", 16, 4096, 2131, 2063.174110779173, 3152.874110779173,
          "1410 900 1290 1320 1290 1320 1290 1320 1290 1320 1290 1320 1290 1320 960 1410",
          "1410 1410 1230 1200 1230 1200 1230 1200 1230 1200 1230 1200 1230 1200 1410 1410"),
    _plan("perseus", "qwen3-1.7b", 16, 4096, 2284, 2279.816270578542, 3343.506270578542,
          "1410 900 1410 1410 1410 1410 1410 1410 1410 1410 1410 1410 1410 1410 960 1410",
          "1410 1410 1290 1260 1290 1260 1290 1260 1290 1260 1290 1260 1290 1260 1410 1410"),
    # tests/perseus/schedules/megatron_qwen3_1.7b/cp1_tp8_mbs8_seq8192/frontier/
    _plan("perseus", "qwen3-1.7b", 8, 8192, 263, 1660.2815799377659, 3138.771579937766,
          "1050 990 990 990 990 990 990 990 990 990 990 990 990 990 990 1020",
          "1050 1020 960 960 960 960 960 960 960 960 960 960 960 960 1050 1020"),
    _plan("perseus", "qwen3-1.7b", 8, 8192, 531, 1691.775028278511, 3124.7050282785112,
          "1080 990 1050 1050 1050 1050 1050 1050 1050 1050 1050 1050 1050 1050 990 1080",
          "1110 1080 1020 960 1020 960 1020 960 1020 960 1020 960 1020 960 1110 1080"),
    _plan("perseus", "qwen3-1.7b", 8, 8192, 799, 1739.6598273878808, 3127.0298273878807,
          "1140 990 1080 1080 1080 1080 1080 1080 1080 1080 1080 1080 1080 1080 990 1110",
          "1140 1110 1020 1020 1020 1020 1020 1020 1020 1020 1020 1020 1020 1020 1140 1110"),
    _plan("perseus", "qwen3-1.7b", 8, 8192, 1067, 1811.4379883719043, 3153.2479883719043,
          "1200 990 1110 1140 1110 1140 1110 1140 1110 1140 1110 1140 1110 1140 990 1170",
          "1200 1170 1050 1050 1050 1050 1050 1050 1050 1050 1050 1050 1050 1050 1200 1170"),
    _plan("perseus", "qwen3-1.7b", 8, 8192, 1335, 1919.077477226024, 3215.327477226024,
          "1260 990 1170 1200 1170 1200 1170 1200 1170 1200 1170 1200 1170 1200 990 1230",
          "1290 1230 1110 1080 1110 1080 1110 1080 1110 1080 1110 1080 1110 1080 1290 1230"),
    _plan("perseus", "qwen3-1.7b", 8, 8192, 1469, 1991.6525526889473, 3265.1225526889475,
          "1290 990 1200 1230 1200 1230 1200 1230 1200 1230 1200 1230 1200 1230 990 1260",
          "1290 1260 1140 1110 1140 1110 1140 1110 1140 1110 1140 1110 1140 1110 1290 1260"),
    _plan("perseus", "qwen3-1.7b", 8, 8192, 1603, 2080.5344581322242, 3331.2244581322243,
          "1320 990 1230 1260 1230 1260 1230 1260 1230 1260 1230 1260 1230 1260 990 1290",
          "1350 1290 1170 1140 1170 1140 1170 1140 1170 1140 1170 1140 1170 1140 1350 1290"),
    _plan("perseus", "qwen3-1.7b", 8, 8192, 1737, 2189.4325756901426, 3417.3425756901424,
          "1380 990 1260 1290 1260 1290 1260 1290 1260 1290 1260 1290 1260 1290 990 1350",
          "1410 1350 1200 1170 1200 1170 1200 1170 1200 1170 1200 1170 1200 1170 1410 1350"),
    _plan("perseus", "qwen3-1.7b", 8, 8192, 1871, 2325.5959611551157, 3530.725961155116,
          "1410 990 1320 1320 1320 1320 1320 1320 1320 1320 1320 1320 1320 1320 990 1410",
          "1410 1410 1230 1200 1230 1200 1230 1200 1230 1200 1230 1200 1230 1200 1410 1410"),
    _plan("perseus", "qwen3-1.7b", 8, 8192, 2005, 2507.999661317191, 3690.349661317191,
          "1410 990 1410 1410 1410 1410 1410 1410 1410 1410 1410 1410 1410 1410 990 1410",
          "1410 1410 1290 1260 1290 1260 1290 1260 1290 1260 1290 1260 1290 1260 1410 1410"),
    # tests/nanobatch_perseus/schedules/megatron_llama3.2_3b/cp1_tp8_mbs8_seq4096/frontier/
    _plan("nanobatch_perseus", "llama3.2-3b", 8, 4096, 102, 1143.4720325263313, 2175.202032526331,
          "990 990 930 990 930 990 930 990 930 990 930 990 930 990 900 930",
          "960 930 900 900 900 900 900 900 900 900 900 900 900 900 960 930"),
    _plan("nanobatch_perseus", "llama3.2-3b", 8, 4096, 308, 1156.3357973037087, 2153.0457973037087,
          "990 990 990 990 990 990 990 990 990 990 990 990 990 990 900 1020",
          "1020 1020 900 900 900 900 900 900 900 900 900 900 900 900 1020 1020"),
    _plan("nanobatch_perseus", "llama3.2-3b", 8, 4096, 514, 1183.8145337608926, 2145.5045337608926,
          "1080 990 1020 1020 1020 1020 1020 1020 1020 1020 1020 1020 1020 1020 900 1080",
          "1080 1080 960 960 960 960 960 960 960 960 960 960 960 960 1080 1080"),
    _plan("nanobatch_perseus", "llama3.2-3b", 8, 4096, 720, 1227.370551422681, 2154.0405514226813,
          "1140 990 1080 1080 1080 1080 1080 1080 1080 1080 1080 1080 1080 1080 900 1140",
          "1170 1140 990 990 990 990 990 990 990 990 990 990 990 990 1170 1140"),
    _plan("nanobatch_perseus", "llama3.2-3b", 8, 4096, 926, 1295.2598576352007, 2186.9098576352008,
          "1230 990 1140 1140 1140 1140 1140 1140 1140 1140 1140 1140 1140 1140 900 1200",
          "1230 1200 1050 1050 1050 1050 1050 1050 1050 1050 1050 1050 1050 1050 1230 1200"),
    _plan("nanobatch_perseus", "llama3.2-3b", 8, 4096, 1132, 1401.0669273581307, 2257.696927358131,
          "1320 990 1200 1230 1200 1230 1200 1230 1200 1230 1200 1230 1200 1230 900 1260",
          "1320 1260 1110 1080 1110 1080 1110 1080 1110 1080 1110 1080 1110 1080 1320 1260"),
    _plan("nanobatch_perseus", "llama3.2-3b", 8, 4096, 1235, 1474.700674624457, 2313.820674624457,
          "1380 990 1230 1290 1230 1290 1230 1290 1230 1290 1230 1290 1230 1290 930 1320",
          "1380 1290 1170 1110 1170 1110 1170 1110 1170 1110 1170 1110 1170 1110 1380 1290"),
    _plan("nanobatch_perseus", "llama3.2-3b", 8, 4096, 1338, 1566.855893932565, 2388.465893932565,
          "1410 990 1260 1320 1260 1320 1260 1320 1260 1320 1260 1320 1260 1320 960 1350",
          "1410 1350 1200 1170 1200 1170 1200 1170 1200 1170 1200 1170 1200 1170 1410 1350"),
    _plan("nanobatch_perseus", "llama3.2-3b", 8, 4096, 1441, 1683.884581703553, 2487.984581703553,
          "1410 990 1320 1380 1320 1380 1320 1380 1320 1380 1320 1380 1320 1380 990 1410",
          "1410 1410 1230 1200 1230 1200 1230 1200 1230 1200 1230 1200 1230 1200 1410 1410"),
    _plan("nanobatch_perseus", "llama3.2-3b", 8, 4096, 1544, 1845.3291117694703, 2631.91911176947,
          "1410 990 1410 1410 1410 1410 1410 1410 1410 1410 1410 1410 1410 1410 990 1410",
          "1410 1410 1320 1260 1320 1260 1320 1260 1320 1260 1320 1260 1320 1260 1410 1410"),
    # tests/nanobatch_perseus/schedules/megatron_qwen3_1.7b/cp1_tp8_mbs8_seq4096/frontier/
    _plan("nanobatch_perseus", "qwen3-1.7b", 8, 4096, 96, 698.7325864590674, 1330.1125864590674,
          "990 990 990 990 990 990 990 990 990 990 990 990 990 990 930 990",
          "1020 990 930 930 930 930 930 930 930 930 930 930 930 930 1020 990"),
    _plan("nanobatch_perseus", "qwen3-1.7b", 8, 4096, 202, 714.2466095604582, 1327.6066095604583,
          "1080 990 1020 1020 1020 1020 1020 1020 1020 1020 1020 1020 1020 1020 930 1080",
          "1080 1080 990 990 990 990 990 990 990 990 990 990 990 990 1080 1080"),
    _plan("nanobatch_perseus", "qwen3-1.7b", 8, 4096, 308, 737.685539166314, 1333.025539166314,
          "1110 990 1050 1080 1050 1080 1050 1080 1050 1080 1050 1080 1050 1050 930 1110",
          "1140 1110 1020 990 1020 990 1020 990 1020 990 1020 990 1020 990 1140 1110"),
    _plan("nanobatch_perseus", "qwen3-1.7b", 8, 4096, 414, 772.1670958241484, 1349.4870958241484,
          "1200 990 1110 1110 1110 1110 1110 1110 1110 1110 1110 1110 1110 1110 930 1170",
          "1230 1170 1080 1050 1080 1050 1080 1050 1080 1050 1080 1050 1080 1050 1230 1170"),
    _plan("nanobatch_perseus", "qwen3-1.7b", 8, 4096, 520, 822.994738499563, 1382.294738499563,
          "1290 990 1170 1170 1170 1170 1170 1170 1170 1170 1170 1170 1170 1170 930 1230",
          "1290 1230 1140 1080 1140 1080 1140 1080 1140 1080 1140 1080 1140 1080 1290 1230"),
    _plan("nanobatch_perseus", "qwen3-1.7b", 8, 4096, 573, 856.7919421486262, 1407.0819421486262,
          "1320 990 1200 1260 1200 1260 1200 1260 1200 1260 1200 1260 1200 1260 930 1290",
          "1350 1290 1140 1110 1140 1110 1140 1110 1140 1110 1140 1110 1140 1110 1350 1290"),
    _plan("nanobatch_perseus", "qwen3-1.7b", 8, 4096, 626, 897.8778886271099, 1439.15788862711,
          "1350 990 1230 1260 1230 1260 1230 1260 1230 1260 1230 1260 1230 1260 930 1320",
          "1410 1320 1170 1140 1170 1140 1170 1140 1170 1140 1170 1140 1170 1140 1410 1320"),
    _plan("nanobatch_perseus", "qwen3-1.7b", 8, 4096, 679, 947.9487522786161, 1480.2187522786162,
          "1410 990 1290 1290 1260 1290 1260 1290 1260 1290 1260 1290 1260 1290 930 1350",
          "1410 1380 1230 1170 1230 1170 1230 1170 1230 1170 1230 1170 1230 1170 1410 1380"),
    _plan("nanobatch_perseus", "qwen3-1.7b", 8, 4096, 732, 1011.0337594795049, 1534.2937594795048,
          "1410 990 1320 1380 1320 1350 1320 1350 1320 1350 1320 1350 1320 1350 930 1410",
          "1410 1410 1260 1230 1260 1230 1260 1230 1260 1230 1260 1230 1260 1230 1410 1410"),
    _plan("nanobatch_perseus", "qwen3-1.7b", 8, 4096, 785, 1095.3717879953135, 1609.6217879953135,
          "1410 990 1410 1410 1410 1410 1410 1410 1410 1410 1410 1410 1410 1410 930 1410",
          "1410 1410 1350 1260 1350 1260 1350 1260 1350 1260 1350 1260 1350 1260 1410 1410"),
    # tests/nanobatch_perseus/schedules/megatron_qwen3_1.7b/cp1_tp8_mbs16_seq4096/frontier/
    _plan("nanobatch_perseus", "qwen3-1.7b", 16, 4096, 197, 1430.2203174369117, 2603.2203174369115,
          "990 900 960 990 960 990 960 990 960 990 960 990 960 990 900 960",
          "990 960 930 930 930 930 930 930 930 930 930 930 930 930 990 960"),
    _plan("nanobatch_perseus", "qwen3-1.7b", 16, 4096, 405, 1444.8191349124993, 2582.4591349124994,
          "1020 900 990 990 990 990 990 990 990 990 990 990 990 990 900 1020",
          "1050 1020 990 960 990 960 990 960 990 960 990 960 990 960 1050 1020"),
    _plan("nanobatch_perseus", "qwen3-1.7b", 16, 4096, 613, 1473.2280214921318, 2575.508021492132,
          "1080 900 1020 1020 1020 1020 1020 1020 1020 1020 1020 1020 1020 1020 900 1080",
          "1110 1080 1020 990 1020 990 1020 990 1020 990 1020 990 1020 990 1110 1080"),
    _plan("nanobatch_perseus", "qwen3-1.7b", 16, 4096, 821, 1521.2581025603224, 2588.1781025603223,
          "1170 900 1080 1080 1080 1080 1080 1080 1080 1080 1080 1080 1080 1080 900 1140",
          "1170 1140 1080 1020 1080 1020 1080 1020 1080 1020 1080 1020 1050 1020 1170 1140"),
    _plan("nanobatch_perseus", "qwen3-1.7b", 16, 4096, 1029, 1602.378206302631, 2633.9382063026314,
          "1230 900 1140 1170 1140 1170 1140 1170 1140 1170 1140 1170 1140 1170 900 1200",
          "1230 1200 1110 1080 1110 1080 1110 1080 1110 1080 1110 1080 1110 1080 1230 1200"),
    _plan("nanobatch_perseus", "qwen3-1.7b", 16, 4096, 1133, 1662.0113750878245, 2675.8913750878246,
          "1260 900 1170 1200 1170 1200 1170 1200 1170 1200 1170 1200 1170 1200 900 1230",
          "1290 1230 1140 1110 1140 1110 1140 1110 1140 1110 1140 1110 1140 1110 1290 1230"),
    _plan("nanobatch_perseus", "qwen3-1.7b", 16, 4096, 1237, 1739.612702425846, 2735.812702425846,
          "1290 900 1200 1230 1200 1230 1200 1230 1200 1230 1200 1230 1200 1230 900 1260",
          "1320 1290 1200 1140 1200 1140 1200 1140 1170 1140 1170 1140 1170 1140 1320 1290"),
    _plan("nanobatch_perseus", "qwen3-1.7b", 16, 4096, 1341, 1840.5147061193413, 2819.0347061193415,
          "1350 900 1230 1260 1230 1260 1230 1260 1230 1260 1230 1260 1230 1260 900 1320",
          "1410 1350 1230 1170 1230 1170 1230 1170 1230 1170 1230 1170 1230 1170 1410 1350"),
    _plan("nanobatch_perseus", "qwen3-1.7b", 16, 4096, 1445, 1975.9082939366806, 2936.7482939366805,
          "1410 900 1290 1320 1290 1320 1290 1320 1290 1320 1290 1320 1290 1320 900 1410",
          "1410 1380 1260 1230 1260 1230 1260 1230 1260 1230 1260 1200 1260 1200 1410 1380"),
    _plan("nanobatch_perseus", "qwen3-1.7b", 16, 4096, 1549, 2174.0132659290043, 3117.173265929004,
          "1410 900 1410 1410 1410 1410 1410 1410 1410 1410 1410 1410 1410 1410 900 1410",
          "1410 1380 1320 1260 1320 1260 1320 1260 1320 1260 1320 1260 1320 1260 1410 1380"),
    # tests/nanobatch_perseus/schedules/megatron_qwen3_1.7b/cp1_tp8_mbs8_seq8192/frontier/
    _plan("nanobatch_perseus", "qwen3-1.7b", 8, 8192, 197, 1629.132444183129, 2914.162444183129,
          "1020 960 1020 1020 1020 1020 1020 1020 1020 1020 1020 1020 1020 1020 960 1020",
          "1020 1020 990 990 990 990 990 990 990 990 990 990 990 990 1020 1020"),
    _plan("nanobatch_perseus", "qwen3-1.7b", 8, 8192, 399, 1653.642904554452, 2904.332904554452,
          "1050 960 1050 1050 1050 1050 1050 1050 1050 1050 1050 1050 1050 1050 960 1050",
          "1080 1080 990 990 990 990 990 990 990 990 990 990 990 990 1080 1080"),
    _plan("nanobatch_perseus", "qwen3-1.7b", 8, 8192, 601, 1698.1535040003578, 2914.5035040003577,
          "1140 960 1080 1080 1080 1080 1080 1080 1080 1080 1080 1080 1080 1080 960 1140",
          "1170 1140 1020 1020 1020 1020 1020 1020 1020 1020 1020 1020 1020 1020 1170 1140"),
    _plan("nanobatch_perseus", "qwen3-1.7b", 8, 8192, 803, 1768.690251316023, 2950.7002513160232,
          "1200 960 1140 1140 1140 1140 1140 1140 1110 1140 1110 1140 1110 1140 960 1200",
          "1230 1200 1080 1080 1080 1080 1080 1080 1080 1050 1080 1050 1080 1050 1230 1200"),
    _plan("nanobatch_perseus", "qwen3-1.7b", 8, 8192, 1005, 1873.332490731369, 3021.002490731369,
          "1260 960 1170 1200 1170 1200 1170 1200 1170 1200 1170 1200 1170 1200 960 1260",
          "1290 1230 1110 1110 1110 1110 1110 1110 1110 1110 1110 1110 1110 1110 1290 1230"),
    _plan("nanobatch_perseus", "qwen3-1.7b", 8, 8192, 1106, 1943.3644246192223, 3073.8644246192225,
          "1290 960 1200 1230 1200 1230 1200 1230 1200 1230 1200 1230 1200 1230 960 1290",
          "1320 1260 1170 1140 1170 1140 1170 1140 1140 1140 1140 1140 1140 1140 1320 1260"),
    _plan("nanobatch_perseus", "qwen3-1.7b", 8, 8192, 1207, 2028.6102770615928, 3141.940277061593,
          "1320 960 1230 1260 1230 1260 1230 1260 1230 1260 1230 1260 1230 1260 960 1320",
          "1380 1320 1200 1140 1200 1140 1200 1140 1200 1140 1200 1140 1200 1140 1380 1320"),
    _plan("nanobatch_perseus", "qwen3-1.7b", 8, 8192, 1308, 2132.9274525539813, 3229.087452553981,
          "1380 960 1290 1290 1290 1290 1290 1290 1290 1290 1260 1290 1260 1290 960 1380",
          "1410 1350 1230 1170 1230 1170 1230 1170 1230 1170 1230 1170 1230 1170 1410 1350"),
    _plan("nanobatch_perseus", "qwen3-1.7b", 8, 8192, 1409, 2263.298580507076, 3342.2885805070764,
          "1410 960 1320 1350 1320 1320 1320 1320 1320 1320 1320 1320 1320 1320 960 1410",
          "1410 1410 1260 1230 1260 1230 1260 1230 1260 1230 1260 1230 1260 1230 1410 1410"),
    _plan("nanobatch_perseus", "qwen3-1.7b", 8, 8192, 1510, 2436.708760655588, 3498.528760655588,
          "1410 960 1410 1410 1410 1410 1410 1410 1410 1410 1410 1410 1410 1410 960 1410",
          "1410 1410 1320 1260 1320 1260 1320 1260 1320 1260 1320 1260 1320 1260 1410 1410"),

)

CONFIGS = tuple(dict.fromkeys(p.config for p in PLANS))


def plans_of(method: str, config: tuple[str, int, int]) -> list[ArtifactPlan]:
    """The method's frontier files of one workload, slowest first (by iteration)."""
    return sorted((p for p in PLANS if p.method == method and p.config == config),
                  key=lambda p: p.iteration)


@dataclass(frozen=True)
class MeasuredPoint:
    """A plan of the artifact as compared: its clocks, its T (and E where recorded), and
    how exact T is (``exact``: a critical path of option times, no relaxation)."""

    label: str
    iteration: int  # -1: the slowest plan, before the first file
    clocks: tuple[tuple[int, ...], ...]
    time_s: float
    energy_j: float | None
    effective_j: float | None
    source: str
    exact: bool
    inferred: bool = False


def measured_points(method: str, config: tuple[str, int, int]) -> list[MeasuredPoint]:
    """The inferred slowest plan, then every file of the frontier, slowest first."""
    plans = plans_of(method, config)
    fastest = plans[-1]
    lowest = tuple(
        tuple(min(p.clocks[s][i] for p in plans) for i in range(len(fastest.clocks[s])))
        for s in range(STAGES)
    )
    # Each (stage, kind) at its lowest clock in any file: every instruction at its slowest
    # Pareto option (the solver's start).
    slowest_clock = {
        (s, kind): min(c for c, k in zip(lowest[s], ARTIFACT_ORDER[s], strict=True) if k == kind)
        for s in range(STAGES) for kind in KINDS
    }
    slowest = MeasuredPoint(
        "slowest*", -1,
        tuple(tuple(slowest_clock[s, k] for k in ARTIFACT_ORDER[s]) for s in range(STAGES)),
        fastest.time_s + (fastest.iteration + 1) * UNIT_TIME_S, None, None,
        f"{fastest.path}: T + (iteration + 1) x 1 ms; clocks: each (stage, kind)'s lowest "
        "in any file", exact=True, inferred=True,
    )
    points = [slowest]
    for p in plans:
        points.append(MeasuredPoint(
            "fastest" if p is fastest else f"it {p.iteration}", p.iteration, p.clocks,
            p.time_s, p.energy_j, p.effective_j, p.path, exact=p is fastest,
        ))
    return points


def solver_step_deviation(method: str, config: tuple[str, int, int]) -> float:
    """The largest |T_j - T_k - (k - j) ms| over the files of one frontier: lowtime takes
    1 ms off T per iteration, so 0 up to rounding if the files were read right."""
    plans = plans_of(method, config)
    return max(abs(a.time_s - b.time_s - (b.iteration - a.iteration) * UNIT_TIME_S)
               for a in plans for b in plans)


# --- kareus's side --------------------------------------------------------------------------

ARTIFACT_CLOCKS = tuple(range(MAX_MHZ, MIN_MHZ - 1, -STEP_MHZ))
Costs = dict[tuple[int, str], dict[int, tuple[float, float]]]
"""(stage, kind) -> MHz -> (seconds, effective joules at 85 W) of one instruction, per GPU."""


def workload_for(model: str, microbatch_size: int, seq: int, as_given: bool = False):
    """The traced workload, and what was asked beyond the plain ``Workload.of`` call: the
    artifact's layout and split where this Workload has the fields (``as_given``: none)."""
    from kareus.offline import Workload

    fields = {f.name for f in dataclasses.fields(Workload)}
    extra: dict[str, Any] = {}
    if not as_given:
        if "layout" in fields:
            extra["layout"] = "megatron"
        if "first_stage_layers" in fields:
            extra["first_stage_layers"] = FIRST_STAGE_LAYERS
    workload = Workload.of(model, tp=TP, pp=STAGES, microbatches=MICROBATCHES,
                           microbatch_size=microbatch_size, seq=seq, recompute="full", **extra)
    return workload, extra


def describe(workload: Any) -> dict[str, Any]:
    """What was traced, as far as the Workload says (read defensively: it is changing)."""
    out: dict[str, Any] = {}
    describe_fn = getattr(workload, "describe", None)
    if callable(describe_fn):
        out.update(describe_fn())
    for name in ("layout", "first_stage_layers", "vocab_parallel_loss", "sp", "recompute"):
        if hasattr(workload, name):
            out.setdefault(name, getattr(workload, name))
    out.setdefault("stage_layers", [len(r) for r in workload.stage_layers])
    model = getattr(workload, "model", None)
    if dataclasses.is_dataclass(model):
        out["model"] = {f.name: getattr(model, f.name) for f in dataclasses.fields(model)
                        if isinstance(getattr(model, f.name), (int, float, str, bool,
                                                               type(None)))}
    return out


def instruction_costs(stages: Sequence[Any], static_power_w: float) -> dict[str, Any]:
    """Each method's ``Costs`` from the traced stages, and the graphs Nanobatching +
    Perseus ran unrewritten (no two-nanobatch variant)."""
    def mhz(point: Any) -> int:
        return point.choice.clock_mhz or MAX_MHZ  # 0: the default clock, the maximum

    def at85(point: Any) -> tuple[float, float]:
        return (point.time_s,
                point.effective_energy_j + (static_power_w - P2P_POWER_W) * point.time_s)

    costs: dict[str, Costs] = {method: {} for method in METHODS}
    unsplit: set[str] = set()
    for st in stages:
        for kind in KINDS.values():
            total = {method: dict.fromkeys(ARTIFACT_CLOCKS, (0.0, 0.0)) for method in METHODS}
            for graph, count in getattr(st, kind):
                alone = {mhz(p): at85(p) for p in graph.frequency_only}
                split = {mhz(p): at85(p) for p in graph.nanobatched
                         if p.choice.nanobatches == 2}
                for method, table in total.items():
                    use = split if method == "nanobatch_perseus" and split else alone
                    if method == "nanobatch_perseus" and not split:
                        unsplit.add(graph.label)
                    for f in ARTIFACT_CLOCKS:
                        if f not in use:
                            raise KeyError(f"{graph.label}: no point at {f} MHz "
                                           f"(has {sorted(use)})")
                        t, e = table[f]
                        table[f] = (t + count * use[f][0], e + count * use[f][1])
            for method in METHODS:
                costs[method][st.stage, kind] = total[method]
    return {"costs": costs, "unsplit": sorted(unsplit)}


def _dag():
    from kareus.planner.pipeline import one_f_one_b

    dag = one_f_one_b(STAGES, MICROBATCHES)
    for s, order in enumerate(dag.orders):
        kinds = "".join(dag.instructions[i].kind[0].upper() for i in order)
        if kinds != ARTIFACT_ORDER[s]:
            raise AssertionError(f"stage {s}: kareus's 1F1B order {kinds} is not the "
                                 f"artifact's {ARTIFACT_ORDER[s]}")
    return dag


def simulate(dag: Any, costs: Costs, clocks: Sequence[Sequence[int]],
             slower_steps: int = 0) -> dict[str, Any]:
    """The iteration on the simulated A100 with each instruction at the artifact's clock
    (``slower_steps`` 30 MHz steps lower, not below 900): T (the DAG's longest path, no
    switch costs, as lowtime), the effective energy of one GPU per stage, the 16 GPUs'
    energy, and how many instructions of each stage the critical path holds."""
    from kareus.planner.pipeline import schedule

    n = len(dag.instructions)
    durations, energies = [0.0] * n, [0.0] * n
    for s, order in enumerate(dag.orders):
        for i, f in zip(order, clocks[s], strict=True):
            f = max(MIN_MHZ, f - slower_steps * STEP_MHZ)
            durations[i], energies[i] = costs[s, dag.instructions[i].kind][f]
    start, makespan = schedule(dag, durations)
    effective = sum(energies)
    return {
        "time_s": makespan,
        "effective_j": effective,
        "energy_j": GPUS_PER_STAGE * (effective + STAGES * P2P_POWER_W * makespan),
        "critical": _critical(dag, start, durations, makespan),
    }


def _critical(dag: Any, start: Sequence[float], durations: Sequence[float],
              makespan: float) -> list[int]:
    preds: dict[int, list[int]] = {i: [] for i in range(len(durations))}
    for a, b in dag.edges:
        preds[b].append(a)
    eps = 1e-9 * max(makespan, 1.0)
    per_stage = [0] * dag.stages
    i = max(range(len(durations)), key=lambda j: start[j] + durations[j])
    while True:
        per_stage[dag.instructions[i].stage] += 1
        before = [a for a in preds[i] if abs(start[a] + durations[a] - start[i]) <= eps]
        if not before:
            return per_stage
        i = before[0]


# --- the comparison -------------------------------------------------------------------------


def _judge(kind: str, measured: float, low: float, high: float | None = None) -> dict:
    """The prediction (or the bracket [low, high]) against the measurement, by the
    calibration tolerance of ``kind`` ("time", "power" for energies, "ratio")."""
    tol = TOLERANCES[kind]
    high = low if high is None else high
    lo, hi = min(low, high), max(low, high)
    nearest = measured if lo <= measured <= hi else (lo if measured < lo else hi)
    error = (nearest - measured) / measured if tol.relative else nearest - measured
    band = tol.widen(measured, measured)
    passes = hi >= band[0] and lo <= band[1]
    return {"kind": kind, "measured": measured, "predicted": [lo, hi] if hi != lo else lo,
            "error": error, "tolerance": tol.amount, "relative": tol.relative,
            "verdict": "PASS" if passes else "FAIL"}


def compare_method(dag: Any, costs: Costs, method: str,
                   config: tuple[str, int, int]) -> dict[str, Any]:
    points = measured_points(method, config)
    fastest, slowest = points[-1], points[0]
    all_max = simulate(dag, costs, [[MAX_MHZ] * len(c) for c in fastest.clocks])
    sim_fast = simulate(dag, costs, fastest.clocks)
    rows = []
    for p in points:
        at, slower = simulate(dag, costs, p.clocks), simulate(dag, costs, p.clocks, 1)
        row: dict[str, Any] = {
            "label": p.label, "iteration": p.iteration, "source": p.source,
            "exact": p.exact, "inferred": p.inferred,
            "steady_clocks": _steady(p.clocks),
            "measured": {"time_s": p.time_s, "energy_j": p.energy_j,
                         "effective_j": p.effective_j},
            "sim": at, "sim_one_step_slower": slower,
            "time_ratio": {"measured": p.time_s / fastest.time_s,
                           "sim": at["time_s"] / all_max["time_s"],
                           "sim_one_step_slower": slower["time_s"] / all_max["time_s"]},
        }
        if p is fastest:
            # lowtime stops at the critical path of every instruction on it at 1410 MHz.
            row["time"] = _judge("time", p.time_s, all_max["time_s"])
        elif p.exact:
            row["time"] = _judge("time", p.time_s, at["time_s"])
        else:
            row["time"] = _judge("time", p.time_s, at["time_s"], slower["time_s"])
        if p is not fastest:
            sim_ratio = row["time_ratio"]["sim"]
            row["time_ratio"]["check"] = _judge(
                "ratio", row["time_ratio"]["measured"], sim_ratio,
                None if p.exact else row["time_ratio"]["sim_one_step_slower"])
        if p.energy_j is not None:
            row["energy"] = _judge("power", p.energy_j, at["energy_j"],
                                   None if p.exact else slower["energy_j"])
            row["effective"] = _judge("power", p.effective_j, at["effective_j"],
                                      None if p.exact else slower["effective_j"])
            if p is not fastest:
                assert fastest.energy_j is not None
                row["energy_ratio"] = _judge(
                    "ratio", p.energy_j / fastest.energy_j,
                    at["energy_j"] / sim_fast["energy_j"],
                    None if p.exact else slower["energy_j"] / sim_fast["energy_j"])
        rows.append(row)
    steady = fastest.clocks[1][2], fastest.clocks[1][3]  # stage 1's steady forward/backward
    return {
        "method": method,
        "points": rows,
        "sim_all_1410": all_max,
        # The fastest file runs stage 1's steady instructions at these clocks within stage
        # 0's at 1410 MHz: measured, stage 1 there takes no longer than stage 0 at 1410.
        "stage_balance": {
            "stage0_1410_s": costs[0, "forward"][MAX_MHZ][0] + costs[0, "backward"][MAX_MHZ][0],
            "stage1_1410_s": costs[1, "forward"][MAX_MHZ][0] + costs[1, "backward"][MAX_MHZ][0],
            "stage1_steady_clocks": list(steady),
            "stage1_at_steady_clocks_s": costs[1, "forward"][steady[0]][0]
            + costs[1, "backward"][steady[1]][0],
        },
        # The fastest file slows instructions that had slack in the measurement (its T is
        # the all-1410 critical path): the simulated DAG should find the same slack.
        "slack": _judge("ratio", 1.0, sim_fast["time_s"] / all_max["time_s"]),
        "clock_response": _judge("ratio", slowest.time_s / fastest.time_s,
                                 rows[0]["time_ratio"]["sim"]),
    }


def _steady(clocks: Sequence[Sequence[int]]) -> str:
    """The steady-state clocks: stage 0's 4th/5th and stage 1's 3rd/4th instructions."""
    return f"F{clocks[0][3]}/B{clocks[0][4]}|F{clocks[1][2]}/B{clocks[1][3]}"


def run_config(config: tuple[str, int, int], as_given: bool, cache_dir: Path) -> dict:
    from kareus.devices.sim.presets import MODEL_VERSION, load_preset
    from kareus.offline.trace import trace_stages

    model, mbs, seq = config
    start = time.perf_counter()
    workload, asked = workload_for(model, mbs, seq, as_given)
    stages = trace_stages(workload, DEVICE, cache_dir=cache_dir / f"{model}-{mbs}-{seq}")
    traced_s = time.perf_counter() - start
    static = load_preset(DEVICE).static_power_w
    found = instruction_costs(stages, static)
    dag = _dag()
    methods = {m: compare_method(dag, found["costs"][m], m, config) for m in METHODS}
    fast = {m: r["points"][-1] for m, r in methods.items()}
    nbp_vs_perseus = {
        "time": _judge("ratio", fast["nanobatch_perseus"]["measured"]["time_s"]
                       / fast["perseus"]["measured"]["time_s"],
                       methods["nanobatch_perseus"]["sim_all_1410"]["time_s"]
                       / methods["perseus"]["sim_all_1410"]["time_s"]),
        "energy": _judge("ratio", fast["nanobatch_perseus"]["measured"]["energy_j"]
                         / fast["perseus"]["measured"]["energy_j"],
                         fast["nanobatch_perseus"]["sim"]["energy_j"]
                         / fast["perseus"]["sim"]["energy_j"]),
    }
    return {
        "model": model, "microbatch_size": mbs, "seq": seq, "tp": TP, "pp": STAGES,
        "microbatches": MICROBATCHES, "recompute": "full",
        "asked": asked, "traced": describe(workload), "trace_s": traced_s,
        "device": DEVICE, "model_version": MODEL_VERSION, "static_power_w": static,
        "unsplit_graphs_nbp": found["unsplit"],
        "instructions": {
            m: {f"stage{s}/{k}": {str(f): {"time_s": t, "effective_j": e}
                                   for f, (t, e) in table.items()}
                for (s, k), table in found["costs"][m].items()}
            for m in METHODS
        },
        "methods": methods,
        "nbp_vs_perseus_fastest": nbp_vs_perseus,
    }


def verdicts(result: dict[str, Any]) -> Iterable[tuple[str, dict[str, Any]]]:
    """Every judged comparison of one workload, named."""
    for method, r in result["methods"].items():
        yield f"{method} slack", r["slack"]
        yield f"{method} clock response", r["clock_response"]
        for row in r["points"]:
            for key in ("time", "energy", "effective"):
                if key in row:
                    yield f"{method} {row['label']} {key}", row[key]
            for key in ("time_ratio", "energy_ratio"):
                check = row.get(key, {}).get("check") if key == "time_ratio" else row.get(key)
                if check:
                    yield f"{method} {row['label']} {key}", check
    for key, check in result["nbp_vs_perseus_fastest"].items():
        yield f"nbp/perseus fastest {key}", check


# --- report ---------------------------------------------------------------------------------

STYLE = {"PASS": "green", "FAIL": "bold red"}


def _v(check: dict[str, Any] | None) -> str:
    return "" if not check else f"[{STYLE[check['verdict']]}]{check['verdict']}[/]"


def _pred(check: dict[str, Any], scale: float = 1.0, fmt: str = "{:.3f}") -> str:
    p = check["predicted"]
    if isinstance(p, list):
        return f"{fmt.format(p[0] * scale)}-{fmt.format(p[1] * scale)}"
    return fmt.format(p * scale)


def _err(check: dict[str, Any]) -> str:
    return f"{100 * check['error']:+.1f}%" if check["relative"] else f"{check['error']:+.3f}"


def points_table(result: dict[str, Any], method: str) -> Table:
    r = result["methods"][method]
    title = (f"{result['model']} {result['microbatch_size']}x{result['seq']}, "
             f"{METHODS[method]}: the artifact (art: lowtime over its measured profiles) vs "
             f"{DEVICE} (sim; a range: at the file's clocks - one 30 MHz step slower)")
    table = Table(title=title, title_justify="left")
    for col in ("point", "steady s0|s1", "T art s", "T sim s", "err", "",
                "T/Tf art", "T/Tf sim", "", "E16 art kJ", "E16 sim kJ", "err", "",
                "E/Ef art", "E/Ef sim", ""):
        table.add_column(col, justify="left" if col in ("point", "steady s0|s1") else "right")
    for row in r["points"]:
        tr = row["time_ratio"].get("check")
        e, er = row.get("energy"), row.get("energy_ratio")
        table.add_row(
            row["label"], row["steady_clocks"],
            f"{row['measured']['time_s']:.3f}", _pred(row["time"]), _err(row["time"]),
            _v(row["time"]),
            f"{row['time_ratio']['measured']:.3f}", _pred(tr) if tr else "1", _v(tr),
            "-" if e is None else f"{e['measured'] / 1e3:.2f}",
            "-" if e is None else _pred(e, 1e-3, "{:.2f}"), "" if e is None else _err(e),
            _v(e),
            "-" if er is None else f"{er['measured']:.3f}", "-" if er is None else _pred(er),
            _v(er),
        )
    return table


def summary_table(results: Sequence[dict[str, Any]]) -> Table:
    table = Table(title="Summary: time at 1410 MHz, clock response, energy at the fastest "
                  "plan", title_justify="left")
    for col in ("workload", "method", "Tfast art", "sim", "err", "", "slack sim", "",
                "Tslow/Tfast art", "sim", "", "E16 fast art kJ", "sim", "err", "",
                "Eeff fast art J", "sim", "err", "X1/X0 sim"):
        table.add_column(col, justify="left" if col in ("workload", "method") else "right")
    for res in results:
        for method, r in res["methods"].items():
            fast = r["points"][-1]
            table.add_row(
                f"{res['model']} {res['microbatch_size']}x{res['seq']}",
                "NBP" if method == "nanobatch_perseus" else "Perseus",
                f"{fast['measured']['time_s']:.3f}", _pred(fast["time"]), _err(fast["time"]),
                _v(fast["time"]), _pred(r["slack"]), _v(r["slack"]),
                f"{r['clock_response']['measured']:.3f}", _pred(r["clock_response"]),
                _v(r["clock_response"]),
                f"{fast['energy']['measured'] / 1e3:.2f}", _pred(fast["energy"], 1e-3, "{:.2f}"),
                _err(fast["energy"]), _v(fast["energy"]),
                f"{fast['effective']['measured']:.0f}", _pred(fast["effective"], 1, "{:.0f}"),
                _err(fast["effective"]),
                f"{r['stage_balance']['stage1_1410_s'] / r['stage_balance']['stage0_1410_s']:.3f}",
            )
    return table


def instruction_table(result: dict[str, Any]) -> Table:
    table = Table(title=f"{result['model']} {result['microbatch_size']}x{result['seq']}: "
                  "simulated instructions per microbatch, per GPU (ms / effective J at 85 W)",
                  title_justify="left")
    shown = (1410, 1200, 1020, 900)
    table.add_column("method / instruction", justify="left")
    for f in shown:
        table.add_column(f"{f} MHz", justify="right")
    table.add_column("t900/t1410", justify="right")
    for method in METHODS:
        for key, per in result["instructions"][method].items():
            table.add_row(f"{method} {key}",
                          *(f"{1e3 * per[str(f)]['time_s']:.1f} / {per[str(f)]['effective_j']:.1f}"
                            for f in shown),
                          f"{per['900']['time_s'] / per['1410']['time_s']:.3f}")
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path,
                        default=Path("benchmarks/results/artifact_check.json"))
    parser.add_argument("--config", action="append", metavar="MODEL:MBS:SEQ",
                        help="a workload to compare (repeatable; default: all of "
                        + ", ".join(f"{m}:{b}:{s}" for m, b, s in CONFIGS) + ")")
    parser.add_argument("--as-given", action="store_true",
                        help="trace the plain Workload.of call, without the artifact's "
                        "layout and split")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="the profile store (default: a fresh temporary directory)")
    args = parser.parse_args(argv)
    configs = CONFIGS
    if args.config:
        configs = tuple((m, int(b), int(s)) for m, b, s in (c.split(":") for c in args.config))
        unknown = [c for c in configs if c not in CONFIGS]
        if unknown:
            parser.error(f"no artifact data for {unknown}; known: {list(CONFIGS)}")
    console = Console(width=240)
    start = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory(prefix="artifact_check-") as tmp:
        cache = args.cache_dir or Path(tmp)
        for config in configs:
            res = run_config(config, args.as_given, cache)
            results.append(res)
            traced = {k: v for k, v in res["traced"].items() if k != "model"}
            console.print(f"[bold]{config[0]} {config[1]}x{config[2]}[/]: traced {traced} "
                          f"(asked {res['asked'] or 'nothing beyond Workload.of'}) in "
                          f"{res['trace_s']:.0f} s; Nanobatching + Perseus runs "
                          f"{res['unsplit_graphs_nbp'] or 'no graph'} unrewritten")
            console.print(instruction_table(res))
            for method in METHODS:
                console.print(points_table(res, method))
    console.print(summary_table(results))
    counts: Counter[str] = Counter()
    failures = []
    for res in results:
        for name, check in verdicts(res):
            counts[check["verdict"]] += 1
            if check["verdict"] == "FAIL":
                failures.append(f"{res['model']} {res['microbatch_size']}x{res['seq']} {name}")
        nb = res["nbp_vs_perseus_fastest"]
        console.print(f"{res['model']} {res['microbatch_size']}x{res['seq']}: Nanobatching + "
                      f"Perseus's fastest / Perseus's: time {nb['time']['measured']:.3f} "
                      f"measured, {nb['time']['predicted']:.3f} simulated {_v(nb['time'])}; "
                      f"energy {nb['energy']['measured']:.3f} measured, "
                      f"{nb['energy']['predicted']:.3f} simulated {_v(nb['energy'])}")
    console.print(f"fidelity checks: {sum(counts.values())} ({counts['PASS']} PASS, "
                  f"{counts['FAIL']} FAIL)")
    record = {
        "artifact": {"repo": ARTIFACT_REPO, "branch": ARTIFACT_BRANCH,
                     "commit": ARTIFACT_COMMIT, "settings": ARTIFACT_SETTINGS,
                     "p2p_power_w": P2P_POWER_W, "unit_time_s": UNIT_TIME_S,
                     "recovery": "T = (total cost with P2P - total cost) / (2 x 85 W); "
                                 "E(16 GPUs) = 8 x total cost with P2P; slowest plan: "
                                 "T_fastest + (iteration + 1) ms"},
        "tolerances": {k: {"amount": t.amount, "relative": t.relative}
                       for k, t in TOLERANCES.items()},
        "as_given": args.as_given,
        "results": results,
        "counts": dict(counts),
        "failures": failures,
        "seconds": time.perf_counter() - start,
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    console.print(f"wrote {args.out} in {record['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
