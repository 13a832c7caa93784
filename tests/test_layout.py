"""The packages import one way: analysis, then graph writing, devices, the runtime, the
profiler, the planner, and the glue above them (the layout in README.md). Every import in
the library counts, function-local and type-checking ones included."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

LIBRARY = Path(__file__).resolve().parents[1] / "kareus"

FOUNDATION = {"errors", "closing", "version", "interrupts"}  # anything may import these
ALLOWED: dict[str, set[str]] = {
    "passes": set(),
    "codegen": {"passes"},
    # the op facts a model reads (the op table, arguments by name, which nodes are
    # collectives and how much they move), and only those
    "devices": {"passes.ops", "passes.schema", "passes.collectives"},
    "runtime": {"devices", "codegen", "passes"},
    "profiler": {"codegen", "devices", "runtime", "passes"},
    "planner": {"profiler", "devices", "codegen", "runtime", "passes"},
    "models": set(),
    # glue above the planner: every stage, the bundled model, and the top-level backend
    # and options (nothing else of the top level: cli and demo sit above it)
    "offline": {"planner", "profiler", "devices", "codegen", "runtime", "passes", "models",
                "backend", "options"},
}
"""What each package may import besides itself and the foundation; the top-level modules
(backend, options, reports, show, cli, demo, verify) may import anything."""


def _modules() -> list[Path]:
    return sorted(LIBRARY.rglob("*.py"))


def _name(path: Path) -> str:
    parts = path.relative_to(LIBRARY.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, text: str | None = None) -> set[str]:
    """The kareus modules ``path`` (or ``text`` as that file) imports, wherever the import
    statement stands."""
    package = _name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text() if text is None else text, str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[: len(package) - node.level + 1], *filter(None, [base])])
            found |= {f"{base}.{a.name}" for a in node.names} | {base}
    return {name for name in found if name == "kareus" or name.startswith("kareus.")}


def _edge_allowed(source: str, target: str) -> bool:
    src, dst = source.split(".")[1:], target.split(".")[1:]
    if not src or len(src) == 1 and src[0] not in ALLOWED:
        return True  # the package root and the top-level glue: anything
    if not dst:
        return False  # the root pulls in the whole library
    if dst[0] in FOUNDATION or dst[0] == src[0]:
        return True
    return any(".".join(dst[: len(a.split("."))]) == a for a in ALLOWED[src[0]])


def forbidden_edges() -> list[str]:
    edges = []
    for path in _modules():
        source = _name(path)
        for target in sorted(_imports(path)):
            if _known(target) and not _edge_allowed(source, target):
                edges.append(f"{source} -> {target}")
    return edges


def _known(target: str) -> bool:
    """A module or package of the library (an imported name is dropped to its module)."""
    path = LIBRARY.parent.joinpath(*target.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def test_packages_import_one_way():
    assert forbidden_edges() == []


@pytest.mark.parametrize("source, target, allowed", [
    ("kareus.passes.analyse", "kareus.runtime.communicators", False),
    ("kareus.devices.sim.model", "kareus.passes.ops", True),
    ("kareus.devices.sim.model", "kareus.passes.partition", False),
    ("kareus.devices.sim.model", "kareus.codegen.nanobatch", False),
    ("kareus.devices.nvml.clock", "kareus.runtime", False),
    ("kareus.codegen.apply", "kareus.passes.decide", True),
    ("kareus.profiler.profile", "kareus.planner.plan", False),
    ("kareus.planner.step", "kareus.runtime.agreement", True),
    ("kareus.runtime.selectable", "kareus.planner.plan", False),
    ("kareus.profiler.store", "kareus", False),
    ("kareus.backend", "kareus.planner.step", True),
    ("kareus.offline.trace", "kareus.backend", True),
    ("kareus.offline.trace", "kareus.planner.step", True),
    ("kareus.offline.models", "kareus.models.llama", True),
    ("kareus.offline.trace", "kareus.cli", False),
    ("kareus.offline.trace", "kareus.demo", False),
    ("kareus.planner.step", "kareus.offline.trace", False),
    ("kareus.models.llama", "kareus.offline", False),
])
def test_the_rule_reads_edges_as_the_layout_says(source, target, allowed):
    assert _edge_allowed(source, target) is allowed


def test_function_local_and_type_checking_imports_count():
    module = LIBRARY / "passes" / "nothing_here.py"  # read, never written
    text = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from kareus.runtime import ProcessRuntime\n"
        "def f():\n    from kareus.planner.plan import Plan\n"
    )
    assert {"kareus.runtime", "kareus.planner.plan"} <= _imports(module, text)
