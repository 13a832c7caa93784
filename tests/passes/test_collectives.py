import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.fx.experimental.proxy_tensor import make_fx

from kareus.passes.collectives import find_collectives


def _trace(fn, *args):
    return make_fx(fn)(*args).graph


def test_records_kind_group_dtype_shape_and_bytes(fake_pg):
    group = dist.group.WORLD

    def fn(x, y, z, w):
        a = funcol.all_reduce(x, "sum", group)
        c10d = torch.ops._c10d_functional
        b = c10d.wait_tensor(c10d.all_gather_into_tensor(y, 2, group.group_name))
        c = c10d.wait_tensor(c10d.reduce_scatter_tensor(z, "avg", 2, group.group_name))
        d = funcol.all_to_all_single(w, None, None, group)
        return a + 1, b * 2, c - 1, d / 2

    graph = _trace(
        fn, torch.randn(8, 4), torch.randn(2, 4, dtype=torch.bfloat16), torch.randn(8, 4),
        torch.randn(4, 4),
    )
    ar, ag, rs, a2a = find_collectives(graph)
    assert [c.kind for c in (ar, ag, rs, a2a)] == [
        "all_reduce", "all_gather", "reduce_scatter", "all_to_all"
    ]
    assert all(c.group_size == fake_pg for c in (ar, ag, rs, a2a))
    assert ar.reduce_op == "sum" and rs.reduce_op == "avg" and ag.reduce_op is None
    assert ar.shapes == ((8, 4),) and ag.dtype == torch.bfloat16
    # nccl-tests sizes: all-gather counts its gathered output.
    assert ar.payload_bytes == 8 * 4 * 4
    assert ag.payload_bytes == 2 * (2 * 4 * 2)
    assert rs.payload_bytes == 8 * 4 * 4
    # ring traffic per rank: all-reduce 2(n-1)/n, the others (n-1)/n of the payload.
    assert ar.bytes_per_rank == ar.payload_bytes  # n = 2
    assert rs.bytes_per_rank == rs.payload_bytes // 2
    for c in (ar, ag, rs, a2a):
        assert len(c.waits) == 1 and c.waits[0].args[0] is c.node


def test_coalesced_collective_has_one_wait_per_tensor(fake_pg):
    def fn(x, y):
        a, b = funcol.all_reduce_coalesced([x, y], "sum", dist.group.WORLD)
        return a + b

    (coll,) = find_collectives(_trace(fn, torch.randn(4), torch.randn(4)))
    assert coll.coalesced and coll.kind == "all_reduce"
    assert len(coll.waits) == 2
    assert coll.payload_bytes == 2 * 4 * 4


def test_graph_without_collectives():
    assert find_collectives(_trace(lambda x: x.sin() @ x, torch.randn(3, 3))) == []
