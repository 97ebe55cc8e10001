"""kernels/ beside PyPI's ``kernels`` (Hugging Face's kernel hub, which transformers 5 requires).

Installed, kernels/ is the package ``mooncake_kernels``; where the checkout's root is on
``sys.path`` it can still be found as ``kernels``, and then gives that name to another installed
``kernels`` or, with none, to ``mooncake_kernels`` (kernels/__init__.py, docs/engine.md). The hub
here is a fake: a package ``kernels`` whose ``__init__`` imports its own submodule absolutely, as
the real one does, on ``PYTHONPATH`` (after the script's folder, like site-packages). Each case
runs in a fresh interpreter; none needs transformers.
"""

from __future__ import annotations

import importlib.machinery
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def fake_hub(tmp_path: Path) -> Path:
    """A folder holding a package ``kernels`` that is not ours: the folder to put on PYTHONPATH."""
    package = tmp_path / "site" / "kernels"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("from kernels.layer import CUDAProperties\n")
    (package / "layer.py").write_text("class CUDAProperties:\n    pass\n")
    return package.parent


def run(code: str, cwd: Path, pythonpath: Path | None = None, *flags: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run([sys.executable, *flags, "-c", code], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


def test_from_the_checkout_kernels_is_the_installed_hub_and_ours_is_not_loaded(fake_hub: Path) -> None:
    # -S: no site-packages (no torch, no editable install): handing the name over needs neither.
    out = run("import json, sys, kernels; from kernels import CUDAProperties; "
              "print(json.dumps([kernels.__file__, sorted(m for m in sys.modules if 'kernels' in m)]))",
              ROOT, fake_hub, "-S")
    assert out.returncode == 0, out.stderr
    # nothing of ours is loaded, under either name
    assert json.loads(out.stdout) == [str(fake_hub / "kernels" / "__init__.py"), ["kernels", "kernels.layer"]]


def test_checkout_without_install_says_so() -> None:
    out = run("import kernels", ROOT, None, "-S")  # no other kernels, and mooncake_kernels not installed
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: ") and "mooncake_kernels" in last and f"pip install -e {ROOT}" in last


BOTH = """
import json, sys
{first}
{second}
import engine.model
import kernels, mooncake_kernels
print(json.dumps({{"kernels": kernels.__file__, "hub_api": kernels.CUDAProperties.__module__,
                  "ours": mooncake_kernels.__file__, "engine_uses": engine.model.kernels.__file__,
                  "ours_api": callable(mooncake_kernels.use_triton), "hub_has_ours": hasattr(kernels, "use_triton")}}))
"""


@pytest.mark.parametrize("hub_first", [True, False], ids=["hub-first", "ours-first"])
@pytest.mark.parametrize("where", ["checkout", "elsewhere"])
def test_one_process_holds_both_in_either_order(fake_hub: Path, tmp_path: Path, hub_first: bool, where: str) -> None:
    hub, ours = "from kernels import CUDAProperties", "import mooncake_kernels"
    first, second = (hub, ours) if hub_first else (ours, hub)
    out = run(BOTH.format(first=first, second=second), ROOT if where == "checkout" else tmp_path, fake_hub)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got == {"kernels": str(fake_hub / "kernels" / "__init__.py"), "hub_api": "kernels.layer",
                   "ours": str(ROOT / "kernels" / "__init__.py"), "engine_uses": str(ROOT / "kernels" / "__init__.py"),
                   "ours_api": True, "hub_has_ours": False}


def _other_kernels_installed() -> bool:
    elsewhere = [p for p in sys.path if Path(p or os.curdir).resolve() != ROOT]
    return importlib.machinery.PathFinder.find_spec("kernels", elsewhere) is not None


@pytest.mark.skipif(_other_kernels_installed(), reason="a `kernels` package (the hub) is installed here: "
                    "`import kernels` is rightly that one; CI's test venv has none")
def test_without_the_hub_kernels_is_ours_module_for_module() -> None:
    code = """
import json, sys
import kernels.dispatch
import mooncake_kernels
kernels.set_mode("torch")
names = sorted(m for m in sys.modules if m.split(".")[0] == "kernels")
print(json.dumps({"same": all(sys.modules[m] is sys.modules["mooncake_" + m] for m in names),
                  "names": names, "mode": mooncake_kernels.dispatch.mode()}))
"""
    out = run(code, ROOT)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    # Every module of the folder is one object under both names: one copy of dispatch's mode.
    files = sorted(f"kernels.{p.stem}" for p in (ROOT / "kernels").glob("*.py") if p.stem != "__init__")
    assert got == {"same": True, "names": ["kernels", *files], "mode": "torch"}


def test_pyproject_lists_every_package_with_kernels_renamed() -> None:
    # pyproject lists the packages (a renamed folder cannot be found by setuptools' `find`): a
    # package missing there would be missing from a wheel while the editable install still works.
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert tool["package-dir"] == {"mooncake_kernels": "kernels"}
    tops = [p.parent for p in ROOT.glob("*/__init__.py")]  # not tests/, nor a venv inside the checkout
    folders = {".".join(p.parent.relative_to(ROOT).parts) for top in tops for p in top.rglob("__init__.py")}
    expected = {"mooncake_" + f if f.split(".")[0] == "kernels" else f for f in folders}
    assert sorted(tool["packages"]) == sorted(expected)


def test_bench_offline_finds_transformers_requirement_on_the_hub() -> None:
    from bench.offline import kernels_requirement

    # transformers 5.x's Requires-Dist lines (importlib.metadata.requires), trimmed
    assert kernels_requirement(["numpy>=1.17", "kernels<0.20,>=0.19.1", 'kernels<0.20,>=0.19.1; extra == "torch"']) \
        == "kernels<0.20,>=0.19.1"
    assert kernels_requirement(["numpy>=1.17", 'kernels<0.20,>=0.19.1; extra == "kernels"']) is None  # 4.x
    assert kernels_requirement(["kernels-extra>=1", "Kernels>=0.19"]) == "Kernels>=0.19"
