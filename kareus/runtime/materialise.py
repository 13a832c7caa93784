"""From a decision to the graph that runs: the ranks agree, then resources are made.

A rewritten graph issues collectives its peers must issue too, in the same order, so no
rank runs a decision its peers did not take: the ranks of the graph's collectives compare
decisions through the store (``agreement``), never a collective, and where they differ or
one does not answer, every one of them runs the graph unrewritten. Only after that are the
capped sub-communicators a variant's resources need created (a collective call of the
group's ranks), so no rank creates one alone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.fx

from kareus.codegen.apply import apply
from kareus.codegen.lowering import lower
from kareus.codegen.nanobatch import CannotRewrite
from kareus.passes.analyse import GraphAnalysis
from kareus.passes.decide import Choice, Decision, decide, follow
from kareus.passes.reasons import Reason, ReasonKind
from kareus.runtime.agreement import agree
from kareus.runtime.communicators import Communicators


def agreed(
    gm: torch.fx.GraphModule,
    analysis: GraphAnalysis,
    decision: Decision,
    *,
    compile_key: str,
    timeout_s: float,
    communicators: Communicators,
) -> tuple[torch.fx.GraphModule, Decision]:
    """The graph that runs and the decision every rank of its collectives took: ``decision``
    where it can be rewritten (else unrewritten, ``CANNOT_REWRITE``) and every rank took the
    same one (else unrewritten, ``RANKS_DISAGREED``), also where this rank asked for none.

    A graph that exchanges rows in per-rank blocks (``GraphAnalysis.exchanged``) is not
    agreed on: its sizes differ by rank, so ranks compile its versions at different steps,
    and a rank may run a version no other rank compiled. Its decision is one every version
    takes alike (from its structure and the options, never planned), so none waits."""
    decision, compiled = _rewritten(gm, analysis, decision)
    if analysis.collectives and not analysis.exchanged:
        verdict = agree(
            compile_key, {"variant": decision.variant, "clock": decision.clock_mhz},
            _groups(analysis),
            timeout_s=timeout_s, falls_back=decision.variant is None,
        )
        if not verdict and decision.variant is not None:
            decision = decision.fallback(Reason(
                ReasonKind.RANKS_DISAGREED, None,
                f"the ranks did not confirm one decision ({verdict.reason}); runs unrewritten",
            ))
    if decision.variant is None:
        return apply(gm, analysis, decision.choice), decision
    if _capped(decision.choice):
        compiled = materialise(gm, analysis, decision.choice, communicators)
    assert compiled is not None
    return compiled, decision


def materialise(
    gm: torch.fx.GraphModule, analysis: GraphAnalysis, choice: Choice,
    communicators: Communicators, clocked: bool = True,
) -> torch.fx.GraphModule:
    """``apply`` with the capped sub-communicators the choice's resources need (made now:
    call only where the ranks agreed on it)."""
    groups = None
    if _capped(choice):
        parts = analysis.space.partitions(choice.nanobatches)
        groups = [None if sms is None else communicators.capped(p.group_name, sms)
                  for p, (_, sms) in zip(parts, choice.partitions, strict=True)]
    return apply(gm, analysis, choice, groups=groups, clocked=clocked)


Run = Callable[[list[Any]], Any]
"""A boxed callable, as Inductor's: it takes its inputs as one list and may clear it."""


class GraphBuilder:
    """Compiles another choice of one graph while the step runs (the plan's, once known;
    the unrewritten graph after a failed check), as the graph was first lowered."""

    def __init__(
        self, gm: torch.fx.GraphModule, analysis: GraphAnalysis, lowering: str,
        inductor_kwargs: Mapping[str, Any], communicators: Communicators,
    ) -> None:
        self.gm, self.analysis, self.lowering = gm, analysis, lowering
        self.inductor_kwargs, self.communicators = dict(inductor_kwargs), communicators

    def build(self, choice: Choice, args: Sequence[Any], clocked: bool = True
              ) -> tuple[Decision, Run]:
        """``choice`` decided (checked against the graph's space) and compiled, with the
        call's inputs as examples; unrewritten (``CANNOT_REWRITE``) where the emitter
        cannot rewrite it. Every rank meets the same graph and choice, so every rank
        falls back alike. ``clocked=False``: without its clock switch (``apply``)."""
        decision, graph = self.graph(choice, clocked)
        return decision, self.lowered(graph, args)

    def graph(self, choice: Choice, clocked: bool = True
              ) -> tuple[Decision, torch.fx.GraphModule]:
        """``choice`` decided and materialised (unrewritten where it cannot be), uncompiled."""
        decision = decide(self.analysis, follow(choice))
        try:
            return decision, materialise(self.gm, self.analysis, decision.choice,
                                         self.communicators, clocked)
        except CannotRewrite as exc:
            decision = decision.fallback(Reason(ReasonKind.CANNOT_REWRITE, None, str(exc)))
            return decision, apply(self.gm, self.analysis, decision.choice, clocked=clocked)

    def lowered(self, graph: torch.fx.GraphModule, args: Sequence[Any]) -> Run:
        """``graph`` compiled as the graph was first lowered, ``args`` its examples."""
        # Compiled while the step runs, outside any compile's context (fake mode).
        with torch._guards.tracing(None):
            return lower(graph, list(args), self.lowering, **self.inductor_kwargs)


def _rewritten(
    gm: torch.fx.GraphModule, analysis: GraphAnalysis, decision: Decision
) -> tuple[Decision, torch.fx.GraphModule | None]:
    if decision.variant is None:
        return decision, None
    try:
        return decision, apply(gm, analysis, decision.choice)
    except CannotRewrite as exc:
        return decision.fallback(Reason(ReasonKind.CANNOT_REWRITE, None, str(exc))), None


def _capped(choice: Choice) -> bool:
    return any(sms is not None for _, sms in choice.partitions)


def _groups(analysis: GraphAnalysis) -> list[str]:
    return [c.group_name for c in analysis.collectives]
