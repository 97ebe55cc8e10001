"""How much of a prompt's prefix the KVCache pool holds, as the Conductor's placement asks it.

The pool is a cache: a lookup that fails or does not answer within a second counts as nothing
held (the instance still loads what it finds), and after a failure the pool is not asked again
for a second, so that lookups do not queue behind a hung one. Calls run on the Conductor's pool
threads, never the default executor's few.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Executor

from cluster.conductor.registry import Registry
from cluster.pool.index import PoolIndex
from cluster.pool.objects import object_keys

log = logging.getLogger(__name__)

LOOKUP_TIMEOUT_S = 1.0


class PoolLookup:
    def __init__(self, pool: PoolIndex | None, registry: Registry, threads: Executor) -> None:
        self._pool = pool
        self._registry = registry
        self._threads = threads
        self._down_until = 0.0

    async def blocks(self, prefix_keys: list[bytes]) -> int:
        """Engine blocks of the leading ``prefix_keys`` the pool holds; 0 without a pool, or when
        its metadata does not answer within ``LOOKUP_TIMEOUT_S``."""
        records = [r for r in self._registry.records if r.up and r.layout is not None and r.info.pool is not None]
        if self._pool is None or not records:
            return 0
        namespace, per_object = records[0].info.pool.namespace, records[0].info.pool.blocks_per_object
        keys = object_keys(namespace, prefix_keys, per_object)
        if not keys:
            return 0
        if time.monotonic() < self._down_until:
            return 0  # it failed a moment ago: do not queue a lookup behind the hung one
        try:
            run = await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(
                self._threads, self._pool.lookup, keys), LOOKUP_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 -- the pool is a cache: no error of it fails a request
            self._down_until = time.monotonic() + LOOKUP_TIMEOUT_S
            log.warning("pool lookup failed; placing without it: %s", exc)
            return 0
        return len(run) * per_object
