"""``python -m server``: the OpenAI-compatible HTTP server over one local engine.

With no arguments it serves the default model (SmolLM2-135M-Instruct) on 127.0.0.1:8000. The
socket listens at once; the model loads in the background (``/health`` answers 503 until it
is ready, then 200).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from server.app import DEFAULT_MAX_BODY_BYTES


def _env(name: str, default=None):
    value = os.environ.get(name)
    return value if value not in (None, "") else default


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m server",
        description="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, "
        "/v1/models, /health, /metrics, /stats) over the mooncake-py engine.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--host", default=_env("MOONCAKE_HOST", "127.0.0.1"),
                   help="address to listen on (env MOONCAKE_HOST)")
    p.add_argument("--port", type=int, default=int(_env("MOONCAKE_PORT", 8000)),
                   help="port to listen on (env MOONCAKE_PORT)")
    p.add_argument("--model", default=_env("MOONCAKE_MODEL"),
                   help="HF model folder or .gguf file; default: SmolLM2-135M-Instruct (env MOONCAKE_MODEL)")
    p.add_argument("--served-model-name", default=None,
                   help="name clients pass as 'model'; default: the model's folder/file name")
    p.add_argument("--kv-cache-gib", type=_positive_float,
                   default=float(v) if (v := _env("MOONCAKE_KV_CACHE_GIB")) else None,
                   help="KV cache size in GiB; default: 1 on CPU, 90%% of free memory on CUDA "
                   "(env MOONCAKE_KV_CACHE_GIB)")
    p.add_argument("--api-key", default=_env("MOONCAKE_API_KEY"),
                   help="if set, /v1 requests need 'Authorization: Bearer KEY' (env MOONCAKE_API_KEY)")
    p.add_argument("--threads", type=_positive_int, default=None,
                   help="torch intra-op threads; default: all cores")
    p.add_argument("--device", default=None, help="cpu or cuda[:N]; default: cuda if available")
    p.add_argument("--max-num-seqs", type=_positive_int, default=256,
                   help="most sequences in one batch")
    p.add_argument("--max-num-batched-tokens", type=_positive_int, default=512,
                   help="token budget of one engine step (chunked prefill)")
    p.add_argument("--max-model-len", type=_positive_int, default=None,
                   help="context length; default: the model's")
    p.add_argument("--max-waiting", type=_non_negative_int, default=256,
                   help="requests allowed to wait for their first token; beyond it: HTTP 429")
    p.add_argument("--max-body-bytes", type=_positive_int, default=DEFAULT_MAX_BODY_BYTES,
                   help="largest request body accepted; beyond it: HTTP 413")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import uvicorn

    from engine.config import EngineConfig
    from server.app import ServerSettings, build_app
    from server.async_engine import AsyncLLMEngine

    config_kwargs = dict(
        model=args.model, kv_cache_gib=args.kv_cache_gib, threads=args.threads,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
    )
    if args.device:
        config_kwargs["device"] = args.device
    try:
        config = EngineConfig(**config_kwargs)
    except ValueError as e:
        sys.exit(f"error: {e}")
    client = AsyncLLMEngine(config, served_model_name=args.served_model_name, max_waiting=args.max_waiting)
    app = build_app(client, ServerSettings(api_key=args.api_key, max_body_bytes=args.max_body_bytes))
    logging.getLogger(__name__).info(
        "serving %r on http://%s:%d (model loads in the background; /health is 503 until ready)",
        client.model_name, args.host, args.port,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=5)


if __name__ == "__main__":
    main()
