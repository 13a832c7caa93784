"""kareus: a torch.compile backend that lowers the energy of distributed training.

``torch.compile(model, backend="kareus", options={...})``; see README.md.
"""

from kareus.runtime.clock import (
    ClockController,
    NullClockController,
    RecordingClockController,
    use_controller,
)
from kareus.options import KareusOptionError, KareusOptions
from kareus.reports import GraphReport, clear_graph_reports, graph_reports

__version__ = "0.1.0"

__all__ = [
    "ClockController",
    "GraphReport",
    "KareusOptionError",
    "KareusOptions",
    "NullClockController",
    "RecordingClockController",
    "__version__",
    "clear_graph_reports",
    "graph_reports",
    "use_controller",
]
