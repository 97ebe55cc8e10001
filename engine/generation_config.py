"""A model's ``generation_config.json``: the EOS ids it ends on and the sampling defaults it ships.

Model authors publish the sampling they tested with (Qwen3: temperature 0.6, top_p 0.95, top_k 20);
the server applies those fields a request leaves out (``--generation-config auto``, vLLM's default
too). Only sampling fields are taken; a malformed value is an error at load, not a silent default.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

# The generation_config.json fields that are request defaults, and the range each may take.
SAMPLING_FIELDS = {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0), "top_k": (-1, None), "min_p": (0.0, 1.0),
                   "repetition_penalty": (0.0, 2.0)}


@dataclass(frozen=True)
class GenerationConfig:
    eos_token_ids: tuple[int, ...] = ()
    sampling_defaults: dict[str, float] = field(default_factory=dict)


def read_generation_config(folder: str | Path) -> GenerationConfig:
    """The folder's generation config (empty without the file). Raises ValueError for a field
    of the wrong type or out of range."""
    path = Path(folder) / "generation_config.json"
    if not path.is_file():
        return GenerationConfig()
    data = json.loads(path.read_text())
    eos = data.get("eos_token_id")
    eos_ids = tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])
    defaults = {}
    for name, (lo, hi) in SAMPLING_FIELDS.items():
        value = data.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or value < lo or (hi is not None and value > hi):
            raise ValueError(f"{path}: {name} must be a number in [{lo}, {hi if hi is not None else 'inf'}], "
                             f"got {value!r}")
        defaults[name] = int(value) if name == "top_k" else float(value)
    if data.get("do_sample") is False:  # transformers' greedy switch: its temperature is then unused
        defaults["temperature"] = 0.0
    return GenerationConfig(eos_ids, defaults)
