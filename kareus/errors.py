"""The root of every error kareus raises on purpose.

Options, decisions, rewrites and devices each have their own classes (``options``,
``passes.decide``, ``profiler.devices.errors``); all derive from ``KareusError``, so a
caller can catch everything kareus refuses with one ``except``.
"""


class KareusError(Exception):
    """Something kareus was asked to do cannot be done; the message says why and what next."""
