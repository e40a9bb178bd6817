"""Chat messages to a prompt: the model's own chat template, checked and tokenized.

Torch-free: takes any Hugging Face tokenizer object and imports only jinja2 for its
error type. Messages follow OpenAI's shape: ``{"role": ..., "content": ...}`` where
content is a string or a list of text parts ``[{"type": "text", "text": ...}]``.

An assistant message's reasoning (``thinking``, or ``reasoning_content`` and
``reasoning`` as OpenAI-compatible servers return it) reaches the template as
``thinking``, the name gpt-oss's template reads: that template writes it back only
before a tool call the conversation has not yet answered in words, as the model needs
its reasoning there; templates that do not read it leave it out.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from jinja2 import TemplateError

from engine.text.chat_guard import guarded_ids, marked, special_pattern

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# What templates know as "system": OpenAI renamed it "developer" for newer models.
_ROLE_ALIASES = {"developer": "system"}
_ROLES = ("system", "developer", "user", "assistant")
# render_chat's own arguments and apply_chat_template's parameters (the template
# itself among them): chat_template_kwargs are template variables only.
_RESERVED_KWARGS = frozenset(
    {
        "messages",
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
# A template with tool support reads a ``tools`` variable ("tools", "tools is defined"...).
_TOOLS_VARIABLE = re.compile(r"\btools\b")
# Where an assistant message carries its reasoning, by API: ours, then OpenAI-compatible.
_REASONING_KEYS = ("thinking", "reasoning_content", "reasoning")
# Text parts are joined with a newline, as vLLM does, so "a" + "b" never fuse into "ab".
PART_SEPARATOR = "\n"


class ChatTemplateError(ValueError):
    """The messages cannot be rendered into a prompt.

    ``param`` names the offending request field (``"messages"``, ``"messages[2].role"``),
    so the service can answer OpenAI's error shape with it.
    """

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.message = message
        self.param = param


NO_CHAT_TEMPLATE = "this model's tokenizer has no chat template, so it cannot render messages"


class NoChatTemplate(ChatTemplateError):
    """The tokenizer has no chat template: messages cannot be rendered, while a raw
    prompt can (``/v1/completions``, Ollama's ``/api/generate``, ``generate --raw``)."""


def template_has_tools(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the tokenizer's chat template renders tool definitions (it reads a
    ``tools`` variable), as Qwen2.5/3, Hermes, Llama 3.1+ and Mistral's do."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and _TOOLS_VARIABLE.search(template) is not None


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """Render ``messages`` with the tokenizer's chat template, ending with the
    assistant generation header (``add_generation_prompt=True``).

    Roles: system, developer (rendered as system), user, assistant, and tool where
    the template renders tools. Content: a string or a list of text parts, joined with
    a newline. An assistant message's ``tool_calls`` are passed on with their JSON
    ``arguments`` text parsed (templates write them with ``tojson``; an object is taken as
    it is, text that is not JSON refused). ``tools``: the
    OpenAI tool definitions, for the template's ``tools`` variable.
    ``template_kwargs``: more template variables (``enable_thinking``...); the names
    the call sets itself are refused.

    Returns:
        The prompt text, special tokens written out as text (e.g. ``<|im_start|>``).
    Raises:
        NoChatTemplate: a tokenizer without a chat template (naming the calls that
            take a raw prompt).
        ChatTemplateError: empty ``messages``, an unknown role, a tool role or
            ``tools`` with a template that has no tool support, content that is not
            text, a reserved name in
            ``template_kwargs``, a template that refuses the conversation (e.g.
            roles out of the order it requires), or a value nested past Python's
            recursion depth as the template's data.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise NoChatTemplate(f"{NO_CHAT_TEMPLATE}: use /v1/completions or /api/generate, which take a raw prompt")
    has_tools = template_has_tools(tokenizer)
    if tools and not has_tools:
        raise ChatTemplateError(
            "this model's chat template has no tool support (it renders no tools), so "
            "tools cannot be used with this model",
            "tools",
        )
    extra = dict(template_kwargs or {})
    reserved = sorted(_RESERVED_KWARGS.intersection(extra))
    if reserved:
        raise ChatTemplateError(
            f"chat_template_kwargs cannot set {', '.join(reserved)}", "chat_template_kwargs"
        )
    normalized = _normalize(messages, tools_allowed=has_tools)
    if tools:
        extra["tools"] = tools
    try:
        prompt = tokenizer.apply_chat_template(
            normalized, tokenize=False, add_generation_prompt=True, **extra
        )
    except RecursionError:
        # transformers copies the template's data recursively, and tojson recurses too.
        raise ChatTemplateError(
            "the model's chat template cannot render these messages: a value is nested too "
            "deeply (a tool's parameters, a call's arguments or a chat_template_kwargs value); "
            "flatten it"
        ) from None
    except (TemplateError, TypeError, ValueError) as exc:
        # Jinja raises TypeError/ValueError too when a variable (a tool definition, a
        # chat_template_kwargs value) is not of the shape the template expects.
        roles = ", ".join(m["role"] for m in normalized)
        raise ChatTemplateError(
            f"the model's chat template cannot render these messages (roles: {roles}): {exc}"
        ) from exc
    if not isinstance(prompt, str):
        # Some tokenizers return a list when given a batch; we never pass one.
        raise ChatTemplateError(f"the chat template returned {type(prompt).__name__}, not text")
    return prompt


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str) -> list[int]:
    """Tokenize a rendered chat prompt without adding a second BOS.

    Templates usually write the BOS text themselves (``<s>``, ``<|begin_of_text|>``);
    the tokenizer's own special tokens are added only when the prompt does not start
    with it.

    Returns:
        Token ids, ``list[int]``.
    """
    return list(tokenizer.encode(prompt, add_special_tokens=_adds_special(tokenizer, prompt)))


def _adds_special(tokenizer: PreTrainedTokenizerBase, prompt: str) -> bool:
    """Whether the tokenizer's own special tokens go around ``prompt``: not when it
    starts with the BOS text already."""
    bos = getattr(tokenizer, "bos_token", None)
    return not (bos and prompt.startswith(bos))


def encode_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """``encode_prompt(tokenizer, render_chat(tokenizer, messages, ...))``, where a
    message's text that spells a special token (``<|im_end|>``) is tokenized as plain
    text (:mod:`engine.text.chat_guard`): no message can end its turn or forge another.

    Returns:
        Prompt token ids, ``list[int]``.
    Raises:
        ChatTemplateError: as ``render_chat``.
    """
    prompt = render_chat(tokenizer, messages, tools=tools, template_kwargs=template_kwargs)
    pattern = special_pattern(tokenizer)
    if pattern is None:
        return encode_prompt(tokenizer, prompt)
    texts: list[str] = []
    guarded = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        # A list of text parts reaches the template as one text (render_chat checked it).
        text = _content_text(content, i, "") if isinstance(content, (str, list)) else ""
        if pattern.search(text):
            message = {**message, "content": marked(len(texts))}
            texts.append(text)
        guarded.append(message)
    if not texts:
        return encode_prompt(tokenizer, prompt)
    # A message spells a special token: it stays text (engine.text.chat_guard).
    marked_prompt = render_chat(tokenizer, guarded, tools=tools, template_kwargs=template_kwargs)
    return guarded_ids(tokenizer, prompt, marked_prompt, texts, _adds_special(tokenizer, prompt))


def _normalize(
    messages: Sequence[Mapping[str, Any]], *, tools_allowed: bool = False
) -> list[dict[str, Any]]:
    """Check roles and content; return plain ``{"role", "content": str}`` dicts (with
    ``tool_calls`` and ``thinking`` on assistant messages and ``tool_call_id``/``name``
    on tool ones)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError("messages must be a list of {role, content} objects")
    if not messages:
        raise ChatTemplateError("messages must not be empty")
    roles = (*_ROLES, "tool") if tools_allowed else _ROLES
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"messages[{i}] is not an object", f"messages[{i}]")
        role = message.get("role")
        if role is None:
            raise ChatTemplateError(f"messages[{i}].role is missing; use one of {', '.join(roles)}",
                                    f"messages[{i}].role")
        if role not in roles:
            hint = (
                " (this model's chat template has no tool support)"
                if role in ("tool", "function")
                else ""
            )
            # tool is one of the API's roles: say why it is not one here.
            tool = "" if tools_allowed else "; tool needs a model whose chat template has tool support"
            raise ChatTemplateError(
                f"messages[{i}].role {role!r} is not supported{hint}; "
                f"use one of {', '.join(roles)}{tool}",
                f"messages[{i}].role",
            )
        calls = message.get("tool_calls") if role == "assistant" else None
        content = message.get("content")
        if calls and content is None:
            content = ""  # an assistant turn that only called tools
        entry: dict[str, Any] = {
            "role": _ROLE_ALIASES.get(role, role),
            "content": _content_text(content, i, role),
        }
        if calls:
            entry["tool_calls"] = _tool_calls(calls, i)
        reasoning = next((message.get(k) for k in _REASONING_KEYS if message.get(k)), None)
        if role == "assistant" and isinstance(reasoning, str):
            entry["thinking"] = reasoning
        if role == "tool":
            for key in ("tool_call_id", "name"):
                if isinstance(message.get(key), str):
                    entry[key] = message[key]
        out.append(entry)
    return out


def _tool_calls(calls: Any, i: int) -> list[dict[str, Any]]:
    """An assistant message's OpenAI ``tool_calls`` for the template: ``arguments``
    JSON text parsed into an object (an object as it is; JSON nested past the reader's
    depth left as its text).

    Raises:
        ChatTemplateError: ``messages[i].tool_calls[j].function.arguments`` for text
            that is not JSON (the template would show the model a call no parser reads).
    """
    param = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise ChatTemplateError(f"{param} must be a list", param)
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ChatTemplateError(
                f"{param}[{j}] must be {{'type': 'function', 'function': {{'name', "
                "'arguments'}}}",
                f"{param}[{j}]",
            )
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except RecursionError:  # JSON nested past the reader's depth: its text, as sent
                pass
            except ValueError as exc:
                where = f"{param}[{j}].function.arguments"
                raise ChatTemplateError(
                    f"{where} is not JSON ({exc}): send the call's arguments as JSON text, "
                    "e.g. '{\"city\": \"Paris\"}', or as an object", where) from None
        out.append(
            {
                "id": call.get("id"),
                "type": "function",
                "function": {"name": function["name"], "arguments": arguments},
            }
        )
    return out


def _content_text(content: Any, i: int, role: str) -> str:
    param = f"messages[{i}].content"
    if isinstance(content, str):
        return content
    if content is None:
        raise ChatTemplateError(f"{param} of the {role!r} message is missing", param)
    if not isinstance(content, list):
        raise ChatTemplateError(
            f"{param} must be a string or a list of text parts, not {type(content).__name__}",
            param,
        )
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        text = part.get("text") if isinstance(part, Mapping) else None
        if kind == "text" and not isinstance(text, str):
            raise ChatTemplateError(
                f"{param}[{j}] is a text part without a string \"text\"; send "
                '{"type": "text", "text": "..."}',
                f"{param}[{j}].text",
            )
        if kind != "text":
            what = f"of type {kind!r}" if kind is not None else "without a type (a part is an object)"
            raise ChatTemplateError(f"{param}[{j}] {what} is not supported; only text parts are", f"{param}[{j}]")
        texts.append(text)
    return PART_SEPARATOR.join(texts)
