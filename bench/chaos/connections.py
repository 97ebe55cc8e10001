"""bench.chaos: idle and slow-header connections beside live traffic (issue 31).

``--idle-connections`` connections that send nothing and ``--slow-header-connections`` that send
a header byte every second and never finish (slowloris) are opened at once to the Conductor's
port while the steady stream and the long prompts go on. The front door's header deadline
(``--header-timeout-s``, 10 s shipped) must close every one of them by itself, within the deadline
plus ``SLACK_S``; meanwhile the live traffic must lose nothing (the usual rows), and afterwards the
connections the Conductor holds on its port come back to what they were (give or take the live
traffic's own). The fault is recovered when all three hold.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from bench.chaos.config import HOST, progress
from bench.chaos.load import open_fds

if TYPE_CHECKING:
    from bench.chaos.run import Run

SHIPPED_HEADER_TIMEOUT_S = 10.0  # --header-timeout-s
SLACK_S = 5.0


def _connections(port: int) -> int:
    """TCP connections accepted on ``port`` that the server still holds: established, or closed by
    the client and not yet by the server (CLOSE_WAIT, a leak's sign)."""
    n = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] in ("01", "08"):
                n += 1
    return n


async def _held_open(port: int, slow: bool, within_s: float) -> float | None:
    """Open a connection (slow: one header byte a second); how long until the server closed it
    (None: still open after ``within_s``)."""
    t0 = time.monotonic()
    try:
        reader, writer = await asyncio.open_connection(HOST, port)
    except OSError:
        return 0.0  # refused at once: closed, as far as a client can tell
    header = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100
    try:
        for i in range(int(within_s) + 1):
            if slow:
                writer.write(header[i:i + 1])
            try:
                if await asyncio.wait_for(reader.read(1), 1.0) == b"":
                    return round(time.monotonic() - t0, 1)
            except asyncio.TimeoutError:
                continue
            except ConnectionError:
                return round(time.monotonic() - t0, 1)
        return None
    finally:
        writer.close()


async def idle_and_slow_connections(run: Run) -> None:
    cfg = run.cfg
    pid, port = run.cluster.server.proc.pid, run.cluster.port
    fds_before, conns_before = len(open_fds(pid)), _connections(port)
    fault: dict[str, Any] = {"kind": "connections", "role": "Conductor", "old_pid": pid, "at_s": run._elapsed(),
                             "idle": cfg.idle_connections, "slow": cfg.slow_header_connections}
    run.faults.append(fault)
    within = (cfg.header_timeout_s or SHIPPED_HEADER_TIMEOUT_S) + SLACK_S
    progress(f"{cfg.idle_connections} idle and {cfg.slow_header_connections} slow-header connections to the "
             "Conductor beside the traffic")
    closed = await asyncio.gather(*(_held_open(run.cluster.port, slow, within) for slow in
                                    [False] * cfg.idle_connections + [True] * cfg.slow_header_connections))
    still_open = sum(c is None for c in closed)
    # The live traffic holds a few connections of its own at any moment: what matters is that
    # none of the hundreds is left on the server's side.
    slack = 16
    t0 = time.monotonic()
    while _connections(port) > conns_before + slack and time.monotonic() - t0 < 10:
        await asyncio.sleep(0.2)
    fault.update(still_open=still_open, closed_after_s_max=max((c for c in closed if c is not None), default=None),
                 connections_before=conns_before, connections_after=_connections(port), fds_before=fds_before,
                 fds_after=len(open_fds(pid)))
    fault["recovered"] = still_open == 0 and fault["connections_after"] <= conns_before + slack
    fault["summary"] = (f"{cfg.idle_connections} idle + {cfg.slow_header_connections} slow-header connections: "
                        f"{len(closed) - still_open} closed by the server (the last after "
                        f"{fault['closed_after_s_max']} s), {still_open} still open after {within:g} s; connections "
                        f"the Conductor holds {conns_before} -> {fault['connections_after']}, its descriptors "
                        f"{fds_before} -> {fault['fds_after']}")
    progress(fault["summary"])
