"""CI's check of the README's first command: `python -m server` serves, answers, and stops clean.

Run with the interpreter of a venv installed exactly as the README says (no extras):

    .venv-ci-serve/bin/python .ci/smoke_server.py

It starts `python -m server` (the default disaggregated mode: a Conductor plus a prefill and a
decode instance process) on a free port, waits for /health, sends one plain completion and one
streamed chat completion, then stops the server as Ctrl-C would (SIGINT to its process group) and
fails if any of its processes is left. Only the standard library is used, so the client itself
needs nothing that the README's install might have missed. Linux only (it reads /proc).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, BinaryIO

ROOT = Path(__file__).resolve().parents[1]


class SmokeFailure(Exception):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, start time in clock ticks) of a live process, None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # the command name may hold spaces and parens
    return fields[0], int(fields[1]), int(fields[19])


def _all_pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


def descendants(root_pid: int) -> dict[int, int]:
    """pid -> start time of every live process below ``root_pid`` (the start time tells a reused pid)."""
    children: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    for pid in _all_pids():
        stat = _proc_stat(pid)
        if stat is not None:
            children.setdefault(stat[1], []).append(pid)
            starts[pid] = stat[2]
    found, todo = {}, [root_pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found[child] = starts[child]
            todo.append(child)
    return found


def alive(pid: int, start: int) -> bool:
    stat = _proc_stat(pid)
    return stat is not None and stat[0] != "Z" and stat[2] == start


def processes_naming_port(port: int) -> list[str]:
    """Command lines of live processes that serve on ``port`` or report to a Conductor on it."""
    marks = (f"--port\0{port}\0", f"127.0.0.1:{port}\0", f"--port={port}\0")
    found = []
    for pid in _all_pids():
        if pid == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_text()
        except OSError:
            continue
        stat = _proc_stat(pid)
        if "server" in cmdline and any(m in cmdline for m in marks) and stat is not None and stat[0] != "Z":
            found.append(f"pid {pid}: {cmdline.replace(chr(0), ' ').strip()}")
    return found


def request(base: str, path: str, body: dict[str, Any] | None, timeout_s: float) -> tuple[int, BinaryIO]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
    try:
        resp = urllib.request.urlopen(req, timeout=timeout_s)
    except urllib.error.HTTPError as e:
        return e.code, e
    return resp.status, resp


def wait_healthy(base: str, server: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SmokeFailure(f"the server exited with {server.returncode} before /health was 200")
        try:
            status, resp = request(base, "/health", None, 5)
            with resp:
                last = f"{status} {resp.read().decode(errors='replace')}"
            if status == 200:
                return
        except (urllib.error.URLError, OSError) as e:  # not listening yet
            last = f"no answer ({e})"
        time.sleep(1)
    raise SmokeFailure(f"/health was not 200 after {timeout_s:.0f} s (last answer: {last})")


def check_completion(base: str, timeout_s: float) -> str:
    status, resp = request(base, "/v1/completions", {
        "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0,
    }, timeout_s)
    with resp:
        body = resp.read().decode()
    if status != 200:
        raise SmokeFailure(f"/v1/completions answered {status}: {body}")
    text = json.loads(body)["choices"][0]["text"]
    if "Paris" not in text:
        raise SmokeFailure(f"/v1/completions did not say Paris: {text!r}")
    return text


def check_streamed_chat(base: str, timeout_s: float) -> str:
    status, resp = request(base, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
        "max_tokens": 16, "temperature": 0, "stream": True,
    }, timeout_s)
    with resp:
        if status != 200:
            raise SmokeFailure(f"streamed /v1/chat/completions answered {status}: {resp.read().decode()}")
        pieces, done = [], False
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue  # blank separators between events
            payload = line[len("data:"):].strip()
            if done:
                raise SmokeFailure(f"an event after data: [DONE]: {payload}")
            if payload == "[DONE]":
                done = True
                continue
            event = json.loads(payload)
            if "error" in event:
                raise SmokeFailure(f"the stream carried an error: {event['error']}")
            for choice in event["choices"]:
                pieces.append(choice["delta"].get("content") or "")
    text = "".join(pieces)
    if not done:
        raise SmokeFailure(f"the stream ended without data: [DONE] (text so far: {text!r})")
    if "Paris" not in text:
        raise SmokeFailure(f"the streamed chat answer does not say Paris: {text!r}")
    return text


def stop(server: subprocess.Popen, timeout_s: float) -> int:
    """SIGINT to the whole process group, as Ctrl-C in a terminal; the exit status."""
    os.killpg(server.pid, signal.SIGINT)
    try:
        return server.wait(timeout_s)
    except subprocess.TimeoutExpired:
        raise SmokeFailure(f"the server did not exit within {timeout_s:.0f} s of SIGINT") from None


def leftovers(known: dict[int, int], port: int, linger_s: float) -> list[str]:
    """What of the server still runs ``linger_s`` after it exited (an instance may be finishing its
    own shutdown when the Conductor is gone; one that takes longer has been left behind)."""
    deadline = time.monotonic() + linger_s
    while True:
        left = [f"pid {pid}" for pid, start in known.items() if alive(pid, start)] + processes_naming_port(port)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def kill_everything(server: subprocess.Popen, known: dict[int, int]) -> None:
    """Clean-up after a failure, so that a failed check leaves no server behind."""
    known = known | descendants(server.pid)
    try:
        os.killpg(server.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for pid, start in known.items():
        if alive(pid, start):
            os.kill(pid, signal.SIGKILL)
    server.wait()


def tail(path: Path, lines: int = 80) -> str:
    """The end of the server's log, without the access lines of our /health polling."""
    kept = [line for line in path.read_text(errors="replace").splitlines() if '"GET /health ' not in line]
    return "\n".join(kept[-lines:])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--health-timeout-s", type=float, default=420,
                   help="how long models may take to load and calibrate (a first run also converts the GGUF)")
    p.add_argument("--request-timeout-s", type=float, default=120)
    p.add_argument("--stop-timeout-s", type=float, default=60, help="how long the server may take to exit")
    p.add_argument("--linger-s", type=float, default=10, help="how long its processes may outlive it")
    args = p.parse_args()

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = Path(tempfile.mkdtemp(prefix="smoke-server-")) / "server.log"
    t0 = time.monotonic()
    print(f"smoke: {sys.executable} -m server --port {port} (log: {log_path})", flush=True)
    with log_path.open("wb") as log:
        # Its own process group, so that our SIGINT reaches the whole group as Ctrl-C in a terminal would.
        server = subprocess.Popen([sys.executable, "-m", "server", "--port", str(port)], cwd=ROOT,
                                  stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  start_new_session=True)
    known: dict[int, int] = {}
    try:
        wait_healthy(base, server, args.health_timeout_s)
        known = descendants(server.pid)
        print(f"smoke: /health is 200 after {time.monotonic() - t0:.0f} s; "
              f"{len(known)} processes below the server", flush=True)
        if not known:
            raise SmokeFailure("the default mode should have started instance processes; none found")
        print(f"smoke: completion: {check_completion(base, args.request_timeout_s)!r}", flush=True)
        print(f"smoke: streamed chat: {check_streamed_chat(base, args.request_timeout_s)!r}", flush=True)
        known |= descendants(server.pid)
        rc = stop(server, args.stop_timeout_s)
        left = leftovers(known, port, args.linger_s)
        if left:
            raise SmokeFailure(f"still running {args.linger_s:.0f} s after the server exited: {left}")
        if rc not in (0, -signal.SIGINT):
            raise SmokeFailure(f"the server exited with {rc} on SIGINT")
    except BaseException as e:  # whatever went wrong (even Ctrl-C here), no server may outlive this
        kill_everything(server, known)
        why = str(e) if isinstance(e, SmokeFailure) else traceback.format_exc()
        print(f"smoke: FAILED: {why}\n--- server log (tail) ---\n{tail(log_path)}", file=sys.stderr, flush=True)
        if not isinstance(e, Exception):
            raise
        return 1
    print(f"smoke: passed in {time.monotonic() - t0:.0f} s (server exit status {rc})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
