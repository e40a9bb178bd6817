"""Token logprobs given out as the answer's text is (service.api.logprobs.ShownLogprobs),
on a made-up vocabulary: with a stop string the tokens spell the content exactly,
however the text arrives."""

from __future__ import annotations

import pytest

from engine.text.stop import StopStringMatcher
from engine.wire.messages import TokenLogprobs
from service.api.logprobs import ShownLogprobs, TokenTexts

VOCAB = ["The", " capital", " is", " Paris", ".", " Then", "<|end|>"]


class _Tokenizer:
    def decode(self, ids):
        return "".join(VOCAB[i] for i in ids)

    def convert_ids_to_tokens(self, token_id):
        return VOCAB[token_id]


def _replay(ids: list[int], stop: list[str], per_output: int) -> tuple[str, list[dict]]:
    """The answer's content and its chat logprobs' entries, the tokens arriving
    ``per_output`` at a time and taken after each, as a stream does."""
    texts = TokenTexts(_Tokenizer())
    shown = ShownLogprobs(texts, hold=bool(stop))
    matcher = StopStringMatcher(stop)
    content, entries = "", []
    for at in range(0, len(ids), per_output):
        chunk = ids[at : at + per_output]
        shown.add([TokenLogprobs(t, -0.5 * (t + 1), [t], [-0.5 * (t + 1)]) for t in chunk])
        safe, stopped = matcher.feed("".join(VOCAB[t] for t in chunk))
        last = at + per_output >= len(ids)
        if not stopped and last:
            safe += matcher.flush()
        shown.show(safe, finished=last, stopped=stopped)
        content += safe
        entries += texts.chat(shown.take())["content"]
        if stopped:
            break
    return content, entries


@pytest.mark.parametrize("per_output", [1, 2, 5])
@pytest.mark.parametrize(
    ("stop", "content", "last"),
    [
        ([" Paris"], "The capital is", " is"),  # at a token boundary
        (["aris"], "The capital is P", " P"),  # inside a token: it is kept, cut
        ([" is P"], "The capital", " capital"),  # the stop begins where a token does
        (["al i"], "The capit", " capit"),  # begins in one token, ends in the next
    ],
)
def test_logprobs_tokens_spell_the_content_a_stop_cut(per_output, stop, content, last):
    got, entries = _replay([0, 1, 2, 3, 4, 5], stop, per_output)
    assert got == content
    assert "".join(e["token"] for e in entries) == content
    assert entries[-1]["token"] == last and bytes(entries[-1]["bytes"]).decode() == last
    # A cut token's logprob is the whole token's (it was sampled whole).
    assert entries[-1]["logprob"] == -0.5 * (len(entries))


def test_without_a_stop_every_token_is_given_out():
    content, entries = _replay([0, 1, 2, 3, 4, 6], [], 2)
    assert content == "The capital is Paris.<|end|>"
    assert [e["token"] for e in entries] == VOCAB[:5] + ["<|end|>"]
    # A stop that never comes holds nothing back at the end.
    content, entries = _replay([0, 1, 2, 3, 4], ["nowhere"], 2)
    assert "".join(e["token"] for e in entries) == content == "The capital is Paris."
