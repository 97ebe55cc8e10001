"""Waiting for a condition in the tests that drive real processes."""

from __future__ import annotations

import time
from collections.abc import Callable


def until(predicate: Callable[[], object], within_s: float, what: str, every_s: float = 0.5) -> object:
    """Poll ``predicate`` until it returns something true (which is returned); fail the test
    after ``within_s`` seconds, naming ``what`` was awaited."""
    deadline = time.monotonic() + within_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(every_s)
    return value
