"""What the ``kareus::set_clock`` op does when a compiled graph runs it.

The op is declared with the other op facts (``passes.ops.SET_CLOCK``); here it gets its
implementation: the request goes to the controller the process's ``ClockRouter`` routes
the calling thread to. ``codegen.lowering`` pins its place in Inductor's output.
"""

from __future__ import annotations

import torch

from kareus.passes.ops import SET_CLOCK
from kareus.runtime import process_runtime

_IMPL = torch.library.Library("kareus", "IMPL")


def _set_clock(graph: str, mhz: int) -> None:
    process_runtime().clocks.current().set_clock(graph, mhz)


_IMPL.impl(SET_CLOCK._opname, _set_clock, "CompositeExplicitAutograd")
