"""Run a Messenger that serves one registered region, for peers, tests and the benchmark.

    MOONCAKE_PY_TRANSFER_SECRET=<hex> python -m cluster.messenger --bytes 268435456 [--shared]

Prints one JSON line (``address`` and the region's ``handle``), then answers commands on stdin,
one per line: ``digest`` prints the region's xxh3-128 digest (so a test can check every byte
without moving them back), ``quit`` or end of input stops. The secret comes from the environment
so it never shows in a process listing.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import numpy as np
import torch
import xxhash

from .config import MessengerConfig
from .messenger import Messenger

SECRET_ENV = "MOONCAKE_PY_TRANSFER_SECRET"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster.messenger", description=__doc__.split("\n\n")[0])
    parser.add_argument("--bytes", type=int, required=True, help="size of the served region")
    parser.add_argument("--shared", action="store_true", help="allocate it in shared memory (same-host peers map it)")
    parser.add_argument("--fill-seed", type=int, help="fill it with numpy's random bytes for this seed")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--streams", type=int, default=MessengerConfig.streams)
    parser.add_argument("--timeout", type=float, default=MessengerConfig.timeout_s)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", stream=sys.stderr)
    secret = os.environ.get(SECRET_ENV)
    if not secret:
        parser.error(f"set {SECRET_ENV} to the cluster secret (hex)")
    config = MessengerConfig(
        secret=bytes.fromhex(secret), host=args.host, port=args.port, streams=args.streams, timeout_s=args.timeout
    )
    with Messenger(config) as engine:
        region = engine.alloc_shared(args.bytes) if args.shared else torch.zeros(args.bytes, dtype=torch.uint8)
        if args.fill_seed is not None:
            region.copy_(torch.from_numpy(np.random.default_rng(args.fill_seed).integers(0, 256, args.bytes, dtype=np.uint8)))
        handle = engine.register(region)
        print(json.dumps({"address": engine.address, "handle": handle.to_dict(), "rdma": engine.rdma_status}), flush=True)
        for line in sys.stdin:
            command = line.strip()
            if command == "digest":
                print(json.dumps({"digest": xxhash.xxh3_128_hexdigest(region.numpy())}), flush=True)
            elif command == "quit":
                break
            elif command:
                print(json.dumps({"error": f"unknown command {command!r}"}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
