import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from engine.detokenizer import IncrementalDetokenizer

SENTENCES = [
    "héllo wörld 你好 🙂",
    "hello world, héllo again",
    "wörld peace and 你好 friends",
    "the quick brown fox 🙂 jumps over the lazy dog",
] * 5

SAMPLES = [
    "héllo wörld 你好 🙂",
    "ñandú 🙂🙃 你们好, wörld!",
    "plain ascii text with spaces   and  gaps",
    "🙂🙂🙂 emoji only 🙃🙃",
    "mixed: héllo 你好 wörld 🙂 again and again, ünïcödé everywhere 日本語のテキスト",
    "",
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<eos>"],
        show_progress=False,
    )
    tok.train_from_iterator(SENTENCES, trainer)
    return tok


@pytest.fixture(scope="module")
def byte_fallback() -> Tokenizer:
    """Llama 2 / Mistral style: SentencePiece spaces, and characters outside the small vocabulary
    as byte tokens <0x00>..<0xFF>, which the decoder renders as one U+FFFD per byte (for the
    whole run of byte tokens) until they form valid UTF-8."""
    vocab = {"<unk>": 0, "<eos>": 1}
    vocab.update({f"<0x{b:02X}>": len(vocab) + b for b in range(256)})
    for piece in ["▁", *"abcdefghijklmnopqrstuvwxyz,!", "é", "你", "好", "▁h", "ll", "▁he", "llo", "▁hello"]:
        vocab[piece] = len(vocab)
    merges = [("▁", "h"), ("l", "l"), ("▁h", "e"), ("ll", "o"), ("▁he", "llo")]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.add_special_tokens(["<eos>"])
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return tok


class CountingTokenizer:
    """Delegates decode and records the longest id list it was asked to decode."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner = inner
        self.longest = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.longest = max(self.longest, len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    pieces = [detok.add(i) for i in ids]
    pieces.append(detok.finish())
    return pieces


def test_tokenizer_splits_multibyte_characters(tokenizer: Tokenizer) -> None:
    # Guards the other tests: they only mean something if single tokens carry partial chars.
    ids = tokenizer.encode("ñandú 🙂🙃 你们好").ids
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)


@pytest.mark.parametrize("prompt", ["", "héllo", "你好 wörld 🙂"])
@pytest.mark.parametrize("text", SAMPLES)
def test_pieces_concatenate_to_full_decode(tokenizer: Tokenizer, prompt: str, text: str) -> None:
    prompt_ids = tokenizer.encode(prompt).ids
    ids = tokenizer.encode(text).ids
    counting = CountingTokenizer(tokenizer)
    detok = IncrementalDetokenizer(counting, prompt_ids, [], True)
    pieces = stream(detok, ids)
    assert "".join(pieces) == tokenizer.decode(ids) == detok.output_text
    assert not any("\ufffd" in piece for piece in pieces)
    assert not detok.stopped
    # Each step decodes a bounded window, never the whole sequence.
    assert counting.longest <= 12


def test_long_sequence_uses_bounded_window(tokenizer: Tokenizer) -> None:
    text = " ".join(SAMPLES) * 8
    ids = tokenizer.encode(text).ids
    counting = CountingTokenizer(tokenizer)
    detok = IncrementalDetokenizer(counting, [], [], True)
    assert "".join(stream(detok, ids)) == text
    assert len(ids) > 200 and counting.longest <= 12


def test_characters_held_until_complete(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("a🙃b").ids
    detok = IncrementalDetokenizer(tokenizer, [], [], True)
    emitted = ""
    for i in ids:
        emitted += detok.add(i)
        assert emitted in ("a", "a🙃", "a🙃b")
    assert emitted == "a🙃b" and detok.finish() == ""


def test_finish_flushes_incomplete_character(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("ok 🙃").ids[:-1]  # cut inside the emoji's bytes
    detok = IncrementalDetokenizer(tokenizer, [], [], True)
    emitted = "".join(detok.add(i) for i in ids)
    assert emitted == "ok "
    tail = detok.finish()
    assert emitted + tail == tokenizer.decode(ids) == detok.output_text
    assert tail.endswith("\ufffd")
    assert detok.finish() == "" and detok.add(ids[0]) == ""


def test_special_tokens_skipped_or_kept(tokenizer: Tokenizer) -> None:
    eos = tokenizer.token_to_id("<eos>")
    ids = tokenizer.encode("héllo").ids + [eos] + tokenizer.encode(" wörld").ids
    skipping = IncrementalDetokenizer(tokenizer, [], [], True)
    assert "".join(stream(skipping, ids)) == "héllo wörld"
    keeping = IncrementalDetokenizer(tokenizer, [], [], False)
    assert "".join(stream(keeping, ids)) == tokenizer.decode(ids, skip_special_tokens=False)
    assert "<eos>" in keeping.output_text


@pytest.mark.parametrize(
    "text,stop,expected",
    [
        ("héllo wörld 你好 🙂 and more", ["wörld 你"], "héllo "),
        ("héllo wörld 你好 🙂 and more", ["好 🙂", "zzz"], "héllo wörld 你"),
        ("ñandú 🙂🙃 你们好, wörld!", ["🙃 你们"], "ñandú 🙂"),
        ("the quick brown fox", ["quick", "he q"], "t"),  # earliest occurrence wins
        ("the quick brown fox", ["fox"], "the quick brown "),
    ],
)
def test_stop_string_never_partially_emitted(
    tokenizer: Tokenizer, text: str, stop: list[str], expected: str
) -> None:
    ids = tokenizer.encode(text).ids
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("prompt: ").ids, stop, True)
    emitted = ""
    for i in ids:
        emitted += detok.add(i)
        # The full text has the stop string right after `expected`: emitting more than
        # `expected` at any point would have shown part of the stop string.
        assert expected.startswith(emitted)
        if detok.stopped:
            break
    assert detok.stopped
    assert emitted == expected == detok.output_text
    assert detok.add(ids[0]) == "" and detok.finish() == ""


def test_possible_stop_prefix_is_held_then_released(tokenizer: Tokenizer) -> None:
    text = "héllo wörld 你好 🙂"
    ids = tokenizer.encode(text).ids
    detok = IncrementalDetokenizer(tokenizer, [], ["wörld 你們", "🙂!"], True)
    emitted = []
    for i in ids:
        emitted.append(detok.add(i))
    # " wörld 你" could start the first stop string and "🙂" the second: both held back.
    assert "".join(emitted) == "héllo wörld 你好 "
    assert detok.output_text == text
    assert detok.finish() == "🙂"
    assert not detok.stopped and detok.output_text == text


def test_held_prefix_released_when_match_fails(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("héllo wörld 你好 🙂").ids
    detok = IncrementalDetokenizer(tokenizer, [], ["héllo wörld 你好 🙃"], True)
    pieces = [detok.add(i) for i in ids]
    assert all(p == "" for p in pieces[:-1])  # every prefix so far matches the stop string
    final = detok.finish()
    assert "".join(pieces) + final == "héllo wörld 你好 🙂"
    assert not detok.stopped


def test_stop_string_at_very_end(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("ok 🙃").ids
    detok = IncrementalDetokenizer(tokenizer, [], ["k 🙃"], True)
    emitted = "".join(detok.add(i) for i in ids) + detok.finish()
    assert emitted == "o" == detok.output_text and detok.stopped


# -- byte fallback ---------------------------------------------------------------------------------
BYTE_FALLBACK_SAMPLES = [
    "a🙃b",
    "hello wörld 你们好 ñandú 🙂",
    "日本語のテキスト、日本語のテキスト、日本語のテキスト",
    "ünïcödé, 你好! 🙂🙃𝄞 €",
]


@pytest.mark.parametrize("text", BYTE_FALLBACK_SAMPLES)
def test_byte_fallback_pieces_concatenate_to_full_decode(byte_fallback: Tokenizer, text: str) -> None:
    ids = byte_fallback.encode(text).ids
    full = byte_fallback.decode(ids)
    assert full == text and any(byte_fallback.id_to_token(i).startswith("<0x") for i in ids)
    # Split prompt / output at every character boundary, so the output often continues the
    # prompt's run of byte tokens.
    splits = [k for k in range(len(ids)) if not byte_fallback.decode(ids[:k]).endswith("\ufffd")]
    for k in splits:
        counting = CountingTokenizer(byte_fallback)
        detok = IncrementalDetokenizer(counting, ids[:k], [], True)
        pieces = stream(detok, ids[k:])
        assert "".join(pieces) == full[len(byte_fallback.decode(ids[:k])):] == detok.output_text
        assert not any("\ufffd" in piece for piece in pieces), (k, pieces)
        # Trimming starts at 12 tokens and waits at most 3 tokens for a pending character.
        assert counting.longest <= 15


def test_byte_fallback_character_held_until_complete(byte_fallback: Tokenizer) -> None:
    ids = byte_fallback.encode("a🙃b").ids
    assert [byte_fallback.id_to_token(i) for i in ids[2:6]] == ["<0xF0>", "<0x9F>", "<0x99>", "<0x83>"]
    detok = IncrementalDetokenizer(byte_fallback, [], [], True)
    emitted = ""
    for i in ids:
        emitted += detok.add(i)
        assert emitted in ("", "a", "a🙃", "a🙃b")
    assert emitted == "a🙃b" and detok.finish() == ""


def single_byte_tokens(tok: Tokenizer, text: str) -> list[int]:
    """The UTF-8 bytes of `text` as one token each."""
    if tok.token_to_id("<0x00>") is not None:
        return [tok.token_to_id(f"<0x{b:02X}>") for b in text.encode()]
    [(chars, _)] = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(text)
    return [tok.token_to_id(c) for c in chars]


@pytest.mark.parametrize("name", ["tokenizer", "byte_fallback"])
def test_invalid_bytes_come_out_as_replacement_characters(name: str, request: pytest.FixtureRequest) -> None:
    tok = request.getfixturevalue(name)
    orphan, *emoji = single_byte_tokens(tok, "é🙃")[1:]  # é's continuation byte alone is invalid
    a, b = tok.token_to_id("a"), tok.token_to_id("b")
    ids = [a, orphan, *emoji, b] + [orphan] * 40 + [b]
    counting = CountingTokenizer(tok)
    detok = IncrementalDetokenizer(counting, [], [], True)
    pieces = stream(detok, ids)
    # Held while the bytes could still be the start of a character (up to 4 tokens), then
    # emitted, without losing the emoji that follows (byte-level BPE decodes it).
    assert pieces[:4] == ["a", "", "", ""] and "\ufffd" in pieces[4]
    assert "".join(pieces) == tok.decode(ids) == detok.output_text
    # A long invalid run allows no clean cut, yet the window stays bounded.
    assert counting.longest <= 24


def test_byte_fallback_character_begun_in_the_prompt_belongs_to_it(byte_fallback: Tokenizer) -> None:
    ids = byte_fallback.encode("日本語").ids  # "▁" then three bytes per character
    detok = IncrementalDetokenizer(byte_fallback, ids[:3], [], True)  # the prompt ends inside 日
    assert "".join(stream(detok, ids[3:])) == "本語" == detok.output_text
