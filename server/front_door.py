"""Every HTTP port of the cluster (the Conductor's, an instance's, the colocated server's) runs
through here: uvicorn with a deadline on each request's head and body and a cap on connections.

uvicorn's h11 protocol closes a connection that sits idle between requests after
``timeout_keep_alive``, but any byte cancels that timer, and nothing bounds how long the head or
the body of a request may take to arrive: a client that connects and says nothing, or sends a
header byte every ten seconds ("slowloris"), holds a connection and a file descriptor for ever,
and enough of them exhaust the process's open files (issue 31 measured 500 such connections
still open after 75 s). So:

* **head deadline** (``header_timeout_s``): from the moment a connection can start a request
  (its opening, or the end of the previous response) to the end of the request's headers.
  Bytes that trickle in do not extend it.
* **body deadline** (``body_timeout_s``): from the end of the headers to the end of the body.
  The endpoint reading the body then sees the client as gone (``http.disconnect``).
* Neither bounds a response: a stream of tokens runs as long as it runs.
* **connection cap** (``max_connections``): a connection past it is closed as soon as it is
  accepted, so the process keeps descriptors for its own files, its peers and its KV transfers.
  The default is the open-file limit less :data:`RESERVED_FDS`, after ``serve`` has raised the
  soft limit to the hard one (``raise_open_file_limit``): under the common soft limit of 1,024
  the cap would be 768 connections while the hard limit allows hundreds of thousands.

An expired deadline closes the connection (a client that has not finished its request has no
response to read); it is logged at debug level, since a flood of them is the attack itself.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
from dataclasses import dataclass

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

# Descriptors kept for the process's own use beside its clients' connections: the model's files,
# connections to instances or peers, KV transfer sockets, shared memory, logs.
RESERVED_FDS = 256
MIN_CONNECTIONS = 64


def raise_open_file_limit() -> int:
    """Raise this process's soft open-file limit to its hard one (at most 1,048,576 where the
    hard one is unlimited); return the soft limit now. Only the soft limit is a default a process
    may lift on its own; the hard one is the operator's (``ulimit -Hn``, systemd's LimitNOFILE)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = 1 << 20 if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as e:  # e.g. above the kernel's nr_open
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, target, e)
            return soft
        log.info("open-file limit raised from %d to %d", soft, target)
        return target
    return soft


def default_max_connections() -> int:
    """The open-file limit less :data:`RESERVED_FDS` (at least :data:`MIN_CONNECTIONS`)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 65536
    return max(MIN_CONNECTIONS, soft - RESERVED_FDS)


@dataclass(frozen=True)
class FrontDoor:
    """The limits of one HTTP port (see the module docstring)."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int | None = None  # None: default_max_connections()

    def __post_init__(self) -> None:
        if not (self.header_timeout_s > 0 and self.body_timeout_s > 0):
            raise ValueError("the header and body timeouts must be positive")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError("max_connections must be at least 1")

    def protocol(self) -> type[H11Protocol]:
        """uvicorn's h11 protocol with this door's deadlines and cap."""
        door, cap = self, self.max_connections or default_max_connections()

        class GuardedH11Protocol(H11Protocol):
            _timer: asyncio.TimerHandle | None = None
            _phase: str | None = None

            def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
                super().connection_made(transport)
                if len(self.connections) > cap:  # this one is already counted
                    log.debug("connection from %s refused: %d open, the cap is %d", self.client,
                              len(self.connections) - 1, cap)
                    transport.close()
                    return
                self._arm()

            def data_received(self, data: bytes) -> None:
                super().data_received(data)
                self._arm()

            def on_response_complete(self) -> None:
                super().on_response_complete()
                self._arm()

            def connection_lost(self, exc: Exception | None) -> None:
                self._disarm()
                super().connection_lost(exc)

            def _arm(self) -> None:
                # The client owes the rest of a request while h11 waits for a request (IDLE) or
                # reads its body (SEND_BODY); in any other state nothing is owed.
                state = self.conn.their_state
                phase = "head" if state is h11.IDLE else "body" if state is h11.SEND_BODY else None
                if phase is None or self.transport.is_closing():
                    self._disarm()
                elif phase != self._phase:  # a deadline runs from the start of its phase
                    self._disarm()
                    self._phase = phase
                    timeout = door.header_timeout_s if phase == "head" else door.body_timeout_s
                    self._timer = self.loop.call_later(timeout, self._expire)

            def _disarm(self) -> None:
                if self._timer is not None:
                    self._timer.cancel()
                self._timer, self._phase = None, None

            def _expire(self) -> None:
                log.debug("closing the connection from %s: its request's %s took over %g s", self.client,
                          self._phase, door.header_timeout_s if self._phase == "head" else door.body_timeout_s)
                self._timer = None
                if not self.transport.is_closing():
                    self.transport.close()

        return GuardedH11Protocol


def serve(app, host: str, port: int, door: FrontDoor, *, log_level: str = "info", fd: int | None = None) -> None:
    """Run ``app`` on ``host:port`` until SIGINT / SIGTERM, behind ``door``; with ``fd``, on that
    inherited listening socket instead (the Supervisor's, which keeps the port across restarts)."""
    raise_open_file_limit()  # before the door's default cap is read from it
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5,
                            http=door.protocol())
    uvicorn.Server(config).run(sockets=None if fd is None else [socket.socket(fileno=fd)])
