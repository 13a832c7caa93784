"""What exists once per process, whatever backends compile in it.

A physical GPU has one clock, whichever backend's graphs run on it; NCCL sub-communicators
are created once per (group, cap) in the order all ranks agreed; the n-th compile of a
graph pairs with the n-th on other ranks; reports and regions are numbered across every
backend. ``process_runtime()`` is the one owner of these; backends hold policy, never this.
"""

from __future__ import annotations

import threading
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kareus.devices.base import ClockController
from kareus.devices.nvml.ownership import HeldClockLocks
from kareus.runtime.agreement import CompileCounter
from kareus.runtime.clock import ClockRouter
from kareus.runtime.communicators import Communicators
from kareus.runtime.pipelining import InstructionTracker
from kareus.runtime.registry import BackendRegistry

if TYPE_CHECKING:
    from kareus.devices.base import Device


@dataclass
class ProcessRuntime:
    clocks: ClockRouter = field(default_factory=ClockRouter)
    communicators: Communicators = field(default_factory=Communicators)
    compiles: CompileCounter = field(default_factory=CompileCounter)
    backends: BackendRegistry = field(default_factory=BackendRegistry)
    instructions: InstructionTracker = field(default_factory=InstructionTracker)
    """Which pipeline instruction runs now, and what each ran (``runtime.pipelining``)."""
    clock_locks: HeldClockLocks = field(default_factory=HeldClockLocks)
    """The GPUs whose clocks this process owns: every device opened here records its
    ownership in it, so a second controller of a GPU in this process is refused, and its
    exit guard resets their clocks at exit and on SIGTERM, SIGINT, SIGHUP and SIGQUIT."""
    _devices: dict[tuple[str, str | None], Device] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def device(self, spec: str, zeusd_socket: str | None = None) -> Device:
        """One device per spec (and zeusd socket, for a GPU whose clocks NVML does not let
        this process change): NVML is opened (and "auto" decided and logged) once."""
        from kareus.devices.resolve import resolve_device

        with self._lock:
            if (spec, zeusd_socket) not in self._devices:
                self._devices[spec, zeusd_socket] = resolve_device(
                    spec, clock_locks=self.clock_locks, zeusd_socket=zeusd_socket)
            return self._devices[spec, zeusd_socket]

    def drive(self, device: Device) -> None:
        """Let the graphs this process runs switch ``device``'s clocks, where it has clocks
        this process controls (a physical GPU): its controller becomes the default."""
        if device.controls_clocks:
            self.clocks.set_default(device.clock_controller())

    def forget_devices(self) -> None:
        """Drop opened devices (tests that open fake GPUs)."""
        with self._lock:
            self._devices.clear()


_PROCESS = ProcessRuntime()


def process_runtime() -> ProcessRuntime:
    return _PROCESS


def use_controller(controller: ClockController) -> AbstractContextManager[ClockController]:
    """Route the set_clock calls of graphs this thread runs to ``controller`` in a block;
    default clocks are restored (``controller.reset()``) on the way out."""
    return _PROCESS.clocks.use(controller)


# Last: the op's implementation reaches the router through ``process_runtime``.
from kareus.runtime import ops as _ops  # noqa: F401 - registers kareus::set_clock's kernel
