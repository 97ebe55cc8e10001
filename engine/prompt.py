"""Checking a prompt before it is queued: the same rules for the engine and for the Conductor,
which validates once at the front door so that an instance never gets a request it must refuse."""

from __future__ import annotations

from engine.tokenizer import Tokenizer


def prompt_token_ids(prompt: str | list[int], tokenizer: Tokenizer, vocab_size: int) -> list[int]:
    """A prompt (text or token ids) as token ids; ValueError if empty or out of the vocabulary."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty")
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, (list, tuple)):
        ids = list(prompt)
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
                raise ValueError(f"prompt token id {t!r} is not an integer in [0, {vocab_size})")
    else:
        raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
    if not ids:
        raise ValueError("prompt is empty")
    return ids


def check_fits(num_prompt_tokens: int, max_tokens: int, limit: int, what: str) -> None:
    """ValueError unless prompt + max_tokens fits in ``limit`` tokens of ``what``."""
    total = num_prompt_tokens + max_tokens
    if total > limit:
        raise ValueError(
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} exceeds "
            f"{what} of {limit} tokens"
        )
