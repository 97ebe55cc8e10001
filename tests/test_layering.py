"""The packages depend on each other one way: paged_kv, kernels -> engine -> cluster -> server -> bench.

A lower layer importing a higher one (even lazily, inside a function) ties the engine to the
HTTP server or the cluster to the benchmarks, and makes import cycles one edit away. Imports are
read with ``ast`` at any depth, guarded or not: an optional upward import is still upward.
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# What each package may import of this project besides itself. paged_kv and kernels are leaves
# and, today, independent of each other. No package imports tests/.
ALLOWED: Mapping[str, frozenset[str]] = {
    "paged_kv": frozenset(),
    "kernels": frozenset(),
    "engine": frozenset({"paged_kv", "kernels"}),
    "cluster": frozenset({"paged_kv", "kernels", "engine"}),
    "server": frozenset({"paged_kv", "kernels", "engine", "cluster"}),
    "bench": frozenset({"paged_kv", "kernels", "engine", "cluster", "server"}),
}
FIRST_PARTY = frozenset({*ALLOWED, "tests"})


@dataclass(frozen=True)
class Violation:
    path: Path
    line: int
    imported: str  # the dotted module named by the import

    def __str__(self) -> str:
        where = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path
        return f"{where}:{self.line} imports {self.imported}"


def _imported_modules(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    # A relative import cannot climb above its top-level package, so it never crosses layers.
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        return [node.module]
    return []


def violations(root: Path, package: str, allowed: frozenset[str]) -> list[Violation]:
    """Imports under ``root / package`` of first-party packages other than itself and ``allowed``."""
    found = []
    for path in sorted((root / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for module in _imported_modules(node):
                top = module.partition(".")[0]
                if top in FIRST_PARTY and top != package and top not in allowed:
                    found.append(Violation(path, node.lineno, module))
    return sorted(found, key=lambda v: (v.path, v.line))


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_lower_layers(package: str) -> None:
    assert (ROOT / package / "__init__.py").is_file()  # a renamed package must not pass by walking nothing
    found = violations(ROOT, package, ALLOWED[package])
    allowed = ", ".join(sorted(ALLOWED[package])) or "no other package of this project"
    assert not found, f"{package} may import only {allowed}:\n" + "\n".join(map(str, found))


def test_checker_flags_planted_upward_imports(tmp_path: Path) -> None:
    engine = tmp_path / "engine"
    (engine / "sub").mkdir(parents=True)
    (engine / "__init__.py").write_text("from engine.config import EngineConfig\nimport kernels.paged\n")
    (engine / "sub" / "deep.py").write_text(textwrap.dedent("""\
        from .. import config
        import torch


        def lazy():
            try:
                from server.app import build_app
            except ImportError:
                build_app = None
            import tests.prompts, cluster
            return build_app
        """))

    found = violations(tmp_path, "engine", ALLOWED["engine"])
    assert [(v.path.relative_to(tmp_path).as_posix(), v.line, v.imported) for v in found] == [
        ("engine/sub/deep.py", 7, "server.app"),
        ("engine/sub/deep.py", 10, "tests.prompts"),
        ("engine/sub/deep.py", 10, "cluster"),
    ]
