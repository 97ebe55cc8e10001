"""Starting and supervising a whole cluster on this machine: the instance processes the Conductor drives.

``python -m server`` (disaggregated mode) runs a :class:`Supervisor`: each instance is
``python -m server --role ROLE --conductor URL`` on its own loopback port with its share of the
cores, the cluster secret in its environment, and the kernel's parent-death signal set, so no
instance outlives the Conductor even if that is killed. An instance that dies is started again on
the same port after a backoff, so the Conductor, which keeps polling that URL, sees a new
incarnation there. The port is the Supervisor's for good: it listens on it from the start and
hands the socket to each incarnation (``LISTEN_FD_ENV``, as systemd's socket activation does), so
no other process can take it while an instance restarts; meanwhile the Supervisor closes every
connection that arrives there at once (a poll fails fast, as at a closed port). One that keeps
dying (a crash loop) is never given up on for good: past the crash-loop limit it is tried again
only every ``crash_loop_backoff_s``, with an ERROR log line each time, and ``/health`` says so;
a cause that goes away (a full disk, a port held by a process that has since ended) then costs
minutes, not the cluster.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import engine.core_share as core_share

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "both")

_PR_SET_PDEATHSIG = 1
# Resolved once here, not in the child: between fork and exec only the forking thread exists, and
# a dlopen there could wait forever on a loader lock another thread of the Conductor held.
_prctl = ctypes.CDLL(None, use_errno=True).prctl


LISTEN_FD_ENV = "MOONCAKE_LISTEN_FD"  # an instance serves on this inherited listening socket
CORE_SHARE_ENV = "MOONCAKE_CORE_SHARE"  # PATH:SLOT, an instance's slot in the host's core budget


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent(parent_pid: int) -> None:  # runs in the child between fork and exec
    _prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))
    # The parent may have died before prctl took effect; then no signal will ever come.
    if os.getppid() != parent_pid:
        os._exit(1)


def describe_exit(returncode: int) -> str:
    """``"exit 1"`` or ``"signal SIGKILL"`` for a ``Popen.returncode``."""
    if returncode >= 0:
        return f"exit {returncode}"
    try:
        return f"signal {signal.Signals(-returncode).name}"
    except ValueError:
        return f"signal {-returncode}"


@dataclass(frozen=True)
class RestartPolicy:
    """When a dead instance is started again.

    The n-th restart in a row waits ``backoff_initial_s * 2**n`` (at most ``backoff_max_s``); a run
    that lasted ``stable_after_s`` starts the series over. An instance that dies after
    ``max_restarts`` restarts within ``window_s`` is crash-looping: its next restart waits
    ``crash_loop_backoff_s`` (0 restarts allowed: every restart waits that long).
    """

    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    stable_after_s: float = 60.0
    max_restarts: int = 5
    window_s: float = 300.0
    crash_loop_backoff_s: float = 300.0

    def __post_init__(self) -> None:
        for name in ("backoff_initial_s", "backoff_max_s", "window_s", "crash_loop_backoff_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if self.backoff_max_s < self.backoff_initial_s:
            raise ValueError(f"backoff_max_s ({self.backoff_max_s}) must be >= backoff_initial_s "
                             f"({self.backoff_initial_s})")
        if not (isinstance(self.stable_after_s, (int, float)) and self.stable_after_s >= 0):
            raise ValueError(f"stable_after_s must be >= 0, got {self.stable_after_s!r}")
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ValueError(f"max_restarts must be an integer >= 0, got {self.max_restarts!r}")

    def backoff_s(self, failures: int) -> float:
        """The wait before the restart that follows ``failures`` short-lived runs in a row."""
        # Capping the exponent keeps 2**n a float of sane size however long the loop ran.
        return min(self.backoff_max_s, self.backoff_initial_s * 2.0 ** min(failures, 64))


# (role, port) -> the instance process's argv
CommandFactory = Callable[[str, int], Sequence[str]]


@dataclass(eq=False)
class _Managed:
    """One supervised instance. The watcher thread alone writes it, under the Supervisor's lock."""

    role: str
    listener: socket.socket  # the port, held across incarnations
    url: str
    process: subprocess.Popen | None = None
    pid: int | None = None
    started_at: float = 0.0
    restarts: int = 0
    crash_looping: bool = False
    last_exit: str | None = None
    restart_at: float | None = None  # monotonic time the pending restart is due
    failures: int = 0  # short-lived runs in a row: the backoff's exponent
    restart_times: deque[float] = field(default_factory=deque)  # within the crash-loop window


class Supervisor:
    """Starts one instance process per entry of ``roles`` and keeps them running until :meth:`stop`.

    Each instance keeps its port (and so its URL) across restarts. ``command`` replaces the
    ``python -m server --role ...`` command line (tests run small fakes); it gets the role and port.
    """

    def __init__(
        self,
        roles: Sequence[str],
        conductor_url: str,
        secret: str,
        threads: int,
        extra_args: Sequence[str] = (),
        host: str = "127.0.0.1",
        policy: RestartPolicy | None = None,
        command: CommandFactory | None = None,
        poll_interval_s: float = 0.2,
        share_cores: int | None = None,
    ) -> None:
        """``threads``: each instance's own; with ``share_cores`` (the machine's cores) the instances
        draw on one budget of that many instead (``engine.core_share``), each starting (and
        calibrating) at ``threads``, the share it gets when all are busy."""
        bad = [r for r in roles if r not in ROLES]
        if bad:
            raise ValueError(f"unknown instance roles {bad}; expected some of {list(ROLES)}")
        if not conductor_url:
            raise ValueError("conductor_url must be set")
        if not secret:
            raise ValueError("secret must be set")
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be a positive integer, got {threads!r}")
        if not poll_interval_s > 0:
            raise ValueError(f"poll_interval_s must be > 0, got {poll_interval_s!r}")
        self._roles = tuple(roles)
        self._conductor_url = conductor_url
        self._threads = threads
        self._extra_args = tuple(extra_args)
        self._host = host
        self._policy = policy or RestartPolicy()
        self._command = command or self.server_command
        self._poll_interval_s = poll_interval_s
        self._env = dict(os.environ, MOONCAKE_CLUSTER_SECRET=secret)
        self._managed = []
        for role in self._roles:
            listener = socket.create_server((host, 0), backlog=1024)
            port = listener.getsockname()[1]
            self._managed.append(_Managed(role, listener, f"http://{host}:{port}"))
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._launched = threading.Event()
        self._stop_timeout_s = 10.0
        self._thread: threading.Thread | None = None
        if share_cores is not None and (isinstance(share_cores, bool) or not isinstance(share_cores, int)
                                        or share_cores < 1):
            raise ValueError(f"share_cores must be a positive integer or None, got {share_cores!r}")
        self._share_cores = share_cores
        self.core_share: Path | None = None  # the budget's file, from start() to the end of stop()

    @property
    def instances(self) -> list[str]:
        """The instances' URLs, in the order of ``roles``; fixed from construction on."""
        return [m.url for m in self._managed]

    def server_command(self, role: str, port: int) -> list[str]:
        """The default ``command``: ``python -m server`` as a ``role`` instance on ``port``."""
        return [sys.executable, "-m", "server", "--role", role, "--host", self._host, "--port", str(port),
                "--conductor", self._conductor_url, "--threads", str(self._threads), *self._extra_args]

    # --- control (any thread) ---

    def start(self) -> None:
        """Launches every instance and returns once each has been spawned (not once it is ready)."""
        with self._lock:
            if self._thread is not None or self._stopping.is_set():
                raise RuntimeError("a Supervisor can be started once, and not after stop()")
            if self._share_cores is not None:
                # Named after this process: two Conductors on one host keep budgets of their own.
                self.core_share = core_share.create(
                    core_share.default_dir() / f"mooncake-cores-{os.getpid()}-{id(self):x}",
                    self._share_cores, len(self._managed))
            # The watcher thread spawns every process, the first ones too: PR_SET_PDEATHSIG fires
            # when the *thread* that forked a child ends, so a child forked by the caller would be
            # killed as soon as, say, an executor thread that called start() finished.
            self._thread = threading.Thread(target=self._run, name="instance-supervisor", daemon=True)
        self._thread.start()
        self._launched.wait()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ends supervision: no more restarts; SIGTERM to every instance, SIGKILL to those still
        running after ``timeout_s``; returns once all are reaped. Later calls do nothing."""
        if not timeout_s >= 0:
            raise ValueError(f"timeout_s must be >= 0, got {timeout_s!r}")
        with self._lock:
            if not self._stopping.is_set():
                self._stop_timeout_s = timeout_s
                self._stopping.set()
            thread = self._thread
        if thread is not None:
            thread.join()

    def status(self) -> list[dict[str, Any]]:
        """One dict per instance: role, url, pid (current or last), alive, restarts, crash_looping,
        last_exit (how its last process ended, e.g. ``"signal SIGKILL"``; None if none has),
        next_restart_s (seconds until a pending restart, else None). ``alive`` lags a death by
        at most the poll interval."""
        now = time.monotonic()
        with self._lock:
            return [dict(role=m.role, url=m.url, pid=m.pid, alive=m.process is not None, restarts=m.restarts,
                         crash_looping=m.crash_looping, last_exit=m.last_exit,
                         next_restart_s=None if m.restart_at is None else max(0.0, m.restart_at - now))
                    for m in self._managed]

    def missing_roles(self) -> dict[str, str]:
        """Roles none of whose instances has a live process, each with why, e.g.
        ``{"decode": "restarting after signal SIGKILL"}``; empty when every role is served."""
        now = time.monotonic()
        with self._lock:
            stopped = self._stopping.is_set()
            reasons: dict[str, list[str]] = {}
            live = set()
            for m in self._managed:
                if m.process is not None:
                    live.add(m.role)
                elif stopped:
                    reasons.setdefault(m.role, []).append("stopped")
                elif m.crash_looping:
                    wait = "" if m.restart_at is None else f"; next try in {max(0.0, m.restart_at - now):.0f} s"
                    reasons.setdefault(m.role, []).append(f"crash-looping after {m.last_exit}{wait}")
                elif m.last_exit is not None:
                    reasons.setdefault(m.role, []).append(f"restarting after {m.last_exit}")
                else:
                    reasons.setdefault(m.role, []).append("not started")
        return {role: "; ".join(dict.fromkeys(why)) for role, why in reasons.items() if role not in live}

    # --- the watcher thread ---

    def _run(self) -> None:
        try:
            for m in self._managed:
                self._spawn(m)
            self._launched.set()
            while not self._stopping.is_set():
                self._stopping.wait(self._check())
        finally:
            self._launched.set()  # start() must not hang if spawning raised
            self._terminate_all()

    def _check(self) -> float:
        """Notices deaths and performs due restarts; returns how long to sleep until the next check."""
        now = time.monotonic()
        for m in self._managed:
            if m.process is not None and m.process.poll() is not None:
                self._on_exit(m, describe_exit(m.process.returncode), now)
            if m.process is None:
                _turn_away(m.listener)
            if m.restart_at is not None and now >= m.restart_at:
                self._spawn(m)
        due = [m.restart_at - now for m in self._managed if m.restart_at is not None]
        return max(0.0, min([self._poll_interval_s, *due]))

    def _spawn(self, m: _Managed) -> None:
        restart = m.last_exit is not None
        try:
            # A process group of its own: a terminal's Ctrl-C reaches only the Conductor, which then
            # stops the instances, instead of the watcher seeing them all die and restarting them.
            fd = m.listener.fileno()
            env = {**self._env, LISTEN_FD_ENV: str(fd)}
            if self.core_share is not None:
                env[CORE_SHARE_ENV] = f"{self.core_share}:{self._managed.index(m)}"
            process = subprocess.Popen(list(self._command(m.role, m.listener.getsockname()[1])),
                                       env=env, pass_fds=(fd,), process_group=0,
                                       preexec_fn=functools.partial(_die_with_parent, os.getpid()))
        except OSError as e:
            process, failure = None, f"failed to start ({e})"
        now = time.monotonic()
        with self._lock:
            if restart:
                m.restarts += 1
                m.restart_times.append(now)
            if process is not None:
                m.process, m.pid, m.started_at, m.restart_at = process, process.pid, now, None
        if process is None:
            self._on_exit(m, failure, now)
            return
        log.info("%s %s instance pid %d on %s%s", "restarted" if restart else "started", m.role, process.pid,
                 m.url, f" (restart {m.restarts})" if restart else "")

    def _on_exit(self, m: _Managed, how: str, now: float) -> None:
        policy = self._policy
        with self._lock:
            dead_pid = m.pid if m.process is not None else None
            if m.process is not None and now - m.started_at >= policy.stable_after_s:
                m.failures = 0
            m.process, m.last_exit, m.restart_at = None, how, None
            while m.restart_times and m.restart_times[0] <= now - policy.window_s:
                m.restart_times.popleft()
            recent = len(m.restart_times)
            m.crash_looping = recent >= policy.max_restarts
            delay = policy.crash_loop_backoff_s if m.crash_looping else policy.backoff_s(m.failures)
            if not m.crash_looping:
                m.failures += 1
            m.restart_at = now + delay
        who = f"{m.role} instance {m.url}" + (f" (pid {dead_pid})" if dead_pid is not None else "")
        if m.crash_looping:
            log.error("%s is crash-looping: it ended with %s after %d restarts within %g s, the limit of %d; "
                      "trying again in %g s", who, how, recent, policy.window_s, policy.max_restarts, delay)
        else:
            log.warning("%s ended with %s; restarting it in %g s", who, how, delay)

    def _terminate_all(self) -> None:
        running = [m for m in self._managed if m.process is not None]
        for m in running:
            m.process.terminate()
        deadline = time.monotonic() + self._stop_timeout_s
        for m in running:
            try:
                m.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                # Once the deadline has passed, the later ones get a zero wait; one may have ended meanwhile.
                if m.process.poll() is None:
                    log.warning("%s instance pid %d did not stop in %g s; killing it", m.role, m.pid,
                                self._stop_timeout_s)
                    m.process.kill()
                m.process.wait()
            with self._lock:
                m.last_exit, m.process, m.restart_at = describe_exit(m.process.returncode), None, None
        for m in self._managed:
            m.listener.close()
        if self.core_share is not None:
            self.core_share.unlink(missing_ok=True)


def _turn_away(listener: socket.socket) -> None:
    """Close every connection waiting on ``listener`` (no instance serves there now)."""
    # O_NONBLOCK belongs to the socket all incarnations shared, and the last may have cleared it.
    listener.setblocking(False)
    while True:
        try:
            connection, _ = listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:  # e.g. EMFILE: the connections wait; tried again at the next check
            log.warning("could not turn away a connection on %s: %s", listener.getsockname(), e)
            return
        connection.close()
