"""cluster.conductor.supervisor.Supervisor with small fake instances: restarts, crash loops, backoff, stop."""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import sys
import threading
import time

import pytest

from cluster.conductor.supervisor import RestartPolicy, Supervisor, describe_exit

pytestmark = pytest.mark.processes  # starts real server / instance / peer processes

# A fake instance: optionally ignores SIGTERM, then answers "up" to every connection on the port's
# socket the Supervisor hands it (so an answer tells the test it is up and has set its signal
# handling) until killed.
LISTENER = """
import os, signal, socket, sys
if sys.argv[2] == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
s = socket.socket(fileno=int(os.environ["MOONCAKE_LISTEN_FD"]))
assert s.getsockname()[1] == int(sys.argv[1])
s.setblocking(True)
while True:
    c, _ = s.accept()
    c.sendall(b"up")
    c.close()
"""
FAST = dict(poll_interval_s=0.01)


def listener(term: str = "obey-term"):
    def command(role: str, port: int) -> list[str]:
        return [sys.executable, "-c", LISTENER, str(port), term]
    return command


def exits(code: int) -> list[str]:
    return ["/bin/sh", "-c", f"exit {code}"]


def wait_until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def answer(url: str) -> bytes | None:
    """What a connection to ``url`` reads before it is closed (b"" when the Supervisor turned it
    away); None when nothing listens there."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=2) as c:
            return c.recv(16)
    except ConnectionRefusedError:
        return None
    except OSError:
        return b""


def listening(url: str) -> bool:
    """An instance serves there."""
    return answer(url) == b"up"


def gone(pid: int) -> bool:
    """True once ``pid`` is neither running nor a zombie (i.e. it was reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def logged(caplog, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "cluster.conductor.supervisor" and r.levelno == level]


def by_role(sup: Supervisor, role: str) -> dict:
    [entry] = [s for s in sup.status() if s["role"] == role]
    return entry


def new(roles, command, policy=None, **kw) -> Supervisor:
    return Supervisor(roles, "http://127.0.0.1:1", "s" * 32, 1, [], command=command,
                      policy=policy or RestartPolicy(backoff_initial_s=0.3, backoff_max_s=1.0), **{**FAST, **kw})


def test_killed_instance_restarts_on_the_same_url(caplog):
    caplog.set_level(logging.INFO, "cluster.conductor.supervisor")
    sup = new(["prefill", "decode"], listener())
    assert sup.missing_roles() == {"prefill": "not started", "decode": "not started"}
    # Started from a thread that ends at once: the children must not die with it (PR_SET_PDEATHSIG
    # follows the forking thread).
    starter = threading.Thread(target=sup.start)
    starter.start()
    starter.join()
    try:
        wait_until(lambda: all(listening(u) for u in sup.instances))
        time.sleep(0.1)
        assert all(s["alive"] for s in sup.status()) and sup.missing_roles() == {}
        # Each in its own process group: a terminal's Ctrl-C to the Conductor does not reach them.
        assert all(os.getpgid(s["pid"]) == s["pid"] for s in sup.status())
        prefill, decode = by_role(sup, "prefill"), by_role(sup, "decode")

        os.kill(decode["pid"], signal.SIGKILL)
        # Between the death and the restart (the 0.3 s backoff) the role is reported missing.
        wait_until(lambda: "decode" in sup.missing_roles())
        assert sup.missing_roles() == {"decode": "restarting after signal SIGKILL"}
        # Meanwhile the port stays the instance's: no other process can bind it (SO_REUSEADDR
        # included, as uvicorn binds), and a connection there is closed at once, not left waiting.
        port = int(decode["url"].rsplit(":", 1)[1])
        intruder = socket.socket()
        intruder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        with intruder, pytest.raises(OSError, match="Address already in use"):
            intruder.bind(("127.0.0.1", port))
        t0 = time.monotonic()
        assert answer(decode["url"]) == b"" and time.monotonic() - t0 < 1.0
        wait_until(lambda: by_role(sup, "decode")["alive"])
        after = by_role(sup, "decode")
        assert after["url"] == decode["url"] and after["pid"] != decode["pid"]
        assert after["restarts"] == 1 and after["last_exit"] == "signal SIGKILL" and not after["crash_looping"]
        wait_until(lambda: listening(after["url"]))  # the new incarnation took the old port
        assert gone(decode["pid"])  # reaped, not left a zombie
        assert by_role(sup, "prefill") == prefill  # untouched
        assert logged(caplog, logging.WARNING) == [
            f"decode instance {decode['url']} (pid {decode['pid']}) ended with signal SIGKILL; restarting it in 0.3 s"]
    finally:
        sup.stop(timeout_s=2)


def test_a_crash_loop_is_tried_again_slowly_never_given_up(caplog):
    """Issue 31: past the crash-loop limit an instance used to be given up on for good; now its
    next try waits crash_loop_backoff_s, and /health's reason says so."""
    spawns = {"prefill": 0, "decode": 0}

    def command(role, port):
        spawns[role] += 1
        return listener()(role, port) if role == "prefill" else exits(3)

    sup = new(["prefill", "decode"], command,
              RestartPolicy(backoff_initial_s=0.01, backoff_max_s=0.02, max_restarts=2, window_s=60,
                            crash_loop_backoff_s=0.8))
    sup.start()
    try:
        wait_until(lambda: by_role(sup, "decode")["crash_looping"])
        time.sleep(0.2)  # ten times the longest backoff: a restart would have happened by now
        decode = by_role(sup, "decode")
        assert spawns["decode"] == 3 and decode["restarts"] == 2
        assert not decode["alive"] and decode["last_exit"] == "exit 3" and 0 < decode["next_restart_s"] <= 0.8
        assert by_role(sup, "prefill")["alive"] and spawns["prefill"] == 1
        assert re.fullmatch(r"crash-looping after exit 3; next try in \d+ s", sup.missing_roles()["decode"])
        assert set(sup.missing_roles()) == {"decode"}
        error = logged(caplog, logging.ERROR)[0]
        assert error.startswith(f"decode instance {decode['url']} (pid {decode['pid']}) is crash-looping: it "
                                "ended with exit 3 after 2 restarts within 60 s, the limit of 2; trying again in 0.8 s")
        # It is tried again after the long backoff (and, still failing, waits as long again).
        wait_until(lambda: spawns["decode"] == 4, timeout_s=5)
        wait_until(lambda: len(logged(caplog, logging.ERROR)) == 2, timeout_s=5)
    finally:
        sup.stop(timeout_s=2)


def test_a_command_that_cannot_start_counts_as_a_crash(caplog):
    sup = new(["prefill"], lambda role, port: ["/nonexistent/instance"],
              RestartPolicy(backoff_initial_s=0.01, backoff_max_s=0.01, max_restarts=1))
    sup.start()
    try:
        wait_until(lambda: by_role(sup, "prefill")["crash_looping"])
    finally:
        sup.stop()
    entry = by_role(sup, "prefill")
    assert entry["pid"] is None and entry["restarts"] == 1
    assert entry["last_exit"].startswith("failed to start ([Errno 2]")
    [error] = logged(caplog, logging.ERROR)
    assert error.startswith("prefill instance http://127.0.0.1:") and "is crash-looping" in error


def test_backoff_doubles_up_to_the_cap_and_resets_after_a_stable_run(caplog):
    policy = RestartPolicy(backoff_initial_s=0.5, backoff_max_s=3.0)
    assert [policy.backoff_s(n) for n in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert policy.backoff_s(10_000) == 3.0

    # Runs 1-3 die at once; run 4 lasts past stable_after_s, so the wait after it starts over.
    spawned_at: list[float] = []

    def command(role, port):
        spawned_at.append(time.monotonic())
        return ["/bin/sh", "-c", "sleep 0.4" if len(spawned_at) == 4 else "exit 1"]

    caplog.set_level(logging.WARNING, "cluster.conductor.supervisor")
    sup = new(["decode"], command, RestartPolicy(backoff_initial_s=0.05, backoff_max_s=1.0, stable_after_s=0.3,
                                                 max_restarts=4, window_s=60))
    sup.start()
    try:
        wait_until(lambda: by_role(sup, "decode")["crash_looping"])
    finally:
        sup.stop(timeout_s=2)
    waits = [float(re.search(r"restarting it in (\S+) s", line)[1]) for line in logged(caplog, logging.WARNING)]
    assert waits == [0.05, 0.1, 0.2, 0.05]
    gaps = [b - a for a, b in zip(spawned_at, spawned_at[1:])]
    assert all(gap >= wait for gap, wait in zip(gaps, waits[:3]))


def test_stop_kills_what_ignores_sigterm_reaps_all_and_restarts_nothing(caplog):
    spawns = []

    def command(role, port):
        spawns.append(role)
        # decode ignores SIGTERM, so prefill dies while stop() is still waiting on decode.
        return listener("ignore-term" if role == "decode" else "obey-term")(role, port)

    sup = new(["prefill", "decode"], command)
    sup.start()
    wait_until(lambda: all(listening(u) for u in sup.instances))
    pids = [s["pid"] for s in sup.status()]
    caplog.set_level(logging.WARNING, "cluster.conductor.supervisor")
    began = time.monotonic()
    sup.stop(timeout_s=0.5)
    took = time.monotonic() - began
    assert 0.5 <= took < 5  # decode needed the SIGKILL
    assert all(gone(pid) for pid in pids)
    status = sup.status()
    assert [s["last_exit"] for s in status] == ["signal SIGTERM", "signal SIGKILL"]
    assert not any(s["alive"] for s in status) and [s["restarts"] for s in status] == [0, 0]
    assert sup.missing_roles() == {"prefill": "stopped", "decode": "stopped"}
    assert logged(caplog, logging.WARNING) == [
        f"decode instance pid {pids[1]} did not stop in 0.5 s; killing it"]

    time.sleep(0.1)  # ten poll intervals: a watcher still running would have restarted them
    assert spawns == ["prefill", "decode"]
    began = time.monotonic()
    sup.stop()  # idempotent
    assert time.monotonic() - began < 0.1
    with pytest.raises(RuntimeError):
        sup.start()


def test_describe_exit():
    assert describe_exit(0) == "exit 0"
    assert describe_exit(1) == "exit 1"
    assert describe_exit(-signal.SIGKILL) == "signal SIGKILL"
    assert describe_exit(-signal.SIGTERM) == "signal SIGTERM"


@pytest.mark.parametrize("kwargs", [
    dict(backoff_initial_s=0), dict(backoff_initial_s=float("nan")), dict(backoff_max_s=-1),
    dict(backoff_initial_s=2.0, backoff_max_s=1.0), dict(window_s=0), dict(stable_after_s=-1),
    dict(max_restarts=-1), dict(max_restarts=1.5),
])
def test_restart_policy_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        RestartPolicy(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(roles=["prefill", "decoder"]), "unknown instance roles"),
    (dict(threads=0), "threads"),
    (dict(secret=""), "secret"),
    (dict(conductor_url=""), "conductor_url"),
    (dict(poll_interval_s=0), "poll_interval_s"),
])
def test_supervisor_rejects_bad_config(kwargs, match):
    args = dict(roles=["decode"], conductor_url="http://127.0.0.1:1", secret="s" * 32, threads=1, extra_args=[])
    with pytest.raises(ValueError, match=match):
        Supervisor(**{**args, **kwargs})


def test_default_command_is_an_instance_of_the_server():
    sup = Supervisor(["prefill", "decode"], "http://127.0.0.1:9", "s" * 32, 3, ["--log-level", "debug"])
    url = sup.instances[1]
    port = int(url.rsplit(":", 1)[1])
    assert sup.server_command("decode", port) == [
        sys.executable, "-m", "server", "--role", "decode", "--host", "127.0.0.1", "--port", str(port),
        "--conductor", "http://127.0.0.1:9", "--threads", "3", "--log-level", "debug"]
    assert len(set(sup.instances)) == 2
