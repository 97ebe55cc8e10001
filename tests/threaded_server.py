"""An ASGI app served by uvicorn on a free loopback port, in a thread of the test process."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import uvicorn


@contextlib.contextmanager
def serve_in_thread(app, sock: socket.socket | None = None, **config) -> Iterator[int]:
    """Serve ``app`` (``uvicorn.Config`` keyword arguments in ``config``) until the block ends, on
    ``sock`` (bound already: the app may need its address) or a free loopback port; yields the port."""
    if sock is None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", **config))
    th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.started, "the test server did not start within 10 s"
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        th.join(timeout=10)
        sock.close()
