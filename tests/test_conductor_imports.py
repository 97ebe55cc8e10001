"""The Conductor process loads neither torch nor the Messenger (issue 31).

The front door tokenizes, places and relays; the pool is only an index to it (``PoolIndex``).
torch would cost it a few hundred MB and a second at every start, and the Messenger is the
instances' transfer engine. Checked on a real ``python -m server`` Conductor, as deployed:
what its memory maps once it has loaded its tokenizer, tokenized a prompt and read the pool's
index, and every module it imported in its whole life (``PYTHONPROFILEIMPORTTIME`` writes one
line per import to its log). tests/test_layering.py keeps the import edges that make it so.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from bench.harness import launch_server, until
from server.cli import SECRET_ENV

pytestmark = pytest.mark.processes  # starts a real server process (about 3 s)

SECRET = "conductor-imports-test-secret-0123456789"
_IMPORT_LINE = re.compile(r"^import time:\s+\d+ \|\s+\d+ \|\s*(\S+)\s*$", re.MULTILINE)
_TORCH_LIBRARIES = ("libtorch", "libc10", "libshm")


def _refused_for_want_of_instances(base_url: str) -> bool:
    """A completion is refused because no instance is up, which the Conductor answers only
    after it has loaded its tokenizer and tokenized the prompt."""
    r = httpx.post(f"{base_url}/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 1},
                   timeout=5.0)
    return r.status_code == 503 and "instance is up" in r.text


def _pool_read(base_url: str) -> bool:
    r = httpx.get(f"{base_url}/stats", timeout=5.0)
    return r.status_code == 200 and "pool" in r.json()


def test_the_conductor_process_loads_no_torch_and_no_messenger(tmp_path: Path) -> None:
    server = launch_server(["--prefill-instances", "0", "--decode-instances", "0"], tmp_path / "conductor.log",
                           name="conductor", env={SECRET_ENV: SECRET, "PYTHONPROFILEIMPORTTIME": "1"})

    def reached(state: Callable[[str], bool]) -> bool:
        if server.proc.poll() is not None:
            raise AssertionError(f"the Conductor exited with {server.proc.returncode}; log tail:\n{server.log_tail()}")
        try:
            return state(server.base_url)
        except (httpx.HTTPError, ValueError):  # not listening yet
            return False

    try:
        # 60 s: the first run on a machine converts the default model (seconds otherwise).
        until(lambda: reached(_refused_for_want_of_instances), 60.0, "the Conductor to tokenize a prompt")
        until(lambda: reached(_pool_read), 10.0, "the Conductor to read the pool's index")
        maps = Path(f"/proc/{server.proc.pid}/maps").read_text()
    finally:
        server.stop(10.0)
    mapped = {line.rsplit("/", 1)[-1] for line in maps.splitlines() if ".so" in line}
    assert not sorted(lib for lib in mapped if lib.startswith(_TORCH_LIBRARIES)), "the Conductor maps torch"
    imported = _IMPORT_LINE.findall(server.log())
    assert "server.app" in imported and "cluster.conductor.conductor" in imported, "no import lines in the log"
    loaded = sorted(m for m in imported if m.split(".")[0] == "torch" or m.startswith("cluster.messenger"))
    assert not loaded, f"the Conductor imported {loaded}"
