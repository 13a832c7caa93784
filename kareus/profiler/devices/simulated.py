"""A simulated GPU: time and energy of an FX graph at an SM clock, from an analytical model.

The graph (post-AOT-autograd aten, ``node.meta["val"]`` fake or real tensors) is costed
once per node, clock-independently (:func:`graph_cost`); a clock is then evaluated by a
two-stream fluid timeline. Constants and their sources are in presets.py.

Kernel i (FLOPs F from ``torch.utils.flop_counter``, halved for causal attention and
scaled by ``TENSOR_TIME_SCALE``; bytes B = inputs read + outputs written, views free), at
SM clock f on a share s of the SMs, getting HBM bandwidth b (at most the capacity
``hbm_efficiency * hbm_bytes_per_s / (1 + sigma (f_max / f - 1))``)::

    t_c = F / (gemm_efficiency * flop_per_clk * f * s)
    t_i = max(t_c, kernel_floor, B / b)

Collective on a group of n (bus bytes D = S 2(n-1)/n for all-reduce, S (n-1)/n for the
others, as nccl-tests count them), with k SMs (its own cap, else NCCL's default), and HBM
traffic h D::

    t = steps * ring_step_latency + (D + min(D, n * nccl_buffer)) / (busbw * min(1, k / k_sat))

Timeline: compute kernels run in node order on the compute stream; a collective is issued
on the comm stream when its node is reached and runs after the collectives before it; the
compute stream blocks at its ``wait_tensor``. While both run, the kernel gets s = (SMs -
k) / SMs and HBM is shared max-min fairly, weighted by the SMs issuing requests.

Power = P_static + C f V(f)^2 (a_compute + a_comm) + e_hbm * HBM bytes/s, with V(f) flat
below a knee and linear above; a_compute = max(s t_c / t_i, a_mem * b_used / b_max) (1
for a GEMM), a_comm = (k / SMs) a_mem (achieved / saturated bus rate), so a collective
that only waits on its peers costs static power. When power would exceed the TDP the
clock drops to the highest supported clock that fits, per interval (a simple power cap).
Energy integrates power over the timeline.

Clocks: ``measure(workload, clock_mhz)`` sets the SM clock to ``clock_mhz`` before the
graph starts (no stall). A ``kareus::set_clock`` node in the graph then composes with it:
``mhz`` = 0 (``DEFAULT_CLOCK_MHZ``, which every kareus graph starts with) means "the clock
the measurement set", so a graph measured at f runs as the same graph without that node
at f (after an earlier switch, it switches back to f); ``mhz`` > 0 switches to that clock,
and everything after it runs there. The compute stream stalls ``clock_switch_s`` only when
the target differs from the current clock (a graph whose first node asks for the measured
clock pays nothing), and two changes closer than ``min_switch_interval_s`` are refused.

Not modelled: Inductor fusion (each aten node is one kernel, an upper bound on memory
traffic), GEMM tile and wave quantisation, temperature, NVLink power (counted in static).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

import torch
import torch.fx
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from kareus.passes.collectives import WAIT_OP, find_collectives, size_hint
from kareus.passes.collectives import Collective as CollectiveRecord
from kareus.passes.ops import facts_of
from kareus.passes.schema import arguments
from kareus.profiler.devices.base import Device, Measurement, Resources, Workload
from kareus.profiler.devices.errors import UnsupportedClockError, UnsupportedMeasurementError
from kareus.profiler.devices.presets import TENSOR_TIME_SCALE, GPUSpec, load_preset
from kareus.runtime.clock import DEFAULT_CLOCK_MHZ, ClockSwitch, RecordingClockController
from kareus.runtime.ops import set_clock

aten = torch.ops.aten

# CPU kernels of attention count like their CUDA counterparts.
_FLOP_ALIASES = {
    aten._scaled_dot_product_flash_attention_for_cpu: aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: (
        aten._scaled_dot_product_flash_attention_backward
    ),
}

class Step(Enum):
    COMPUTE = "compute"  # run kernels[i] on the compute stream
    ISSUE = "issue"  # enqueue collectives[i] on the comm stream
    WAIT = "wait"  # compute stream waits for collectives[i]
    CLOCK = "clock"  # set the SM clock to i MHz (0: the clock the measurement set)


@dataclass(frozen=True, slots=True)
class Kernel:
    name: str
    flops: float  # bf16-equivalent tensor-core FLOPs
    bytes: float


@dataclass(frozen=True, slots=True)
class Collective:
    name: str
    kind: str
    group_size: int
    bus_bytes: float
    steps: int


@dataclass(frozen=True)
class GraphCost:
    """Clock-independent cost of a graph: its kernels, collectives and the issue order."""

    kernels: tuple[Kernel, ...]
    collectives: tuple[Collective, ...]
    program: tuple[tuple[Step, int], ...]


# ---------------------------------------------------------------------------------------
# Graph -> GraphCost


def _tensors(value: object) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


def _nbytes(t: torch.Tensor) -> int:
    """Bytes a kernel touches for ``t``: broadcast (stride-0) dims are read once."""
    n = t.element_size()
    for size, stride in zip(t.shape, t.stride(), strict=True):
        if size_hint(stride) != 0:
            n *= size_hint(size)
    return n


def _is_free(node: torch.fx.Node) -> bool:
    """Views, aliases, allocations (the op table) and non-tensor (symbolic) ops launch no kernel."""
    return not facts_of(node).launches_kernel or not _tensors(_val(node))


def _val(node: torch.fx.Node) -> object:
    if "val" not in node.meta:
        raise ValueError(
            f"node {node.name} ({node.target}) has no meta['val']: cost a graph traced with "
            "fake or real tensors (make_fx, AOT autograd)"
        )
    return node.meta["val"]


def _kernel(node: torch.fx.Node) -> Kernel:
    out = _tensors(_val(node))
    out_bytes = sum(_nbytes(t) for t in out)
    read = 0
    partial = facts_of(node).partial_read
    partial_input = arguments(node).get(partial) if partial else None
    for inp in node.all_input_nodes:
        # get_attr inputs (subgraphs of higher-order ops) carry no tensor value.
        value = inp.meta.get("val") if inp.op == "get_attr" else _val(inp)
        b = sum(_nbytes(t) for t in _tensors(value))
        if inp is partial_input:  # a gather reads only the rows it returns
            b = min(b, out_bytes)
        read += b
    packet = getattr(node.target, "overloadpacket", node.target)
    formula = flop_registry.get(_FLOP_ALIASES.get(packet, packet))
    flops = 0.0
    if formula is not None:
        args, kwargs = torch.fx.node.map_arg(
            (node.args, node.kwargs), lambda n: n.meta.get("val", n)
        )
        flops = float(size_hint(formula(*args, **kwargs, out_val=_val(node))))
        # Causal attention skips the masked half (the registry counts all of it).
        flops *= 0.5 if arguments(node).get("is_causal") else 1.0
        inputs = _tensors(args)
        if inputs:
            flops *= TENSOR_TIME_SCALE.get(str(inputs[0].dtype).removeprefix("torch."), 1.0)
    return Kernel(node.name, flops, float(read + out_bytes))


def _collective(record: CollectiveRecord, world_size: int) -> Collective:
    n = record.group_size or world_size
    return Collective(
        record.name, record.kind, n, record.bus_bytes(n), record.ring_passes * (n - 1)
    )


def graph_cost(gm: torch.fx.GraphModule, world_size: int = 1) -> GraphCost:
    """Walk ``gm`` in node order once; ``world_size`` sizes groups that cannot be resolved."""
    kernels: list[Kernel] = []
    collectives: list[Collective] = []
    program: list[tuple[Step, int]] = []
    records = {c.node: c for c in find_collectives(gm.graph)}
    completed_by = {w: c.node for c in records.values() for w in c.waits}
    issued: dict[torch.fx.Node, int] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node in records:
            issued[node] = len(collectives)
            collectives.append(_collective(records[node], world_size))
            program.append((Step.ISSUE, issued[node]))
        elif node in completed_by:
            program.append((Step.WAIT, issued[completed_by[node]]))
        elif node.target is WAIT_OP:
            continue  # a second wait on a tensor already waited (MoE code does this): no-op
        elif getattr(node.target, "namespace", None) == "_c10d_functional":
            raise ValueError(
                f"simulated GPU cannot cost {node.target}: it is not a collective kareus "
                "pairs with a wait (all_reduce, all_gather_into_tensor, reduce_scatter_tensor, "
                "all_to_all_single and their coalesced forms)"
            )
        elif node.target is set_clock:
            program.append((Step.CLOCK, int(arguments(node)["mhz"])))
        elif not _is_free(node):
            program.append((Step.COMPUTE, len(kernels)))
            kernels.append(_kernel(node))
    return GraphCost(tuple(kernels), tuple(collectives), tuple(program))


# ---------------------------------------------------------------------------------------
# Evaluation at a clock


@dataclass(frozen=True, slots=True)
class _Interval:
    """Rates while one kernel and/or one collective run at clock ``mhz``."""

    mhz: float
    kernel_s: float  # duration of the whole kernel at these rates (inf: none)
    comm_s: float  # duration of the whole collective at these rates (inf: none)
    dynamic_w: float


def _fair_share(d1: float, w1: float, d2: float, w2: float, cap: float) -> tuple[float, float]:
    """Weighted max-min fair split of bandwidth ``cap`` between demands d1 and d2."""
    if d1 + d2 <= cap:
        return d1, d2
    s1 = cap * w1 / (w1 + w2)
    if d1 <= s1:
        return d1, cap - d1
    if d2 <= cap - s1:
        return cap - d2, d2
    return s1, cap - s1


class _Evaluator:
    """Evaluates one GraphCost at many clocks, caching rates and power caps across them.

    ``caps`` maps collective names to their SM caps (validated); others get the default.
    """

    def __init__(self, spec: GPUSpec, cost: GraphCost, caps: Mapping[str, int]) -> None:
        self.spec = spec
        self.cost = cost
        self.clocks = spec.supported_clocks()[::-1]  # ascending, for the cap search
        self.sm_coeff = spec.sm_power_coeff
        self.hbm_j_per_byte = spec.hbm_pj_per_bit * 8e-12
        # Per collective: its SMs, its bus bandwidth with them, and its link-limited
        # duration and HBM traffic (all clock-independent).
        self.sms = [caps.get(c.name, spec.default_comm_sms) for c in cost.collectives]
        self.link_bytes_per_s = [
            spec.bus_bytes_per_s[c.kind] * min(1.0, sms / spec.saturating_comm_sms)
            for c, sms in zip(cost.collectives, self.sms, strict=True)
        ]
        self.comm = [
            (
                c.steps * spec.ring_step_latency_s
                + (c.bus_bytes + min(c.bus_bytes, c.group_size * spec.nccl_buffer_bytes))
                / link,
                c.bus_bytes * spec.comm_hbm_bytes_per_bus_byte,
            )
            for c, link in zip(cost.collectives, self.link_bytes_per_s, strict=True)
        ]
        self.resources = tuple((c.name, caps[c.name]) for c in cost.collectives if c.name in caps)
        self._rates: dict[tuple[int | None, int | None, float], _Interval] = {}
        self._caps: dict[tuple[int | None, int | None], float] = {}

    def rates(self, kernel: int | None, comm: int | None, mhz: float) -> _Interval:
        key = (kernel, comm, mhz)
        if key not in self._rates:
            self._rates[key] = self._compute_rates(kernel, comm, mhz)
        return self._rates[key]

    def _compute_rates(self, kernel: int | None, comm: int | None, mhz: float) -> _Interval:
        spec = self.spec
        sms = spec.sm_count
        k = self.sms[comm] if comm is not None else 0
        share = (sms - k) / sms
        slow = 1.0 + spec.memory_clock_sensitivity * (spec.max_clock_mhz / mhz - 1.0)
        hbm_max = spec.hbm_efficiency * spec.hbm_bytes_per_s
        capacity = hbm_max / slow
        t_c = u_c = demand_c = u_m = demand_m = 0.0
        if kernel is not None:
            kern = self.cost.kernels[kernel]
            t_c = kern.flops / (spec.gemm_efficiency * spec.flop_per_clk * mhz * 1e6 * share)
            u_c = max(t_c, spec.kernel_floor_s)
            demand_c = kern.bytes / u_c
        if comm is not None:
            u_m, hbm_m = self.comm[comm]
            demand_m = hbm_m / u_m
        bw_c, bw_m = _fair_share(demand_c, sms - k, demand_m, k, capacity)
        activity = 0.0
        hbm_rate = 0.0
        kernel_s = comm_s = math.inf
        if kernel is not None:
            kernel_s = max(u_c, kern.bytes / bw_c) if kern.bytes else u_c
            rate = kern.bytes / kernel_s
            activity += max(share * t_c / kernel_s, spec.memory_sm_activity * rate / hbm_max)
            hbm_rate += rate
        if comm is not None:
            comm_s = max(u_m, hbm_m / bw_m) if hbm_m else u_m
            coll = self.cost.collectives[comm]
            bus_rate = coll.bus_bytes / comm_s / self.link_bytes_per_s[comm]
            activity += k / sms * spec.memory_sm_activity * bus_rate
            hbm_rate += hbm_m / comm_s
        dynamic = activity * self.sm_coeff * mhz * spec.voltage(mhz) ** 2
        dynamic += self.hbm_j_per_byte * hbm_rate
        return _Interval(mhz, kernel_s, comm_s, dynamic)

    def interval(self, kernel: int | None, comm: int | None, mhz: float) -> _Interval:
        """Rates at ``mhz``, or at the highest clock under the TDP if that draws more."""
        key = (kernel, comm)
        if key not in self._caps:
            self._caps[key] = self._power_cap(kernel, comm)
        return self.rates(kernel, comm, min(mhz, self._caps[key]))

    def _power_cap(self, kernel: int | None, comm: int | None) -> float:
        budget = self.spec.tdp_w - self.spec.static_power_w
        clocks = self.clocks
        if self.rates(kernel, comm, clocks[-1]).dynamic_w <= budget:
            return clocks[-1]
        # Power grows with the clock: bisect for the last clock within the budget.
        lo, hi = 0, len(clocks) - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.rates(kernel, comm, clocks[mid]).dynamic_w <= budget:
                lo = mid
            else:
                hi = mid - 1
        return clocks[lo]

    def run(self, clock_mhz: int) -> Measurement:
        timeline = _Timeline(self, clock_mhz)
        for step, i in self.cost.program:
            if step is Step.COMPUTE:
                timeline.compute(i)
            elif step is Step.ISSUE:
                timeline.issue(i)
            elif step is Step.WAIT:
                timeline.wait(i)
            else:
                timeline.set_clock(i)
        timeline.drain()
        return timeline.measurement()


class _Timeline:
    """The fluid two-stream simulation of one graph execution at one clock."""

    def __init__(self, ev: _Evaluator, clock_mhz: int) -> None:
        self.ev = ev
        self.requested = clock_mhz
        self.mhz = clock_mhz
        self.queue: deque[int] = deque()
        self.active: int | None = None
        self.left = 0.0  # fraction of the active collective still to run
        self.done: set[int] = set()
        self.now = 0.0
        self.compute_s = self.comm_s = self.overlap_s = self.exposed_s = 0.0
        self.switch_s = 0.0
        self.switches = 0
        self.last_switch: float | None = None
        self.dynamic_j = 0.0
        self.clock_s = 0.0  # integral of the effective clock over compute time

    def issue(self, c: int) -> None:
        if self.ev.cost.collectives[c].group_size <= 1:
            self.done.add(c)
            return
        self.queue.append(c)
        self._start_next()

    def _start_next(self) -> None:
        if self.active is None and self.queue:
            self.active, self.left = self.queue.popleft(), 1.0

    def _spend(self, dt: float, iv: _Interval, computing: bool, comm_finishes: bool) -> None:
        self.now += dt
        self.dynamic_j += iv.dynamic_w * dt
        if computing:
            self.compute_s += dt
            self.clock_s += iv.mhz * dt
        if self.active is None:
            return
        self.comm_s += dt
        if computing:
            self.overlap_s += dt
        else:
            self.exposed_s += dt
        if comm_finishes:
            self.done.add(self.active)
            self.active = None
            self._start_next()
        else:
            self.left -= dt / iv.comm_s

    def compute(self, k: int) -> None:
        left = 1.0
        while left > 0.0:
            iv = self.ev.interval(k, self.active, self.mhz)
            dt_kernel = left * iv.kernel_s
            dt_comm = self.left * iv.comm_s if self.active is not None else math.inf
            if dt_comm < dt_kernel:
                left -= dt_comm / iv.kernel_s
                self._spend(dt_comm, iv, computing=True, comm_finishes=True)
            else:
                left = 0.0
                self._spend(dt_kernel, iv, computing=True, comm_finishes=dt_comm == dt_kernel)

    def _idle(self, seconds: float) -> None:
        """The compute stream does nothing for ``seconds`` (inf: until the comm queue drains)."""
        while seconds > 0.0 and self.active is not None:
            iv = self.ev.interval(None, self.active, self.mhz)
            dt_comm = self.left * iv.comm_s
            finishes = dt_comm <= seconds
            dt = dt_comm if finishes else seconds
            self._spend(dt, iv, computing=False, comm_finishes=finishes)
            seconds -= dt
        if math.isfinite(seconds) and seconds > 0.0:
            self.now += seconds

    def wait(self, c: int) -> None:
        while c not in self.done and self.active is not None:
            iv = self.ev.interval(None, self.active, self.mhz)
            self._spend(self.left * iv.comm_s, iv, computing=False, comm_finishes=True)

    def drain(self) -> None:
        self._idle(math.inf)

    def set_clock(self, mhz: int) -> None:
        spec = self.ev.spec
        # The measurement stands in for the default clock (see the module docstring).
        target = self.requested if mhz == DEFAULT_CLOCK_MHZ else mhz
        _check_clock(spec, target)
        if target == self.mhz:
            return
        since = math.inf if self.last_switch is None else self.now - self.last_switch
        if since < spec.min_switch_interval_s:
            raise ValueError(
                f"{spec.name}: clock switches {1e3 * since:.1f} ms apart; "
                f"this device allows at most one per {1e3 * spec.min_switch_interval_s:.0f} ms "
                "(switch per graph, not inside one)"
            )
        self._idle(spec.clock_switch_s)
        self.switch_s += spec.clock_switch_s
        self.switches += 1
        self.mhz = target
        self.last_switch = self.now

    def measurement(self) -> Measurement:
        spec = self.ev.spec
        static_j = spec.static_power_w * self.now
        return Measurement(
            time_s=self.now,
            energy_j=static_j + self.dynamic_j,
            static_power_w=spec.static_power_w,
            clock_mhz=self.requested,
            method="simulated",
            resources=self.ev.resources,
            details={
                "compute_s": self.compute_s,
                "comm_s": self.comm_s,
                "overlap_s": self.overlap_s,
                "exposed_comm_s": self.exposed_s,
                "switch_s": self.switch_s,
                "clock_switches": float(self.switches),
                "static_j": static_j,
                "dynamic_j": self.dynamic_j,
                "effective_clock_mhz": self.clock_s / self.compute_s if self.compute_s else 0.0,
            },
        )


def _check_clock(spec: GPUSpec, mhz: int) -> None:
    supported = spec.supported_clocks()
    if mhz not in supported:
        raise UnsupportedClockError(spec.name, mhz, supported)


def _is_sm_count(value: object, sm_count: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value < sm_count


# ---------------------------------------------------------------------------------------


class SimulatedGPU(Device):
    """A :class:`Device` whose measurements come from the model above (no hardware)."""

    def __init__(self, spec: GPUSpec | str) -> None:
        self.spec = load_preset(spec) if isinstance(spec, str) else spec
        self.name = self.spec.name
        self._controller = RecordingClockController()

    def supported_clocks(self) -> tuple[int, ...]:
        return self.spec.supported_clocks()

    def search_clocks(self) -> tuple[int, ...]:
        return self.spec.search_clocks()

    @property
    def static_power_w(self) -> float:
        return self.spec.static_power_w

    def clock_controller(self) -> RecordingClockController:
        """Records the switches a plan makes; :meth:`switch_overhead` prices them. It
        stands for no GPU of this process (``controls_clocks`` is False)."""
        return self._controller

    def measure(
        self, workload: Workload, clock_mhz: int, *, resources: Resources | None = None
    ) -> Measurement:
        return self.sweep(workload, (clock_mhz,), resources=resources)[clock_mhz]

    def estimate(self, gm: torch.fx.GraphModule, world_size: int = 1) -> Measurement:
        workload = Workload("estimate", gm, world_size=world_size)
        return self.measure(workload, self.search_clocks()[0])

    def sweep(
        self,
        workload: Workload | GraphCost,
        clocks: Iterable[int] | None = None,
        *,
        resources: Resources | None = None,
    ) -> dict[int, Measurement]:
        """Measure at many clocks (default: the search clocks), costing the graph once."""
        clocks = tuple(self.search_clocks() if clocks is None else clocks)
        for mhz in clocks:
            _check_clock(self.spec, mhz)
        cost = workload if isinstance(workload, GraphCost) else self._cost(workload)
        evaluator = _Evaluator(self.spec, cost, self._caps(cost, resources or {}))
        return {mhz: evaluator.run(mhz) for mhz in clocks}

    def _caps(self, cost: GraphCost, resources: Resources) -> dict[str, int]:
        """The caps given (None: default, dropped), each naming a collective of the graph
        and leaving compute at least one SM."""
        names = [c.name for c in cost.collectives]
        for name, sms in resources.items():
            if name not in names:
                raise UnsupportedMeasurementError(
                    self.name,
                    f"resources[{name!r}]",
                    f"{name!r} issues no collective of the graph; its collectives are "
                    f"{', '.join(names) or 'none'}",
                )
            if sms is not None and not _is_sm_count(sms, self.spec.sm_count):
                raise UnsupportedMeasurementError(
                    self.name,
                    f"resources[{name!r}]={sms!r}",
                    f"an SM cap must be an integer in 1..{self.spec.sm_count - 1}",
                )
        return {name: sms for name, sms in resources.items() if sms is not None}

    @staticmethod
    def _cost(workload: Workload) -> GraphCost:
        if workload.gm is None:
            raise ValueError(
                f"workload {workload.name!r} has no graph: the simulated GPU costs "
                "workload.gm (with node.meta['val'])"
            )
        return graph_cost(workload.gm, workload.world_size)

    def switch_overhead(
        self, switches: Sequence[ClockSwitch], start_mhz: int | None = None
    ) -> tuple[float, float]:
        """(seconds, joules) of a recorded switch sequence: each change of clock stalls the
        GPU ``clock_switch_s`` at static power. ``start_mhz``: the clock before the first."""
        current = self.spec.max_clock_mhz if start_mhz is None else start_mhz
        changes = 0
        for switch in switches:
            mhz = self.spec.max_clock_mhz if switch.mhz == DEFAULT_CLOCK_MHZ else switch.mhz
            changes += mhz != current
            current = mhz
        seconds = changes * self.spec.clock_switch_s
        return seconds, seconds * self.spec.static_power_w
