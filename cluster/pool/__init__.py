"""The distributed KVCache pool: every node's host DRAM (and SSD) as one store of prefix blocks.

``objects`` (what an object is and how it is named), ``segment`` and ``ssd`` (one node's share:
allocation, LRU eviction to the SSD tier, read leases), ``service`` (the segment on the network:
requests over the Messenger, entries in the metadata store under the node's lease, hot-object
replication), ``messages`` (what clients and segments say over the Messenger), ``index`` (which
segments hold which objects, read from the metadata: all the Conductor needs), ``client``
(find, read and store objects), ``metadata`` (etcd, or the Conductor's embedded store),
``config``. ``python -m cluster.pool`` runs a node that only contributes memory.

The names below load on first use (PEP 562): ``import cluster.pool.index`` (the Conductor's)
must not pull in the Messenger and torch with the segment and the client.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "PoolClient": "cluster.pool.client",
    "PoolConfig": "cluster.pool.config",
    "PoolFull": "cluster.pool.segment",
    "PoolGeometry": "cluster.pool.objects",
    "PoolIndex": "cluster.pool.index",
    "Segment": "cluster.pool.segment",
    "SegmentConfig": "cluster.pool.segment",
    "SegmentService": "cluster.pool.service",
    "SsdTier": "cluster.pool.ssd",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'cluster.pool' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
