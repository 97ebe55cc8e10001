"""The distributed KVCache pool: every node's host DRAM (and SSD) as one store of prefix blocks.

``objects`` (what an object is and how it is named), ``segment`` and ``ssd`` (one node's share:
allocation, LRU eviction to the SSD tier, read leases), ``service`` (the segment on the network:
requests over the Messenger, entries in the metadata store under the node's lease, hot-object
replication), ``client`` (find, read and store objects), ``metadata`` (etcd, or the Conductor's
embedded store), ``config``. ``python -m cluster.pool`` runs a node that only contributes memory.
"""

from cluster.pool.client import PoolClient
from cluster.pool.config import PoolConfig
from cluster.pool.objects import PoolGeometry
from cluster.pool.segment import PoolFull, Segment, SegmentConfig
from cluster.pool.service import SegmentService
from cluster.pool.ssd import SsdTier

__all__ = ["PoolClient", "PoolConfig", "PoolFull", "PoolGeometry", "Segment", "SegmentConfig", "SegmentService",
           "SsdTier"]
