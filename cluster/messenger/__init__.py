"""Messenger: the KV transfer engine (TCP, shared memory, RDMA) between engines of the cluster.

Typical use::

    engine = Messenger(MessengerConfig(secret=cluster_secret))
    kv = engine.alloc_shared(nbytes)           # or any contiguous CPU tensor / buffer
    mine = engine.register(kv)                 # RegionHandle: share theirs with to_dict()
    batch = engine.write(peer_address, [(mine, 0, theirs, 0, nbytes)])
    batch.wait(timeout=10)                     # or `await batch`
"""

from .batch import Batch
from .config import MessengerConfig
from .errors import (
    AuthenticationError,
    ChecksumError,
    PeerError,
    RdmaUnavailable,
    RemoteAccessError,
    StaleWrite,
    TransferError,
)
from .messenger import Entry, Messenger
from .regions import RegionHandle

__all__ = [
    "AuthenticationError",
    "Batch",
    "ChecksumError",
    "Entry",
    "Messenger",
    "MessengerConfig",
    "PeerError",
    "RdmaUnavailable",
    "RegionHandle",
    "RemoteAccessError",
    "StaleWrite",
    "TransferError",
]
