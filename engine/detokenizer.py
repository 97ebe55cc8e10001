"""Streaming token-to-text conversion with stop-string handling for one request.

Two layers:
  * decoding: each new token is decoded together with a short window of preceding tokens and
    only the text beyond what the window already produced is taken. The window gives the
    decoder the context it needs for spaces (e.g. SentencePiece's leading-space rule), and
    its bounded length keeps the cost per token O(1). Trailing U+FFFDs may be the bytes of an
    incomplete UTF-8 character (a token can end inside one), so they are held back until a
    later token completes the character, or until it is clear they never will.
  * stop strings: decoded text is only emitted once it cannot be the beginning of a stop
    string; when a stop string appears, the output is cut right before it.

Decoders render an incomplete character differently: byte-level BPE (GPT-2, Llama 3, Qwen) as
one U+FFFD, a ByteFallback decoder (Llama 2, Mistral) as one U+FFFD per byte, and for the whole
run of consecutive byte tokens it belongs to, complete characters included. So the window may
start inside a character only where the text after it still decodes intact: a run of byte
tokens cut mid-character decodes to U+FFFDs throughout.

Decoding assumes the tokenizer's decoder is append-only apart from that: decoding a window plus
one more token extends the window's text rather than rewriting it. That holds for byte-level
BPE, byte-fallback and metaspace decoders.
"""

from __future__ import annotations

import tokenizers

_REPLACEMENT = "\ufffd"
# Tokens of context kept in front of new tokens when the window is trimmed. One token of left
# context is enough for spacing rules; more leaves room to find a cut at a character boundary.
_CONTEXT_TOKENS = 6
# The window is trimmed back to at most _CONTEXT_TOKENS once it reaches this length, so decoding
# is one call on about this many tokens per step plus a few short ones when trimming.
_MAX_WINDOW_TOKENS = 2 * _CONTEXT_TOKENS
# A window this long is trimmed even without a clean cut. Only text that is not valid UTF-8
# gets here (a run of invalid byte tokens); its U+FFFDs may then come out miscounted.
_FORCE_TRIM_TOKENS = 4 * _CONTEXT_TOKENS
# UTF-8 encodes a character in at most 4 bytes and every token adds at least one, so an
# incomplete character is completed within 3 more tokens after the one carrying its first byte.
_MAX_INCOMPLETE_TOKENS = 3


def _leading_replacements(text: str) -> int:
    return len(text) - len(text.lstrip(_REPLACEMENT))


def _trailing_replacements(text: str) -> int:
    return len(text) - len(text.rstrip(_REPLACEMENT))


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
        min_tokens: int = 0,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = list(stop)
        # Stop strings end the output only from its ``min_tokens``-th token on (vLLM's min_tokens):
        # until then text is emitted as it comes, none held back as a possible stop's prefix.
        self._unarmed_tokens = min_tokens
        self.stopped_by: str | None = None  # the stop string the output ended before
        self._window, decoded = self._prompt_context(prompt_token_ids)
        # Characters of decode(self._window) already accounted for: all of the prompt context
        # here (even a dangling partial character, which belongs to the prompt), later the
        # part of the window's text that was moved into self._text.
        self._window_chars = len(decoded)
        # Consecutive tokens after which trailing U+FFFDs were held and nothing new was taken.
        self._stalled = 0
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
        self._unarmed_tokens -= 1
        self._window.append(token_id)
        decoded = self._decode(self._window)
        held = _trailing_replacements(decoded)
        end = len(decoded) - held
        if held and end <= self._window_chars:
            # With byte fallback the U+FFFDs can also cover characters already taken (`end`
            # falls below `_window_chars`): they reappear once the pending character completes.
            self._stalled += 1
            if self._stalled > _MAX_INCOMPLETE_TOKENS:
                # No character stays incomplete this long, so the run is invalid bytes. Its last
                # U+FFFD is still held: for byte-level BPE it may be a new incomplete character.
                end = len(decoded) - 1
                self._stalled = 0
        else:
            self._stalled = 0
        piece = decoded[self._window_chars:end]
        # Text that ends complete is all accounted for. The count can exceed it when the prompt
        # ended inside a character that byte fallback rendered as one U+FFFD per byte: the
        # completed character belongs to the prompt.
        self._window_chars = len(decoded) if not held else max(self._window_chars, end)
        if len(self._window) >= _MAX_WINDOW_TOKENS:
            self._trim(decoded)
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

    def _prompt_context(self, prompt_token_ids: list[int]) -> tuple[list[int], str]:
        """The last few prompt tokens, starting at a character boundary if one is near, and
        their text. A start inside a character decodes to leading U+FFFDs."""
        first = max(len(prompt_token_ids) - _CONTEXT_TOKENS, 0)
        for start in range(first, len(prompt_token_ids)):
            text = self._decode(prompt_token_ids[start:])
            if text and not text.startswith(_REPLACEMENT):
                return list(prompt_token_ids[start:]), text
        return list(prompt_token_ids[first:]), self._decode(prompt_token_ids[first:])

    def _trim(self, decoded: str) -> None:
        """Drops all but the last few tokens of the window, keeping the text accounting.

        A cut is taken if the shorter window's text, past any U+FFFDs of a character split by
        the cut, is the tail of `decoded` and starts with text already taken (the first kept
        token is context only). That rules out cutting into a run of byte-fallback tokens whose
        characters are not all complete: the whole run would decode as U+FFFDs.
        """
        pending = len(decoded) - self._window_chars
        starts = range(len(self._window) - _CONTEXT_TOKENS, len(self._window))
        for start in starts:
            text = self._decode(self._window[start:])
            taken = len(text) - pending
            split = _leading_replacements(text)
            if taken > split and decoded.endswith(text[split:]):
                break
        else:
            if len(self._window) < _FORCE_TRIM_TOKENS:
                return  # a pending character may still complete; try again after the next token
            start = starts[0]
            taken = max(len(self._decode(self._window[start:])) - pending, 0)
        self._window = self._window[start:]
        self._window_chars = taken

    def _push(self, piece: str, final: bool) -> str:
        """Appends decoded text, applies stop strings and returns what can be emitted."""
        self._text += piece
        stops = self._stop if self._unarmed_tokens <= 0 else []
        # A stop string cannot start inside already emitted text: while any of its prefixes
        # was the text's tail, that tail was held back.
        cut, by = min(((at, s) for at, s in ((self._text.find(s, self._emitted), s) for s in stops) if at >= 0),
                      default=(-1, None))
        if cut >= 0:
            self._text = self._text[:cut]
            self._stopped, self.stopped_by = True, by
            end = cut
        elif final or not stops:
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
