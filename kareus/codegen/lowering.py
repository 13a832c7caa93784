"""Lower a kareus graph: Inductor code generation with our schedule pinned, or eager."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import MappingProxyType
from typing import Any

import torch
import torch.fx
from torch._functorch.aot_autograd import make_boxed_func
from torch._inductor import config as inductor_config
from torch._inductor.compile_fx import compile_fx_inner

from kareus.errors import KareusError


class UnknownLoweringError(KareusError, ValueError):
    """The lowering named is neither "inductor" nor "eager"."""


# Inductor passes that move collectives or reorder nodes across the whole graph. kareus
# decides where communication is issued and where clocks switch, so they are turned off
# (REFERENCE.md section 5: 2.14 enables simple_overlap by default; keys a torch release
# does not have are skipped).
_REORDERING_PASSES = MappingProxyType({
    "reorder_for_compute_comm_overlap": False,
    "reorder_for_peak_memory": False,
    "aten_distributed_optimizations.enable_overlap_scheduling": False,
    "aten_distributed_optimizations.enable_simple_overlap": False,
})


def pinned_schedule_config() -> dict[str, Any]:
    """The Inductor config patches that keep kareus's node order (those this torch has)."""
    known = inductor_config.get_config_copy()
    return {k: v for k, v in _REORDERING_PASSES.items() if k in known}


def lower(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    lowering: str,
    **inductor_kwargs: Any,
) -> Callable[..., Any]:
    """A boxed callable running ``gm``: Inductor-compiled, or interpreted op by op."""
    if lowering == "inductor":
        return compile_fx_inner(gm, example_inputs, **inductor_kwargs)
    if lowering == "eager":
        return make_boxed_func(gm.forward)
    raise UnknownLoweringError(f"unknown lowering {lowering!r}")
