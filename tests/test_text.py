"""engine.text: chat template, incremental detokenizer, stop strings, tokenizer loading."""

from __future__ import annotations

import random
import subprocess
import sys

import jinja2
import pytest

from engine.text.chat import ChatTemplateError, encode_chat, encode_prompt, render_chat
from engine.text.detokenizer import IncrementalDetokenizer
from engine.text.stop import StopStringMatcher
from engine.text.tokenizer import load_tokenizer

MIXED_TEXT = "Hi 👋🏽 世界, ça va? — 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 🎉 done."


# --- a SentencePiece-style tokenizer, built offline -------------------------------------


@pytest.fixture(scope="module")
def sp_tokenizer():
    """A tiny Llama-style tokenizer: "▁" for spaces, byte fallback for anything outside
    its vocabulary, a BOS added by the post-processor, a template that writes "<s>"."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    vocab = {t: i for i, t in enumerate(specials)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for c in "▁abcdefghijklmnopqrstuvwxyz,.!?":
        vocab[c] = len(vocab)
    merges = [
        ("▁", "t"),
        ("h", "e"),
        ("▁t", "he"),
        ("▁", "w"),
        ("o", "r"),
        ("▁w", "or"),
        ("l", "d"),
        ("▁wor", "ld"),
        ("l", "o"),
    ]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True)
    )
    tok.add_special_tokens(specials)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    wrapped.chat_template = (
        "{{ '<s>' }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}"
    )
    return wrapped


class RecordingTokenizer:
    """Forwards ``decode`` and records the longest id list it was given."""

    def __init__(self, inner):
        self.inner = inner
        self.max_decode_len = 0

    def decode(self, ids, **kwargs):
        self.max_decode_len = max(self.max_decode_len, len(ids))
        return self.inner.decode(ids, **kwargs)


def stream(det: IncrementalDetokenizer, ids: list[int], step: int = 1) -> list[str]:
    pieces = [det.add(ids[i : i + step]) for i in range(0, len(ids), step)]
    return pieces + [det.flush()]


# --- chat --------------------------------------------------------------------------------


def test_prompt_ends_with_generation_header(smollm_tokenizer):
    prompt = render_chat(smollm_tokenizer, [{"role": "user", "content": "What is 2+2?"}])
    assert prompt.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")


def test_developer_renders_as_system(smollm_tokenizer):
    as_dev = render_chat(
        smollm_tokenizer,
        [{"role": "developer", "content": "Be terse."}, {"role": "user", "content": "hi"}],
    )
    as_sys = render_chat(
        smollm_tokenizer,
        [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi"}],
    )
    assert as_dev == as_sys
    assert as_dev.startswith("<|im_start|>system\nBe terse.<|im_end|>\n")


def test_text_parts_are_joined(smollm_tokenizer):
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    joined = render_chat(smollm_tokenizer, [{"role": "user", "content": parts}])
    assert joined == render_chat(smollm_tokenizer, [{"role": "user", "content": "first\nsecond"}])


def test_multi_turn_keeps_every_message(smollm_tokenizer):
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U1"},
        {"role": "assistant", "content": "A1"},
        {"role": "user", "content": "U2"},
    ]
    assert render_chat(smollm_tokenizer, messages) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU1<|im_end|>\n"
        "<|im_start|>assistant\nA1<|im_end|>\n<|im_start|>user\nU2<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_a_missing_role_is_said_to_be_missing(smollm_tokenizer):
    with pytest.raises(ChatTemplateError) as info:
        render_chat(smollm_tokenizer, [{"content": "hi"}])
    assert str(info.value).startswith("messages[0].role is missing; use one of system, developer, user")
    assert info.value.param == "messages[0].role"


def test_a_content_part_that_is_not_an_object_is_named(smollm_tokenizer):
    with pytest.raises(ChatTemplateError) as info:
        render_chat(smollm_tokenizer, [{"role": "user", "content": [5]}])
    assert "messages[0].content[0] without a type (a part is an object) is not supported" in str(info.value)


@pytest.mark.parametrize("role", ["tool", "function", "narrator"])
def test_unsupported_role_is_named(smollm_tokenizer, role):
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "x"},
        {"role": role, "content": "42"},
    ]
    with pytest.raises(ChatTemplateError) as info:
        render_chat(smollm_tokenizer, messages)
    assert f"messages[2].role {role!r} is not supported" in str(info.value)
    assert info.value.param == "messages[2].role"
    # Every role the API takes is named, tool with why it is not one for this model.
    assert "system, developer, user, assistant; tool needs a model whose chat template" in str(info.value)


def test_non_text_part_is_rejected(smollm_tokenizer):
    parts = [
        {"type": "text", "text": "look"},
        {"type": "image_url", "image_url": {"url": "data:,"}},
    ]
    with pytest.raises(ChatTemplateError) as info:
        render_chat(smollm_tokenizer, [{"role": "user", "content": parts}])
    assert info.value.param == "messages[0].content[1]"
    assert "'image_url'" in info.value.message


@pytest.mark.parametrize("content", [None, 7, {"type": "text", "text": "x"}])
def test_bad_content_is_rejected(smollm_tokenizer, content):
    with pytest.raises(ChatTemplateError) as info:
        render_chat(smollm_tokenizer, [{"role": "user", "content": content}])
    assert info.value.param == "messages[0].content"


def test_empty_messages_rejected(smollm_tokenizer):
    with pytest.raises(ChatTemplateError, match="must not be empty"):
        render_chat(smollm_tokenizer, [])


def test_template_error_becomes_chat_template_error():
    class StrictTokenizer:
        chat_template = "strict"

        def apply_chat_template(self, messages, **kwargs):
            raise jinja2.TemplateError("Conversation roles must alternate user/assistant")

    with pytest.raises(ChatTemplateError) as info:
        render_chat(
            StrictTokenizer(), [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
        )
    assert "roles: user, user" in info.value.message
    assert "must alternate" in info.value.message
    assert info.value.param == "messages"


@pytest.mark.parametrize("where", ["tools", "arguments", "template_kwargs"])
def test_values_nested_past_the_renderer_s_depth_are_a_chat_template_error(smollm_tokenizer, where):
    """A tool's parameters 800 objects deep (within the body decoder's limit) answered
    500 ``internal error: RecursionError`` on every chat route (transformers copies the
    template's data recursively, and Jinja's tojson recurses too); so did a past call's
    arguments as an object and a chat_template_kwargs value. Now a ChatTemplateError
    (a 400) saying to flatten it."""
    deep: dict = {"type": "object"}
    for _ in range(800):
        deep = {"type": "object", "properties": {"a": deep}}
    tool = {"type": "function", "function": {"name": "f", "parameters": deep if where == "tools" else {}}}
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": deep if where == "arguments" else {}}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c", "content": "ok"}]
    kwargs = {"x": deep} if where == "template_kwargs" else None
    original = smollm_tokenizer.chat_template
    smollm_tokenizer.chat_template = "{{ tools | tojson }}{% for m in messages %}{{ m | tojson }}{% endfor %}{{ x | tojson }}"
    try:
        with pytest.raises(ChatTemplateError, match="nested too deeply") as info:
            render_chat(smollm_tokenizer, messages, tools=[tool], template_kwargs=kwargs)
    finally:
        smollm_tokenizer.chat_template = original
    assert info.value.param == "messages" and "flatten" in info.value.message


def test_no_chat_template_points_to_completions():
    class PlainTokenizer:
        chat_template = None

    with pytest.raises(ChatTemplateError, match="/v1/completions"):
        render_chat(PlainTokenizer(), [{"role": "user", "content": "hi"}])


def test_encode_chat_matches_rendered_prompt(smollm_tokenizer):
    messages = [{"role": "user", "content": "Hello 世界"}]
    ids = encode_chat(smollm_tokenizer, messages)
    prompt = render_chat(smollm_tokenizer, messages)
    assert ids == smollm_tokenizer.encode(prompt, add_special_tokens=False)
    assert smollm_tokenizer.decode(ids) == prompt
    im_start = smollm_tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids[0] == im_start and ids[1] != im_start


def test_encode_chat_adds_bos_once(sp_tokenizer):
    ids = encode_chat(sp_tokenizer, [{"role": "user", "content": "the world"}])
    assert ids[0] == sp_tokenizer.bos_token_id
    assert ids.count(sp_tokenizer.bos_token_id) == 1
    # A prompt the template did not start with BOS gets the tokenizer's own, once.
    plain = encode_prompt(sp_tokenizer, "the world")
    assert plain[0] == sp_tokenizer.bos_token_id and plain[1] != sp_tokenizer.bos_token_id


# --- detokenizer -------------------------------------------------------------------------


@pytest.mark.parametrize("step", [1, 2, 3])
def test_detok_never_splits_characters(smollm_tokenizer, step):
    ids = smollm_tokenizer.encode(MIXED_TEXT, add_special_tokens=False)
    pieces = stream(IncrementalDetokenizer(smollm_tokenizer), ids, step)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == smollm_tokenizer.decode(ids) == MIXED_TEXT
    if step == 1:
        assert "" in pieces[:-1]  # a multi-byte character was held back


def test_detok_after_chat_prompt(smollm_tokenizer):
    prompt_ids = encode_chat(smollm_tokenizer, [{"role": "user", "content": "hi"}])
    gen = smollm_tokenizer.encode("Hello there! 你好 🙂", add_special_tokens=False)
    eos = smollm_tokenizer.convert_tokens_to_ids("<|im_end|>")
    pieces = stream(IncrementalDetokenizer(smollm_tokenizer, prompt_ids), gen + [eos])
    assert "".join(pieces) == "Hello there! 你好 🙂"


def test_detok_special_tokens(smollm_tokenizer):
    eos = smollm_tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = smollm_tokenizer.encode("ok", add_special_tokens=False) + [eos]
    assert "".join(stream(IncrementalDetokenizer(smollm_tokenizer), ids)) == "ok"
    kept = IncrementalDetokenizer(smollm_tokenizer, skip_special_tokens=False)
    assert "".join(stream(kept, ids)) == "ok<|im_end|>"


def test_detok_flush_releases_split_character(smollm_tokenizer):
    ids = smollm_tokenizer.encode("a🎉", add_special_tokens=False)
    det = IncrementalDetokenizer(smollm_tokenizer)
    held = det.add(ids[:-1])  # "a" plus the emoji's first bytes
    assert "\ufffd" not in held
    assert held + det.flush() == smollm_tokenizer.decode(ids[:-1])


def test_detok_decodes_a_bounded_window(smollm_tokenizer):
    recording = RecordingTokenizer(smollm_tokenizer)
    ids = smollm_tokenizer.encode(MIXED_TEXT * 20, add_special_tokens=False)
    prompt = smollm_tokenizer.encode("a long prompt " * 50, add_special_tokens=False)
    pieces = stream(IncrementalDetokenizer(recording, prompt), ids)
    assert "".join(pieces) == MIXED_TEXT * 20
    assert recording.max_decode_len <= 12


@pytest.mark.parametrize("step", [1, 2])
def test_detok_sentencepiece_spaces_and_bytes(sp_tokenizer, step):
    text = "the world  hello 世界 🎉 the fox."
    ids = sp_tokenizer.encode(text, add_special_tokens=False)
    assert sp_tokenizer.convert_ids_to_tokens(ids)[0] == "▁the"  # spaces live in tokens
    pieces = stream(IncrementalDetokenizer(sp_tokenizer), ids, step)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == sp_tokenizer.decode(ids) == text


def test_detok_sentencepiece_keeps_space_after_prompt(sp_tokenizer):
    prompt_ids = sp_tokenizer.encode("hello")
    gen = sp_tokenizer.encode("the world", add_special_tokens=False)  # starts with "▁the"
    pieces = stream(IncrementalDetokenizer(sp_tokenizer, prompt_ids), gen)
    assert "".join(pieces) == " the world"


# --- stop strings ------------------------------------------------------------------------


def test_stop_split_across_feeds():
    m = StopStringMatcher(["STOP"])
    assert m.feed("Hello S") == ("Hello ", False)
    assert m.feed("T") == ("", False)
    assert m.feed("O") == ("", False)
    assert m.feed("P and more") == ("", True)
    assert m.stopped
    assert m.feed("later") == ("", True)
    assert m.flush() == ""


def test_stop_inside_one_feed():
    m = StopStringMatcher(["\n\n", "###"])
    assert m.matched is None
    assert m.feed("answer: 4###junk\n\n") == ("answer: 4", True)
    assert m.matched == "###"  # the one that ended the text (Anthropic's stop_sequence)


def test_held_text_released_when_it_diverges():
    m = StopStringMatcher(["STOP"])
    assert m.feed("a ST") == ("a ", False)
    assert m.feed("ART") == ("START", False)


def test_flush_returns_held_text():
    m = StopStringMatcher(["</answer>"])
    assert m.feed("42 </ans") == ("42 ", False)
    assert m.flush() == "</ans"
    assert m.flush() == ""


def test_stop_that_completes_first_wins_whatever_the_split():
    # "bc" completes before "abcd" does, so generation ends there in either split.
    assert StopStringMatcher(["abcd", "bc"]).feed("xabcd") == ("xa", True)
    m = StopStringMatcher(["abcd", "bc"])
    out = [m.feed(c) for c in "xabcd"]
    assert "".join(t for t, _ in out) == "xa" and out[3][1]


def test_no_stops_passes_text_through():
    m = StopStringMatcher([])
    assert m.feed("anything") == ("anything", False)
    assert m.flush() == ""


@pytest.mark.parametrize("stops", [[""], ["ok", ""]])
def test_empty_stop_rejected(stops):
    with pytest.raises(ValueError, match="non-empty"):
        StopStringMatcher(stops)


def _reference_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    ends = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
    return (text[: min(ends)[1]], True) if ends else (text, False)


def test_stop_matches_reference_on_random_splits():
    rng = random.Random(0)
    for _ in range(500):
        stops = ["".join(rng.choices("ab", k=rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choices("abc", k=rng.randint(0, 20)))
        m = StopStringMatcher(stops)
        out, stopped, i = [], False, 0
        while i < len(text) and not stopped:
            n = rng.randint(1, 4)
            piece, stopped = m.feed(text[i : i + n])
            out.append(piece)
            i += n
        if not stopped:
            out.append(m.flush())
        assert ("".join(out), stopped) == _reference_stop(text, stops), (text, stops)


# --- tokenizer loading and imports -------------------------------------------------------


def test_load_tokenizer_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(str(tmp_path / "nope"))


def test_load_tokenizer_empty_folder(tmp_path):
    with pytest.raises(OSError, match="no loadable tokenizer"):
        load_tokenizer(str(tmp_path))


def test_load_tokenizer_round_trip(smollm_tokenizer, tmp_path):
    smollm_tokenizer.save_pretrained(tmp_path)
    loaded = load_tokenizer(str(tmp_path))
    messages = [{"role": "user", "content": MIXED_TEXT}]
    assert encode_chat(loaded, messages) == encode_chat(smollm_tokenizer, messages)


def test_text_modules_do_not_import_torch():
    code = (
        "import sys, engine.text.chat, engine.text.detokenizer, engine.text.stop, "
        "engine.text.tokenizer; print('torch' in sys.modules, 'transformers' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.split() == ["False", "False"]
