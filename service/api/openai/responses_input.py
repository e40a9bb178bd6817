"""A Responses API body as the one :class:`~service.api.request.GenerationRequest` a
call runs as: its input items as chat messages, its flat tools as chat tools, its
``text.format`` as a response format, its ``reasoning.effort`` as thinking.

Input items, in order, become the messages the model's chat template renders:

- ``message`` (or an item with a ``role`` and no ``type``): its role (``developer`` is
  ``system``), its text (a string, or ``input_text``/``output_text`` parts joined, an
  assistant's ``refusal`` parts read as its text); an empty list of parts, an
  ``input_image`` or an ``input_file`` part is a 400 (this server serves text models);
- ``function_call``: a tool call of the assistant turn (joined to the assistant
  message just before it, if any), with ``call_id`` as its id;
- ``function_call_output``: a ``tool`` message answering ``call_id``;
- ``reasoning``: its ``reasoning_text`` goes with the next assistant turn as
  ``reasoning_content``, which the template renders or leaves out as it chooses.

Refused with a 400 naming the field: ``previous_response_id`` and ``conversation``
(the server is stateless: send the whole input), ``background``, ``prompt``,
``top_logprobs``, an ``include`` value OpenAI does not define (and
``message.output_text.logprobs``), ``metadata`` that is not OpenAI's map of at most 16
string keys (64 characters) to strings (512 characters), ``stream_options`` without
``stream``, an empty ``input`` (``""`` or
``[]``), an ``item_reference`` or unknown item, a ``function_call`` whose
``call_id`` no ``function_call_output`` of the input answers (as OpenAI refuses it) and an
output whose ``call_id`` no ``function_call`` before it made, a tool other than ``function`` (``web_search``, ``file_search``...), and an unknown
``tool_choice``. What the model's chat template refuses (a ``function_call_output``
where it has no tool support...) is answered in the same terms by :func:`input_error`:
the input item and its type, never the chat message it became. Each item's fields are
read, with the codes of docs/api.md's Errors (``missing_field``, ``invalid_type``), by
:mod:`service.api.openai.responses_items`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

from engine.common.clip import clip
from engine.text.chat import ChatTemplateError
from service.api.openai.messages import field_of, json_type
from service.api.openai.requests import check_stream_options
from service.api.openai.responses_items import (
    call_fields,
    message_role,
    message_text,
    output_call_id,
    reasoning_text,
)
from service.api.openai.responses_schemas import ResponsesRequest
from service.api.prompts import chat_prompt
from service.api.request import GenerationRequest
from service.api.sampling import sampling_of
from service.api.structured import response_schema
from service.api.thinking import effort_thinking, with_thinking
from service.api.tool_checks import check_tool_name
from service.common.errors import (
    INVALID_TYPE,
    INVALID_VALUE,
    MISSING_FIELD,
    NOT_FOUND,
    APIError,
    invalid,
)

_STATELESS = (
    "this server is stateless and stores no responses: send the whole conversation as "
    "input instead"
)


def not_stored(response_id: str) -> APIError:
    """The answer to a call on a stored response (``GET``, ``DELETE`` or ``POST
    /v1/responses/{id}``, its ``/input_items`` or ``/cancel``): 404
    ``response_not_found`` in OpenAI's error shape, saying none is ever stored."""
    return APIError(
        404,
        f"headroom does not store responses: {clip(response_id)!r} cannot be retrieved, listed, "
        f"cancelled or deleted; {_STATELESS}",
        type=NOT_FOUND,
        code="response_not_found",
    )


def _refuse_stateful(body: ResponsesRequest) -> None:
    if body.previous_response_id is not None:
        raise invalid(f"previous_response_id is not supported: {_STATELESS}", "previous_response_id")
    if body.conversation is not None:
        raise invalid(f"conversation is not supported: {_STATELESS}", "conversation")
    if body.background:
        raise invalid("background responses are not supported by this server", "background")
    if body.prompt is not None:
        raise invalid("stored prompts are not supported by this server; send input", "prompt")
    if body.top_logprobs:
        raise invalid("top_logprobs is not supported on /v1/responses", "top_logprobs")


# OpenAI's ``include`` values. Those of outputs this server never makes (built-in tools,
# images) add nothing; ``reasoning.encrypted_content`` neither (reasoning goes back as
# text), though stateless clients send it.
_INCLUDES = (
    "code_interpreter_call.outputs",
    "computer_call_output.output.image_url",
    "file_search_call.results",
    "message.input_image.image_url",
    "reasoning.encrypted_content",
    "web_search_call.action.sources",
    "web_search_call.results",
)
_LOGPROBS_INCLUDE = "message.output_text.logprobs"
_METADATA_KEYS, _METADATA_KEY_CHARS, _METADATA_VALUE_CHARS = 16, 64, 512


def _check_include(include: list[str] | None) -> None:
    for i, value in enumerate(include or ()):
        if value == _LOGPROBS_INCLUDE:
            raise invalid(f"{value} is not supported on /v1/responses (no logprobs here)", f"include[{i}]")
        if value not in _INCLUDES:
            raise invalid(f"invalid value {clip(value)!r}; supported values are: "
                          f"{', '.join(_INCLUDES)}, {_LOGPROBS_INCLUDE} (refused here)", f"include[{i}]")


def _check_metadata(metadata: dict[str, Any] | None) -> None:
    """OpenAI's rule: at most 16 pairs, keys of at most 64 characters, string values of
    at most 512."""
    if not metadata:
        return
    if len(metadata) > _METADATA_KEYS:
        raise invalid(f"metadata holds {len(metadata)} keys; at most {_METADATA_KEYS} are allowed", "metadata")
    for key, value in metadata.items():
        if len(key) > _METADATA_KEY_CHARS:
            raise invalid(f"metadata key {clip(key)!r} is longer than {_METADATA_KEY_CHARS} characters", "metadata")
        if not isinstance(value, str):
            raise invalid(f"metadata.{key} must be a string: metadata maps keys to strings",
                          f"metadata.{key}", INVALID_TYPE)
        if len(value) > _METADATA_VALUE_CHARS:
            raise invalid(f"metadata.{key} is longer than {_METADATA_VALUE_CHARS} characters", f"metadata.{key}")


@dataclass(frozen=True)
class _Origin:
    """Where one chat message came from in the Responses body: ``path`` (``input[3]``,
    ``input``, ``instructions``), the item's ``kind`` and, for an assistant turn of
    tool calls, the path of each call's ``function_call`` item."""

    path: str
    kind: str
    calls: tuple[str, ...] = ()


def _converted(
    input: str | list[Any], instructions: str | None
) -> tuple[list[dict[str, Any]], list[_Origin]]:
    """:func:`input_messages` with the :class:`_Origin` of each message."""
    messages: list[dict[str, Any]] = []
    origins: list[_Origin] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
        origins.append(_Origin("instructions", "instructions"))
    if not input:
        raise invalid("input must not be empty: send a string or a list of input items", "input")
    if isinstance(input, str):
        return [*messages, {"role": "user", "content": input}], [*origins, _Origin("input", "message")]
    answered = {  # each output's call_id checked first: a call answered by a malformed one names that
        output_call_id(item, f"input[{i}]")
        for i, item in enumerate(input)
        if isinstance(item, dict) and item.get("type") == "function_call_output"
    }
    reasoning, called = "", set()
    for i, item in enumerate(input):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid("each input item must be an object", param)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = message_role(item, f"{param}.role")
            if "content" not in item:
                raise invalid("content is missing: send a string or a list of content parts", f"{param}.content",
                              MISSING_FIELD)
            content = message_text(item["content"], f"{param}.content", role)
            message: dict[str, Any] = {"role": role, "content": content}
            if role == "assistant" and reasoning:
                message["reasoning_content"], reasoning = reasoning, ""
            messages.append(message)
            origins.append(_Origin(param, kind))
        elif kind == "function_call":
            call_id, name, arguments = call_fields(item, param)
            if call_id not in answered:
                # As OpenAI: a call the input does not answer is refused, not dropped.
                raise invalid(
                    f"no tool output found for function call {call_id!r}: send a "
                    f"function_call_output item with call_id {call_id!r} after it",
                    param,
                )
            called.add(call_id)
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and not reasoning:
                last.setdefault("tool_calls", []).append(call)
                origins[-1] = replace(origins[-1], calls=(*origins[-1].calls, param))
                continue
            message = {"role": "assistant", "content": "", "tool_calls": [call]}
            if reasoning:
                message["reasoning_content"], reasoning = reasoning, ""
            messages.append(message)
            origins.append(_Origin(param, kind, (param,)))
        elif kind == "function_call_output":
            call_id = output_call_id(item, param)
            if call_id not in called:  # as OpenAI: an output must answer a call before it
                raise invalid(f"no function_call found for call_id {call_id!r}: send the function_call "
                              "item it answers before it, or leave the output out", f"{param}.call_id")
            output = item.get("output", "")
            messages.append(
                {"role": "tool", "tool_call_id": call_id, "content": message_text(output, f"{param}.output")}
            )
            origins.append(_Origin(param, kind))
        elif kind == "reasoning":
            reasoning += reasoning_text(item, param)
        elif kind == "item_reference":
            raise invalid(f"item_reference is not supported: {_STATELESS}", param)
        else:
            raise invalid(
                f"input item type {kind!r} is not supported; send message, function_call, "
                "function_call_output or reasoning items",
                param,
            )
    if not messages:
        # Reasoning items alone: each goes with the assistant turn after it, so none is left.
        raise invalid("input holds no message: a reasoning item goes with the assistant message "
                      "after it; send at least one message item", "input")
    return messages, origins


def input_messages(input: str | list[Any], instructions: str | None) -> list[dict[str, Any]]:
    """The chat messages of a Responses ``input`` (see the module docstring).

    Raises:
        APIError: 400 naming ``input[i]`` (or a part of it) for an item this server
            cannot take, a ``function_call`` among them whose ``call_id`` no
            ``function_call_output`` of the input answers (as OpenAI refuses it);
            400 ``input[i].call_id`` for an output no ``function_call`` before it made;
            400 ``missing_field`` / ``invalid_type`` naming an item's field
            (:mod:`service.api.openai.responses_items`);
            400 ``input[i].name`` / ``input[i].arguments`` for a ``function_call``
            whose name a tool could not have or whose arguments are no JSON object text
            (:mod:`service.api.tool_checks`).
    """
    return _converted(input, instructions)[0]


_MESSAGE_PATH = re.compile(r"^messages\[(\d+)\](?:\.tool_calls\[(\d+)\])?(.*)$")


def input_error(error: ChatTemplateError, body: ResponsesRequest) -> APIError:
    """A chat template's refusal of the messages :func:`input_messages` made, in the
    Responses body's terms: 400 naming the input item (``input[2]``, its
    ``.content`` or ``.output``) and its type, not the chat message it became."""
    if error.param == "messages":
        return invalid(error.message, "input")
    match = _MESSAGE_PATH.match(error.param)
    if match is None:
        return invalid(error.message, error.param)
    origin = _converted(body.input, body.instructions)[1][int(match[1])]
    path, rest = origin.path, match[3]
    if match[2] is not None and int(match[2]) < len(origin.calls):
        path = origin.calls[int(match[2])]
    elif rest == ".content" and origin.kind == "function_call_output":
        rest = ".output"
    if origin.kind == "function_call_output" and rest == ".role":
        return invalid(
            f"{path} is a function_call_output item, which this model cannot take: its chat "
            "template has no tool support (it renders no tool results); send message items "
            "only, or serve a model whose chat template renders tools",
            path,
        )
    param = f"{path}{rest}"
    named = param if origin.kind == "instructions" else f"{param} (a {origin.kind} item)"
    if error.param in error.message:
        return invalid(error.message.replace(error.param, named, 1), param)
    return invalid(f"{named}: {error.message}", param)


def chat_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools in the chat shape (``{"type": "function",
    "function": {...}}``).

    Raises:
        APIError: 400 ``tools[i]`` for a built-in tool type; 400 ``tools[i].name``
            absent (``missing_field``), no string (``invalid_type``) or a name OpenAI
            refuses (:func:`service.api.tool_checks.check_tool_name`).
    """
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise invalid(
                f"tool type {kind!r} is not supported: this server runs function tools only "
                "(no web_search, file_search, code_interpreter...)",
                f"tools[{i}]",
            )
        name = field_of(tool, "name", f"tools[{i}].name", str, "a string",
                        "a function tool is {'type': 'function', 'name': ..., 'parameters': {...}}")
        check_tool_name(name, f"tools[{i}].name")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(tool_choice: Any) -> Any:
    """Responses' ``tool_choice`` in the chat shape (``{"type": "function", "name"}``
    becomes ``{"type": "function", "function": {"name"}}``; ``allowed_tools``' ``mode``
    and ``tools`` move under ``allowed_tools``, each tool's ``name`` under ``function``).

    Raises:
        APIError: 400 ``tool_choice`` for a built-in tool or an unknown form
            (``invalid_type`` for one that is neither a string nor an object).
    """
    if tool_choice is None or tool_choice in ("auto", "none", "required"):
        return tool_choice
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        if isinstance(tool_choice.get("name"), str):
            return {"type": "function", "function": {"name": tool_choice["name"]}}
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "allowed_tools":
        tools = tool_choice.get("tools")
        named = [{"type": "function", "function": {"name": t.get("name")}} if isinstance(t, dict) else t
                 for t in (tools if isinstance(tools, list) else [])]
        return {"type": "allowed_tools", "allowed_tools": {"mode": tool_choice.get("mode"), "tools": named}}
    raise invalid(
        "tool_choice must be 'auto', 'none', 'required', {'type': 'function', 'name': ...} or "
        "{'type': 'allowed_tools', 'mode': 'auto' | 'required', 'tools': [{'type': 'function', 'name': ...}]}",
        "tool_choice",
        INVALID_VALUE if isinstance(tool_choice, str | dict) else INVALID_TYPE,
    )


def text_schema(text: dict[str, Any] | None) -> str | None:
    """The JSON schema ``text.format`` constrains the answer to, or None.

    Raises:
        APIError: 400 ``text.format`` for one that is no object (``invalid_type``),
            an unknown type or a json_schema without a ``schema`` object.
    """
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise invalid(f"text.format must be an object, got {json_type(fmt)}: {{'type': 'text'}}, "
                      "{'type': 'json_object'} or {'type': 'json_schema', ...}", "text.format", INVALID_TYPE)
    return response_schema(fmt, "text.format")


def responses_request(
    body: ResponsesRequest, request_id: str, started: float, default_max_tokens: int
) -> GenerationRequest:
    """A Responses body as the request it runs as (one answer).

    Args:
        default_max_tokens: ``--default-max-tokens``, the length when
            ``max_output_tokens`` is absent (0: the rest of the context).

    Raises:
        APIError: 400 naming the field (see the module docstring; ``text.format``,
            ``reasoning.effort``).
    """
    _refuse_stateful(body)
    _check_include(body.include)
    _check_metadata(body.metadata)
    check_stream_options(body.stream_options, body.stream)
    effort = body.reasoning.effort if body.reasoning else None
    thinking, budget = effort_thinking(effort, "reasoning.effort")
    tools = chat_tools(body.tools)
    messages = input_messages(body.input, body.instructions)
    return GenerationRequest(
        request_id=request_id,
        started=started,
        prompts=tuple(chat_prompt(messages, tools, with_thinking(None, thinking, effort), "input")),
        sampling=sampling_of(body),
        max_tokens=body.max_output_tokens,
        max_tokens_param="max_output_tokens",
        default_max_tokens=default_max_tokens or None,
        json_schema=text_schema(body.text),
        schema_param="text.format",
        chat=True,
        tools=tools,
        tool_choice=chat_tool_choice(body.tool_choice),
        truncate=body.truncation == "auto",
        stream=body.stream,
        thinking=thinking,
        thinking_budget=budget,
        thinking_param="reasoning.effort",
    )
