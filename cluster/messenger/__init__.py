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
from .messenger import Entry, Messenger
from .errors import AuthenticationError, ChecksumError, PeerError, RdmaUnavailable, RemoteAccessError, TransferError
from .regions import RegionHandle

__all__ = [
    "AuthenticationError",
    "Batch",
    "ChecksumError",
    "Entry",
    "PeerError",
    "RdmaUnavailable",
    "RegionHandle",
    "RemoteAccessError",
    "MessengerConfig",
    "Messenger",
    "TransferError",
]
