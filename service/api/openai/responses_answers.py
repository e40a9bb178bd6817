"""The Responses API's answers: a started :class:`~service.api.generation.Generation`
as one ``response`` object, or as its stream of events.

The answer's text is shaped as a chat answer's is (:class:`service.api.chat_output.ChatOutput`:
reasoning split, tool calls parsed), then laid out as Responses' output items: a
``reasoning`` item, a ``message`` item, one ``function_call`` item per call, each only
when the answer has it (an answer with none of them has an empty message). A finish
by ``max_output_tokens`` is ``status: "incomplete"`` with
``incomplete_details.reason: "max_output_tokens"``, and so is the text item the cut
fell in: the message, or the reasoning when nothing came after it.

Streams are Server-Sent Events, each ``event: <type>`` and ``data: <JSON>`` whose
``type`` repeats it and whose ``sequence_number`` counts from 0, as OpenAI sends
them: ``response.created``, ``response.in_progress``; per item
``response.output_item.added``, then for text ``response.content_part.added``, the
deltas (``response.reasoning_text.delta`` or ``response.output_text.delta``), their
``.done``, ``response.content_part.done``, or for a call
``response.function_call_arguments.delta`` and ``.done``; then
``response.output_item.done``; last ``response.completed`` (or
``response.incomplete``) with the whole response. A stream cut early closes the item
it was writing with the text sent so far, ``status: "incomplete"`` (its ``.done``
events, then ``response.output_item.done``): the length limit as above; the request
timeout (``--request-timeout``), then ``response.incomplete`` with
``incomplete_details.reason: "request_timeout"``; any other error after the stream
began, then an ``error`` event and ``response.failed``. There is no ``[DONE]``.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec
from litestar import Request, Response

from engine.wire.messages import FINISH_LENGTH
from service.api.chat_output import ChatOutput
from service.api.engine_errors import REQUEST_TIMEOUT
from service.api.generation import Generation, Piece
from service.api.openai.responses_schemas import (
    FunctionCallItem,
    IncompleteDetails,
    MessageItem,
    OutputText,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    ResponseError,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from service.api.openai.schemas import ChatMessageOut, Delta
from service.api.responses import first_piece_held, gone, json_response, run_to_end, stream_answer
from service.common.errors import APIError

_encoder = msgspec.json.Encoder()
_Item = MessageItem | ReasoningItem | FunctionCallItem


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _head(body: ResponsesRequest, gen: Generation, model: str, created: int) -> ResponseObject:
    """The response as it starts: ``in_progress``, no output, the request's settings."""
    return ResponseObject(
        id=gen.request_id,
        created_at=created,
        model=model,
        status="in_progress",
        output=[],
        instructions=body.instructions,
        max_output_tokens=body.max_output_tokens,
        parallel_tool_calls=body.parallel_tool_calls,
        # The values used: an unset field took the model's default.
        temperature=gen.sampling[0].temperature if gen.sampling else body.temperature,
        top_p=gen.sampling[0].top_p if gen.sampling else body.top_p,
        truncation=body.truncation or "disabled",
        tool_choice=body.tool_choice if body.tool_choice is not None else "auto",
        tools=list(body.tools or []),
        text=body.text or {"format": {"type": "text"}},
        reasoning=body.reasoning,
        metadata=body.metadata or {},
    )


async def _finish(
    resp: ResponseObject, gen: Generation, finish_reason: str | None, reasoning: str, cut_by: str | None = None
) -> None:
    """Set the response's final status and usage (reasoning tokens: its reasoning
    text tokenized again, at most the answer's tokens). ``cut_by``: why the stream was
    cut before the engine finished (``"request_timeout"``), or None."""
    if cut_by is not None or finish_reason == FINISH_LENGTH:
        resp.status = "incomplete"
        resp.incomplete_details = IncompleteDetails(reason=cut_by or "max_output_tokens")
    else:
        resp.status = "completed"
    output = gen.completion_tokens
    thought = len(await gen.text.encode_text(reasoning)) if reasoning else 0
    resp.usage = ResponseUsage(
        input_tokens=gen.prompt_tokens,
        output_tokens=output,
        total_tokens=gen.prompt_tokens + output,
        output_tokens_details=OutputTokensDetails(reasoning_tokens=min(thought, output)),
    )


def output_items(message: ChatMessageOut, finish_reason: str | None) -> list[_Item]:
    """A chat answer's message as Responses' output items (see the module docstring)."""
    items: list[_Item] = []
    cut = "incomplete" if finish_reason == FINISH_LENGTH else "completed"
    reasoning = message.reasoning_content
    calls = message.tool_calls if isinstance(message.tool_calls, list) else []
    if isinstance(reasoning, str) and reasoning:
        # Cut with nothing after it: the cut fell in the reasoning.
        status = cut if not (message.content or calls) else "completed"
        items.append(ReasoningItem(id=_item_id("rs"), content=[ReasoningText(text=reasoning)], status=status))
    if message.content or not (items or calls):
        text = [OutputText(text=message.content or "")]
        items.append(MessageItem(id=_item_id("msg"), status=cut, content=text))
    for call in calls:
        function = call["function"]
        items.append(
            FunctionCallItem(
                id=_item_id("fc"), call_id=call["id"], name=function["name"], arguments=function["arguments"]
            )
        )
    return items


async def responses_answer(
    gen: Generation, request: Request, model: str, body: ResponsesRequest
) -> Response[Any]:
    """The answer of ``POST /v1/responses``: one response object, or its events when
    the call streams (a stream constrained by ``text.format`` waits for the engine's
    first piece, so a schema it refuses is a 400 as without stream)."""
    try:
        return await _answer(gen, request, model, body)
    except APIError as exc:
        raise _named(exc) from None


def _named(exc: APIError) -> APIError:
    """An error of the engine's structured output names this API's field."""
    if exc.param == "response_format":
        exc.param = "text.format"
    return exc


async def _answer(gen: Generation, request: Request, model: str, body: ResponsesRequest) -> Response[Any]:
    assert gen.chat is not None
    output = ChatOutput.planned(gen.chat, 1)
    resp = _head(body, gen, model, int(time.time()))
    if gen.request.stream:
        held = await first_piece_held(gen) if gen.request.json_schema is not None else None
        events = _Events(gen, resp, output)
        return stream_answer(gen, events.run(held or gen.pieces()), frame=_sse, error_payload=events.cut)
    result = await run_to_end(gen, request)
    if result is None:
        return gone()
    (text,), (reason,) = result
    message, _ = output.message(text, reason)
    resp.output = list(output_items(message, reason))
    reasoning = message.reasoning_content if isinstance(message.reasoning_content, str) else ""
    await _finish(resp, gen, reason, reasoning)
    return json_response(resp)


def _sse(payload: dict[str, Any] | list[dict[str, Any]]) -> bytes:
    """One event (or several) as Server-Sent Events named by their ``type``."""
    events = payload if isinstance(payload, list) else [payload]
    return b"".join(
        b"event: " + e["type"].encode() + b"\ndata: " + _encoder.encode(e) + b"\n\n" for e in events
    )


@dataclass
class _Events:
    """The events of one streamed response (see the module docstring)."""

    gen: Generation
    resp: ResponseObject
    output: ChatOutput
    seq: int = 0
    items: list[_Item] = field(default_factory=list)
    open: _Item | None = None  # the item being written (the last of ``items``)
    text: str = ""  # the open text item's text so far
    reasoning: str = ""

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        """The next event (an item in an ``added`` event is a copy: it changes later,
        and a delta may close it before the event is sent)."""
        out = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return out

    def _snapshot(self) -> ResponseObject:
        return msgspec.structs.replace(self.resp, output=list(self.items))

    async def run(self, pieces: Any) -> Any:
        yield self.event("response.created", response=self._snapshot())
        yield self.event("response.in_progress", response=self._snapshot())
        reason = None
        async for piece in pieces:
            for choice in self._choices(piece):
                for event in self._on_delta(choice.delta):
                    yield event
            reason = piece.finish_reason or reason
        if not self.items:
            for event in self._open_text(MessageItem(id=_item_id("msg"), status="in_progress", content=[])):
                yield event
        for event in self._close(reason):
            yield event
        self.resp.output = list(self.items)
        await _finish(self.resp, self.gen, reason, self.reasoning)
        kind = "response.incomplete" if self.resp.status == "incomplete" else "response.completed"
        yield self.event(kind, response=self.resp)

    def _choices(self, piece: Piece) -> list[Any]:
        out = self.output.deltas(0, piece.text, None, None) if piece.text else []
        if piece.finish_reason:
            out += self.output.deltas(0, "", piece.finish_reason, None)
        return out

    def _on_delta(self, delta: Delta) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        index = len(self.items) - 1
        if delta.reasoning_content:
            if not isinstance(self.open, ReasoningItem):
                events += self._open_text(ReasoningItem(id=_item_id("rs"), content=[], status="in_progress"))
                index = len(self.items) - 1
            self.text += delta.reasoning_content
            self.reasoning += delta.reasoning_content
            events.append(self.event(
                "response.reasoning_text.delta", item_id=self.items[index].id, output_index=index,
                content_index=0, delta=delta.reasoning_content,
            ))
        if delta.content:
            if not isinstance(self.open, MessageItem):
                events += self._open_text(MessageItem(id=_item_id("msg"), status="in_progress", content=[]))
                index = len(self.items) - 1
            self.text += delta.content
            events.append(self.event(
                "response.output_text.delta", item_id=self.items[index].id, output_index=index,
                content_index=0, delta=delta.content, logprobs=[],
            ))
        for call in delta.tool_calls or []:
            events += self._on_call(call)
        return events

    def _on_call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        """A tool call's head (id and name: a new item) or its arguments."""
        events: list[dict[str, Any]] = []
        arguments = call["function"].get("arguments", "")
        if "id" in call:
            events += self._close(None)
            item = FunctionCallItem(
                id=_item_id("fc"), call_id=call["id"], name=call["function"]["name"], arguments="",
                status="in_progress",
            )
            self.items.append(item)
            self.open = item
            events.append(self.event(
                "response.output_item.added", output_index=len(self.items) - 1, item=msgspec.structs.replace(item)
            ))
        elif isinstance(self.open, FunctionCallItem) and arguments:
            self.open.arguments += arguments
            events.append(self.event(
                "response.function_call_arguments.delta", item_id=self.open.id,
                output_index=len(self.items) - 1, delta=arguments,
            ))
        return events

    def _open_text(self, item: MessageItem | ReasoningItem) -> list[dict[str, Any]]:
        events = self._close(None)
        self.items.append(item)
        self.open, self.text = item, ""
        index = len(self.items) - 1
        part = ReasoningText(text="") if isinstance(item, ReasoningItem) else OutputText(text="")
        return [
            *events,
            self.event("response.output_item.added", output_index=index, item=msgspec.structs.replace(item)),
            self.event("response.content_part.added", item_id=item.id, output_index=index, content_index=0, part=part),
        ]

    def _close(self, finish_reason: str | None, *, cut: bool = False) -> list[dict[str, Any]]:
        """The open item's ``.done`` events, its text (or arguments) those sent so far:
        ``incomplete`` when ``cut`` (the stream ends early), and a message or reasoning
        cut by the length limit; else ``completed``."""
        item, self.open = self.open, None
        if item is None:
            return []
        index = len(self.items) - 1
        events = []
        status = "incomplete" if cut or finish_reason == FINISH_LENGTH else "completed"
        if isinstance(item, FunctionCallItem):
            item.status = "incomplete" if cut else "completed"
            events.append(self.event(
                "response.function_call_arguments.done", item_id=item.id, output_index=index,
                arguments=item.arguments,
            ))
        else:
            where = {"item_id": item.id, "output_index": index, "content_index": 0}
            if isinstance(item, ReasoningItem):
                part: Any = ReasoningText(text=self.text)
                item.content = [part]
                item.status = status
                events.append(self.event("response.reasoning_text.done", **where, text=self.text))
            else:
                part = OutputText(text=self.text)
                item.content = [part]
                item.status = status
                events.append(self.event("response.output_text.done", **where, text=self.text, logprobs=[]))
            events.append(self.event("response.content_part.done", **where, part=part))
        events.append(self.event("response.output_item.done", output_index=index, item=item))
        return events

    async def cut(self, exc: APIError) -> list[dict[str, Any]]:
        """The end of a stream cut by ``exc`` after it began: the open item closed as
        ``incomplete`` with the text sent so far; then for the request timeout
        ``response.incomplete`` (``incomplete_details.reason: "request_timeout"``),
        for any other error an ``error`` event and ``response.failed``, each with the
        output so far."""
        events = self._close(None, cut=True)
        self.resp.output = list(self.items)
        if exc.code == REQUEST_TIMEOUT:
            await _finish(self.resp, self.gen, None, self.reasoning, cut_by=REQUEST_TIMEOUT)
            return [*events, self.event("response.incomplete", response=self.resp)]
        exc = _named(exc)
        code = exc.code or ("server_error" if exc.status >= 500 else exc.type)
        self.resp.status = "failed"
        self.resp.error = ResponseError(code=code, message=exc.message)
        return [
            *events,
            self.event("error", code=code, message=exc.message, param=exc.param),
            self.event("response.failed", response=self.resp),
        ]
