"""Every third-party package the code imports is one that pyproject.toml makes pip install.

The README's serve command installs the project with no extras, so whatever engine/, kernels/,
paged_kv/, cluster/ and server/ import must be in ``[project] dependencies``; bench/ may also
use the ``bench`` and ``mooncake`` extras, and tests/ the ``test`` extra (what CI installs). Imports are read with ``ast`` at any depth (a lazy
import inside a function fails just as late on a machine without the package); one inside a
``try`` that catches ImportError is optional by design and is skipped. Import names are mapped
to distributions with ``importlib.metadata``, so these tests run in the project's environment.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import textwrap
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNTIME_PACKAGES = ("engine", "kernels", "paged_kv", "cluster", "server")
# Import names: kernels/ is `mooncake_kernels` (pyproject's package-dir); an `import kernels` reaches
# PyPI's kernel hub, not ours, and is reported as an undeclared third-party import.
FIRST_PARTY = frozenset({"engine", "mooncake_kernels", "paged_kv", "cluster", "server", "bench", "tests"})
# packages_distributions() knows only what is installed; the mooncake extra's wheel needs
# Debian's libibverbs1, so the test environment usually lacks it and its import name has to be
# mapped by hand. Any other missing import name is assumed to be its own distribution's name.
NOT_ALWAYS_INSTALLED = {"mooncake": "mooncake-transfer-engine-non-cuda"}
IMPORT_ERRORS = frozenset({"ImportError", "ModuleNotFoundError"})


@dataclass(frozen=True)
class Import:
    module: str  # the top-level name, e.g. "torch" for "import torch.nn"
    path: Path
    line: int

    def __str__(self) -> str:
        where = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path
        return f"{self.module} (imported at {where}:{self.line})"


def normalize(name: str) -> str:
    """A distribution name as PEP 503 compares them (Jinja2 == jinja2, prometheus_client == prometheus-client)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def declared_distributions(*extras: str, pyproject: Path = ROOT / "pyproject.toml") -> frozenset[str]:
    """Normalized names of ``[project] dependencies`` plus those of the given extras."""
    project = tomllib.loads(pyproject.read_text())["project"]
    requirements = list(project.get("dependencies", []))
    for extra in extras:
        requirements += project["optional-dependencies"][extra]
    return frozenset(normalize(re.match(r"[A-Za-z0-9._-]+", r.strip()).group(0)) for r in requirements)


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    return handler.type is not None and any(
        isinstance(n, ast.Name) and n.id in IMPORT_ERRORS for n in ast.walk(handler.type))


def _optional_import_nodes(tree: ast.AST) -> set[int]:
    """ids of the import nodes inside a ``try`` body whose handlers catch ImportError."""
    guarded: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(_catches_import_error(h) for h in node.handlers):
            for stmt in node.body:
                guarded |= {id(n) for n in ast.walk(stmt) if isinstance(n, (ast.Import, ast.ImportFrom))}
    return guarded


def third_party_imports(directories: Iterable[Path], first_party: frozenset[str] = FIRST_PARTY) -> list[Import]:
    """Unguarded imports of neither the standard library nor ``first_party``, under ``directories``."""
    found = []
    for directory in directories:
        for path in sorted(directory.rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            guarded = _optional_import_nodes(tree)
            for node in ast.walk(tree):
                if id(node) in guarded:
                    continue
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:  # not an import, or a relative one (always this project's)
                    continue
                for name in names:
                    top = name.partition(".")[0]
                    if top not in sys.stdlib_module_names and top not in first_party:
                        found.append(Import(top, path, node.lineno))
    return sorted(found, key=lambda i: (i.path, i.line))


def undeclared(
    imports: Iterable[Import], declared: frozenset[str], distributions: Mapping[str, list[str]]
) -> list[Import]:
    """The imports none of whose providing distributions is declared."""
    missing = []
    for imp in imports:
        providers = distributions.get(imp.module) or [NOT_ALWAYS_INSTALLED.get(imp.module, imp.module)]
        if not {normalize(p) for p in providers} & declared:
            missing.append(imp)
    return missing


def _check(directories: list[str], *extras: str, first_party: frozenset[str] = FIRST_PARTY) -> list[Import]:
    imports = third_party_imports((ROOT / d for d in directories), first_party)
    # Guards against a walk that silently found nothing (a renamed folder, a broken filter).
    assert {"torch", "numpy"} <= {i.module for i in imports}
    return undeclared(imports, declared_distributions(*extras), importlib.metadata.packages_distributions())


def test_runtime_code_imports_only_project_dependencies() -> None:
    missing = _check(list(RUNTIME_PACKAGES))
    assert not missing, "third-party imports not in [project] dependencies (the README's serve command " \
        "installs no extras):\n" + "\n".join(map(str, missing))


def test_bench_imports_only_dependencies_and_its_extras() -> None:
    missing = _check(["bench"], "bench", "mooncake")
    assert not missing, "bench/ imports packages in neither [project] dependencies nor the bench or " \
        "mooncake extras:\n" + "\n".join(map(str, missing))


def test_tests_import_only_dependencies_and_the_test_extra() -> None:
    # CI installs ".[test]" alone; pytest puts tests/ on sys.path, so its helper modules are ours.
    helpers = frozenset(p.stem for p in (ROOT / "tests").glob("*.py"))
    missing = _check(["tests"], "test", first_party=FIRST_PARTY | helpers)
    assert not missing, "tests/ imports packages in neither [project] dependencies nor the test " \
        "extra:\n" + "\n".join(map(str, missing))


def test_checker_flags_a_planted_undeclared_import(tmp_path: Path) -> None:
    package = tmp_path / "planted"
    package.mkdir()
    (package / "mod.py").write_text(textwrap.dedent("""\
        import json
        import numpy as np
        from . import sibling
        from engine.config import EngineConfig

        try:
            import hypothesis
        except (ImportError, OSError):
            hypothesis = None


        def lazy():
            import pytest.mark
            return pytest
        """))
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\nname = "planted"\ndependencies = ["NumPy>=1"]\n')

    imports = third_party_imports([package])
    assert [(i.module, i.line) for i in imports] == [("numpy", 2), ("pytest", 13)]
    missing = undeclared(imports, declared_distributions(pyproject=pyproject),
                         importlib.metadata.packages_distributions())
    assert [(i.module, i.path, i.line) for i in missing] == [("pytest", package / "mod.py", 13)]


@pytest.mark.parametrize(("distributions", "expected"), [
    ({"yaml": ["PyYAML"]}, []),  # the import name differs from the distribution's
    ({}, ["yaml"]),  # not installed: taken as its own distribution name, which is undeclared
])
def test_checker_maps_import_names_to_distributions(
    tmp_path: Path, distributions: dict[str, list[str]], expected: list[str]
) -> None:
    (tmp_path / "m.py").write_text("import yaml\n")
    missing = undeclared(third_party_imports([tmp_path]), frozenset({"pyyaml"}), distributions)
    assert [i.module for i in missing] == expected
