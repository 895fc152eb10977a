"""IncrementalDetokenizer and StopStringMatcher: streamed text equals the text of the whole."""

import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, normalizers

from capstan.runtime.engine.detokenizer import IncrementalDetokenizer
from capstan.runtime.engine.stop_strings import StopStringMatcher
from capstan.runtime.tokenizer import Tokenizer

GOLDEN = Path(__file__).parent / "data" / "golden"
MULTIBYTE = "漢字 ✓ ünïcödé — 🙂 naïve"


def stream(tok: Tokenizer, ids: list[int], skip_special_tokens: bool = True) -> tuple[str, list[str]]:
    detok = IncrementalDetokenizer(tok, prompt_ids=[1, 2, 3], skip_special_tokens=skip_special_tokens)
    deltas = [detok.add(i) for i in ids]
    return "".join(deltas) + detok.flush(), deltas


def sentencepiece_style() -> Tokenizer:
    """A Llama-2/Mistral-style tokenizer: "▁" for spaces, byte fallback, leading space stripped on decode."""
    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "▁", *"abcdefghijklmnopqrstuvwxyzü"]
    merges = [("▁", "h"), ("▁h", "i"), ("▁", "ü")]
    vocab = {p: i for i, p in enumerate(pieces + ["".join(m) for m in merges])}
    rust = RustTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    rust.add_special_tokens(["<unk>", "<s>", "</s>"])
    rust.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    rust.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return Tokenizer(rust, name="sentencepiece-style", bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(params=["llama-s11", "qwen3-s13", "gemma3-s14", "sentencepiece-style"])
def tok(request) -> Tokenizer:
    if request.param == "sentencepiece-style":
        return sentencepiece_style()
    return Tokenizer.from_pretrained(GOLDEN / request.param)


def test_multibyte_text_streams_whole_characters(tok):
    ids = tok.encode(MULTIBYTE, add_special_tokens=False)
    text, deltas = stream(tok, ids)
    assert text == MULTIBYTE
    assert all("\ufffd" not in d for d in deltas)
    assert len(ids) > len([d for d in deltas if d])  # some byte tokens were held back


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_ids_stream_equals_whole_decode(tok, skip_special_tokens):
    rng = random.Random(1234)
    specials = sorted(tok.special_token_ids | {tok.vocab_size + 3})  # models may pad their vocabulary
    pieces = tok.encode(MULTIBYTE, add_special_tokens=False)
    for _ in range(200):
        ids = []
        for _ in range(rng.randrange(1, 40)):
            kind = rng.random()
            if kind < 0.5:  # arbitrary tokens, including lone bytes of multi-byte characters
                ids.append(rng.randrange(tok.vocab_size))
            elif kind < 0.9:
                start = rng.randrange(len(pieces))
                ids.extend(pieces[start : start + rng.randrange(1, 6)])
            else:
                ids.append(rng.choice(specials))
        text, _ = stream(tok, ids, skip_special_tokens)
        assert text == tok.decode(ids, skip_special_tokens=skip_special_tokens), ids


def test_special_tokens_are_skipped_by_default(tok):
    ids = tok.encode("Hi there", add_special_tokens=False) + [tok.eos_token_id]
    assert stream(tok, ids)[0] == "Hi there"
    assert stream(tok, ids, skip_special_tokens=False)[0] == "Hi there" + tok.eos_token


def run_matcher(stops: list[str], deltas: list[str]) -> tuple[str, bool, list[str]]:
    matcher = StopStringMatcher(stops)
    emitted, stopped = [], False
    for delta in deltas:
        text, stopped = matcher.feed(delta)
        emitted.append(text)
        if stopped:
            break
    return "".join(emitted) + matcher.flush(), stopped, emitted


def test_stop_spanning_many_deltas_is_never_emitted():
    text, stopped, emitted = run_matcher(["</answer>"], ["The answer", " is 4<", "/ans", "w", "er>", " ignored"])
    assert (text, stopped) == ("The answer is 4", True)
    assert emitted == ["The answer", " is 4", "", "", ""]


def test_first_completed_of_several_stops_wins():
    assert run_matcher(["STOP", "\n\n", "x"], ["one\n", "\ntwo STOP"])[:2] == ("one", True)
    assert run_matcher(["abcd", "c"], ["abcd"])[:2] == ("ab", True)
    assert run_matcher(["abcd", "c"], list("abcd"))[:2] == ("ab", True)


def test_stop_at_the_very_start():
    assert run_matcher(["Hello"], ["Hel", "lo world"])[:2] == ("", True)


def test_no_stop_emits_everything():
    assert run_matcher(["###"], ["a #", "# b", " #"])[:2] == ("a ## b #", False)
    assert run_matcher([], ["plain ", "text"])[:2] == ("plain text", False)


def test_partial_match_that_fails_is_released():
    _, stopped, emitted = run_matcher(["<|end|>"], ["Go <|e", "nd but not", " quite"])
    assert not stopped
    assert emitted == ["Go ", "<|end but not", " quite"]


def test_random_splits_give_the_same_result():
    rng = random.Random(7)
    stops = ["<eos>", "ab", "\n\n"]
    for _ in range(300):
        source = "".join(rng.choice(["a", "b", "<", "eos>", "\n", "x ", "ü"]) for _ in range(20))
        cut = sorted(rng.sample(range(1, len(source)), rng.randrange(0, 6)))
        deltas = [source[i:j] for i, j in zip([0, *cut], [*cut, len(source)], strict=True)]
        whole = run_matcher(stops, [source])[:2]
        assert run_matcher(stops, deltas)[:2] == whole
        ends = [(source.find(s) + len(s), source.find(s)) for s in stops if s in source]
        expected = source[: min(ends)[1]] if ends else source
        assert whole == (expected, bool(ends))
