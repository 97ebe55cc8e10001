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
# Import name -> package folder: kernels/ is imported as `mooncake_kernels` (`kernels` is also the
# import name of PyPI's kernel hub: docs/engine.md#the-name-kernels).
FOLDER_OF = {**{p: p for p in ALLOWED if p != "kernels"}, "mooncake_kernels": "kernels", "tests": "tests"}
FIRST_PARTY = frozenset(FOLDER_OF)


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
                top = FOLDER_OF.get(module.partition(".")[0])
                if top is not None and top != package and top not in allowed:
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
    (engine / "__init__.py").write_text("from engine.config import EngineConfig\nimport mooncake_kernels.paged\n")
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


# -- inside cluster/: one package per paper box, with the edges architecture.md asks for ---------
# For each package of cluster/, the first-party modules it may import besides
# itself, as dotted prefixes. Anything of this project not listed is refused.
# What of the engine loads no torch: the Conductor's share (tests/test_conductor_imports.py).
_LIGHT_ENGINE = ("engine.outputs", "engine.sampling_params", "engine.engine_client", "engine.prompt",
                 "engine.tokenizer", "engine.model_config", "engine.default_model", "engine.kv_layout",
                 "engine.core_share", "engine.session")
CLUSTER_ALLOWED: Mapping[str, tuple[str, ...]] = {
    # pure code on plain snapshots, shared with the simulator
    "cluster.policies": (),
    # bytes between registered regions: no model, no blocks, no HTTP
    "cluster.messenger": (),
    # the wire: plain data of the engine only (and the engine's seam for a refused start)
    "cluster.protocol": ("engine.outputs", "engine.sampling_params", "engine.session", "engine.engine_client"),
    # faults injected on purpose (bench.faults): a leaf the data paths ask
    "cluster.failpoints": (),
    # the cluster's shared state under leases (etcd, or the embedded store): membership, claims,
    # the elastic-roles decider, the pool's index; signs its records, knows nothing of the rest
    "cluster.metadata": ("cluster.protocol",),
    # the pool stores objects over the messenger; of the engine only the wire layout and the sink seam
    "cluster.pool": ("cluster.failpoints", "cluster.messenger", "cluster.metadata", "cluster.protocol",
                     "engine.kv_layout", "engine.hooks", "paged_kv.prefix_keys"),
    # the front door: policies, the pool's index (its lookups; not the client, which moves bytes
    # over the Messenger), the wire; no model code, no instance internals
    "cluster.conductor": ("cluster.policies", "cluster.pool.index", "cluster.metadata", "cluster.pool.objects",
                          "cluster.protocol", "paged_kv.prefix_keys", "paged_kv.block_hashes", *_LIGHT_ENGINE),
    # a prefill's KV into a decode instance's reservation, over the messenger: an instance's and a stage's
    "cluster.kv_stream": ("cluster.failpoints", "cluster.messenger", "engine.kv_layout", "engine.hooks"),
    # a prefill instance's stages: below the instance that leads them (never cluster.instance)
    "cluster.cpp": ("cluster.kv_stream", "cluster.messenger", "cluster.pool", "cluster.protocol", "engine"),
    # one engine process: everything below the Conductor
    "cluster.instance": ("cluster.cpp", "cluster.failpoints", "cluster.kv_stream", "cluster.messenger",
                         "cluster.metadata", "cluster.pool", "cluster.policies", "cluster.protocol", "engine",
                         "paged_kv"),
}
# Modules that do I/O or threads: policies must stay pure; the messenger speaks no HTTP.
FORBIDDEN_THIRD_PARTY: Mapping[str, tuple[str, ...]] = {
    "cluster.policies": ("asyncio", "socket", "threading", "subprocess", "httpx", "starlette", "uvicorn",
                         "etcd3gw", "torch", "urllib", "os"),
    "cluster.messenger": ("httpx", "starlette", "uvicorn"),
}


def _cluster_unit(root: Path, path: Path) -> str:
    """``cluster.PACKAGE`` for a file of that package."""
    return ".".join(path.relative_to(root).with_suffix("").parts[:2])


def _matches(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def cluster_violations(root: Path = ROOT) -> list[str]:
    found = []
    for path in sorted((root / "cluster").rglob("*.py")):
        if path.parent == root / "cluster" and path.name != "__init__.py":
            found.append(f"{path.relative_to(root)}: only __init__.py sits loose in cluster/")
            continue
        if path.name == "__init__.py" and path.parent == root / "cluster":
            continue
        unit = _cluster_unit(root, path)
        allowed = CLUSTER_ALLOWED.get(unit)
        if allowed is None:
            found.append(f"{path.relative_to(root)}: {unit} is not a package of cluster/ that the rules know")
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for module in _imported_modules(node):
                top = module.partition(".")[0]
                if top in FIRST_PARTY:
                    if not _matches(module, (unit,)) and not _matches(module, allowed):
                        found.append(f"{path.relative_to(root)}:{node.lineno} imports {module}")
                elif _matches(module, FORBIDDEN_THIRD_PARTY.get(unit, ())):
                    found.append(f"{path.relative_to(root)}:{node.lineno} imports {module} (I/O)")
    return found


def test_cluster_packages_keep_their_edges() -> None:
    for unit in CLUSTER_ALLOWED:
        target = ROOT / unit.replace(".", "/")
        assert (target / "__init__.py").is_file() or target.with_suffix(".py").is_file(), unit
    found = cluster_violations()
    assert not found, "cluster/ layering:\n" + "\n".join(found)


def test_stages_import_nothing_of_the_instance_they_serve() -> None:
    """An instance is built of its stages (instance -> cpp); a stage that imported the instance
    would make the two one package with a cycle one edit away."""
    assert not any(_matches(p, ("cluster.instance",)) or _matches("cluster.instance", (p,))
                   for p in CLUSTER_ALLOWED["cluster.cpp"])
    found = [v for v in cluster_violations() if v.startswith("cluster/cpp/")]
    assert not found, "\n".join(found)


def test_conductor_process_loads_no_model_code() -> None:
    """The front door tokenizes and routes; it must not pay for torch, triton, the kernels, the
    model or the Messenger (tests/test_conductor_imports.py checks the running process)."""
    import subprocess
    import sys

    code = ("import sys, cluster.conductor.conductor, cluster.conductor.supervisor, server.app;"
            "print(' '.join(sorted(m for m in sys.modules if m in ('torch', 'triton', 'mooncake_kernels',"
            " 'cluster.messenger', 'engine.model', 'engine.model_runner', 'engine.llm_engine')"
            " or m.startswith(('mooncake_kernels.', 'triton.')))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == []


def test_cluster_checker_flags_planted_edges(tmp_path: Path) -> None:
    (tmp_path / "cluster" / "policies").mkdir(parents=True)
    (tmp_path / "cluster" / "__init__.py").write_text("")
    (tmp_path / "cluster" / "loose.py").write_text("")
    (tmp_path / "cluster" / "policies" / "bad.py").write_text(
        "import httpx\nfrom cluster.instance.service import InstanceService\nfrom cluster.policies import snapshot\n")
    assert cluster_violations(tmp_path) == [
        "cluster/loose.py: only __init__.py sits loose in cluster/",
        "cluster/policies/bad.py:1 imports httpx (I/O)",
        "cluster/policies/bad.py:2 imports cluster.instance.service",
    ]
