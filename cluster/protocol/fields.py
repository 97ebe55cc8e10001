"""Field checks for ``from_dict``: each raises ``BadRequest`` naming the field."""

from __future__ import annotations

import base64
from typing import Any

from cluster.protocol.errors import BadRequest
from engine.sampling_params import MAX_CACHE_SALT_CHARS, SamplingParams


# -- field checks (each raises BadRequest naming the field) ------------------------------------------

def _field(data: Any, name: str) -> Any:
    if not isinstance(data, dict):
        raise BadRequest("the body must be a JSON object")
    return data.get(name)


def _str(data: Any, name: str, optional: bool = False) -> str | None:
    value = _field(data, name)
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value:
        raise BadRequest(f"{name} must be a non-empty string")
    return value


def _text(data: Any, name: str) -> str:
    """A string that may be empty or missing (then empty)."""
    value = _field(data, name)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise BadRequest(f"{name} must be a string")
    return value


def _int(data: Any, name: str, default: int | None = None) -> int:
    value = _field(data, name)
    if value is None and default is not None:
        return default
    if type(value) is not int:
        raise BadRequest(f"{name} must be an integer")
    return value


def _number(data: Any, name: str) -> float:
    value = _field(data, name)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise BadRequest(f"{name} must be a number")
    return float(value)


def _dict(data: Any, name: str, optional: bool = False) -> dict[str, Any] | None:
    value = _field(data, name)
    if value is None and optional:
        return None
    if not isinstance(value, dict):
        raise BadRequest(f"{name} must be a JSON object")
    return value


def _strings(data: Any, name: str) -> list[str]:
    value = _field(data, name)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise BadRequest(f"{name} must be a list of strings")
    return value


def _keys(data: Any, name: str) -> list[bytes]:
    """Prefix keys, which travel as hex strings."""
    try:
        return [bytes.fromhex(k) for k in _strings(data, name)]
    except ValueError:
        raise BadRequest(f"{name} must be a list of hex strings") from None


def _naturals(value: Any) -> bool:
    return isinstance(value, list) and all(type(n) is int and n >= 0 for n in value)


def _ints(data: Any, name: str) -> list[int]:
    value = _field(data, name)
    if not _naturals(value):
        raise BadRequest(f"{name} must be a list of non-negative integers")
    return value


def _flag(data: Any, name: str) -> bool:
    value = _field(data, name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be true or false")
    return value


def token_ids(value: Any, name: str = "prompt_token_ids") -> list[int]:
    if not value or not _naturals(value):
        raise BadRequest(f"{name} must be a non-empty list of non-negative integers")
    return value


def _params(data: Any) -> SamplingParams:
    try:
        return SamplingParams.from_dict(_field(data, "params"))
    except (TypeError, ValueError) as e:
        raise BadRequest(f"params: {e}") from None


def _salt(data: Any) -> str | None:
    """A message's ``cache_salt`` (``SamplingParams.cache_salt``), or None when it has none."""
    value = _str(data, "cache_salt", optional=True)
    if value is not None and len(value) > MAX_CACHE_SALT_CHARS:
        raise BadRequest(f"cache_salt is over {MAX_CACHE_SALT_CHARS} characters")
    return value


def _dest(data: Any) -> dict[str, Any]:
    dest = _dict(data, "dest")
    if type(dest.get("num_blocks")) is not int or type(dest.get("skip_blocks")) is not int:
        raise BadRequest("dest must be a KV destination (with num_blocks and skip_blocks)")
    return dest


def _bytes(value: bytes | None) -> str | None:
    return None if value is None else base64.b64encode(value).decode()


def _unbytes(value: Any, name: str) -> bytes | None:
    if value is None:
        return None
    try:
        return base64.b64decode(value, validate=True)
    except (TypeError, ValueError):
        raise BadRequest(f"{name} must be base64") from None
