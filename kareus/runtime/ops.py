"""Runtime custom ops that compiled kareus graphs call.

``kareus::set_clock(graph, mhz)`` asks for an SM clock as a graph starts, of the controller
the process's ``ClockRouter`` routes the calling thread to. It returns nothing, so it is
registered as side-effectful: FX dead-code elimination and Inductor's scheduler keep it,
and ``codegen.lowering`` pins its place.
"""

from __future__ import annotations

import torch
import torch.fx

from kareus.runtime import process_runtime

_LIB = torch.library.Library("kareus", "DEF")
_LIB.define("set_clock(str graph, int mhz) -> ()")


def _set_clock(graph: str, mhz: int) -> None:
    process_runtime().clocks.current().set_clock(graph, mhz)


_LIB.impl("set_clock", _set_clock, "CompositeExplicitAutograd")
torch.library.register_fake("kareus::set_clock", lambda graph, mhz: None, lib=_LIB)

set_clock = torch.ops.kareus.set_clock.default
torch.fx.node.has_side_effect(set_clock)
