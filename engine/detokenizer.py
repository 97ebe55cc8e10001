"""Streaming token-to-text conversion with stop-string handling for one request.

Two layers:
  * decoding: each new token is decoded together with a short window of preceding tokens and
    only the text beyond what the window already produced is taken. The window gives the
    decoder the context it needs for spaces (e.g. SentencePiece's leading-space rule), and
    its bounded length keeps the cost per token O(1). A trailing U+FFFD means the last bytes
    are an incomplete UTF-8 character (byte-level BPE can split one across tokens), so that
    character is held back until a later token completes it.
  * stop strings: decoded text is only emitted once it cannot be the beginning of a stop
    string; when a stop string appears, the output is cut right before it.

Decoding assumes the tokenizer's decoder is append-only: decoding a window plus one more
token extends the window's text rather than rewriting it. That holds for byte-level BPE,
byte-fallback and metaspace decoders.
"""

from __future__ import annotations

import tokenizers

_REPLACEMENT = "\ufffd"
# Tokens of context kept in front of new tokens. A pending incomplete character spans at most
# 3 bytes and therefore at most 3 tokens, so a window of this many tokens always contains it
# whole, and one token of left context is enough for spacing rules.
_CONTEXT_TOKENS = 6
# The window is trimmed back to _CONTEXT_TOKENS once it reaches this length, so decoding is
# one call on at most this many tokens per step plus one re-anchoring call now and then.
_MAX_WINDOW_TOKENS = 2 * _CONTEXT_TOKENS


class IncrementalDetokenizer:
    """Turns one request's sampled tokens into text pieces that are safe to stream.

    Call `add` for every sampled token and `finish` once at the end; the returned pieces
    concatenated equal `output_text` after `finish` (and at any time once `stopped`).
    `output_text` is all text decoded so far: it may run ahead of the emitted pieces by text
    held back as a possible stop-string prefix, but never contains a partial character.
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        prompt_token_ids: list[int],
        stop: list[str],
        skip_special_tokens: bool,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = list(stop)
        self._window = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        # Characters of decode(self._window) already accounted for: all of the prompt context
        # here (even a dangling partial character, which belongs to the prompt), later the
        # part of the window's text that was moved into self._text.
        self._window_chars = len(self._decode(self._window))
        self._text = ""
        self._emitted = 0  # characters of self._text handed out so far
        self._stopped = False
        self._finished = False

    @property
    def output_text(self) -> str:
        return self._text

    @property
    def stopped(self) -> bool:
        """True once a stop string was generated; the output ends right before it."""
        return self._stopped

    def add(self, token_id: int) -> str:
        """Feed one sampled token; returns the text that may be streamed now (maybe '')."""
        if self._stopped or self._finished:
            return ""
        self._window.append(token_id)
        decoded = self._decode(self._window)
        complete = self._complete_length(decoded)
        piece = decoded[self._window_chars:complete]
        self._window_chars = max(self._window_chars, complete)
        if len(self._window) >= _MAX_WINDOW_TOKENS:
            # The unconsumed tail (a pending incomplete character, if any) lies inside the
            # kept tokens, so it is the same text at the end of the shorter window's decode.
            # The cut may split an earlier character into leading U+FFFDs; those only count
            # as consumed text.
            pending = len(decoded) - self._window_chars
            self._window = self._window[-_CONTEXT_TOKENS:]
            self._window_chars = len(self._decode(self._window)) - pending
        return self._push(piece, final=False)

    def finish(self) -> str:
        """Flushes held-back text (including an incomplete character, as U+FFFD)."""
        if self._stopped or self._finished:
            return ""
        self._finished = True
        decoded = self._decode(self._window)
        return self._push(decoded[self._window_chars:], final=True)

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    @staticmethod
    def _complete_length(text: str) -> int:
        # The decoder renders an incomplete trailing byte sequence as a single U+FFFD.
        return len(text) - 1 if text.endswith(_REPLACEMENT) else len(text)

    def _push(self, piece: str, final: bool) -> str:
        """Appends decoded text, applies stop strings and returns what can be emitted."""
        self._text += piece
        # A stop string cannot start inside already emitted text: while any of its prefixes
        # was the text's tail, that tail was held back.
        cut = min(
            (at for at in (self._text.find(s, self._emitted) for s in self._stop) if at >= 0),
            default=-1,
        )
        if cut >= 0:
            self._text = self._text[:cut]
            self._stopped = True
            end = cut
        elif final:
            end = len(self._text)
        else:
            end = len(self._text) - self._stop_prefix_length()
        emitted = self._text[self._emitted:end]
        self._emitted = end
        return emitted

    def _stop_prefix_length(self) -> int:
        """Length of the longest tail of the unemitted text that begins some stop string."""
        pending = len(self._text) - self._emitted
        longest = 0
        for stop in self._stop:
            for length in range(min(len(stop) - 1, pending), longest, -1):
                if self._text.endswith(stop[:length]):
                    longest = length
                    break
        return longest
