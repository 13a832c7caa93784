"""Checking a rewritten graph against the graph it rewrote, on the same inputs.

The ``verify`` option: the first call of every newly chosen rewrite runs against the
unrewritten graph on the same inputs and random state (``Verifier``); the ranks of its
collectives agree on the verdict through the store, and on a mismatch on any rank the
graph runs unrewritten from then on, with ``ReasonKind.VERIFY_FAILED`` in its report.

The two runs must draw the same random numbers (a graph with dropout), so the random
state is captured before the reference and restored before the rewrite. Outputs match
within what summing partial results in another order gives: fp32 and wider within
rtol 1e-4 / atol 1e-5; lower precisions within ``torch.testing.assert_close``'s defaults.
"""

from __future__ import annotations

import logging
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

_WIDE = (torch.float32, torch.float64)


def outputs_mismatch(expected: Any, got: Any) -> str | None:
    """Where ``got`` differs from ``expected`` (None: nowhere)."""
    want, have = pytree.tree_leaves(expected), pytree.tree_leaves(got)
    if len(want) != len(have):
        return f"{len(have)} outputs instead of {len(want)}"
    for i, (a, b) in enumerate(zip(want, have)):
        if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
            if a != b:
                return f"output {i}: {b!r} instead of {a!r}"
            continue
        tolerance = {"rtol": 1e-4, "atol": 1e-5} if a.dtype in _WIDE else {}
        try:
            torch.testing.assert_close(b, a, **tolerance)
        except AssertionError as exc:
            return f"output {i}: " + " ".join(str(exc).split())
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

    def __call__(self, choice: Choice, args: list[Any], run: Run) -> tuple[Any, Run]:
        examples = list(args)  # ``run`` may clear its list
        rng = RandomState.capture()
        expected = self.gm.forward(*examples)
        rng.restore()
        got = run(args)
        problem = outputs_mismatch(expected, got)
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
