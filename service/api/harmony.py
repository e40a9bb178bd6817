"""gpt-oss's harmony format: an answer's channels as reasoning, content and tool calls.

A harmony answer is a run of messages, each a header and a body, written with special
tokens (the text here keeps them: the detokenizer does not skip them for these models)::

    <|channel|>analysis<|message|>The user asks...<|end|>
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

The generation prompt ends with ``<|start|>assistant``, so the answer starts inside
the first header. A header names the message's channel and, for a call, its recipient
(``to=functions.NAME``, after the channel or after the role, as the template writes
past calls); ``<|constrain|>json`` says the body is JSON. A body ends at ``<|end|>``,
``<|return|>`` (the answer's end) or ``<|call|>`` (a call's end).

What each message becomes: ``analysis`` is reasoning (``reasoning_content``, Ollama's
``thinking``, Anthropic's thinking blocks); ``final`` and ``commentary`` without a
recipient (a preamble shown to the user) are content; a message with a recipient is a
tool call, its body the arguments (``functions.`` left off the name). A header that is
not one (too long, or holding other special tokens) turns the rest of the answer into
plain content, with the harmony tokens left out, as a model that ignored the format
would have been shown; a call whose arguments are not JSON (cut by ``max_tokens``) is
content too, and so is a marker's cut start ending the answer (``<|``, ``<|channel``:
text, no token). Nothing here raises on what a model writes.

:class:`HarmonyParser` works on streamed text: reasoning and content go out as they
come, a marker cut between two pieces is held back until it is whole, and a call's
arguments are held until its body ends.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from service.api import finite_json

START = "<|start|>"
CHANNEL = "<|channel|>"
MESSAGE = "<|message|>"
CONSTRAIN = "<|constrain|>"
END = "<|end|>"
RETURN = "<|return|>"
CALL = "<|call|>"
_ENDS = (END, RETURN, CALL)
_HEADER_MARKERS = (START, CHANNEL, CONSTRAIN)
# Every token of the format, left out of plain content (``<|endoftext|>`` is an end token).
_TOKENS = (*_HEADER_MARKERS, MESSAGE, *_ENDS, "<|endoftext|>")
_TOKEN = re.compile("|".join(re.escape(t) for t in _TOKENS))
# A header is a few words: a longer run without <|message|> is not one.
_MAX_HEADER = 256
_HEADER_STARTS = (*_HEADER_MARKERS, "to=")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
# The role a model's own messages carry after <|start|>.
_ROLE = "assistant"
_FUNCTIONS = "functions."

REASONING = "analysis"
FINAL = "final"
COMMENTARY = "commentary"

# The opening of a thinking block and its close into the answer, as the engine's
# thinking budget matches and forces them (:mod:`engine.sampling.thinking`).
THINKING_OPEN = CHANNEL + REASONING + MESSAGE
THINKING_CLOSE = END + START + "assistant" + CHANNEL + FINAL + MESSAGE
# The header of the final message, up to its body: a schema-constrained answer's start.
FINAL_OPENING = CHANNEL + FINAL + MESSAGE


def template_is_harmony(chat_template: str | None) -> bool:
    """Whether a chat template writes harmony messages (gpt-oss's)."""
    return bool(chat_template) and CHANNEL in chat_template and MESSAGE in chat_template  # type: ignore[operator]


def recipient_fault(name: str) -> str | None:
    """Why a call to function ``name`` cannot be written in a header, or None when it
    can: the recipient ``to=functions.NAME`` ends at whitespace or a token's ``<``."""
    if _RECIPIENT.fullmatch(f"to={_FUNCTIONS}{name}") is None:
        return (
            f"tool name {name!r} cannot be called by this model: its calls name the function "
            "in the message header as to=functions.NAME, which ends at whitespace or '<'; "
            "rename it without them (letters, digits, '_' and '-', as OpenAI requires, always work)"
        )
    return None


def call_opening(name: str) -> str:
    """The header of a call to function ``name``, up to its JSON body: the answer a
    forced call starts with."""
    return f"{CHANNEL}{COMMENTARY} to={_FUNCTIONS}{name} {CONSTRAIN}json{MESSAGE}"


def harmony_lead(parser: HarmonyParser) -> str:
    """What closes the message ``parser`` stands in (fed a prompt's tail) and opens the
    next header, so that a header the server writes follows: nothing in a header."""
    return "" if parser.in_header else END + START + "assistant"


def plain(text: str) -> str:
    """``text`` with the format's tokens left out."""
    return _TOKEN.sub("", text)


def _held(text: str, markers: tuple[str, ...]) -> int:
    """How many trailing characters of ``text`` could start one of ``markers``."""
    for n in range(min(max(len(m) for m in markers) - 1, len(text)), 0, -1):
        if any(m.startswith(text[-n:]) for m in markers):
            return n
    return 0


def _role_possible(header: str) -> bool:
    """Whether each ``<|start|>`` of ``header`` is followed by what can still become the
    model's role and its recipient (``assistant``, ``assistant to=...``), up to the next
    marker."""
    for after in header.split(START)[1:]:
        after = after.split("<", 1)[0]
        if _ROLE.startswith(after):
            continue
        rest = after[len(_ROLE):] if after.startswith(_ROLE) else ""
        if not rest[:1].isspace() or not ("to=".startswith(rest.lstrip()) or rest.lstrip().startswith("to=")):
            return False
    return True


def _header_possible(header: str) -> bool:
    """Whether ``header`` (no ``<|message|>`` yet) can still become a header: it starts
    with a header's token (or the recipient the role may carry), a ``<|start|>`` is
    followed by the model's role, and it holds no other token."""
    if len(header) > _MAX_HEADER or not _role_possible(header):
        return False
    start = header.lstrip()  # whitespace between messages is let through
    if not any(m.startswith(start) or start.startswith(m) for m in _HEADER_STARTS):
        return False
    rest = header
    for marker in _HEADER_MARKERS:
        rest = rest.replace(marker, "")
    rest = rest[: len(rest) - _held(rest, (MESSAGE, *_HEADER_MARKERS))]
    return "<|" not in rest


def _unfinished_header(header: str, prompt: int = 0) -> str:
    """What of ``header``, cut before its ``<|message|>``, the model wrote as text (its
    first ``prompt`` characters are the prompt's): a marker's cut start (``<|``,
    ``<|channel``) is no token; the model's whole text when it began no header. A
    header's tokens, role, channel and recipient are not text."""
    cut = _held(header, (MESSAGE, *_HEADER_MARKERS))
    began = header[prompt : len(header) - cut]
    if any(m in began for m in _HEADER_MARKERS) or began.lstrip().startswith("to="):
        return header[len(header) - cut :]
    return header[prompt:] if began.strip() or cut else ""


@dataclass(frozen=True)
class HarmonyCall:
    """A call the answer made: ``arguments`` is JSON text, as OpenAI sends it."""

    name: str
    arguments: str


@dataclass
class HarmonyParser:
    """Splits one sequence's harmony text, fed piece by piece, into reasoning, content
    and calls (:attr:`calls`, complete ones only)."""

    calls: list[HarmonyCall] = field(default_factory=list)
    _state: str = "header"  # header, body or plain
    _pending: str = ""  # the header so far, or a body's possible partial marker
    _channel: str = ""
    _recipient: str | None = None
    _arguments: str = ""  # a call's body so far
    _prompt: int = 0  # leading characters of the held header that the prompt wrote (prime)

    @property
    def in_header(self) -> bool:
        """Whether the text so far ends between messages or inside a header."""
        return self._state == "header"

    @property
    def in_reasoning(self) -> bool:
        """Whether the text so far ends inside an analysis message's body."""
        return self._state == "body" and self._recipient is None and self._channel == REASONING

    def prime(self, prompt: str) -> None:
        """Read the prompt's text the answer continues (its open header, say
        ``<|start|>assistant``): it shapes what follows but is never the model's text."""
        self.feed(prompt)
        self._prompt = len(self._pending) if self._state == "header" else 0

    def feed(self, text: str) -> tuple[str, str]:
        """The ``(reasoning, content)`` that ``text`` completes."""
        text = self._pending + text
        self._pending = ""
        reasoning: list[str] = []
        content: list[str] = []
        while text:
            if self._state == "plain":
                content.append(plain(text))
                break
            if self._state == "header":
                at = text.find(MESSAGE)
                header = text if at < 0 else text[:at]
                if not _header_possible(header):
                    self._state = "plain"
                    text, self._prompt = text[self._prompt :], 0  # the prompt's part is not shown
                    continue
                if at < 0:
                    self._pending = text
                    break
                self._open(header)
                text = text[at + len(MESSAGE) :]
                continue
            found = [(at, m) for m in (*_ENDS, START) if (at := text.find(m)) >= 0]
            if found:
                at, marker = min(found)
                body, text = text[:at], text[at + (0 if marker == START else len(marker)) :]
            else:
                keep = _held(text, (*_ENDS, START))
                body, self._pending, text = text[: len(text) - keep], text[len(text) - keep :], ""
            self._body(body, reasoning, content)
            if found:
                self._close(content)
        return "".join(reasoning), "".join(content)

    def flush(self) -> tuple[str, str]:
        """What is held back, at the end of the sequence: an unclosed body's text (a
        call's arguments as a call when they are whole JSON, else as content); an
        unfinished header's text that is no token (``<|chan`` cut by ``max_tokens``) as
        content."""
        reasoning: list[str] = []
        content: list[str] = []
        text, self._pending = self._pending, ""
        if self._state == "plain":
            content.append(plain(text))
        elif self._state == "body":
            self._body(text, reasoning, content)
            self._close(content)
        else:
            content.append(_unfinished_header(text, self._prompt))
        self._prompt = 0
        return "".join(reasoning), "".join(content)

    def _open(self, header: str) -> None:
        after = header.split(CHANNEL, 1)[1] if CHANNEL in header else ""
        self._channel = re.split(r"[\s<]", after, maxsplit=1)[0] or FINAL
        recipient = _RECIPIENT.search(header)
        self._recipient = recipient.group(1) if recipient else None
        self._arguments = ""
        self._state = "body"
        self._prompt = 0

    def _body(self, text: str, reasoning: list[str], content: list[str]) -> None:
        if self._recipient is not None:
            self._arguments += text
        elif self._channel == REASONING:
            reasoning.append(text)
        else:
            content.append(text)

    def _close(self, content: list[str]) -> None:
        self._state = "header"
        if self._recipient is None:
            return
        arguments = self._arguments.strip()
        try:
            finite_json.loads(arguments)
        except (ValueError, RecursionError):  # NaN, 1e999 (finite_json); nested past the reader's depth
            content.append(self._arguments)  # not a call: what the model wrote
            return
        self.calls.append(HarmonyCall(self._recipient.removeprefix(_FUNCTIONS), arguments))


def split_harmony(text: str, primer: str = "") -> tuple[str | None, str, list[HarmonyCall]]:
    """A whole answer as ``(reasoning or None, content, calls)``; ``primer``: the
    prompt's text the answer continues (its open header), read but not returned."""
    parser = HarmonyParser()
    parser.prime(primer)
    reasoning, content = parser.feed(text)
    tail_reasoning, tail_content = parser.flush()
    return (reasoning + tail_reasoning) or None, content + tail_content, parser.calls
