"""``python -m server``: the OpenAI-compatible HTTP server, and the cluster's processes.

Three ways to run it:

* ``python -m server`` (``--mode disaggregated``, the default): the Conductor serves the OpenAI
  API on 127.0.0.1:8000 and starts one prefill and one decode instance of the default model
  (SmolLM2-135M-Instruct) on this machine, each with its share of the cores; KV moves between
  them through shared memory. ``--prefill-instances`` / ``--decode-instances`` change the
  counts (0 and 0: instances started elsewhere register with ``--conductor``).
* ``python -m server --mode colocated``: one engine does prefill and decode (the baseline).
* ``python -m server --role prefill|decode|both --conductor URL``: one instance process.

The socket listens at once; models load in the background (``/health`` answers 503 until the
server can serve, then 200).

The cluster secret (which the Conductor and its instances derive their keys from) comes from
``MOONCAKE_CLUSTER_SECRET`` or ``--cluster-secret-file``; ``--cluster-secret`` still works but
puts it where every user of the machine can read it (``ps``).

The flags are ``server/cli.py``'s; what each role runs is ``server/launch.py``'s.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from engine.chat_template import ChatTemplateError, check_template
from server import launch
from server.app import ServerSettings
from server.cli import SECRET_ENV, parse_args, read_cluster_secret, read_keys


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per control or metadata call otherwise

    try:
        secret = read_cluster_secret(args)
    except ValueError as e:
        sys.exit(f"error: {e}")
    if args.stage is not None:
        if args.role != "prefill" or not args.group or args.cpp_stages > 1:
            sys.exit("error: --stage needs --role prefill and --group NAME (and no --cpp-stages)")
        if (args.stage[0] > 0) != (args.first is not None):
            sys.exit("error: a later stage (--stage I/X, I > 0) needs --first URL; stage 0 takes none")
    if args.role is not None and secret is None:
        what = "a pipeline stage" if args.stage is not None and args.stage[0] > 0 else "an instance"
        sys.exit(f"error: {what} needs the cluster secret: set {SECRET_ENV} or pass --cluster-secret-file")
    if args.role is not None and args.stage is not None and args.stage[0] > 0:
        launch.serve_stage(args, secret)
        return
    # Taken: a process this one starts must not think the socket its own (it is not passed on).
    os.environ.pop("MOONCAKE_LISTEN_FD", None)
    try:
        api_keys, operator_key = read_keys(args)
    except ValueError as e:
        sys.exit(f"error: {e}")
    if args.cache_scope not in ("per-key", "shared"):  # argparse leaves an env default unchecked
        sys.exit(f"error: MOONCAKE_CACHE_SCOPE must be per-key or shared, not {args.cache_scope!r}")
    chat_template = None
    if args.chat_template is not None:
        try:
            chat_template = Path(args.chat_template).read_text()
            check_template(chat_template)  # a broken file stops the start, not each request
        except (OSError, UnicodeDecodeError, ChatTemplateError) as e:
            sys.exit(f"error: --chat-template {args.chat_template}: {e}")
    settings = ServerSettings(api_keys=api_keys, operator_key=operator_key, max_user_priority=args.max_user_priority,
                              cache_scope=args.cache_scope, allowed_origins=tuple(args.allowed_origins),
                              generation_config=args.generation_config, chat_template=chat_template,
                              max_body_bytes=args.max_body_bytes, public_metrics=args.public_metrics)
    if args.role is not None:
        launch.serve_instance(args, secret)
    elif args.mode == "colocated":
        launch.serve_colocated(args, settings)
    else:
        launch.serve_conductor(args, secret, settings)


if __name__ == "__main__":
    main()
