"""Checking a rewritten graph against the graph it rewrote, on the same inputs.

The two runs must draw the same random numbers (a graph with dropout), so the random
state is captured before the reference and restored before the rewrite. Outputs match
within what summing partial results in another order gives: fp32 and wider within
rtol 1e-4 / atol 1e-5; lower precisions within ``torch.testing.assert_close``'s defaults.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

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
