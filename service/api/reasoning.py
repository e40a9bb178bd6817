"""A reasoning model's thinking, kept apart from its answer.

Models such as Qwen3 and DeepSeek-R1 write their reasoning between ``<think>`` and
``</think>`` before the answer. The API returns that text as
``message.reasoning_content`` (``delta.reasoning_content`` in streams, as vLLM and
DeepSeek's API name it) and the rest as ``content``. Some templates open the block in
the prompt (the prompt ends with ``<think>``), so the answer starts inside it; others
close an empty block when thinking is off (``enable_thinking: false``), so the answer
has none. The split applies only to models whose chat template speaks of ``<think>``.

:class:`ReasoningSplitter` works on streamed text: a tag cut between two pieces is held
back until it is whole, so no piece of ``<think>`` ever reaches ``content``.
"""

from __future__ import annotations

from dataclasses import dataclass

from service.api.harmony import template_is_harmony

OPEN = "<think>"
CLOSE = "</think>"


def template_thinks(chat_template: str | None) -> bool:
    """Whether a chat template writes thinking blocks (mentions ``<think>``) or
    harmony's analysis messages."""
    return bool(chat_template) and (OPEN in chat_template or template_is_harmony(chat_template))  # type: ignore[operator]


def prompt_opens_thinking(prompt_tail: str) -> bool:
    """Whether the rendered prompt ends inside a thinking block (its last ``<think>``
    is not closed), so the model's first words are reasoning."""
    return prompt_tail.rfind(OPEN) > prompt_tail.rfind(CLOSE)


def _held(text: str, tag: str) -> int:
    """How many trailing characters of ``text`` could be the start of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


@dataclass
class ReasoningSplitter:
    """Splits one sequence's text, fed piece by piece, into reasoning and content.

    Args:
        in_reasoning: start inside a thinking block (the prompt opened it).
    """

    in_reasoning: bool = False
    _pending: str = ""
    _seen_text: bool = False

    def feed(self, text: str) -> tuple[str, str]:
        """The ``(reasoning, content)`` that ``text`` completes; a possible partial
        tag at its end is held until the next call or :meth:`flush`."""
        text = self._pending + text
        self._pending = ""
        reasoning: list[str] = []
        content: list[str] = []
        while text:
            if self.in_reasoning:
                end = text.find(CLOSE)
                if end < 0:
                    keep = _held(text, CLOSE)
                    reasoning.append(text[: len(text) - keep])
                    self._pending = text[len(text) - keep :]
                    break
                reasoning.append(text[:end])
                text = text[end + len(CLOSE) :]
                self.in_reasoning = False
                continue
            # A block opens only at the start of the answer (after whitespace).
            if not self._seen_text:
                stripped = text.lstrip()
                if stripped.startswith(OPEN):
                    text = stripped[len(OPEN) :]
                    self.in_reasoning = True
                    self._seen_text = True
                    continue
                if OPEN.startswith(stripped):
                    self._pending = text  # maybe "<thi": wait for more
                    break
            self._seen_text = True
            content.append(text)
            break
        return "".join(reasoning), "".join(content)

    def flush(self) -> tuple[str, str]:
        """What is held back, at the end of the sequence."""
        text, self._pending = self._pending, ""
        if self.in_reasoning:
            return text, ""
        return "", text


def split_reasoning(text: str, *, in_reasoning: bool = False) -> tuple[str | None, str]:
    """A whole answer as ``(reasoning or None, content)``; the content loses the
    whitespace the template puts after ``</think>``."""
    if not (in_reasoning or OPEN in text or CLOSE in text):
        return None, text
    splitter = ReasoningSplitter(in_reasoning=in_reasoning)
    reasoning, content = splitter.feed(text)
    tail_reasoning, tail_content = splitter.flush()
    return (reasoning + tail_reasoning).strip() or None, (content + tail_content).lstrip()


def reasoning_start(chat_template: str | None, prompt_tail: str) -> bool | None:
    """How a model's answer is split: None (not at all: its template writes no
    thinking), True (it starts inside a block the prompt opened), False (a block may
    open at its start). ``prompt_tail``: the end of the rendered prompt."""
    if not template_thinks(chat_template):
        return None
    return prompt_opens_thinking(prompt_tail)
