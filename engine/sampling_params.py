"""Per-request sampling parameters, validated once when a request is admitted.

Validation happens here so that the sampler, detokenizer and scheduler can trust every
field (types, ranges, finiteness) without re-checking on the per-step hot path.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, fields
from typing import Any

from engine.structured_output import check_spec

# torch.Generator.manual_seed accepts exactly this range (signed 64-bit lows, unsigned highs).
_SEED_MIN = -(2**63)
_SEED_MAX = 2**64 - 1
_MAX_LOGPROBS = 20
# OpenAI allows a bias from -100 (the token is never picked) to 100 (it almost always is).
_MAX_BIAS = 100.0
MAX_LOGIT_BIAS = 1024  # tokens a request may bias (each one is a scatter in every step)


def _real(name: str, value: Any) -> float:
    # bool is an int subclass; a stray `true` in JSON must not silently become 1.0.
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    result = float(value)
    if not math.isfinite(result):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return result


def _integer(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    return int(value)


def _boolean(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a boolean, got {value!r} ({type(value).__name__})")
    return value


def _stop_strings(value: Any) -> list[str]:
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        raise ValueError(f"stop must be a string, a list of strings or None, got {value!r}")
    for item in items:
        if not isinstance(item, str) or not item:
            raise ValueError(f"stop must contain only non-empty strings, got {item!r}")
    return list(items)


def _logit_bias(value: Any) -> dict[int, float] | None:
    """Token id -> bias; ids may come as strings (JSON object keys: OpenAI's shape, and the wire's)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"logit_bias must be an object of token id -> bias, got {type(value).__name__}")
    if len(value) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias may name at most {MAX_LOGIT_BIAS} tokens, got {len(value)}")
    bias = {}
    for key, b in value.items():
        token = int(key) if isinstance(key, str) and key.isdigit() else key
        token = _integer("logit_bias token id", token)
        if token < 0:
            raise ValueError(f"logit_bias token ids must be non-negative, got {token}")
        b = _real("logit_bias value", b)
        if not -_MAX_BIAS <= b <= _MAX_BIAS:
            raise ValueError(f"logit_bias values must be in [-{_MAX_BIAS:g}, {_MAX_BIAS:g}], got {b}")
        bias[token] = b
    return bias or None


def _token_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"stop_token_ids must be a list of integers, got {value!r}")
    ids = [_integer("stop_token_ids", item) for item in value]
    for token_id in ids:
        if token_id < 0:
            raise ValueError(f"stop_token_ids must be non-negative, got {token_id}")
    return ids


# A salt is hashed once per request; a bound keeps a body from making that the work.
MAX_CACHE_SALT_CHARS = 1024


@dataclass
class SamplingParams:
    """How to pick the next token and when to stop, following OpenAI/vLLM conventions.

    After construction `stop` is always a list of non-empty strings and numeric fields hold
    plain Python floats/ints, whatever numeric types were passed in.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int = 16
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # EOS (unless ignore_eos) and stop_token_ids cannot be sampled, nor stop strings end the
    # request, before this many tokens (vLLM's min_tokens).
    min_tokens: int = 0
    # Added to the logits of these token ids before sampling (OpenAI's logit_bias).
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    # Score the prompt too: each prompt token's logprob (the first has none) with this many top
    # alternatives, raw (the model's log-softmax, before penalties and temperature). None: off.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # Not about sampling, but it travels wherever a request's parameters do: the prompt's KV is
    # cached and looked up under this salt only (``paged_kv.prefix_keys.salt_root``), as vLLM's
    # ``cache_salt``. The server sets it per user under ``--cache-scope per-key``.
    cache_salt: str | None = None
    # The answer held to a JSON schema, a regex, a choice or a grammar (vLLM's structured_outputs:
    # exactly one of json, json_object, regex, choice, grammar; engine/structured_output.py).
    structured_outputs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.temperature = _real("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")

        self.top_p = _real("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

        self.top_k = _integer("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or >= 1, got {self.top_k}")

        self.min_p = _real("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

        self.max_tokens = _integer("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")

        self.stop = _stop_strings(self.stop)
        self.stop_token_ids = _token_ids(self.stop_token_ids)
        self.ignore_eos = _boolean("ignore_eos", self.ignore_eos)
        self.min_tokens = _integer("min_tokens", self.min_tokens)
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        self.logit_bias = _logit_bias(self.logit_bias)

        if self.seed is not None:
            self.seed = _integer("seed", self.seed)
            if not _SEED_MIN <= self.seed <= _SEED_MAX:
                raise ValueError(f"seed must be in [{_SEED_MIN}, {_SEED_MAX}], got {self.seed}")

        for name in ("presence_penalty", "frequency_penalty"):
            value = _real(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
            setattr(self, name, value)

        self.repetition_penalty = _real("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")

        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                value = _integer(name, value)
                if not 0 <= value <= _MAX_LOGPROBS:
                    raise ValueError(f"{name} must be None or in [0, {_MAX_LOGPROBS}], got {value}")
                setattr(self, name, value)

        self.skip_special_tokens = _boolean("skip_special_tokens", self.skip_special_tokens)

        if self.structured_outputs is not None:
            check_spec(self.structured_outputs)

        if self.cache_salt is not None:
            if not isinstance(self.cache_salt, str) or not 0 < len(self.cache_salt) <= MAX_CACHE_SALT_CHARS:
                raise ValueError(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} "
                                 "characters")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        """Build from a request body's fields; unknown keys are an error, not ignored."""
        if not isinstance(d, dict):
            raise ValueError(f"sampling parameters must be a dict, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(key) for key in d if key not in known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        return cls(**d)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
