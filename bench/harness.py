"""Start, watch and stop `python -m server` processes: the one harness of benchmarks and tests.

A server (colocated, or a Conductor with the instance processes its Supervisor starts) runs as the
leader of a process group of its own, with its output in a log file. ``stop`` sends SIGTERM to the
group (the Conductor stops its instances), waits, and sends SIGKILL to whatever is left, so no run
leaves processes behind. Every wait here is bounded and fails naming what it waited for and the
end of the server's log.

An etcd of a test's or a benchmark's own (``start_etcd``) runs the same way: a process group,
a log file, a bounded wait for it to be healthy, and a ``stop`` that leaves nothing behind.

Also here, because every client of the server needs them: parsing a streamed (SSE) answer, and
the list of what an instance must no longer hold once the requests it served are gone.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx

from cluster.conductor.supervisor import free_port

__all__ = ["HOST", "INSTANCE_HELD", "DONE", "EtcdProcess", "ServerProcess", "SSEStream", "free_port",
           "launch_server", "sse_data", "sse_events", "staging_holders", "start_etcd", "start_server", "until"]

HOST = "127.0.0.1"
DONE = "[DONE]"
# What an instance's /stats counts as held: all zero once no request is in flight on it (blocks
# cached for prefix reuse are free, not used).
INSTANCE_HELD = ("num_used_blocks", "num_reservations", "num_running", "num_waiting",
                 "staging_send_ranges", "staging_recv_ranges", "staging_pool_ranges")


def staging_holders(stats: dict[str, Any]) -> dict[str, list]:
    """An instance's ``/stats``' named holders of its staging ranges (owner, seconds held), the
    areas that hold any: what a report of held staging adds, to name the request behind it."""
    return {k: stats[k] for k in ("staging_send_holders", "staging_recv_holders", "staging_pool_holders")
            if stats.get(k)}

T = TypeVar("T")


def until(predicate: Callable[[], T], within_s: float, what: str, every_s: float = 0.2) -> T:
    """Call ``predicate`` until it returns something true, which is returned; after ``within_s``
    seconds raise ``TimeoutError`` naming ``what`` was awaited."""
    deadline = time.monotonic() + within_s
    while not (value := predicate()):
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {within_s:g} s waiting for {what}")
        time.sleep(every_s)
    return value


# --------------------------------------------------------------------------- streamed answers


def sse_data(line: str) -> str | None:
    """The payload of an SSE ``data:`` line; None for any other line (blank separators, comments)."""
    line = line.strip()
    return line[len("data:"):].strip() if line.startswith("data:") else None


@dataclass
class SSEStream:
    events: list[dict[str, Any]] = field(default_factory=list)  # the JSON events before [DONE]
    done: bool = False  # ended by data: [DONE]; a stream cut short has not

    @property
    def error(self) -> Any:
        """The error event's ``error`` object, if the stream carried one."""
        return next((e["error"] for e in self.events if "error" in e), None)

    @property
    def text(self) -> str:
        """A ``/v1/completions`` stream's text: its events' first choices, joined."""
        return "".join(e["choices"][0]["text"] for e in self.events if e.get("choices"))


def sse_events(lines: Iterable[str]) -> SSEStream:
    """Parse a streamed answer's lines. An event that is not JSON, or any event after ``[DONE]``,
    raises ``ValueError``: the server broke the stream's framing."""
    stream = SSEStream()
    for line in lines:
        if (data := sse_data(line)) is None:
            continue
        if stream.done:
            raise ValueError(f"an event after data: [DONE]: {data[:200]}")
        if data == DONE:
            stream.done = True
        else:
            stream.events.append(json.loads(data))
    return stream


# --------------------------------------------------------------------------- server processes


@dataclass
class ServerProcess:
    name: str
    cmd: list[str]
    proc: subprocess.Popen
    log_path: Path
    base_url: str

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, n: int = 3000) -> str:
        return self.log()[-n:]

    # -- views ---------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any] | None:
        """The server's /stats, or None when it does not answer with them."""
        try:
            r = httpx.get(f"{self.base_url}/stats", timeout=10.0)
            return r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    def instances(self, role: str | None = None) -> list[dict[str, Any]]:
        """The Conductor's record of each instance (``/stats``), of ``role`` if given."""
        return [i for i in (self.stats() or {}).get("instances", []) if role is None or i["role"] == role]

    @staticmethod
    def instance_stats(url: str) -> dict[str, Any]:
        r = httpx.get(url + "/stats", timeout=10.0)
        r.raise_for_status()
        return r.json()

    def held(self, also: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
        """What each instance that is up still holds (``INSTANCE_HELD``), by URL; ``also(stats)``
        adds what the caller counts besides, under ``"conductor"``."""
        stats = self.stats() or {}
        dirty: dict[str, dict[str, Any]] = {}
        for inst in stats.get("instances", []):
            if inst["up"]:
                own = self.instance_stats(inst["url"])
                if held := {k: own[k] for k in INSTANCE_HELD if own.get(k)}:
                    dirty[inst["url"]] = held
        if also is not None and (extra := also(stats)):
            dirty["conductor"] = extra
        return dirty

    def assert_clean(self, within_s: float = 15.0,
                     also: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> None:
        """Every instance that is up holds nothing, within ``within_s`` (aborts and releases
        travel asynchronously after a request ends); else ``AssertionError`` naming what is held."""
        last: dict[str, dict[str, Any]] = {}

        def clean() -> bool:
            nonlocal last
            last = self.held(also)
            return not last

        try:
            until(clean, within_s, "the instances to release everything")
        except TimeoutError:
            raise AssertionError(f"still held after {within_s:g} s: {last}; staging held by {self._holders(last)}") from None

    def _holders(self, held: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """Who holds the staging of the instances in ``held`` (``staging_holders``), for a message."""
        holders: dict[str, Any] = {}
        for url in held.keys() - {"conductor"}:
            try:
                if h := staging_holders(self.instance_stats(url)):
                    holders[url] = h
            except (httpx.HTTPError, ValueError) as e:  # it went down meanwhile: say so, keep the message
                holders[url] = f"/stats: {type(e).__name__}"
        return holders

    # -- waits ---------------------------------------------------------------------------------------
    def _check_running(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} server exited with {self.proc.returncode} before it was ready; "
                               f"log tail:\n{self.log_tail()}")

    def _wait(self, ready: Callable[[], bool], timeout_s: float, what: str, every_s: float = 0.5) -> float:
        t0 = time.monotonic()

        def check() -> bool:
            self._check_running()
            try:
                return ready()
            except (httpx.HTTPError, ValueError, KeyError):
                return False

        try:
            until(check, timeout_s, f"{self.name} server: {what}", every_s=every_s)
        except TimeoutError as e:
            raise TimeoutError(f"{e}; log tail:\n{self.log_tail()}") from None
        return time.monotonic() - t0

    def wait_healthy(self, timeout_s: float) -> float:
        """Wait for ``/health`` to answer 200; returns the seconds it took."""
        return self._wait(lambda: httpx.get(f"{self.base_url}/health", timeout=5.0).status_code == 200,
                          timeout_s, "/health to answer 200")

    def wait_instances(self, n: int, timeout_s: float) -> float:
        """Wait until the Conductor counts ``n`` instances up; returns the seconds it took."""
        return self._wait(lambda: sum(i["up"] for i in self.instances()) == n, timeout_s, f"{n} instances up")

    # -- the end -------------------------------------------------------------------------------------
    def _group_alive(self) -> bool:
        try:
            os.killpg(self.proc.pid, 0)  # start_new_session: the leader's pid is the group's id
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True

    def stop(self, timeout_s: float = 30.0, sig: signal.Signals = signal.SIGTERM) -> None:
        """Send ``sig`` to the server's process group; SIGKILL what is left after ``timeout_s``."""
        pgid = self.proc.pid
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + timeout_s
        try:
            self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        while self._group_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        if self._group_alive() or self.proc.poll() is None:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            end = time.monotonic() + 5.0  # killed children are reaped by init, not by us
            while self._group_alive() and time.monotonic() < end:
                time.sleep(0.05)


def start_server(name: str, cmd: Sequence[str], base_url: str, log_path: Path,
                 env: dict[str, str] | None = None, cwd: Path | None = None) -> ServerProcess:
    """Run ``cmd`` (a server listening at ``base_url``) as a new process group, output to ``log_path``;
    ``env`` is added to this process's environment; ``cwd``: where it runs (default: here)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=full_env, cwd=cwd)
    return ServerProcess(name, list(cmd), proc, log_path, base_url)


def launch_server(flags: Sequence[str], log_path: Path, *, name: str = "server", python: str = sys.executable,
                  host: str = HOST, env: dict[str, str] | None = None, advertise: bool = False) -> ServerProcess:
    """``python -m server --host H --port P *flags`` on a free port (``start_server``);
    ``advertise``: also ``--url`` with its own address (an instance started by hand, which says
    where Conductors reach it)."""
    port = free_port(host)
    url = f"http://{host}:{port}"
    cmd = [python, "-m", "server", "--host", host, "--port", str(port), *(["--url", url] if advertise else []), *flags]
    return start_server(name, cmd, url, log_path, env)


# --------------------------------------------------------------------------- etcd


@dataclass
class EtcdProcess(ServerProcess):
    """A single-member etcd started by ``start_etcd``: ``url`` is its client URL, ``proc`` the
    process (a test may SIGSTOP it: ``stop`` resumes it first), ``data_dir`` its ``--data-dir``."""

    data_dir: Path

    @property
    def url(self) -> str:
        return self.base_url

    def stop(self, timeout_s: float = 10.0, sig: signal.Signals = signal.SIGTERM) -> None:
        """SIGCONT (a test or the bench may have stopped it, and a stopped etcd cannot act on
        SIGTERM), then ``ServerProcess.stop``: ``sig``, and SIGKILL after ``timeout_s``."""
        try:
            os.killpg(self.proc.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        super().stop(timeout_s, sig)


def start_etcd(data_dir: Path, *, host: str = HOST, name: str = "etcd", fast_leases: bool = False,
               client_port: int | None = None, peer_port: int | None = None, prefix: Sequence[str] = (),
               log_path: Path | None = None, within_s: float = 15.0,
               tls: tuple[Path, Path, Path] | None = None) -> EtcdProcess:
    """Start a single-member etcd with its data in ``data_dir`` and wait until ``/health`` says it
    is healthy; its output goes to ``log_path`` (default: ``data_dir`` with ``.log`` appended).

    It listens for clients at ``http://host:client_port`` and for peers at ``http://host:peer_port``
    (a single member has none, but etcd needs the URL); each port, unless given, is one free here.
    ``prefix`` runs it inside something, e.g. ``ip netns exec NS`` for a host of its own: there
    this namespace's free ports say nothing, so pass the ports, and ``host`` must be an address
    this process reaches (the health check is made from here).

    ``tls``: (CA certificate, etcd's certificate, its key), PEM files: clients then reach it at
    ``https://`` (the health check trusts that CA).

    ``fast_leases``: etcd's shortest lease is 1.5 election timeouts rounded up to whole seconds
    (2 s at the default 1 s timeout); a 50 ms election timeout (10 ms heartbeats) brings it to
    1 s, which keeps the tests that wait for a lease to expire short. Without it etcd runs at its
    shipped timing, as a deployment would.

    Raises ``FileNotFoundError`` without an ``etcd`` binary on PATH (a caller decides whether to
    skip), and ``RuntimeError`` (etcd exited) or ``TimeoutError`` (not healthy within
    ``within_s``) with the end of its log; etcd is stopped before either is raised.
    """
    binary = shutil.which("etcd")
    if binary is None:
        raise FileNotFoundError("no etcd binary (apt-get install etcd-server)")
    scheme = "https" if tls is not None else "http"
    client = f"{scheme}://{host}:{client_port if client_port is not None else free_port(host)}"
    peer = f"http://{host}:{peer_port if peer_port is not None else free_port(host)}"
    timing = ["--heartbeat-interval", "10", "--election-timeout", "50"] if fast_leases else []
    certs = ["--cert-file", str(tls[1]), "--key-file", str(tls[2])] if tls is not None else []
    cmd = [*prefix, binary, "--name", name, "--data-dir", str(data_dir),
           "--listen-client-urls", client, "--advertise-client-urls", client,
           "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
           "--initial-cluster", f"{name}={peer}", *timing, *certs, "--logger", "zap", "--log-level", "error"]
    started = start_server("etcd" if name == "etcd" else f"etcd {name}", cmd, client,
                           log_path or data_dir.with_name(data_dir.name + ".log"))
    etcd = EtcdProcess(started.name, started.cmd, started.proc, started.log_path, client, data_dir)

    def healthy() -> bool:
        verify = ssl.create_default_context(cafile=str(tls[0])) if tls is not None else True
        return httpx.get(f"{client}/health", timeout=1.0, trust_env=False, verify=verify).json().get("health") == "true"

    try:
        etcd._wait(healthy, within_s, "/health to say healthy", every_s=0.05)
    except BaseException:
        etcd.stop()
        raise
    return etcd
