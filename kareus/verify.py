"""Checking a rewritten graph against the graph it rewrote, on the same inputs.

The ``verify`` option: the first call of every newly chosen rewrite runs against the
unrewritten graph on the same inputs and random state (``Verifier``); the ranks of its
collectives agree on the verdict through the store, and on a mismatch on any rank the
graph runs unrewritten from then on, with ``ReasonKind.VERIFY_FAILED`` in its report.

The two runs must draw the same random numbers (a graph with dropout), so the random
state is captured before the reference and restored before the rewrite. Outputs match
within what summing partial results in another order gives, judged against each output's
scale rather than element by element: a sum whose terms cancel is near zero, and there
reordering moves it by far more than its own size (on an H200, 0.2% of an fp32 embedding
gradient's elements missed rtol 1e-4 / atol 1e-5, while its largest difference was 7e-6
of its largest magnitude). A wrong rewrite (rows of two nanobatches swapped, a partial sum
dropped or doubled) moves an output by a sizeable part of its scale. Integer outputs match
exactly, except the dropout state of fused attention kernels (``STATE_RETURNS``).
"""

from __future__ import annotations

import logging
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree

from kareus.passes.analyse import GraphAnalysis
from kareus.passes.decide import Choice
from kareus.passes.reasons import Reason, ReasonKind
from kareus.runtime.agreement import agree
from kareus.runtime.materialise import GraphBuilder, Run
from kareus.runtime.selectable import Reports

log = logging.getLogger("kareus")

STATE_RETURNS = frozenset({"rng_state", "unused", "philox_seed", "philox_offset"})
"""Returns of CUDA's fused attention kernels (flash, memory-efficient, cuDNN), by their
schemas' names, that carry the state of the kernel's dropout to its backward: left
uninitialised where there is no dropout, and state rather than results (on an H200 the
flash kernel's came back with other bits from the rewritten graph than from the
unrewritten one), so a rewrite is not judged by them."""


def tolerance(dtype: torch.dtype) -> float:
    """The largest difference a floating-point output of ``dtype`` may show, relative to its
    largest magnitude: 1e-4 for fp32 and wider, 8 rounding steps (8 eps) below it (bf16
    6.3e-2, fp16 7.8e-3). Measured on an H200 at k = 2 against k = 1
    (benchmarks/results/h200_default.json): fp32 gradients summed over 16384 tokens 7.4e-6,
    bf16 activations after 4 layers 1.7e-2."""
    return max(1e-4, 8 * torch.finfo(dtype).eps)


def scaled_error(expected: torch.Tensor, got: torch.Tensor) -> float:
    """max |got - expected| over max |expected| (over the finite elements; the difference
    itself where that is 0), inf where shape, dtype or the places of NaNs and infinities
    differ."""
    if expected.shape != got.shape or expected.dtype != got.dtype:
        return math.inf
    if not expected.numel():
        return 0.0
    wide = torch.promote_types(expected.dtype, torch.float32)
    a, b = expected.detach().to(wide), got.detach().to(wide)
    if not all(torch.equal(test(a), test(b))
               for test in (torch.isnan, torch.isposinf, torch.isneginf)):
        return math.inf
    finite = torch.isfinite(a)
    diff = float((b - a).abs().where(finite, 0).max())
    scale = float(a.abs().where(finite, 0).max())
    return diff / scale if scale else diff


def state_outputs(gm: torch.fx.GraphModule) -> frozenset[int]:
    """Where ``gm``'s outputs (its output's leaves, in order) are kernel state
    (``STATE_RETURNS``)."""
    output = next(iter(gm.graph.find_nodes(op="output")))
    leaves = pytree.tree_leaves(output.args[0])
    return frozenset(i for i, node in enumerate(leaves) if _is_state(node))


def _is_state(node: object) -> bool:
    if not isinstance(node, torch.fx.Node) or node.target is not operator.getitem:
        return False
    source, index = node.args
    schema = getattr(getattr(source, "target", None), "_schema", None)
    return (schema is not None and isinstance(index, int) and index < len(schema.returns)
            and schema.returns[index].name in STATE_RETURNS)


def outputs_mismatch(
    expected: Any, got: Any, state: frozenset[int] = frozenset()
) -> str | None:
    """Where ``got`` differs from ``expected`` (None: nowhere); the outputs at ``state``
    (``state_outputs``) are not compared."""
    want, have = pytree.tree_leaves(expected), pytree.tree_leaves(got)
    if len(want) != len(have):
        return f"{len(have)} outputs instead of {len(want)}"
    for i, (a, b) in enumerate(zip(want, have)):
        if i in state:
            continue
        if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
            if a != b:
                return f"output {i}: {b!r} instead of {a!r}"
        elif not a.is_floating_point():
            if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a, b):
                return f"output {i}: {a.dtype} {tuple(a.shape)} not equal"
        elif (error := scaled_error(a, b)) > tolerance(a.dtype):
            return (f"output {i}: largest difference {error:.3g} of its largest magnitude "
                    f"({a.dtype}, tolerance {tolerance(a.dtype):.3g})")
    return None


@dataclass(frozen=True)
class RandomState:
    """The CPU generator's state and, where CUDA is initialised, every GPU's."""

    cpu: torch.Tensor
    cuda: Sequence[torch.Tensor]

    @classmethod
    def capture(cls) -> RandomState:
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else ()
        return cls(torch.get_rng_state(), cuda)

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda:
            torch.cuda.set_rng_state_all(self.cuda)


class Verifier:
    """Checks the first call of each newly chosen rewrite of one graph (see the module)."""

    def __init__(
        self, gm: torch.fx.GraphModule, analysis: GraphAnalysis, builder: GraphBuilder,
        reports: Reports, *, compile_key: str, timeout_s: float,
    ) -> None:
        self.gm, self.analysis, self.builder, self.reports = gm, analysis, builder, reports
        self.compile_key, self.timeout_s = compile_key, timeout_s
        self.state = state_outputs(gm)

    def __call__(self, choice: Choice, args: list[Any], run: Run) -> tuple[Any, Run]:
        examples = list(args)  # ``run`` may clear its list
        rng = RandomState.capture()
        expected = self.gm.forward(*examples)
        rng.restore()
        got = run(args)
        problem = outputs_mismatch(expected, got, self.state)
        verdict = agree(
            f"{self.compile_key}/verify/{choice!r}", problem is None,
            (c.group_name for c in self.analysis.collectives), timeout_s=self.timeout_s,
        )
        if problem is None and verdict:
            return got, run
        why = problem or f"another rank's check failed ({verdict.reason})"
        message = f"verify: k={choice.nanobatches} differs from the unrewritten graph: {why}"
        log.error("%s: %s; runs unrewritten", self.analysis.label, message)
        _, unrewritten = self.builder.build(Choice(1, choice.clock_mhz), examples)
        self.reports.update(
            self.analysis.label, fallback=Reason(ReasonKind.VERIFY_FAILED, None, message),
            notes_added=(message,), choice=Choice(1, choice.clock_mhz),
        )
        return expected, unrewritten
