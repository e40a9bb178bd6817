"""Chat messages to a prompt: the model's own chat template, checked and tokenized.

Torch-free: takes any Hugging Face tokenizer object and imports only jinja2 for its
error type. Messages follow OpenAI's shape: ``{"role": ..., "content": ...}`` where
content is a string or a list of text parts ``[{"type": "text", "text": ...}]``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from jinja2 import TemplateError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# What templates know as "system": OpenAI renamed it "developer" for newer models.
_ROLE_ALIASES = {"developer": "system"}
_ROLES = ("system", "developer", "user", "assistant")
# Text parts are joined with a newline, as vLLM does, so "a" + "b" never fuse into "ab".
_PART_SEPARATOR = "\n"


class ChatTemplateError(ValueError):
    """The messages cannot be rendered into a prompt.

    ``param`` names the offending request field (``"messages"``, ``"messages[2].role"``),
    so the service can answer OpenAI's error shape with it.
    """

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Mapping[str, Any]]) -> str:
    """Render ``messages`` with the tokenizer's chat template, ending with the
    assistant generation header (``add_generation_prompt=True``).

    Roles: system, developer (rendered as system), user, assistant. Content: a string
    or a list of text parts, joined with a newline.

    Returns:
        The prompt text, special tokens written out as text (e.g. ``<|im_start|>``).
    Raises:
        ChatTemplateError: empty ``messages``, an unknown or tool role, content that is
            not text, a tokenizer without a chat template, or a template that refuses
            the conversation (e.g. roles out of the order it requires).
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError(
            "this model's tokenizer has no chat template; use /v1/completions "
            "with a raw prompt instead"
        )
    normalized = _normalize(messages)
    try:
        prompt = tokenizer.apply_chat_template(
            normalized, tokenize=False, add_generation_prompt=True
        )
    except TemplateError as exc:
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
    bos = getattr(tokenizer, "bos_token", None)
    add_special = not (bos and prompt.startswith(bos))
    return list(tokenizer.encode(prompt, add_special_tokens=add_special))


def encode_chat(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[Mapping[str, Any]]
) -> list[int]:
    """``encode_prompt(tokenizer, render_chat(tokenizer, messages))``.

    Returns:
        Prompt token ids, ``list[int]``.
    Raises:
        ChatTemplateError: as ``render_chat``.
    """
    return encode_prompt(tokenizer, render_chat(tokenizer, messages))


def _normalize(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    """Check roles and content; return plain ``{"role", "content": str}`` dicts."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError("messages must be a list of {role, content} objects")
    if not messages:
        raise ChatTemplateError("messages must not be empty")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"messages[{i}] is not an object", f"messages[{i}]")
        role = message.get("role")
        if role not in _ROLES:
            hint = " (tool calling is not supported)" if role in ("tool", "function") else ""
            raise ChatTemplateError(
                f"messages[{i}].role {role!r} is not supported{hint}; "
                f"use one of {', '.join(_ROLES)}",
                f"messages[{i}].role",
            )
        content = _content_text(message.get("content"), i, role)
        out.append({"role": _ROLE_ALIASES.get(role, role), "content": content})
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
        if kind != "text" or not isinstance(text, str):
            raise ChatTemplateError(
                f"{param}[{j}] of type {kind!r} is not supported; only text parts are",
                f"{param}[{j}]",
            )
        texts.append(text)
    return _PART_SEPARATOR.join(texts)
