"""One API call's generation: sampling checks, engine requests, text out.

Shared by chat and text completions, streaming or not. A :class:`Generation` takes the
checked call into the engine in one part (:meth:`Generation.start`: its place among the
waiting requests, its prompts to token ids, ``len(prompts) * n`` engine sequences
submitted to the worker link's routing), then turns each sequence's token ids into text
(:meth:`Generation.pieces`: incremental detokenizer, then stop strings, which end the
sequence in the engine at once), counts usage and times the first token.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import msgspec

from engine.wire.ipc import Rejected
from engine.wire.messages import (
    ERROR_INVALID_SCHEMA,
    FINISH_ERROR,
    FINISH_LENGTH,
    EngineInfo,
    GenerateRequest,
    SamplingParams,
    TokenLogprobs,
)
from engine.text.stop import StopStringMatcher
from service.api.admission import Admission, Ticket
from service.common.errors import SERVER_ERROR, APIError, invalid
from service.api.prompts import Prompt, encode_prompts
from service.common.ranges import MAX_TOKENS_MIN, SEED_MIN, TEMPERATURE_MAX, TEMPERATURE_MIN
from service.api.sampling_defaults import SamplingDefaults
from service.api.schemas import MAX_N, SEED_MAX, TOP_K_MAX, _SamplingFields
from service.api.text import TextSide
from service.supervision.inflight import EngineFailure, Submission
from service.common.engine_states import ENGINE_RESTARTED
from service.supervision.supervisor import Supervisor

_REPLACEMENT = "\ufffd"
# ``seed``: any integer in 0..2**63-1 (a signed 64-bit integer in every client's
# language; the engine's generator takes 64 bits). Choice ``i`` of ``n`` uses
# ``(seed + i) mod 2**63``. Anything outside is a 400: wrapping it would make different
# seeds give the same text. top_k beyond the vocabulary means "off"; its bound keeps it
# a 32-bit integer on its way to the engine. The schema declares both; the checks here
# hold for bodies built in Python too.
# OpenAI takes up to 4 stop strings; we take more, within bounds that keep the stop
# matcher's per-token work small.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024


def _check_range(
    value: float | None, param: str, low: float, high: float, *, low_open: bool = False
) -> None:
    if value is None:
        return
    if value < low or value > high or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise invalid(f"{param} must be in {bracket}{low}, {high}], got {value}", param)


def stop_strings(stop: str | list[str] | None) -> list[str]:
    """OpenAI's ``stop`` as a list; empty strings are dropped (they would match
    everywhere).

    Raises:
        APIError: 400 ``stop`` for more than :data:`MAX_STOP_STRINGS` strings or one
            longer than :data:`MAX_STOP_CHARS` characters.
    """
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > MAX_STOP_STRINGS:
        raise invalid(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise invalid(f"each stop string must be at most {MAX_STOP_CHARS} characters", "stop")
    return [s for s in stops if s]


def _check_int(value: int | None, param: str, low: int, high: int) -> None:
    if value is not None and not low <= value <= high:
        raise invalid(f"{param} must be an integer in [{low}, {high}], got {value}", param)


def resolve_max_tokens(
    requested: int | None,
    param: str,
    prompt_tokens: int,
    context_tokens: int,
    *,
    prompt_param: str,
    default: int | None = None,
) -> int:
    """How many tokens a sequence may generate.

    ``param`` / ``prompt_param`` name the fields blamed in errors. ``requested`` None
    means ``default`` (clamped to the rest of the context), or, with
    no default, the whole rest of the context. ``0`` is allowed and produces an empty
    completion (``finish_reason: "length"``), without running the engine unless the
    call scores its prompt (``echo`` with ``logprobs``).

    Raises:
        APIError: 400 ``param`` for a negative value; 400 ``context_length_exceeded``
            when the prompt alone, or prompt plus ``requested``, exceeds
            ``context_tokens`` (both numbers in the message).
    """
    if requested is not None and requested < 0:
        raise invalid(f"{param} must be at least 0, got {requested}", param)
    remaining = context_tokens - prompt_tokens
    if remaining < (1 if requested != 0 else 0):
        raise invalid(
            f"This model's maximum context length is {context_tokens} tokens. However, your "
            f"prompt is {prompt_tokens} tokens, which leaves no room for a completion. "
            "Please shorten the prompt.",
            prompt_param,
            "context_length_exceeded",
        )
    if requested is None:
        return remaining if default is None else min(default, remaining)
    if requested > remaining:
        raise invalid(
            f"This model's maximum context length is {context_tokens} tokens. However, you "
            f"requested {prompt_tokens + requested} tokens ({prompt_tokens} in the prompt, "
            f"{requested} in the completion). Please reduce the prompt or {param}.",
            param,
            "context_length_exceeded",
        )
    return requested


@dataclass(frozen=True)
class MaxTokens:
    """How a call asks for its completions' length (see :func:`resolve_max_tokens`):
    ``requested`` tokens (None: ``default``, or the rest of the context), ``param`` and
    ``prompt_param`` the fields its errors name."""

    requested: int | None
    param: str
    prompt_param: str
    default: int | None = None

    def resolve(self, prompt_tokens: int, context_tokens: int) -> int:
        """Tokens a sequence after a prompt of ``prompt_tokens`` may generate."""
        return resolve_max_tokens(
            self.requested,
            self.param,
            prompt_tokens,
            context_tokens,
            prompt_param=self.prompt_param,
            default=self.default,
        )


_OPENAI_DEFAULTS = SamplingDefaults()


def sampling_params(
    req: _SamplingFields,
    max_new_tokens: int,
    seed_offset: int,
    defaults: SamplingDefaults = _OPENAI_DEFAULTS,
    json_schema: str | None = None,
) -> SamplingParams:
    """OpenAI sampling fields to engine :class:`SamplingParams`. An unset field takes
    its value from ``defaults`` (the model's generation config, see
    :mod:`service.api.sampling_defaults`; OpenAI's: temperature 1, top_p 1). With a
    seed, sequence ``i`` of ``n`` uses ``seed + i`` so its choices differ yet repeat run
    to run. ``json_schema``: the JSON schema (as text) the answer is constrained to
    (:mod:`service.api.structured`), or None.

    Raises:
        APIError: 400 naming the field for a value out of range.
    """
    _check_range(req.temperature, "temperature", TEMPERATURE_MIN, TEMPERATURE_MAX)
    _check_range(req.top_p, "top_p", 0.0, 1.0, low_open=True)
    _check_range(req.min_p, "min_p", 0.0, 1.0)
    _check_range(req.presence_penalty, "presence_penalty", -2.0, 2.0)
    _check_range(req.frequency_penalty, "frequency_penalty", -2.0, 2.0)
    _check_range(req.repetition_penalty, "repetition_penalty", 0.0, 10.0, low_open=True)
    if req.top_k is not None and not -1 <= req.top_k <= TOP_K_MAX:
        raise invalid(
            f"top_k must be -1 or 0 (off) or a positive count up to {TOP_K_MAX}, got {req.top_k}",
            "top_k",
        )
    _check_int(req.seed, "seed", SEED_MIN, SEED_MAX)
    seed = None if req.seed is None else (req.seed + seed_offset) % (SEED_MAX + 1)
    return SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=defaults.temperature if req.temperature is None else req.temperature,
        top_k=defaults.top_k if req.top_k is None else max(0, req.top_k),
        top_p=defaults.top_p if req.top_p is None else req.top_p,
        min_p=defaults.min_p if req.min_p is None else req.min_p,
        seed=seed,
        repetition_penalty=(
            defaults.repetition_penalty
            if req.repetition_penalty is None
            else req.repetition_penalty
        ),
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        ignore_eos=req.ignore_eos,
        logit_bias=logit_bias_pairs(req.logit_bias),
        json_schema=json_schema,
        logprobs=(k := wanted_logprobs(req)),
        prompt_logprobs=k if getattr(req, "echo", False) else None,
    )


def wanted_logprobs(req: _SamplingFields) -> int | None:
    """How many alternatives each token's logprobs carry, or None for no logprobs: a
    chat's ``logprobs: true`` with ``top_logprobs`` (0 when unset), a text completion's
    ``logprobs`` count. Their range (0..20) is checked with the call's fields
    (:mod:`service.api.checks`)."""
    asked = getattr(req, "logprobs", None)
    if asked is None or asked is False:
        return None
    if asked is True:
        return getattr(req, "top_logprobs", None) or 0
    return asked


# OpenAI's bounds of a logit_bias value; -100 and 100 ban or force a token in practice.
LOGIT_BIAS_MAX = 100.0


def logit_bias_pairs(
    logit_bias: dict[str, float] | None, vocab_size: int | None = None
) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias`` (token id as text -> bias) as the engine's pairs.

    Raises:
        APIError: 400 ``logit_bias`` for a key that is not a token id, one outside
            ``[0, vocab_size)`` (when ``vocab_size`` is given) or a bias outside
            [-100, 100].
    """
    pairs = []
    for key, bias in (logit_bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise invalid(f"logit_bias keys are token ids, got {key!r}", "logit_bias") from None
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            top = "" if vocab_size is None else f"..{vocab_size - 1}"
            raise invalid(
                f"logit_bias token id {token} is outside the vocabulary (0{top})", "logit_bias"
            )
        if not -LOGIT_BIAS_MAX <= bias <= LOGIT_BIAS_MAX:
            raise invalid(
                f"logit_bias values must be in [-100, 100], got {bias} for {key}", "logit_bias"
            )
        pairs.append((token, float(bias)))
    return tuple(pairs)


def check_common(req: _SamplingFields) -> None:
    """Checks that need no tokenizer or engine: ``n``, ``logit_bias`` (its ids against
    the vocabulary come later, with the engine's facts), ``stop``, the
    sampling ranges (``seed`` in 0..2**63-1, ``top_k``, ``temperature``...) and
    ``max_tokens`` at least 0 (its upper bound is the context, checked with the prompt).

    Raises:
        APIError: 400 naming the field.
    """
    if req.n < 1 or req.n > MAX_N:
        raise invalid(f"n must be between 1 and {MAX_N}, got {req.n}", "n")
    logit_bias_pairs(req.logit_bias)
    stop_strings(req.stop)
    sampling_params(req, 0, 0)
    if req.max_tokens is not None and req.max_tokens < MAX_TOKENS_MIN:
        raise invalid(f"max_tokens must be at least {MAX_TOKENS_MIN}, got {req.max_tokens}", "max_tokens")


# Seconds a client should wait before retrying a request that ran out of device
# memory: the engine has rolled back and shrunk its steps by then, and memory another
# process held for a moment may be back.
OOM_RETRY_AFTER_S = 1
OUT_OF_MEMORY = "out_of_memory"
REQUEST_TIMEOUT = "request_timeout"


def engine_error(code: str | None, message: str | None) -> APIError:
    """The API error for a sequence the engine ended with ``finish_reason="error"``.

    ``out_of_memory`` (the request did not fit in device memory even alone; the engine
    stayed up) is a 503 with Retry-After: the same request may well run later. Any
    other code is a 500 carrying the engine's code (``engine_error`` when it gave none).
    """
    if code == ERROR_INVALID_SCHEMA:
        # The schema did not compile (unsupported, or not in time): the request's fault.
        return invalid(message or "the JSON schema cannot be used", "response_format")
    if code == OUT_OF_MEMORY:
        return APIError(
            503,
            message or "the device ran out of memory for this request; retry later",
            type=SERVER_ERROR,
            code=OUT_OF_MEMORY,
            headers={"Retry-After": str(OOM_RETRY_AFTER_S)},
        )
    return APIError(
        500,
        message or "the engine failed this request",
        type=SERVER_ERROR,
        code=code or "engine_error",
    )


@dataclass
class Piece:
    """New text of one sequence; ``finish_reason`` set on its last piece."""

    index: int
    text: str
    finish_reason: str | None = None


@dataclass
class _SeqText:
    matcher: StopStringMatcher
    detokenizer: object
    completion_tokens: int = 0
    finished: bool = False
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # not yet taken
    prompt_logprobs: list[TokenLogprobs | None] | None = None


class CallSteps:
    """A call's own steps inside :meth:`Generation.start`, around its prompts'
    encoding. This base takes none (text completions); a chat's
    (:class:`service.api.chat_generation.ChatSteps`) checks its tools and
    ``response_format`` and continues its prompt for a forced tool call.

    Attributes:
        json_schema: the JSON schema (as text) every answer is constrained to, or None
            (free text); known once :meth:`check` has passed.
    """

    json_schema: str | None = None

    def check(self) -> None:
        """The call's own checks, after its admission and before any tokenizing.

        Raises:
            APIError: 400 naming the field.
        """

    async def continued(self, prompt_ids: list[int]) -> list[int]:
        """A prompt's token ids as the engine gets them, from its encoding."""
        return prompt_ids


@dataclass
class Generation:
    """The sequences of one API call.

    Args:
        supervisor: the worker's keeper; the engine requests go through its link's
            routing (``supervisor.link.requests``), its ``retry_after_s`` dates a 503.
        text: the tokenizer side.
        request_id: the API id (``chatcmpl-...``); engine ids are ``{request_id}-{i}``.
        n: sequences per prompt; sequence ``i`` answers ``prompts[i // n]``.
        stops: stop strings.
        started: ``time.perf_counter()`` when the HTTP request arrived.
        deadline: ``time.perf_counter()`` past which :meth:`pieces` gives up (504
            ``request_timeout``; the caller's :meth:`close` aborts the sequences), or
            None.
        defaults: what an unset sampling field means (the model's generation config,
            :mod:`service.api.sampling_defaults`).
        context_tokens: a smaller context than the engine's for this call (Ollama's
            ``num_ctx``), or None.

    Attributes (set by :meth:`start`):
        prompts: prompt token ids, one list per prompt.
        sampling: one :class:`SamplingParams` per sequence.
        ticket: the request's place among those waiting for the engine, released at
            its first output or at :meth:`close`.
    """

    supervisor: Supervisor
    text: TextSide
    request_id: str
    n: int
    stops: list[str]
    started: float
    deadline: float | None = None
    defaults: SamplingDefaults = _OPENAI_DEFAULTS
    context_tokens: int | None = None
    prompts: list[list[int]] = field(default_factory=list)
    sampling: list[SamplingParams] = field(default_factory=list)
    ticket: Ticket | None = None
    first_token_at: float | None = None
    submission: Submission | None = None
    _seqs: list[_SeqText] = field(default_factory=list)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def completion_tokens(self) -> int:
        return sum(s.completion_tokens for s in self._seqs)

    @property
    def ttft_ms(self) -> float | None:
        if self.first_token_at is None:
            return None
        return (self.first_token_at - self.started) * 1000.0

    async def start(
        self,
        admission: Admission,
        info: EngineInfo,
        req: _SamplingFields,
        prompts: Sequence[Prompt],
        max_tokens: MaxTokens,
        steps: CallSteps | None = None,
    ) -> None:
        """Take the checked call ``req`` into the engine, in this order (so the errors
        come in it): a place among the requests waiting for the engine
        (``admission``), ``logit_bias`` against the vocabulary, the call's own checks
        (``steps``, see :class:`CallSteps`), the prompts to token ids (bounded
        untokenized, then the chat template or the tokenizer in threads, see
        :func:`service.api.prompts.encode_prompts`; then continued by ``steps``), each
        prompt's completion length against the context (``info``'s, or
        ``context_tokens``), one ``GenerateRequest`` per sequence, submitted (none
        when the length is 0, except one per prompt that scores its prompt tokens for
        ``echo`` with ``logprobs``). The place is given back when any step fails.

        Raises:
            APIError: 503 ``queue_full``; 400 ``logit_bias``; 400 as ``steps``,
                :func:`~service.api.prompts.encode_prompts` and
                :func:`resolve_max_tokens` raise (``context_length_exceeded``...).
            engine.text.chat.ChatTemplateError: messages the template cannot render.
            NotReady: no worker ready; nothing submitted.
        """
        steps = steps or CallSteps()
        self.ticket = admission.enter()
        try:
            logit_bias_pairs(req.logit_bias, info.vocab_size)
            steps.check()
            context = info.max_context_tokens
            if self.context_tokens is not None:
                context = min(context, self.context_tokens)
            encoded = await encode_prompts(self.text, prompts, info, context)
            self.prompts = [await steps.continued(ids) for ids in encoded]
            self.sampling = []
            for ids in self.prompts:
                max_new = max_tokens.resolve(len(ids), context)
                self.sampling += [
                    sampling_params(req, max_new, j, self.defaults, steps.json_schema)
                    for j in range(self.n)
                ]
            self._submit()
        except BaseException:
            self.ticket.release()
            raise

    def _submit(self) -> None:
        prompt_of = [self.prompts[i // self.n] for i in range(len(self.sampling))]
        self._seqs = [
            _SeqText(StopStringMatcher(self.stops), self.text.detokenizer(ids)) for ids in prompt_of
        ]
        if self.sampling and self.sampling[0].max_new_tokens == 0:
            if self.sampling[0].prompt_logprobs is not None:
                self._submit_scoring()
            return
        requests = [
            GenerateRequest(
                request_id=f"{self.request_id}-{i}", prompt_token_ids=ids, sampling=sampling
            )
            for i, (ids, sampling) in enumerate(zip(prompt_of, self.sampling, strict=True))
        ]
        self.submission = self.supervisor.link.requests.submit(requests)

    @property
    def _scoring(self) -> bool:
        """Whether this call only scores its prompts (``max_tokens`` 0 with ``echo`` and
        ``logprobs``, see :meth:`_submit_scoring`)."""
        return self.submission is not None and self.sampling[0].max_new_tokens == 0

    def _submit_scoring(self) -> None:
        """Score each prompt once for its ``n`` choices: the engine computes prompt
        logprobs only on the way to a sampled token (it refuses ``max_new_tokens`` 0),
        so each request asks for one token, which :meth:`_scored` drops."""
        requests = [
            GenerateRequest(
                request_id=f"{self.request_id}-{p * self.n}",
                prompt_token_ids=ids,
                sampling=msgspec.structs.replace(
                    self.sampling[p * self.n], max_new_tokens=1, logprobs=None
                ),
            )
            for p, ids in enumerate(self.prompts)
        ]
        self.submission = self.supervisor.link.requests.submit(requests)

    def close(self) -> None:
        """Abort whatever is still running in the engine. Idempotent."""
        if self.ticket is not None:
            self.ticket.release()
        if self.submission is not None:
            self.supervisor.link.requests.cancel(self.submission)

    async def pieces(self) -> AsyncIterator[Piece]:
        """Text as it is generated, until every sequence has finished.

        Raises:
            APIError: 503 ``engine_restarted`` when the worker died under a sequence
                that had produced tokens (or died twice); 400 when the engine
                rejected a sequence; 503 ``out_of_memory`` (Retry-After) when one ran
                out of device memory; 500 with the engine's code when one failed
                otherwise (see :func:`engine_error`); 504 ``request_timeout`` past
                ``deadline``.
        """
        if self.submission is None:
            if self.ticket is not None:
                self.ticket.release()
            for i, _ in enumerate(self._seqs):
                self._seqs[i].finished = True
                yield Piece(i, "", FINISH_LENGTH)
            return
        if self._scoring:
            async for piece in self._scored():
                yield piece
            return
        pending = len(self._seqs)
        queue = self.submission.queue
        while pending:
            index, event = await self._next(queue)
            if self.ticket is not None:
                self.ticket.release()  # the engine has taken it up
            seq = self._seqs[index]
            if seq.finished:
                continue
            if isinstance(event, EngineFailure):
                raise self._failure(event)
            if isinstance(event, Rejected):
                raise APIError(400, event.message, param=event.param, code=event.code)
            piece = self._on_output(index, seq, event)
            if seq.finished:
                pending -= 1
            if piece is not None:
                yield piece

    async def _scored(self) -> AsyncIterator[Piece]:
        """The empty choices of a scoring call (:meth:`_submit_scoring`), each once its
        prompt's logprobs arrived; the one token each engine request sampled is
        dropped (neither text nor usage). Raises as :meth:`pieces`."""
        assert self.submission is not None
        pending = len(self.prompts)
        while pending:
            prompt, event = await self._next(self.submission.queue)
            if self.ticket is not None:
                self.ticket.release()
            if isinstance(event, EngineFailure):
                raise self._failure(event)
            if isinstance(event, Rejected):
                raise APIError(400, event.message, param=event.param, code=event.code)
            choices = range(prompt * self.n, (prompt + 1) * self.n)
            if event.prompt_logprobs is not None:
                for i in choices:
                    self._seqs[i].prompt_logprobs = event.prompt_logprobs
            if not event.finished:
                continue
            if event.finish_reason == FINISH_ERROR:
                raise engine_error(event.error_code, event.error_message)
            pending -= 1
            for i in choices:
                self._seqs[i].finished = True
                yield Piece(i, "", FINISH_LENGTH)

    async def _next(self, queue: asyncio.Queue) -> tuple[int, object]:
        if self.deadline is None:
            return await queue.get()
        left = self.deadline - time.perf_counter()
        try:
            if left <= 0:
                raise TimeoutError
            return await asyncio.wait_for(queue.get(), left)
        except TimeoutError:
            raise APIError(
                504,
                "the request took longer than this server allows (--request-timeout); "
                "ask for fewer tokens or retry later",
                type=SERVER_ERROR,
                code=REQUEST_TIMEOUT,
            ) from None

    def take_logprobs(self, index: int) -> list[TokenLogprobs]:
        """Sequence ``index``'s token logprobs that arrived since the last take (the
        request asked for them, see :func:`wanted_logprobs`; else always empty)."""
        seq = self._seqs[index]
        taken, seq.logprobs = seq.logprobs, []
        return taken

    def prompt_logprobs(self, index: int) -> list[TokenLogprobs | None] | None:
        """The logprobs of sequence ``index``'s prompt tokens (``echo`` with
        ``logprobs``; the first is None), once they arrived, else None."""
        return self._seqs[index].prompt_logprobs

    def _on_output(self, index: int, seq: _SeqText, output) -> Piece | None:
        if output.logprobs:
            seq.logprobs += output.logprobs
        if output.prompt_logprobs is not None:
            seq.prompt_logprobs = output.prompt_logprobs
        text = ""
        if output.token_ids:
            if self.first_token_at is None:
                self.first_token_at = time.perf_counter()
            seq.completion_tokens += len(output.token_ids)
            text = seq.detokenizer.add(output.token_ids)
        if output.finished:
            if output.finish_reason == FINISH_ERROR:
                raise engine_error(output.error_code, output.error_message)
            # A character cut by max_tokens stays incomplete forever: drop it rather
            # than show U+FFFD.
            text += seq.detokenizer.flush().rstrip(_REPLACEMENT)
        safe, stopped = seq.matcher.feed(text) if text else ("", seq.matcher.stopped)
        if stopped:
            seq.finished = True
            # The stop string ended it here: free the engine's pages now.
            self.supervisor.link.requests.abort_one(f"{self.request_id}-{index}")
            return Piece(index, safe, "stop")
        if output.finished:
            seq.finished = True
            safe += seq.matcher.flush()
            reason = FINISH_LENGTH if output.finish_reason == FINISH_LENGTH else "stop"
            return Piece(index, safe, reason)
        return Piece(index, safe) if safe else None

    def _failure(self, event: EngineFailure) -> APIError:
        headers = {}
        retry_after = self.supervisor.retry_after_s()
        if event.code == ENGINE_RESTARTED and retry_after is not None:
            headers["Retry-After"] = str(retry_after)
        return APIError(503, event.message, type=SERVER_ERROR, code=event.code, headers=headers)
