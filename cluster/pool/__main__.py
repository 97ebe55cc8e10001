"""A standalone pool node: contributes DRAM (and SSD) to the KVCache pool and serves reads.

Like Mooncake's store servers, it computes nothing, so the pool's capacity grows apart from
compute. It needs the cluster secret (``MOONCAKE_CLUSTER_SECRET`` or ``--cluster-secret-file``)
and the pool's metadata: ``--etcd http://HOST:2379``, or the Conductor's embedded store
(``--metadata URL``, printed in the Conductor's log).

    python -m cluster.pool --dram-gib 4 --metadata http://127.0.0.1:PORT
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading

from cluster.protocol import MESSENGER, derive_key
from cluster.pool.client import PoolClient
from cluster.pool.config import PoolConfig
from cluster.metadata import connect_metadata
from cluster.pool.segment import Segment, SegmentConfig
from cluster.pool.service import SegmentService
from cluster.pool.ssd import SsdTier
from cluster.messenger import MessengerConfig, Messenger

log = logging.getLogger("cluster.pool")


def _secret(args: argparse.Namespace) -> bytes:
    if args.cluster_secret_file:
        with open(args.cluster_secret_file) as f:
            secret = f.read().strip()
    else:
        secret = os.environ.get("MOONCAKE_CLUSTER_SECRET", "")
    if len(secret) < 16:
        raise SystemExit("the cluster secret (MOONCAKE_CLUSTER_SECRET or --cluster-secret-file) must be "
                         "at least 16 characters")
    return secret.encode()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m cluster.pool", description=__doc__.split("\n\n")[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--etcd", metavar="URL", help="etcd endpoint holding the pool's metadata "
                       "(TLS and an etcd user: MOONCAKE_ETCD_* as in docs/serving.md)")
    where.add_argument("--metadata", metavar="URL", help="the Conductor's embedded metadata server")
    p.add_argument("--dram-gib", type=float, default=4.0, help="DRAM this node contributes (4)")
    p.add_argument("--ssd-dir", default=None, help="directory of this node's SSD tier")
    p.add_argument("--ssd-gib", type=float, default=0.0, help="size of the SSD tier")
    p.add_argument("--host", default="127.0.0.1", help="address the Messenger listens on")
    p.add_argument("--transfer-timeout-s", type=float, default=30.0)
    p.add_argument("--session-retention-s", type=float, default=SegmentConfig.session_retention_s,
                   help="how long a session's objects stay ahead of colder ones in DRAM (0: off)")
    p.add_argument("--session-retention-share", type=float, default=SegmentConfig.retained_share,
                   help="at most this share of DRAM is held for sessions")
    p.add_argument("--cluster-secret-file", default=None)
    p.add_argument("--log-level", default="info")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per metadata call otherwise
    config = PoolConfig(metadata_url=args.etcd or args.metadata, etcd=args.etcd is not None,
                        dram_gib=args.dram_gib, ssd_dir=args.ssd_dir, ssd_gib=args.ssd_gib)
    if not config.dram_bytes:
        raise SystemExit("a pool node must contribute some DRAM (--dram-gib > 0)")
    secret = _secret(args)
    transfer = Messenger(MessengerConfig(secret=derive_key(secret, MESSENGER), host=args.host,
                                             timeout_s=args.transfer_timeout_s))
    metadata = connect_metadata(config.metadata_url, secret, etcd=config.etcd)
    ssd = SsdTier(config.ssd_dir, config.ssd_bytes) if config.ssd_dir else None
    client = PoolClient(transfer, metadata, transfer_timeout_s=args.transfer_timeout_s)
    segment = Segment(transfer, SegmentConfig(config.dram_bytes, session_retention_s=args.session_retention_s,
                                              retained_share=args.session_retention_share), ssd)
    service = SegmentService(segment, transfer, metadata, client,
                             "node", lease_ttl_s=config.lease_ttl_s)
    log.info("pool node %s: %g GiB of DRAM%s at %s", service.segment_id, args.dram_gib,
             f", {args.ssd_gib:g} GiB of SSD in {args.ssd_dir}" if ssd else "", transfer.address)
    print(f"pool node ready: {service.segment_id} at {transfer.address}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    service.close()
    metadata.close()
    transfer.close()


if __name__ == "__main__":
    main()
