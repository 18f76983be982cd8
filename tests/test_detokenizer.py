"""IncrementalDetokenizer and chat helpers, on tokenizers trained in-test (no downloads)."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers.processors import TemplateProcessing
from transformers import PreTrainedTokenizerFast

from pagedserve.actors.chat import apply_chat_template, eos_token_ids, load_tokenizer
from pagedserve.actors.incremental_detokenizer import IncrementalDetokenizer, TokenDecoder
from pagedserve.actors.messages import ChatMessage, PromptOptions, SamplingParams

FFFD = "\ufffd"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "héllo wörld 日本語 🙂 emoji",
    "The quick brown fox jumps over the lazy dog. Hello world, hello again!",
    "naïve café crème brûlée — “quotes” and ‘apostrophes’ …",
    "日本語のテキストと中文文本，还有한국어 텍스트.",
    "emoji: 🙂😀🎉👍🏽 and math ∑∫√∞ ≠ ≤ ≥",
    "Straße, Ærø, Ελληνικά, русский текст",
    "  leading spaces and\ttabs\nnewlines\n\n trailing  ",
    "code: def f(x): return x ** 2  # comment",
]
TEXTS = CORPUS + [
    "unseen: ĉu vi parolas Esperanton? 🦀🐍 ☃ 漢字",
    " héllo",
    "a  b   c    d",
    "🙂🙂🙂",
    "x",
]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _wrap(tok: Tokenizer, **kwargs) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, clean_up_tokenization_spaces=False, **kwargs
    )


def _byte_level() -> PreTrainedTokenizerFast:
    """GPT-2 / Qwen style byte-level BPE."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIALS,
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return _wrap(tok, eos_token="<|endoftext|>")


def _byte_fallback_bpe(sp_style: str) -> PreTrainedTokenizerFast:
    """SentencePiece style BPE with byte fallback: 'llama' (Llama-2 normalizer and decoder
    with Strip) or 'metaspace' (Metaspace pre-tokenizer and decoder, Mistral style)."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    if sp_style == "llama":
        tok.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=300, limit_alphabet=40, special_tokens=["<unk>", "<s>", "</s>"],
        show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator(CORPUS, trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    spec["decoder"] = {
        "type": "Sequence",
        "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0},
        ],
    }
    if sp_style == "metaspace":
        spec["decoder"]["decoders"] = [
            {"type": "ByteFallback"},
            {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": True},
        ]
    tok = Tokenizer.from_str(json.dumps(spec))
    return _wrap(tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module")
def tokenizers_by_name() -> dict[str, PreTrainedTokenizerFast]:
    return {
        "bytelevel": _byte_level(),
        "llama": _byte_fallback_bpe("llama"),
        "metaspace": _byte_fallback_bpe("metaspace"),
    }


@pytest.fixture(params=["bytelevel", "llama", "metaspace"])
def tok(request, tokenizers_by_name) -> PreTrainedTokenizerFast:
    return tokenizers_by_name[request.param]


@pytest.fixture(scope="module")
def bl(tokenizers_by_name) -> PreTrainedTokenizerFast:
    return tokenizers_by_name["bytelevel"]


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _stream(tokenizer, prompt, out, chunks=None, finish=True, **sampling_kwargs):
    """Feed `out` in chunks (default one token each); return (detokenizer, deltas, results)."""
    sampling = SamplingParams(**sampling_kwargs)
    d = IncrementalDetokenizer(TokenDecoder(tokenizer), prompt, sampling)
    sizes = chunks or [1] * len(out)
    results, pos = [], 0
    for i, n in enumerate(sizes):
        last = finish and i == len(sizes) - 1
        results.append(d.update(out[pos : pos + n], finished=last))
        pos += n
    return d, [r.text_delta for r in results], results


def _splits_a_char(tokenizer, ids: list[int]) -> bool:
    """True if some single token of `ids` decodes to an incomplete character."""
    return any(FFFD in tokenizer.decode([i]) for i in ids)


# ---------------------------------------------------------------- streaming == decode


@pytest.mark.parametrize("skip", [True, False])
def test_stream_equals_decode_one_token_at_a_time(tok, skip):
    for text in TEXTS:
        ids = _encode(tok, text)
        d, deltas, _ = _stream(tok, [], ids, skip_special_tokens=skip)
        expected = tok.decode(ids, skip_special_tokens=skip)
        assert "".join(deltas) == expected, text
        if FFFD not in expected:
            assert not any(FFFD in delta for delta in deltas), (text, deltas)


def test_multibyte_characters_split_across_tokens(tok):
    text = "a🦀b漢字 🙂 ☃"  # 🦀, 漢, 字 and ☃ are not in the training corpus
    ids = _encode(tok, text)
    assert _splits_a_char(tok, ids), "test needs a character split across tokens"
    _, deltas, _ = _stream(tok, [], ids)
    assert not any(FFFD in delta for delta in deltas)
    assert "".join(deltas) == text
    assert "🦀" in deltas  # emitted once, whole, when its last byte arrives
    assert deltas.count("") >= 3  # the tokens holding 🦀's first bytes emit nothing


def test_random_chunk_sizes(tok):
    rng = random.Random(0)
    for text in TEXTS:
        ids = _encode(tok, text)
        chunks, left = [], len(ids)
        while left:
            chunks.append(min(left, rng.randint(1, 4)))
            left -= chunks[-1]
        _, deltas, _ = _stream(tok, [], ids, chunks=chunks)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)


def test_with_prompt_context(tok):
    """Output text is what the output tokens add after the prompt."""
    for text in TEXTS:
        ids = _encode(tok, "Prompt: tell me. " + text)
        full = tok.decode(ids)
        for k in range(1, len(ids)):
            prefix = tok.decode(ids[:k])
            if not full.startswith(prefix) or prefix.endswith(FFFD):
                continue  # the split falls inside a character
            _, deltas, _ = _stream(tok, ids[:k], ids[k:])
            assert "".join(deltas) == full[len(prefix) :], (text, k)


def test_bytelevel_with_prompt_equals_decode_of_output(bl):
    for text in TEXTS:
        prompt = _encode(bl, "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n")
        out = _encode(bl, text)
        for skip in (True, False):
            _, deltas, _ = _stream(bl, prompt, out, skip_special_tokens=skip)
            assert "".join(deltas) == bl.decode(out, skip_special_tokens=skip)


def test_sentencepiece_leading_space(tokenizers_by_name):
    for name in ("llama", "metaspace"):
        tok = tokenizers_by_name[name]
        prompt, out = _encode(tok, "Prompt text:"), _encode(tok, "hello wörld")
        assert tok.convert_ids_to_tokens(out[0]).startswith("▁")
        assert tok.decode(out) == "hello wörld"
        # The first output token starts a word after prompt text: it keeps its space.
        _, deltas, _ = _stream(tok, prompt, out)
        assert "".join(deltas) == " hello wörld"
        assert tok.decode(prompt + out) == "Prompt text: hello wörld"
        # After only a BOS (skipped), nothing precedes it: like decode([bos] + out).
        bos = [tok.bos_token_id]
        _, deltas, _ = _stream(tok, bos, out)
        assert "".join(deltas) == "hello wörld" == tok.decode(bos + out, skip_special_tokens=True)


def test_random_token_ids_bytelevel(bl):
    """Arbitrary ids (invalid UTF-8 included) still stream to exactly decode(ids)."""
    rng = random.Random(1)
    vocab = len(bl)
    for _ in range(200):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        for skip in (True, False):
            _, deltas, _ = _stream(bl, [], ids, skip_special_tokens=skip)
            assert "".join(deltas) == bl.decode(ids, skip_special_tokens=skip)


def test_random_word_sequences_never_emit_fffd(tok):
    rng = random.Random(2)
    words = " ".join(TEXTS).split()
    for _ in range(50):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(1, 12)))
        ids = _encode(tok, text)
        _, deltas, _ = _stream(tok, [], ids)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)
        assert not any(FFFD in delta for delta in deltas)


def test_special_tokens(bl):
    im_end = bl.convert_tokens_to_ids("<|im_end|>")
    eot = bl.convert_tokens_to_ids("<|endoftext|>")
    out = _encode(bl, "hello") + [im_end] + _encode(bl, " wörld") + [eot]
    _, deltas, _ = _stream(bl, [], out, skip_special_tokens=True)
    assert "".join(deltas) == "hello wörld"
    assert not any("<|" in delta for delta in deltas)
    _, deltas, _ = _stream(bl, [], out, skip_special_tokens=False)
    assert "".join(deltas) == "hello<|im_end|> wörld<|endoftext|>"


def test_special_tokens_sentencepiece(tok):
    eos = tok.eos_token_id
    out = _encode(tok, "hello") + [eos] + _encode(tok, "wörld") + [eos]
    for skip in (True, False):
        _, deltas, _ = _stream(tok, [], out, skip_special_tokens=skip)
        assert "".join(deltas) == tok.decode(out, skip_special_tokens=skip)


@pytest.mark.parametrize("name", ["llama", "metaspace"])
def test_decode_window_stays_small(tokenizers_by_name, name, monkeypatch):
    """O(1) per token: each decode covers only a few tokens, however long the output."""
    tok = tokenizers_by_name[name]
    windows: list[int] = []
    real = TokenDecoder.decoder

    def spy(self, skip):
        decode = real(self, skip)
        return lambda ids: (windows.append(len(ids)), decode(ids))[1]

    monkeypatch.setattr(TokenDecoder, "decoder", spy)
    out = _encode(tok, " ".join(TEXTS) * 20)
    assert len(out) > 2000
    prompt = _encode(tok, "some prompt text here")
    d, deltas, _ = _stream(tok, prompt, out)
    assert "".join(deltas) == tok.decode(prompt + out)[len(tok.decode(prompt)) :]
    assert max(windows) <= 16


def test_bytelevel_streams_by_table_lookups(bl, monkeypatch):
    """Byte-level BPE: no call into the tokenizer per token (one decode of the prompt's last
    tokens, to know its text ends on a character boundary)."""
    calls: list[int] = []
    real = TokenDecoder.decoder

    def spy(self, skip):
        decode = real(self, skip)
        return lambda ids: (calls.append(len(ids)), decode(ids))[1]

    monkeypatch.setattr(TokenDecoder, "decoder", spy)
    out = _encode(bl, " ".join(TEXTS) * 20)
    _, deltas, _ = _stream(bl, _encode(bl, "some prompt"), out)
    assert "".join(deltas) == bl.decode(out) and len(calls) == 1
    assert "🦀" in deltas  # a character split over tokens is emitted whole


def test_bytelevel_prompt_ending_inside_a_character(bl):
    """A prompt whose last tokens hold the first bytes of a character: the output's text is
    what it adds to the prompt's (the decode window's way)."""
    ids = _encode(bl, "emoji 🦀 crab")
    for k in range(1, len(ids)):
        prompt, out = ids[:k], ids[k:]
        full, prefix = bl.decode(ids), bl.decode(prompt)
        _, deltas, _ = _stream(bl, prompt, out)
        if not prefix.endswith(FFFD):
            assert "".join(deltas) == full[len(prefix) :] == bl.decode(out), k
        else:
            assert "".join(deltas).endswith(" crab"), k


def test_bytelevel_added_tokens_special_or_not(bl):
    """Added tokens (special and not, and text outside the byte alphabet) between bytes of
    split characters, streamed one at a time and in random chunks: exactly decode()."""
    tok = Tokenizer.from_str(bl.backend_tokenizer.to_str())
    tok.add_tokens(["<tool>", "é x", "ñ"])
    fast = _wrap(tok, eos_token="<|endoftext|>")
    added = [fast.convert_tokens_to_ids(t) for t in ("<tool>", "é x", "ñ", "<|im_end|>")]
    rng = random.Random(3)
    pieces = [_encode(fast, t) for t in TEXTS] + [[a] for a in added]
    for _ in range(300):
        ids = [i for _ in range(rng.randint(1, 12)) for i in rng.choice(pieces)]
        cut = rng.randrange(len(ids) + 1)  # split a character now and then
        ids = ids[:cut] + [rng.randrange(len(fast))] + ids[cut:]
        chunks, left = [], len(ids)
        while left:
            chunks.append(min(left, rng.randint(1, 3)))
            left -= chunks[-1]
        for skip in (True, False):
            _, deltas, _ = _stream(fast, [], ids, chunks=chunks, skip_special_tokens=skip)
            assert "".join(deltas) == fast.decode(ids, skip_special_tokens=skip), (ids, skip)


# ---------------------------------------------------------------- stop strings


def _check_stop(tokenizer, text, stop, expected, matched, include=False, prompt=()):
    out = _encode(tokenizer, text)
    d, deltas, results = _stream(
        tokenizer, list(prompt), out, stop=stop, include_stop_str_in_output=include
    )
    streamed = ""
    for delta in deltas:
        streamed += delta
        assert expected.startswith(streamed), "streamed text that the stop string removes"
    assert streamed == expected
    stops = [r.stop_string for r in results if r.stop_string is not None]
    assert stops == ([matched] if matched else [])
    return d


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_truncates(tok, include):
    text = "héllo wörld 日本語 🙂 emoji"
    expected = "héllo wörld" if include else "héllo "
    d = _check_stop(tok, text, ["wörld"], expected, "wörld", include)
    assert d.update(_encode(tok, " more"), finished=False).text_delta == ""  # it has finished


def test_stop_string_split_across_tokens(bl):
    stop = "quick brown fox"
    ids = _encode(bl, "The quick brown fox jumps")
    pieces = [bl.decode([i]) for i in ids]
    assert not any(stop in p for p in pieces) and len(ids) > 3  # spans several tokens
    _check_stop(bl, "The quick brown fox jumps", [stop], "The ", stop)
    _check_stop(bl, "The quick brown fox jumps", [stop], "The quick brown fox", stop, True)


def test_multibyte_stop_string(tok):
    _check_stop(tok, "héllo wörld 日本語 🙂 emoji", ["本語"], "héllo wörld 日", "本語")
    _check_stop(tok, "a🙂b🙂c", ["🙂c"], "a🙂b", "🙂c")
    _check_stop(tok, "a🙂b🙂c", ["🙂"], "a🙂", "🙂", include=True)


def test_earliest_stop_string_wins(tok):
    text = "héllo wörld 日本語 🙂 emoji"
    _check_stop(tok, text, ["語", "wör", "zzz"], "héllo ", "wör")
    _check_stop(tok, text, ["emoji", "llo"], "hé", "llo")


def test_random_stop_strings(tok):
    """A stop string cut from the text (or one that never occurs) ends the stream at its first
    occurrence, whatever characters precede it."""
    rng = random.Random(3)
    words = " ".join(TEXTS).split()
    for _ in range(40):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(2, 10)))
        full = tok.decode(_encode(tok, text), skip_special_tokens=True)
        start = rng.randrange(len(full))
        stop = full[start : start + rng.randint(1, 4)]
        if rng.random() < 0.3:
            stop = "§" + stop  # never in the text: nothing is held back for good
        cut = full.find(stop)
        expected = full if cut < 0 else full[:cut]
        _check_stop(tok, text, [stop], expected, None if cut < 0 else stop)


def test_held_back_text_flushed_when_finished(bl):
    out = _encode(bl, "abc wörld x")
    d = IncrementalDetokenizer(TokenDecoder(bl), [], SamplingParams(stop=["x marks", "wörld!"]))
    streamed = "".join(d.update([i], finished=False).text_delta for i in out)
    assert streamed == "abc wörld "  # "x" may start "x marks": held back
    last = d.update([], finished=True)
    assert last.text_delta == "x" and last.stop_string is None


def test_only_possible_stop_prefixes_are_held(bl):
    d = IncrementalDetokenizer(TokenDecoder(bl), [], SamplingParams(stop=["zzzz"]))
    streamed = "".join(d.update([i], finished=False).text_delta for i in _encode(bl, "hello"))
    assert streamed == "hello"  # no suffix of "hello" can start "zzzz"


def test_stop_string_in_prompt_is_ignored(bl):
    prompt = _encode(bl, "please stop here: wör")
    _check_stop(bl, "ld and go", ["stop", "wörld"], "ld and go", None, prompt=prompt)


def test_stop_string_matches_special_token_text(bl):
    im_end = bl.convert_tokens_to_ids("<|im_end|>")
    out = _encode(bl, "hello") + [im_end] + _encode(bl, " more")
    d, deltas, results = _stream(bl, [], out, stop=["<|im_end|>"], skip_special_tokens=False)
    assert "".join(deltas) == "hello"
    assert [r.stop_string for r in results if r.stop_string] == ["<|im_end|>"]


# ---------------------------------------------------------------- chat helpers


def test_apply_chat_template(bl):
    bl.chat_template = CHATML
    try:
        msgs = [ChatMessage("system", "be nice"), ChatMessage("user", "héllo 🙂")]
        ids = apply_chat_template(bl, msgs, PromptOptions())
        assert all(isinstance(i, int) for i in ids)
        expected = "<|im_start|>system\nbe nice<|im_end|>\n<|im_start|>user\nhéllo 🙂<|im_end|>\n"
        assert bl.decode(ids) == expected + "<|im_start|>assistant\n"
        assert ids.count(bl.convert_tokens_to_ids("<|im_start|>")) == 3
        ids = apply_chat_template(bl, msgs, PromptOptions(add_generation_prompt=False))
        assert bl.decode(ids) == expected
    finally:
        bl.chat_template = None


def test_chat_template_options(bl):
    """vLLM's chat fields: the final message left open (continue_final_message), variables
    for the template (chat_template_kwargs), the tokenizer's special tokens on request."""
    bl.chat_template = (
        CHATML[: CHATML.index("{% if add_generation_prompt")]
        + "{% if add_generation_prompt %}<|im_start|>assistant\n"
        + "{% if not enable_thinking | default(true) %}<think></think>{% endif %}{% endif %}"
    )
    try:
        msgs = [ChatMessage("user", "hi"), ChatMessage("assistant", "Once upon")]
        options = PromptOptions(add_generation_prompt=False, continue_final_message=True)
        text = bl.decode(apply_chat_template(bl, msgs, options))
        assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nOnce upon"
        one = [ChatMessage("user", "hi")]
        thinking = bl.decode(apply_chat_template(bl, one, PromptOptions()))
        off = PromptOptions(chat_template_kwargs={"enable_thinking": False})
        assert bl.decode(apply_chat_template(bl, one, off)) == thinking + "<think></think>"
        plain = apply_chat_template(bl, one, PromptOptions())
        eot = bl.convert_tokens_to_ids("<|endoftext|>")
        backend, saved = bl.backend_tokenizer, bl.backend_tokenizer.post_processor
        backend.post_processor = TemplateProcessing(
            single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", eot)]
        )  # a tokenizer that adds a BOS of its own
        try:
            assert apply_chat_template(bl, one, PromptOptions()) == plain
            special = apply_chat_template(bl, one, PromptOptions(add_special_tokens=True))
            assert special == [eot, *plain]
        finally:
            backend.post_processor = saved
    finally:
        bl.chat_template = None


def test_tools_and_earlier_calls_reach_the_template(bl):
    """A request's tools and the messages' calls and call ids are template variables; a call's
    JSON arguments come as an object (templates write them with tojson), as vLLM gives them."""
    bl.chat_template = (
        "{% for t in tools or [] %}[{{ t['function']['name'] }}]{% endfor %}"
        "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}"
        "{% for c in m.get('tool_calls') or [] %}<{{ c['function']['name'] }}"
        "{{ c['function']['arguments'] | tojson }}>{% endfor %}"
        "{% if m.get('tool_call_id') %}#{{ m['tool_call_id'] }}{% endif %};{% endfor %}"
    )
    try:
        call = {"id": "c1", "type": "function",
                "function": {"name": "f", "arguments": '{"x": 1}'}}  # fmt: skip
        msgs = [ChatMessage("user", "hi"), ChatMessage("assistant", "", [call]),
                ChatMessage("tool", "42", tool_call_id="c1")]  # fmt: skip
        tools = [{"type": "function", "function": {"name": "f"}}]
        ids = apply_chat_template(bl, msgs, PromptOptions(tools=tools))
        assert bl.decode(ids) == '[f]user:hi;assistant:<f{"x": 1}>;tool:42#c1;'
    finally:
        bl.chat_template = None


def test_apply_chat_template_errors(bl):
    with pytest.raises(ValueError, match="no chat template"):
        apply_chat_template(bl, [ChatMessage("user", "hi")], PromptOptions())
    bl.chat_template = "{{ raise_exception('roles must alternate') }}"
    try:
        with pytest.raises(ValueError, match="roles must alternate"):
            apply_chat_template(bl, [ChatMessage("user", "hi")], PromptOptions())
        both = PromptOptions(continue_final_message=True)  # add_generation_prompt too
        with pytest.raises(ValueError, match="Cannot set both"):
            apply_chat_template(bl, [ChatMessage("user", "hi")], both)
        reserved = PromptOptions(chat_template_kwargs={"tokenize": True, "x": 1})
        with pytest.raises(ValueError, match="may not set tokenize"):
            apply_chat_template(bl, [ChatMessage("user", "hi")], reserved)
        bl.chat_template = "{{ limit + 1 }}"  # a kwarg of the wrong type: a TypeError inside
        wrong = PromptOptions(chat_template_kwargs={"limit": "ten"})
        with pytest.raises(ValueError, match="chat template error"):
            apply_chat_template(bl, [ChatMessage("user", "hi")], wrong)
    finally:
        bl.chat_template = None


def test_load_tokenizer_and_eos_ids(bl, tmp_path):
    bl.save_pretrained(tmp_path)
    loaded = load_tokenizer(str(tmp_path))
    ids = _encode(loaded, "héllo wörld 日本語")
    assert ids == _encode(bl, "héllo wörld 日本語")
    assert eos_token_ids(str(tmp_path), loaded) == [loaded.eos_token_id]  # no generation config
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert eos_token_ids(str(tmp_path), loaded) == [2]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2, 0]}))
    assert eos_token_ids(str(tmp_path), loaded) == [0, 2]
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": True}))
    assert eos_token_ids(str(tmp_path), loaded) == [loaded.eos_token_id]
    no_eos = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()))
    assert eos_token_ids(str(tmp_path / "missing"), no_eos) == []
