"""IncrementalDetokenizer against the SmolLM2 tokenizer (byte-level BPE) and a SentencePiece-style one.

The invariant throughout: the deltas, then finish(), concatenate to the full decode of the output.
"""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedserve.output import detokenizer
from pagedserve.output.detokenizer import IncrementalDetokenizer, token_bytes
from tests.support.detokenizer_paths import StreamOnly, WindowOnly

TEXTS = [
    "Hello, world! This is plain ASCII.",
    "Café déjà vu, naïve façade, Ångström, señor.",
    "日本語のテキストと中文字符，还有한국어도 있습니다。",
    "Emoji: 😀 👍🏽 👨‍👩‍👧 🇫🇷 🎉🎉 and text after.",
    "Mixed: Ελληνικά, кириллица, עברית, العربية, हिन्दी, ∑∫√∞ ≠ ≤.",
    "  leading spaces, tabs\tand\nnewlines\n\n  ",
    "😀",
    "世",
]


def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from executor_svc.model_loader import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir("default"))


# Every test runs on the three paths: each token's bytes from a table ("bytes"), the tokenizers library's
# DecodeStream ("stream") and the Python window.
@pytest.fixture(scope="module", params=["bytes", "stream", "window"])
def tok(request):
    fast = smollm2_tokenizer()
    return {"bytes": fast, "stream": StreamOnly(fast), "window": WindowOnly(fast)}[request.param]


def test_each_path_is_the_one_meant(tok):
    detok = IncrementalDetokenizer(tok, [])
    path = "bytes" if detok._token_bytes else "stream" if detok._stream else "window"
    assert path == {WindowOnly: "window", StreamOnly: "stream"}.get(type(tok), "bytes")


@pytest.fixture(scope="module")
def chat_prompt_ids(tok) -> list[int]:
    text = tok.apply_chat_template([{"role": "user", "content": "Say something"}], add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


def stream(tok, prompt_ids: list[int], out_ids: list[int], chunk_sizes=None, skip_special_tokens=True):
    """The deltas (the last one from finish()) of detokenizing out_ids in chunks (default: one by one)."""
    detok = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=skip_special_tokens)
    deltas, i = [], 0
    sizes = iter(chunk_sizes or [])
    while i < len(out_ids):
        n = next(sizes, 1)
        deltas.append(detok.add_tokens(out_ids[i:i + n]))
        i += n
    deltas.append(detok.finish())
    return deltas


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("with_prompt", [False, True])
def test_encoded_text_one_token_at_a_time(tok, chat_prompt_ids, text, with_prompt):
    ids = tok.encode(text, add_special_tokens=False)
    deltas = stream(tok, chat_prompt_ids if with_prompt else [], ids)
    assert "".join(deltas) == tok.decode(ids) == text
    # Split characters are held back whole, never shown as U+FFFD, and nothing is left for finish().
    assert not any("\ufffd" in d for d in deltas)
    assert deltas[-1] == ""


def test_multibyte_character_is_held_until_complete(tok):
    ids = tok.encode("😀", add_special_tokens=False)
    assert len(ids) > 1  # byte-level BPE splits it, which is the point
    detok = IncrementalDetokenizer(tok, [])
    assert [detok.add_tokens([i]) for i in ids] == [""] * (len(ids) - 1) + ["😀"]


@pytest.mark.parametrize("seed", range(20))
def test_encoded_text_in_random_chunks(tok, chat_prompt_ids, seed):
    rng = random.Random(seed)
    text = "".join(rng.choice(TEXTS) for _ in range(4))
    ids = tok.encode(text, add_special_tokens=False)
    sizes = [rng.randint(1, 5) for _ in ids]
    deltas = stream(tok, chat_prompt_ids if seed % 2 else [], ids, sizes)
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(min_size=1, max_size=40), data=st.data())
def test_any_text_round_trips(tok, text, data):
    ids = tok.encode(text, add_special_tokens=False)
    sizes = data.draw(st.lists(st.integers(1, 4), max_size=len(ids)))
    deltas = stream(tok, [], ids, sizes)
    # Not always == text: a few control bytes (e.g. \x06) are missing from SmolLM2's vocabulary.
    assert "".join(deltas) == tok.decode(ids)
    if "\ufffd" not in tok.decode(ids):  # some characters' bytes are missing from the vocabulary too
        assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_ids_match_full_decode(tok, chat_prompt_ids, seed, skip_special_tokens):
    # Random ids make invalid UTF-8 and special tokens; the concatenation must still be the decode.
    rng = random.Random(seed)
    special = [0, 1, 2, 3, 16]
    ids = [rng.choice(special) if rng.random() < 0.1 else rng.randrange(len(tok)) for _ in range(rng.randint(1, 60))]
    sizes = [rng.randint(1, 4) for _ in ids]
    deltas = stream(tok, chat_prompt_ids if seed % 2 else [], ids, sizes, skip_special_tokens)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_special_tokens_skipped_or_kept(tok, chat_prompt_ids):
    ids = tok.encode("Hi there", add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    ids += tok.encode("\nmore", add_special_tokens=False)
    assert "".join(stream(tok, chat_prompt_ids, ids)) == "Hi there\nmore"
    assert "".join(stream(tok, chat_prompt_ids, ids, skip_special_tokens=False)) == "Hi there<|im_end|>\nmore"


def test_finish_flushes_an_incomplete_trailing_character(tok):
    ids = tok.encode("ok 世", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [])
    partial = ids[:-1]  # the last byte of 世 never arrives
    text = "".join(detok.add_tokens([i]) for i in partial)
    assert "\ufffd" not in text
    assert text + detok.finish() == tok.decode(partial)
    assert detok.finish() == ""


def test_prompt_ending_mid_character(tok):
    # Only token-id prompts can do this; the output's stray continuation byte decodes as on its own.
    ids = tok.encode("ok 世", add_special_tokens=False)
    out = ids[-1:] + tok.encode(" then", add_special_tokens=False)
    assert "".join(stream(tok, ids[:-1], out)) == tok.decode(out)


class CountingTokenizer:
    """Records how many ids each decode call gets, to show the per-step cost does not grow."""

    def __init__(self, inner):
        self.inner, self.sizes = inner, []

    def decode(self, ids, **kwargs):
        self.sizes.append(len(ids))
        return self.inner.decode(ids, **kwargs)


@pytest.mark.parametrize("path", ["bytes", "stream"])
def test_a_fast_tokenizer_decodes_in_the_tokenizers_library(chat_prompt_ids, path):
    """No Python-level decode per step: only the prompt context is decoded once, to check it ends whole."""
    tok = smollm2_tokenizer() if path == "bytes" else StreamOnly(smollm2_tokenizer())
    counting = CountingTokenizer(tok)
    counting.backend_tokenizer = tok.backend_tokenizer
    ids = tok.encode(" ".join(TEXTS), add_special_tokens=False)
    assert "".join(stream(counting, chat_prompt_ids, ids)) == tok.decode(ids)
    assert len(counting.sizes) == 1


def test_decode_window_stays_small(tok, chat_prompt_ids):
    ids = tok.encode(" ".join(TEXTS) * 20, add_special_tokens=False)
    assert len(ids) > 1000
    counting = CountingTokenizer(tok)
    assert "".join(stream(counting, chat_prompt_ids, ids)) == tok.decode(ids)
    assert max(counting.sizes) <= 16


# --------------------------------------------------------------------------- the byte table


def with_added_tokens(tokens):
    """SmolLM2's tokenizer with more added tokens (the table spells them as its decoder does)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_str(smollm2_tokenizer().backend_tokenizer.to_str())
    backend.add_tokens(tokens)
    return PreTrainedTokenizerFast(tokenizer_object=backend)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_added_tokens_spelt_in_and_outside_the_byte_alphabet(skip_special_tokens):
    from tokenizers import AddedToken

    # "aĠb" is spelt in the byte alphabet (Ġ is a space); the others are not, and decode as written.
    added = [AddedToken("aĠb", normalized=False), AddedToken("a b c", normalized=False),
             AddedToken("<xĠ>", special=True), AddedToken("<x y>", special=True)]
    tok = with_added_tokens(added)
    assert token_bytes(tok.backend_tokenizer, skip_special_tokens) is not None
    first = len(tok) - len(added)
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.choice([*range(first, len(tok)), rng.randrange(first)]) for _ in range(rng.randint(1, 30))]
        deltas = stream(tok, [], ids, [rng.randint(1, 3) for _ in ids], skip_special_tokens)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_a_table_that_disagrees_with_the_decode_is_not_used(monkeypatch):
    """A wrong table is caught by the check against the tokenizer's own decode; DecodeStream takes over."""
    tok = with_added_tokens([])  # a tokenizer object of its own: the table cache has not seen it
    right = detokenizer._byte_level_alphabet()
    monkeypatch.setattr(detokenizer, "_byte_level_alphabet", lambda: right | {"Ġ": ord("_")})
    assert token_bytes(tok.backend_tokenizer, True) is None
    ids = tok.encode(" spaced words", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [])
    assert detok._token_bytes is None and detok._stream is not None
    assert "".join(detok.add_tokens([i]) for i in ids) + detok.finish() == " spaced words"


def test_ids_outside_the_vocabulary_decode_to_nothing(tok):
    # (A model's vocabulary may be padded beyond its tokenizer's.)
    ids = tok.encode("Hello world", add_special_tokens=False)
    assert len(ids) == 2
    assert "".join(stream(tok, [], [ids[0], len(tok) + 5, ids[1]])) == "Hello world"


# --------------------------------------------------------------------------- SentencePiece style


@pytest.fixture(scope="module", params=["stream", "window"])
def sp_tok(request):
    """A tiny Llama-like tokenizer: Unigram with byte fallback, Metaspace, and a decoder that strips
    the first token's leading space (so decoding one token at a time loses spaces)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["▁", "▁Hello", "▁world", "Hello", "world", "▁a", "a", "b", "▁b", ".", ",", "▁."]
    vocab = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)]
    vocab += [(f"<0x{b:02X}>", -10.0) for b in range(256)] + [(p, -1.0) for p in pieces]
    backend = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    return fast if request.param == "stream" else WindowOnly(fast)


SP_TEXTS = ["Hello world", "Hello world 世界 a.b , Hello", "a b 😀 b a", "  Hello  world  "]


@pytest.mark.parametrize("text", SP_TEXTS)
def test_sentencepiece_leading_spaces(sp_tok, text):
    ids = sp_tok.encode(text, add_special_tokens=False)
    assert "".join(sp_tok.decode([i]) for i in ids) != sp_tok.decode(ids)  # the naive way is wrong
    deltas = stream(sp_tok, [], ids)
    assert "".join(deltas) == sp_tok.decode(ids)
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("text", SP_TEXTS)
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_sentencepiece_after_a_prompt_keeps_the_continuation_space(sp_tok, text, skip_special_tokens):
    prompt = [sp_tok.bos_token_id] + sp_tok.encode("Hello, a", add_special_tokens=False)
    ids = sp_tok.encode(text, add_special_tokens=False) + [sp_tok.eos_token_id]
    full = sp_tok.decode(prompt + ids, skip_special_tokens=skip_special_tokens)
    prompt_text = sp_tok.decode(prompt, skip_special_tokens=skip_special_tokens)
    assert "".join(stream(sp_tok, prompt, ids, skip_special_tokens=skip_special_tokens)) == full[len(prompt_text):]


@pytest.mark.parametrize("seed", range(30))
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_sentencepiece_random_pieces_and_byte_characters(sp_tok, seed, skip_special_tokens):
    # Byte tokens come in whole characters here: HF's ByteFallback decoder turns a whole run of byte
    # tokens into U+FFFDs once any of it is invalid, which no streaming decoder can foresee.
    rng = random.Random(seed)
    vocab = sp_tok.get_vocab()
    pieces = [i for t, i in vocab.items() if not t.startswith("<")] + [sp_tok.bos_token_id, sp_tok.eos_token_id]
    ids: list[int] = []
    length = rng.randint(1, 40)
    while len(ids) < length:
        if rng.random() < 0.3:
            char = chr(rng.choice([rng.randrange(0x20, 0x7F), rng.randrange(0xA0, 0xD800), rng.randrange(0x10000, 0x10FFFF)]))
            ids += [vocab[f"<0x{b:02X}>"] for b in char.encode()]
        else:
            ids.append(rng.choice(pieces))
    sizes = [rng.randint(1, 3) for _ in ids]
    deltas = stream(sp_tok, [], ids, sizes, skip_special_tokens)
    assert "".join(deltas) == sp_tok.decode(ids, skip_special_tokens=skip_special_tokens)
    assert not any("\ufffd" in d for d in deltas)
