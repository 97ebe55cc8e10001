"""A minimal paged-KV inference engine for Llama-family models.

The names below load on first use (PEP 562): ``import engine.outputs`` or
``engine.sampling_params`` (plain data, what the Conductor and the wire need) must not pull in
torch, triton and the model code.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "LLM": "engine.llm",
    "GenerationResult": "engine.llm",
    "EngineConfig": "engine.config",
    "ModelConfig": "engine.model_config",
    "LLMEngine": "engine.llm_engine",
    "RequestOutput": "engine.outputs",
    "SamplingParams": "engine.sampling_params",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
