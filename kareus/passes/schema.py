"""Arguments of an FX call read by name, as its op's schema names them.

Positions differ between overloads and keyword use differs between tracers (Dynamo,
AOT autograd, make_fx), so passes read ``arguments(node)["dim"]``, never ``node.args[2]``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch.fx.operator_schemas import normalize_function


def arguments(node: torch.fx.Node) -> dict[str, Any]:
    """Every argument of ``node``'s call by name, defaults filled in (``self`` is ``input``).

    Empty for calls without a schema (``operator.getitem``, Python functions).
    """
    if not isinstance(node.target, torch._ops.OpOverload):
        return {}
    pair = normalize_function(
        node.target, tuple(node.args), dict(node.kwargs), normalize_to_only_use_kwargs=True
    )
    if pair is not None:
        return dict(pair.kwargs)
    schema = node.target._schema  # normalize_function declines a few schemas: bind by hand
    bound = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
    bound.update({a.name: v for a, v in zip(schema.arguments, node.args)})
    bound.update(node.kwargs)
    if "self" in bound:
        bound["input"] = bound.pop("self")
    return bound


def position(node: torch.fx.Node, name: str) -> int:
    """Index of argument ``name`` in the op's positional arguments (``self`` as ``input``)."""
    names = ["input" if a.name == "self" else a.name for a in node.target._schema.arguments]
    return names.index(name)
