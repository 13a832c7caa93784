"""kareus: a torch.compile backend that lowers the energy of distributed training.

``torch.compile(model, backend="kareus", options={...})``, or
``torch.compile(model, backend=kareus.KareusBackend(options, chooser=...))``; see README.md.
"""

from typing import TYPE_CHECKING, Any

from kareus.devices.base import ClockController, NullClockController, RecordingClockController
from kareus.errors import KareusError
from kareus.options import KareusOptionError, KareusOptions
from kareus.passes.reasons import Reason, ReasonKind
from kareus.reports import GraphReport
from kareus.runtime import use_controller
from kareus.version import __version__

if TYPE_CHECKING:
    from kareus.backend import KareusBackend, clear_graph_reports, current_plan, graph_reports

# The backend pulls in Inductor; ``import kareus`` (and every submodule import, such as a
# clock controller's) stays light until it is used.
_FROM_BACKEND = frozenset(
    {"KareusBackend", "clear_graph_reports", "current_plan", "graph_reports"}
)


def __getattr__(name: str) -> Any:
    if name in _FROM_BACKEND:
        import kareus.backend

        return getattr(kareus.backend, name)
    raise AttributeError(f"module 'kareus' has no attribute {name!r}")


__all__ = [
    "ClockController",
    "GraphReport",
    "KareusBackend",
    "KareusError",
    "KareusOptionError",
    "KareusOptions",
    "NullClockController",
    "Reason",
    "ReasonKind",
    "RecordingClockController",
    "__version__",
    "clear_graph_reports",
    "current_plan",
    "graph_reports",
    "use_controller",
]
