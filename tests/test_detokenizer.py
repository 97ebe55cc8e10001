import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

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
