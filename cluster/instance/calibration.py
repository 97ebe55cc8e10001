"""Calibrating the Conductor's cost models on the instance itself, at start.

FAST'25 predicts TTFT with a prefill-time model fitted on offline profiling (§5.1); we profile
each instance when it starts, on its own engine, so the Conductor's predictions are in this
machine's seconds. Prefill: prompts of a few lengths, each from scratch and again behind a cached
prefix, timed as the engine step that computes them (``PrefillCostModel.fit``). Decode: steps of
batches of a few sizes and contexts (a least-squares fit of ``DecodeStepModel``).

Runs on the engine thread (``AsyncLLMEngine.call``) before the instance takes requests. Profile
prompts are random token ids; their blocks stay in the prefix cache as ordinary evictable blocks.

Measuring takes about a minute on a busy CPU, paid again by every restart, so ``cached_profile``
keeps each measured profile on disk under a key of everything the timings depend on
(``cache_key``) and loads it when an instance starts with the same key. The cache is a directory
of one JSON file per key: ``$MOONCAKE_CALIBRATION_CACHE``, else ``calibration/`` under
``$MOONCAKE_CACHE_DIR``, ``$XDG_CACHE_HOME/mooncake-py`` or ``~/.cache/mooncake-py``. Instances
that start together with the same key measure once: the first holds a lock file beside the
profile's, the others wait for it and load what it saved.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import random
import struct
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import filelock
import numpy as np
import torch

from cluster.policies.cost_model import DecodeStepModel, InstanceProfile, PrefillCostModel
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

# Bump whenever the procedure below changes what it measures or how it fits: older cached
# profiles then miss.
CALIBRATION_VERSION = 2
CACHE_ENV = "MOONCAKE_CALIBRATION_CACHE"
# How long an instance waits for another one measuring the same key (``_measuring_once``) before
# it measures for itself: longer than a measurement takes on a busy CPU.
MEASURING_WAIT_S = 300.0

# /proc/cpuinfo fields naming the core and its instruction sets (x86, then Arm); not the clock
# or microcode lines, which change without changing what a step costs.
_CPU_FIELDS = ("vendor_id", "cpu family", "model", "model name", "flags",
               "CPU implementer", "CPU architecture", "CPU variant", "CPU part", "Features")


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def _run_alone(engine: LLMEngine) -> tuple[float, list[RequestOutput]]:
    """Seconds of the steps until the engine is idle (nothing else runs during calibration), and
    what they produced."""
    outputs = []
    start = time.perf_counter()
    while engine.has_unfinished():
        outputs += engine.step()
    return time.perf_counter() - start, outputs


def profile(engine: LLMEngine, seed: int = 0) -> InstanceProfile:
    """Calibrate through the engine's public API only: requests in, step outputs and statistics out."""
    if engine.has_unfinished():
        raise RuntimeError("calibrate an idle engine")
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    budget = engine.config.max_num_batched_tokens
    capacity = engine.stats().num_blocks * engine.config.block_size
    limit = min(budget, engine.max_model_len - 2, capacity // 2)
    lengths = sorted({max(8, n) for n in (32, limit // 4, limit // 2, limit)})
    ns, ps, ts = [], [], []
    _warm_up(engine, rng, vocab, one)
    for n in lengths:
        prompt = _prompt(rng, n, vocab)
        engine.add_request(prompt, one)
        ns.append(n), ps.append(0), ts.append(_run_alone(engine)[0])
        # The same prompt's first half is now cached: a request sharing it computes the rest.
        half = n // 2
        engine.add_request(prompt[:half] + _prompt(rng, n - half, vocab), one)
        t, (out,) = _run_alone(engine)
        ns.append(n), ps.append(out.num_cached_tokens), ts.append(t)
    prefill = PrefillCostModel.fit(ns, ps, ts)

    decode = None
    if engine.config.role != "prefill":
        rows, times = [], []
        for batch in (1, 4, 16):
            for context in (32, min(256, limit)):
                if batch * (context + 8) > capacity:
                    continue
                # One shared prompt but for its last token: the prefix cache keeps the prefills
                # cheap, and each sequence still attends over its whole context.
                shared = _prompt(rng, context - 1, vocab)
                generated = {}  # request id -> tokens generated so far
                for _ in range(batch):
                    rid = engine.add_request(shared + _prompt(rng, 1, vocab),
                                             SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
                    generated[rid] = 0
                while not all(generated.values()):
                    for out in engine.step():  # the prefills
                        generated[out.request_id] += len(out.new_token_ids)
                step_times = []
                while engine.has_unfinished():
                    tokens = sum(context + n for n in generated.values())
                    start = time.perf_counter()
                    outputs = engine.step()
                    step_times.append(time.perf_counter() - start)
                    rows.append((1.0, batch, tokens))
                    for out in outputs:
                        generated[out.request_id] += len(out.new_token_ids)
                times.extend(step_times)
        coef, *_ = np.linalg.lstsq(np.asarray(rows, dtype=np.float64), np.asarray(times), rcond=None)
        base, per_seq, per_token = (float(max(c, 0.0)) for c in coef)
        decode = DecodeStepModel(base, per_seq, per_token, capacity)
    return InstanceProfile(prefill, decode)


def _warm_up(engine: LLMEngine, rng: random.Random, vocab: int, params: SamplingParams) -> None:
    # First steps pay for lazy allocations and kernel selection; keep them out of the fit.
    engine.add_request(_prompt(rng, 16, vocab), params)
    _run_alone(engine)


def cache_dir() -> Path:
    """The directory of cached profiles (see the module docstring)."""
    if env := os.environ.get(CACHE_ENV):
        return Path(env).expanduser()
    if env := os.environ.get("MOONCAKE_CACHE_DIR"):
        return Path(env).expanduser() / "calibration"
    xdg = os.environ.get("XDG_CACHE_HOME")
    # The XDG spec says to ignore a relative XDG_CACHE_HOME.
    root = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return root / "mooncake-py" / "calibration"


def weights_digest(model_path: str | Path) -> str:
    """A digest of what the model's step times depend on: its config.json and the headers of its
    safetensors files (every tensor's name, dtype, shape and offsets), not the weights' values.

    Hashing the whole files would read gigabytes at every start, the cost the cache is there to
    avoid; names, sizes and mtimes would miss on a mere copy or touch and could still match a
    different layout of the same size. Two checkpoints with equal headers run the same kernels on
    the same shapes, so they share a profile (a fine-tune of the same shapes times the same).
    """
    folder = Path(model_path)
    h = hashlib.sha256()
    h.update((folder / "config.json").read_bytes())
    for path in sorted(folder.glob("*.safetensors")):
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            h.update(path.name.encode() + b"\0" + f.read(length))
    return h.hexdigest()


def _cpu() -> dict[str, str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            first = f.read().split("\n\n", 1)[0]  # the first processor's block
    except OSError:
        return {"machine": platform.machine(), "processor": platform.processor()}
    fields = {}
    for line in first.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() in _CPU_FIELDS:
            fields[name.strip()] = value.strip()
    return fields


def cache_key(engine: LLMEngine, seed: int = 0) -> dict[str, Any]:
    """Everything a profile depends on, as JSON would read it back (tuples become lists)."""
    cfg = engine.config
    cuda = cfg.device.startswith("cuda")
    key = {
        "calibration_version": CALIBRATION_VERSION,
        "weights": weights_digest(engine.model_path),
        "dtype": cfg.dtype, "quantization": cfg.quantization, "kv_cache_dtype": cfg.kv_cache_dtype,
        "deterministic": cfg.deterministic,
        "device": cfg.device, "gpu": torch.cuda.get_device_name(cfg.device) if cuda else None,
        "threads": cfg.threads, "role": cfg.role, "stage": cfg.stage,
        # The step budget and the cache's size pick the profiled lengths and batches; the
        # capacity is also part of the decode model.
        "max_num_batched_tokens": cfg.max_num_batched_tokens, "max_num_seqs": cfg.max_num_seqs,
        "prefill_chunk_tokens": cfg.prefill_chunk_tokens, "chunk_min_prompt_tokens": cfg.chunk_min_prompt_tokens,
        "enable_prefix_caching": cfg.enable_prefix_caching, "block_size": cfg.block_size,
        "num_blocks": engine.stats().num_blocks, "max_model_len": engine.max_model_len,
        "seed": seed, "cpu": _cpu(), "torch": torch.__version__,
    }
    return json.loads(json.dumps(key))


def cache_path(key: dict[str, Any]) -> Path:
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return cache_dir() / f"{name}.json"


def _load(path: Path, key: dict[str, Any], recalibrate_after: float | None) -> InstanceProfile | None:
    """The cached profile at ``path``, or None (with a warning when the file is there but unusable)."""
    try:
        with path.open(encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("ignoring unreadable calibration cache %s (%s); measuring again", path, e)
        return None
    try:
        if data["key"] != key:
            log.warning("calibration cache %s is for another configuration; measuring again", path)
            return None
        if recalibrate_after is not None and float(data["measured_at"]) < recalibrate_after:
            log.info("calibration cache %s predates --recalibrate; measuring again", path)
            return None
        return InstanceProfile.from_dict(data["profile"])
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        log.warning("ignoring corrupt calibration cache %s (%r); measuring again", path, e)
        return None


def _save(path: Path, key: dict[str, Any], prof: InstanceProfile, seconds: float) -> None:
    # A temporary file renamed into place: a reader (another instance starting) sees the old
    # file or the whole new one, never half of it.
    data = {"key": key, "profile": prof.to_dict(), "measured_at": time.time(), "seconds": seconds}
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp",
                                         delete=False, encoding="utf-8") as f:
            tmp = f.name
            json.dump(data, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        log.warning("could not save the calibration to %s: %s", path, e)
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


@contextmanager
def _measuring_once(path: Path) -> Iterator[None]:
    """Held while this process measures the profile cached at ``path``: an exclusive lock on a file
    beside it, which other instances with the same key wait for (at most ``MEASURING_WAIT_S``).

    Instances started together on one host with the same key (a Conductor's prefill instances, or
    its decode instances) would otherwise all measure at once: each measurement slows the others
    and times a machine busier than it will be. The kernel drops the lock when its holder exits,
    killed or not; a holder that is stuck is waited out.
    """
    lock_path = path.with_name(f".{path.stem}.lock")
    lock = filelock.FileLock(lock_path, preserve_lock_file=True)  # removing it could race a waiter
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock.acquire(timeout=MEASURING_WAIT_S, poll_interval=0.1)
    except filelock.Timeout:
        log.warning("another instance has been measuring %s for over %.0f s; measuring here as well",
                    path, MEASURING_WAIT_S)
    except OSError as e:  # an unwritable cache: nothing to share with the others anyway
        log.warning("could not open the calibration lock %s: %s; measuring without it", lock_path, e)
    try:
        yield
    finally:
        if lock.is_locked:
            lock.release()


def cached_profile(engine: LLMEngine, seed: int = 0, recalibrate_after: float | None = None) -> InstanceProfile:
    """The engine's profile from the cache, else measured (``profile``) and cached; another
    instance measuring the same key at the time is waited for (``_measuring_once``) and its
    profile loaded.

    ``recalibrate_after``: a Unix time; a profile cached before it is measured again (``--recalibrate``).
    """
    key = cache_key(engine, seed)
    path = cache_path(key)
    prof = _load(path, key, recalibrate_after)
    if prof is None:
        with _measuring_once(path):
            # Whoever held the lock before has saved its profile by now.
            prof = _load(path, key, recalibrate_after)
            if prof is None:
                started = time.perf_counter()
                prof = profile(engine, seed)
                seconds = time.perf_counter() - started
                _save(path, key, prof, seconds)
                log.info("calibration measured in %.1f s, cached at %s: %s", seconds, path, prof)
                return prof
    log.info("calibration loaded from %s: %s", path, prof)
    return prof
