"""IncrementalDetokenizer on real byte-level tokenizers: UTF-8 safety, stop strings, streaming."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from deltaserve.engine.detokenizer import IncrementalDetokenizer

END = "<|end|>"
TEXTS = [
    "Hello, world!",
    "héllo wörld — naïve café",
    "日本語のテキスト と 中文 세계",
    "emoji 😀🚀 and flags 🇫🇷 ok",
    "mixed: Ωμέγα 世界 😀 Привет \n\n done",
]


def _byte_to_char() -> dict[int, str]:
    """GPT-2's byte -> printable char table, as used by the ByteLevel pre-tokenizer."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _make_tokenizer(merges: list[tuple[int, int]]) -> PreTrainedTokenizerFast:
    """Byte-level BPE: one token per UTF-8 byte, plus `merges` of byte pairs."""
    chars = _byte_to_char()
    assert set(chars.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    vocab = {chars[b]: b for b in range(256)}
    merge_pairs = [(chars[a], chars[b]) for a, b in merges]
    for a, b in merge_pairs:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merge_pairs))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=END)


# Merges whose tokens straddle character boundaries: 😀 = F0 9F 98 80 -> [F0][9F 98][80];
# "él" -> [C3][A9 'l']; 世界 = E4 B8 96 E7 95 8C -> [E4][B8][96 E7][95][8C].
CROSS_MERGES = [(0x9F, 0x98), (0xA9, ord("l")), (0x96, 0xE7)]


@pytest.fixture(scope="module", params=["bytes", "cross"])
def tokenizer(request: pytest.FixtureRequest) -> PreTrainedTokenizerFast:
    tok = _make_tokenizer([] if request.param == "bytes" else CROSS_MERGES)
    if request.param == "cross":
        ids = tok.encode("él 世界 😀", add_special_tokens=False)
        assert len(ids) < len("él 世界 😀".encode())  # the merges are in use
    return tok


def encode(tok: PreTrainedTokenizerFast, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_incremental_equals_full_decode(
    tokenizer: PreTrainedTokenizerFast, text: str, chunk: int
) -> None:
    prompt = encode(tokenizer, "Prompt: ")
    ids = encode(tokenizer, text)
    assert tokenizer.decode(ids) == text
    detok = IncrementalDetokenizer(tokenizer, prompt)
    pieces = [detok.add_tokens(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    assert not any("\ufffd" in piece for piece in pieces)
    assert "".join(pieces) == text
    assert detok.output_text == text
    if any(len(c.encode()) > 1 for c in text):
        assert "" in pieces  # some tokens had to wait for the rest of their character


def test_special_tokens_skipped_or_kept(tokenizer: PreTrainedTokenizerFast) -> None:
    end_id = tokenizer.convert_tokens_to_ids(END)
    ids = encode(tokenizer, "a 世") + [end_id] + encode(tokenizer, "b")
    skip = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    keep = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    for t in ids:
        skip.add_tokens([t])
        keep.add_tokens([t])
    assert skip.output_text == "a 世b"
    assert keep.output_text == f"a 世{END}b"


def test_no_tokenizer_gives_empty_text() -> None:
    detok = IncrementalDetokenizer(None, [1, 2, 3])
    assert detok.add_tokens([4, 5]) == ""
    assert detok.output_text == ""
    assert detok.check_stop(["x"], False) is None
    assert detok.get_stream_delta(True, ["x"]) == ""


def test_flush_emits_trailing_incomplete_character(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = encode(tokenizer, "ok 😀")[:-1]  # cut inside the emoji, as max_tokens might
    detok = IncrementalDetokenizer(tokenizer, [])
    streamed = ""
    for t in ids:
        assert "\ufffd" not in detok.add_tokens([t])
        streamed += detok.get_stream_delta(False, [])
    assert detok.output_text == streamed == "ok "
    streamed += detok.get_stream_delta(True, [])
    assert streamed == detok.output_text == tokenizer.decode(ids)
    assert detok.output_text.endswith("\ufffd")


def _generate(
    tok: PreTrainedTokenizerFast, text: str, stop: list[str], include: bool
) -> tuple[IncrementalDetokenizer, str | None, list[str], int]:
    """Feed `text` token by token as the engine would; stop at a stop string.

    Returns the detokenizer, the matched stop, the streamed deltas, and how many tokens were fed.
    Checks at every step that what was streamed is a prefix of the text so far.
    """
    ids = encode(tok, text)
    detok = IncrementalDetokenizer(tok, encode(tok, "Q: "))
    deltas: list[str] = []
    matched = None
    fed = 0
    for i, t in enumerate(ids):
        detok.add_tokens([t])
        fed += 1
        matched = detok.check_stop(stop, include)
        finished = matched is not None or i == len(ids) - 1
        deltas.append(detok.get_stream_delta(finished, stop))
        assert detok.output_text.startswith("".join(deltas))
        if finished:
            break
    return detok, matched, deltas, fed


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize(
    ("text", "stop", "before"),
    [
        ("Hello 世界 and more", ["世界"], "Hello "),
        ("one 😀🚀 two", ["🚀 t"], "one 😀"),
        ("line\nnext\n\nrest", ["\n\n"], "line\nnext"),
        ("café naïve STOP tail", ["xyz", "ïve S"], "café na"),
        ("ab abc abcd", ["abcd", "c a"], "ab ab"),  # earliest match wins
    ],
)
def test_stop_strings_spanning_tokens(
    tokenizer: PreTrainedTokenizerFast, text: str, stop: list[str], before: str, include: bool
) -> None:
    detok, matched, deltas, fed = _generate(tokenizer, text, stop, include)
    assert matched in stop
    expected = before + matched if include else before
    assert detok.output_text == expected
    assert "".join(deltas) == expected
    # Stopped on the token that completed the stop string, not later.
    ids = encode(tokenizer, text)
    assert matched in tokenizer.decode(ids[:fed])
    assert not any(s in tokenizer.decode(ids[: fed - 1]) for s in stop)
    # Nothing more is decoded after a stop.
    assert detok.add_tokens(encode(tokenizer, "more")) == ""
    assert detok.output_text == expected


def test_streaming_holds_back_possible_stop_prefix(tokenizer: PreTrainedTokenizerFast) -> None:
    stop = ["\n\n", "END!"]
    detok = IncrementalDetokenizer(tokenizer, [])
    streamed = ""
    for t in encode(tokenizer, "a\nb EN"):
        detok.add_tokens([t])
        assert detok.check_stop(stop, False) is None
        streamed += detok.get_stream_delta(False, stop)
    assert detok.output_text == "a\nb EN"
    assert streamed == "a\nb "  # "EN" could start "END!"
    for t in encode(tokenizer, "Dx\n"):
        detok.add_tokens([t])
        assert detok.check_stop(stop, False) is None
        streamed += detok.get_stream_delta(False, stop)
    assert streamed == "a\nb ENDx"  # "\n" could start "\n\n"
    streamed += detok.get_stream_delta(True, stop)
    assert streamed == detok.output_text == "a\nb ENDx\n"


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_final_text_without_stop(
    tokenizer: PreTrainedTokenizerFast, text: str
) -> None:
    stop = ["zzz", "\n\n\n", "ok!"]
    detok, matched, deltas, _ = _generate(tokenizer, text, stop, False)
    assert matched is None
    assert "".join(deltas) == detok.output_text == text


def test_check_stop_searches_only_new_text(tokenizer: PreTrainedTokenizerFast) -> None:
    detok = IncrementalDetokenizer(tokenizer, [])
    detok.add_tokens(encode(tokenizer, "abcdef"))
    assert detok.check_stop(["zz"], False) is None
    detok.add_tokens(encode(tokenizer, "g"))
    # "bc" lies wholly in text checked before: not searched again.
    assert detok.check_stop(["bc"], False) is None
    # "fg" straddles old and new text: found.
    detok.add_tokens(encode(tokenizer, "h"))
    assert detok.check_stop(["gh"], True) == "gh"
    assert detok.output_text == "abcdefgh"


def test_stop_string_in_prompt_is_ignored(tokenizer: PreTrainedTokenizerFast) -> None:
    detok = IncrementalDetokenizer(tokenizer, encode(tokenizer, "say STOP"))
    detok.add_tokens(encode(tokenizer, " fine"))
    assert detok.check_stop(["STOP"], False) is None
    assert detok.output_text == " fine"


def test_earliest_stop_wins_when_several_appear_in_one_step(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    detok = IncrementalDetokenizer(tokenizer, [])
    detok.add_tokens(encode(tokenizer, "hello wörld"))  # e.g. several speculative tokens at once
    assert detok.check_stop(["wörld", "llo"], False) == "llo"
    assert detok.output_text == "he"


def test_prompt_context_keeps_leading_space_of_first_output_token() -> None:
    # SentencePiece-style "▁" marks: decoding a sequence drops the first token's leading space,
    # so the first output token must be decoded with the prompt's tail as left context.
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3, "▁again": 4}
    model = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    model.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    tok = PreTrainedTokenizerFast(tokenizer_object=model, unk_token="<unk>")
    assert tok.decode([2]) == "world"
    detok = IncrementalDetokenizer(tok, [1])
    pieces = [detok.add_tokens([t]) for t in [2, 3, 4]]
    assert pieces == [" world", "!", " again"]
    assert tok.decode([1, 2, 3, 4]) == "Hello" + detok.output_text
