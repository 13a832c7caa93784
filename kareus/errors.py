"""The root of every error kareus raises on purpose.

Each class lives next to the code that raises it, one per kind of failure: options
(``options``), decisions and variants (``passes.decide``, ``passes.variants``), plans and
budgets (``planner.plan``, ``planner.budget``), devices (``devices.errors``: opening,
measuring on and controlling GPUs, real or simulated), profiling (``profiler.measure``,
``profiler.search``, ``profiler.store``, ``profiler.exchange``), the runtime
(``runtime.agreement``, ``runtime.clock``, ``runtime.communicators``), lowering
(``codegen.lowering``), the bundled model (``models.llama``), offline planning
(``offline.models``, ``offline.workload``, ``offline.trace``) and ``show``. All derive from
``KareusError``, so a caller can catch everything kareus refuses with one ``except``; most
also keep the builtin they stand for (``ValueError``, ``RuntimeError``...), so code written
against it still catches them.
"""


class KareusError(Exception):
    """Something kareus was asked to do cannot be done; the message says why and what next."""
