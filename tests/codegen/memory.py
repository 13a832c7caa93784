"""Peak memory of a graph run op by op, from its tensor metadata.

Each storage is allocated by the node whose value first holds it and freed after the
last node that uses it or any view of it; graph inputs and outputs stay live. Views
share their base's storage (fake tensors track this), so only real allocations count.
Used to check that nanobatching costs no more memory than its extra buffers explain.
"""

from __future__ import annotations

import torch
import torch.fx
from torch.utils._pytree import tree_leaves


def _storages(node: torch.fx.Node) -> dict[int, int]:
    """Storage id -> bytes of every tensor in the node's value."""
    found = {}
    for t in tree_leaves(node.meta.get("val")):
        if isinstance(t, torch.Tensor):
            storage = t.untyped_storage()
            found[storage._cdata] = storage.nbytes()
    return found


def peak_memory_bytes(graph: torch.fx.Graph) -> int:
    nodes = list(graph.nodes)
    size: dict[int, int] = {}
    born: dict[int, int] = {}
    last_use: dict[int, int] = {}
    pinned: set[int] = set()
    for i, node in enumerate(nodes):
        for sid, nbytes in _storages(node).items():
            size.setdefault(sid, nbytes)
            born.setdefault(sid, i)
            last_use[sid] = i
            if node.op == "placeholder":
                pinned.add(sid)
        for arg in node.all_input_nodes:
            for sid in _storages(arg):
                if node.op == "output":
                    pinned.add(sid)
                last_use[sid] = max(last_use.get(sid, i), i)
    delta = [[0, 0] for _ in nodes]  # bytes allocated, freed at each node
    for sid, i in born.items():
        delta[i][0] += size[sid]
    for sid, i in last_use.items():
        if sid not in pinned:
            delta[i][1] += size[sid]
    live = peak = 0
    for allocated, freed in delta:
        live += allocated
        peak = max(peak, live)
        live -= freed
    return peak
