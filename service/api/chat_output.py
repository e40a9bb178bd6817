"""A chat answer's text shaped into OpenAI's message: reasoning, content, tool calls.

One :class:`ChatOutput` per request, built from what the request and the model's
template say (:class:`service.api.chat_plan.ChatPlan`, decided as the request goes into
the engine): whether the answer starts inside a thinking block
(:mod:`service.api.reasoning`), which tool-call format to parse and the text the answer
was started with (:mod:`service.api.tools`). The routes ask it for each choice's
message (whole answers) or deltas (streams); the text path, the engine and the
finish reasons stay theirs, except that an answer with calls ends with
``"tool_calls"``.

Streams: reasoning goes out as ``delta.reasoning_content`` as it comes; content goes
out as it comes until a tool call may have begun, then is held; at the end the held
text is parsed, and each call goes out as OpenAI sends it (a delta with its index, id
and name and empty arguments, then one with the arguments), followed by the finish.

gpt-oss's harmony answers (``harmony``) are read by their channels instead
(:mod:`service.api.harmony`): analysis is reasoning, final is content, a message to a
function is a call; its text keeps the special tokens the format is written in.

Text that does not parse as calls is content, streamed or not, and is what the model
wrote: a forced call cut by ``max_tokens`` (its JSON unfinished) answers the model's
text (the cut arguments, without the call's opening the server started the answer
with or the closing it would have added), no ``tool_calls``, and ``finish_reason``
``"length"``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from service.api.harmony import HarmonyCall, HarmonyParser, split_harmony
from service.api.openai.schemas import ChatChunkChoice, ChatMessageOut, Delta
from service.api.reasoning import ReasoningSplitter, split_reasoning
from service.api.tools import ToolCall, ToolPlan, call_start, parse_tool_calls

if TYPE_CHECKING:
    from service.api.chat_plan import ChatPlan

FINISH_TOOL_CALLS = "tool_calls"


@dataclass
class _Sequence:
    reasoning: ReasoningSplitter | None
    held: str = ""  # content not yet sent: a tool call may have begun in it
    harmony: HarmonyParser | None = None
    sent: int = 0  # characters of the answer's content (prefix included) sent


@dataclass
class ChatOutput:
    """Shapes the ``n`` answers of one chat request.

    Args:
        n: choices.
        thinking: None (no reasoning split), or whether answers start inside a
            thinking block (:func:`service.api.reasoning.reasoning_start`).
        tools: the request's :class:`~service.api.tools.ToolPlan`.
        harmony: the answers are harmony messages (``thinking`` is then None).
        primer: harmony's text the answers continue (``ChatPlan.primer``).
    """

    n: int
    thinking: bool | None = None
    tools: ToolPlan = field(default_factory=ToolPlan)
    harmony: bool = False
    primer: str = ""
    _seqs: list[_Sequence] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._seqs = [
            _Sequence(
                reasoning=None if self.thinking is None else ReasoningSplitter(self.thinking),
                held=self.tools.prefix,
                harmony=HarmonyParser() if self.harmony else None,
            )
            for _ in range(self.n)
        ]
        for seq in self._seqs:
            if seq.harmony is not None:
                seq.harmony.prime(self.primer + self.tools.prefix)  # the prompt's: not shown

    @classmethod
    def planned(cls, plan: ChatPlan, n: int) -> ChatOutput:
        """The output of ``n`` answers shaped as a chat's ``plan`` says."""
        return cls(n=n, thinking=plan.thinking, tools=plan.tools, harmony=plan.harmony, primer=plan.primer)

    def _calls(self, calls: list[HarmonyCall]) -> tuple[str, list[ToolCall]]:
        """A harmony answer's calls as tool calls; without tool parsing (``tool_choice``
        none) their arguments are content."""
        if self.tools.parse is None:
            return "".join(c.arguments for c in calls), []
        return "", [ToolCall(c.name, c.arguments) for c in calls]

    # -- whole answers ---------------------------------------------------------------

    def message(self, text: str, finish_reason: str | None) -> tuple[ChatMessageOut, str | None]:
        """One choice's message and finish reason from its whole text."""
        if self.harmony:
            reasoning, text, found = split_harmony(text + self.tools.suffix, self.primer + self.tools.prefix)
            extra, calls = self._calls(found)
            message = ChatMessageOut(role="assistant", content=text + extra)
            if reasoning is not None:
                message.reasoning_content = reasoning
            if calls:
                message.content = message.content or None
                message.tool_calls = [c.as_openai() for c in calls]
                return message, FINISH_TOOL_CALLS
            return message, finish_reason
        reasoning = None
        if self.thinking is not None:
            reasoning, text = split_reasoning(text, in_reasoning=self.thinking)
        message = ChatMessageOut(role="assistant", content=text)
        if reasoning is not None:
            message.reasoning_content = reasoning
        if self.tools.parse is not None:
            whole = self.tools.prefix + text + self.tools.suffix
            content, calls = parse_tool_calls(self.tools.parse, whole, self.tools.tools)
            if calls:
                message.content = content or None
                message.tool_calls = [c.as_openai() for c in calls]
                return message, FINISH_TOOL_CALLS
        return message, finish_reason

    # -- streams ---------------------------------------------------------------------

    def deltas(
        self, index: int, text: str, finish_reason: str | None, role: str | None
    ) -> list[ChatChunkChoice]:
        """The stream choices one piece of sequence ``index`` makes (the role event:
        ``role`` set, no text)."""
        if role is not None:
            return [ChatChunkChoice(index=index, delta=Delta(role=role, content=""))]
        seq = self._seqs[index]
        if seq.harmony is not None:
            return self._harmony_deltas(index, seq.harmony, text, finish_reason)
        reasoning, content = "", text
        if seq.reasoning is not None:
            reasoning, content = seq.reasoning.feed(text)
            if finish_reason is not None:
                tail_reasoning, tail_content = seq.reasoning.flush()
                reasoning += tail_reasoning
                content += tail_content
        out = []
        if reasoning:
            out.append(ChatChunkChoice(index=index, delta=Delta(reasoning_content=reasoning)))
        if self.tools.parse is None:
            if content:
                out.append(ChatChunkChoice(index=index, delta=Delta(content=content)))
        else:
            out += self._tool_deltas(index, seq, content, finish_reason)
            if finish_reason is not None and out and out[-1].finish_reason is not None:
                return out
        if finish_reason is not None:
            out.append(ChatChunkChoice(index=index, delta=Delta(), finish_reason=finish_reason))
        return out

    def _tool_deltas(
        self, index: int, seq: _Sequence, content: str, finish_reason: str | None
    ) -> list[ChatChunkChoice]:
        assert self.tools.parse is not None
        seq.held += content
        if finish_reason is None:
            start = call_start(self.tools.parse, seq.held)
            safe = seq.held if start is None else seq.held[:start]
            seq.held = seq.held[len(safe) :]
            seq.sent += len(safe)
            return [ChatChunkChoice(index=index, delta=Delta(content=safe))] if safe else []
        rest, calls = parse_tool_calls(self.tools.parse, seq.held + self.tools.suffix, self.tools.tools)
        if not calls:
            # What the model wrote, as in a whole answer: a forced call's opening (never
            # sent: a call starts in it) and closing are the server's, not the model's.
            rest = seq.held.removeprefix(self.tools.prefix)
        out = []
        if rest:
            out.append(ChatChunkChoice(index=index, delta=Delta(content=rest)))
        return out + self._call_deltas(index, calls)

    def _harmony_deltas(
        self, index: int, parser: HarmonyParser, text: str, finish_reason: str | None
    ) -> list[ChatChunkChoice]:
        reasoning, content = parser.feed(text)
        calls: list[ToolCall] = []
        if finish_reason is not None:
            for more in (parser.feed(self.tools.suffix), parser.flush()):
                reasoning, content = reasoning + more[0], content + more[1]
            extra, calls = self._calls(parser.calls)
            content += extra
        out = []
        if reasoning:
            out.append(ChatChunkChoice(index=index, delta=Delta(reasoning_content=reasoning)))
        if content:
            out.append(ChatChunkChoice(index=index, delta=Delta(content=content)))
        out += self._call_deltas(index, calls)
        if finish_reason is not None and not calls:
            out.append(ChatChunkChoice(index=index, delta=Delta(), finish_reason=finish_reason))
        return out

    def _call_deltas(self, index: int, calls: list[ToolCall]) -> list[ChatChunkChoice]:
        """The stream choices of an answer's calls, then its ``tool_calls`` finish."""
        out = []
        for i, call in enumerate(calls):
            head: dict[str, Any] = call.as_openai(i)
            arguments = head["function"]["arguments"]
            head["function"]["arguments"] = ""
            out.append(ChatChunkChoice(index=index, delta=Delta(tool_calls=[head])))
            piece = {"index": i, "function": {"arguments": arguments}}
            out.append(ChatChunkChoice(index=index, delta=Delta(tool_calls=[piece])))
        if calls:
            out.append(ChatChunkChoice(index=index, delta=Delta(), finish_reason=FINISH_TOOL_CALLS))
        return out
