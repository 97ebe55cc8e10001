"""The model's tokenizer (``tokenizer.json``), its special tokens, EOS ids and chat template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from engine.chat_template import ChatTemplates
from engine.generation_config import read_generation_config
from engine.structured_output import GrammarCompiler


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json stores special tokens either as strings or as AddedToken dicts.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    def __init__(self, folder: str | Path, eos_token_ids: tuple[int, ...] = ()):
        folder = Path(folder)
        # What loads this tokenizer again in another process (server.parse_worker).
        self.source = (str(folder), tuple(eos_token_ids))
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"model folder {folder} has no tokenizer.json")
        self.hf = HFTokenizer.from_file(str(path))
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.pad_token = _token_text(config.get("pad_token"))
        self.templates = ChatTemplates(folder, config)
        generation = read_generation_config(folder)
        # The sampling the model ships with (``--generation-config auto`` applies it to requests).
        self.sampling_defaults = generation.sampling_defaults
        eos = set(eos_token_ids) | set(generation.eos_token_ids)
        if self.eos_token is not None and self.hf.token_to_id(self.eos_token) is not None:
            eos.add(self.hf.token_to_id(self.eos_token))
        self.eos_token_ids = frozenset(eos)
        self._grammars: GrammarCompiler | None = None

    @property
    def chat_template(self) -> str | None:
        """The chat template a request without tools is rendered with (None: the model has none)."""
        return self.templates.default

    @property
    def grammars(self) -> GrammarCompiler:
        """Structured-output specs compiled for this tokenizer (made at first use)."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(self)
        return self._grammars

    def info(self, max_model_len: int) -> dict[str, Any]:
        """What a client needs to tokenize as the server does (vLLM's ``/tokenizer_info`` keys)."""
        return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": self.bos_token,
                "eos_token": self.eos_token, "pad_token": self.pad_token, "chat_template": self.chat_template,
                "model_max_length": max_model_len, "vocab_size": self.vocab_size}

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, *, tools: list | None = None,
        override: str | None = None, kwargs: dict[str, Any] | None = None,
    ) -> str:
        """Render ``messages`` with the model's chat template (``engine/chat_template.py``; the
        operator's ``override`` instead when given). Raises ``ChatTemplateError`` (a ValueError)."""
        return self.templates.render(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                     override=override, bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                                     kwargs=kwargs)
