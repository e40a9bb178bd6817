"""The generation runner: one :class:`~service.api.request.GenerationRequest` into the
engine, and its sequences' text out.

Shared by every API (OpenAI's chat and text completions, Ollama's chat and generate),
streaming or not. :meth:`Generation.start` takes the request into the engine in one
part, in the order the API's errors come in: a place among the waiting requests
(503 ``queue_full``, :mod:`service.api.admission`), ``logit_bias`` ids against the
vocabulary (400), a chat's tool plan against the template (400,
:mod:`service.api.chat_plan`), the prompts to token ids (400 ``context_length_exceeded``
before any tokenizing, then the template or the tokenizer in threads,
:mod:`service.api.prompts`), each prompt's ``max_tokens`` against the context (400),
then ``len(prompts) * n`` engine sequences submitted to the worker link's routing.
:meth:`Generation.pieces` turns each sequence's token ids into text (incremental
detokenizer, then stop strings, which end the sequence in the engine at once), counts
usage and times the first token; the answer builders read it and nothing else.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec

from engine.text.stop import StopStringMatcher
from engine.wire.ipc import Rejected
from engine.wire.messages import (
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    EngineInfo,
    GenerateRequest,
    SamplingParams,
    TokenLogprobs,
)
from service.api.admission import Ticket
from service.api.chat_plan import ChatPlan, continue_prompt, plan_chat
from service.api.deadline import get_before
from service.api.engine_errors import engine_error, failure, rejected
from service.api.logprobs import ShownLogprobs
from service.api.prompt_fit import fit_prompts
from service.api.prompts import encode_prompts
from service.api.request import GenerationRequest, resolve_max_tokens
from service.api.sampling import check_vocabulary, sampling_params
from service.api.services import Services
from service.api.text import TextSide
from service.events.metrics import ServiceMetrics
from service.supervision.inflight import EngineFailure, Submission
from service.supervision.supervisor import Supervisor

_REPLACEMENT = "\ufffd"


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
    logprobs: ShownLogprobs  # given out as their text is
    completion_tokens: int = 0
    finished: bool = False
    last_token_at: float | None = None  # time.perf_counter() of its latest tokens
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass
class Generation:
    """The sequences of one API call (build it with :meth:`start`).

    Args:
        request: the call.
        supervisor: the worker's keeper; the engine requests go through its link's
            routing (``supervisor.link.requests``), its ``retry_after_s`` dates a 503.
        text: the tokenizer side.
        deadline: the ready clock's reading past which :meth:`pieces` gives up (504
            ``request_timeout``; :meth:`close` aborts the sequences), or None
            (:mod:`service.api.deadline`).
        metrics: the app's metrics (the time between tokens is observed here), or None.

    Attributes (set by :meth:`start`):
        prompts: prompt token ids, one list per prompt.
        sampling: one :class:`SamplingParams` per sequence.
        chat: a chat's :class:`~service.api.chat_plan.ChatPlan`, or None.
        ticket: the call's place among those waiting for the engine, released at its
            first output or at :meth:`close`.
        load_s: seconds the call waited for the model to load (about 0 if loaded).
        start_number: the call's number among the requests started
            (:meth:`~service.api.services.Services.note_start`).
    """

    request: GenerationRequest
    supervisor: Supervisor
    text: TextSide
    deadline: float | None = None
    metrics: ServiceMetrics | None = None
    prompts: list[list[int]] = field(default_factory=list)
    sampling: list[SamplingParams] = field(default_factory=list)
    chat: ChatPlan | None = None
    ticket: Ticket | None = None
    first_token_at: float | None = None
    submission: Submission | None = None
    load_s: float = 0.0
    start_number: int = 0
    _seqs: list[_SeqText] = field(default_factory=list)

    @property
    def request_id(self) -> str:
        return self.request.request_id

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
        return (self.first_token_at - self.request.started) * 1000.0

    @classmethod
    async def start(
        cls, svc: Services, info: EngineInfo, request: GenerationRequest,
        deadline: float | None = None, ticket: Ticket | None = None,
    ) -> Generation:
        """Take ``request`` into the engine (see the module docstring for the order of
        its steps and errors). The place among the waiting requests is given back when
        any step fails. ``deadline``: as the attribute (:func:`start_generation` sets
        it from ``--request-timeout``). ``ticket``: the place taken already (before
        the wait for a load), else one is taken here.

        Raises:
            APIError: 503 ``queue_full``; 400 ``logit_bias``; 400
                ``tools``/``tool_choice``; 400 as
                :func:`~service.api.prompts.encode_prompts` and
                :func:`~service.api.request.resolve_max_tokens` raise
                (``context_length_exceeded``...).
            engine.text.chat.ChatTemplateError: messages the template cannot render.
            NotReady: no worker ready; nothing submitted.
        """
        assert svc.text is not None
        gen = cls(
            request=request,
            supervisor=svc.supervisor,
            text=svc.text,
            deadline=deadline,
            metrics=svc.metrics,
        )
        gen.ticket = ticket or svc.admission.enter()
        try:
            check_vocabulary(request.logit_bias, info.vocab_size)
            context = info.max_context_tokens
            if request.context_tokens is not None:
                context = min(context, request.context_tokens)
            gen.chat, gen.prompts = await prompt_ids(gen.text, info, request, context)
            gen.sampling = gen._sampling(context, svc)
            # An engine unloaded while the prompt was encoded (a long one) loads again.
            await svc.supervisor.ready()
            gen._submit()
        except BaseException:
            gen.ticket.release()
            raise
        return gen

    def _sampling(self, context: int, svc: Services) -> list[SamplingParams]:
        """One :class:`SamplingParams` per sequence: each prompt's ``max_tokens``
        resolved against the context, the seed offset by the sequence's place."""
        r = self.request
        schema = self.chat.json_schema if self.chat is not None else r.json_schema
        thinking = self.chat.thinking_budget if self.chat is not None else None
        # A prompt too long for its completion is blamed on the prompts' field as a
        # whole (``prompt``, not ``prompt[1]``).
        prompt_param = r.prompts[0].param.partition("[")[0]
        out = []
        for ids in self.prompts:
            max_tokens = resolve_max_tokens(
                r.max_tokens,
                r.max_tokens_param,
                len(ids),
                context,
                prompt_param=prompt_param,
                default=r.default_max_tokens,
                context_param=r.context_param,
            )
            out += [
                sampling_params(
                    r.sampling,
                    max_tokens,
                    j,
                    svc.sampling_defaults,
                    schema,
                    logit_bias=r.logit_bias,
                    logprobs=r.logprobs,
                    prompt_logprobs=r.logprobs if r.echo else None,
                    thinking=thinking,
                )
                for j in range(r.n)
            ]
        return out

    def _submit(self) -> None:
        prompt_of = [self.prompts[i // self.request.n] for i in range(len(self.sampling))]
        stop = list(self.request.stop)
        self._seqs = [
            _SeqText(
                StopStringMatcher(stop),
                self.text.detokenizer(ids, keep_special=self.chat is not None and self.chat.harmony),
                ShownLogprobs(self.text.token_texts, hold=bool(stop)),
            )
            for ids in prompt_of
        ]
        if self.sampling and self.sampling[0].max_new_tokens == 0:
            if self.sampling[0].prompt_logprobs is not None:
                self._submit_scoring()
            return
        requests = [
            GenerateRequest(
                request_id=f"{self.request_id}-{i}", prompt_token_ids=ids, sampling=sampling,
                group=self.request_id,
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
                request_id=f"{self.request_id}-{p * self.request.n}",
                group=self.request_id,
                prompt_token_ids=ids,
                sampling=msgspec.structs.replace(
                    self.sampling[p * self.request.n], max_new_tokens=1, logprobs=None
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
                otherwise (see :mod:`service.api.engine_errors`); 504
                ``request_timeout`` past ``deadline``.
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
            seq = self._seqs[index]
            if seq.finished:
                continue
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
            self._raise_failed(event)
            choices = range(prompt * self.request.n, (prompt + 1) * self.request.n)
            if event.prompt_logprobs is not None:
                for i in choices:
                    self._seqs[i].prompt_logprobs = event.prompt_logprobs
            if not event.finished:
                continue
            if event.finish_reason == FINISH_ERROR:
                raise engine_error(event.error_code, event.error_message, self._schema_param)
            pending -= 1
            for i in choices:
                self._seqs[i].finished = True
                yield Piece(i, "", FINISH_LENGTH)

    async def _next(self, queue: asyncio.Queue) -> tuple[int, object]:
        """The next event of any sequence; the call's place among the waiting
        requests is given back with it (the engine has taken the call up).

        Raises:
            APIError: 504 ``request_timeout`` past ``deadline``.
        """
        event = await get_before(queue, self.deadline, self.supervisor.ready_clock)
        if self.ticket is not None:
            self.ticket.release()
        return event

    @property
    def _schema_param(self) -> str:
        """The field a refused schema came from: a forced call's is its tool's."""
        forced = self.chat is not None and self.chat.tools.schema is not None
        return "tools" if forced else self.request.schema_param

    def _raise_failed(self, event: object) -> None:
        """Raise the API error of a sequence the worker's death ended or the engine
        refused."""
        if isinstance(event, EngineFailure):
            raise failure(event, self.supervisor.retry_after_s())
        if isinstance(event, Rejected):
            raise rejected(event, self._schema_param)

    def take_logprobs(self, index: int) -> list[TokenLogprobs]:
        """Sequence ``index``'s token logprobs whose text came out since the last take
        (the request asked for them; else always empty): the tokens spell the text,
        none past a stop string (:class:`~service.api.logprobs.ShownLogprobs`)."""
        return self._seqs[index].logprobs.take()

    def stop_string(self, index: int) -> str | None:
        """The stop string that ended sequence ``index`` (its finish reason is then
        ``"stop"``), or None: it ended otherwise, or has not ended."""
        return self._seqs[index].matcher.matched

    def prompt_logprobs(self, index: int) -> list[TokenLogprobs | None] | None:
        """The logprobs of sequence ``index``'s prompt tokens (``echo`` with
        ``logprobs``; the first is None), once they arrived, else None."""
        return self._seqs[index].prompt_logprobs

    def _on_output(self, index: int, seq: _SeqText, output) -> Piece | None:
        self._raise_failed(output)
        if output.logprobs:
            ended = output.finished and output.finish_reason == FINISH_STOP
            # The tokens spell the text: the end token that stopped it and any special
            # token the text skips (``<|im_end|>`` under ignore_eos) are left out, as
            # OpenAI leaves them out.
            records = output.logprobs[:-1] if ended else output.logprobs
            seq.logprobs.add([r for r in records if seq.detokenizer.shows(r.token_id)])
        if output.prompt_logprobs is not None:
            seq.prompt_logprobs = output.prompt_logprobs
        text = ""
        if output.token_ids:
            now = time.perf_counter()
            if self.first_token_at is None:
                self.first_token_at = now
            if seq.last_token_at is not None and self.metrics is not None:
                self.metrics.tokens_arrived(now - seq.last_token_at, len(output.token_ids))
            seq.last_token_at = now
            seq.completion_tokens += len(output.token_ids)
            text = seq.detokenizer.add(output.token_ids)
        if output.finished:
            if output.finish_reason == FINISH_ERROR:
                raise engine_error(output.error_code, output.error_message, self._schema_param)
            # A character cut by max_tokens stays incomplete forever: drop it rather
            # than show U+FFFD.
            text += seq.detokenizer.flush().rstrip(_REPLACEMENT)
        safe, stopped = seq.matcher.feed(text) if text else ("", seq.matcher.stopped)
        if stopped:
            seq.finished = True
            seq.logprobs.show(safe, stopped=True)
            # The stop string ended it here: free the engine's pages now.
            self.supervisor.link.requests.abort_one(f"{self.request_id}-{index}")
            return Piece(index, safe, "stop")
        if output.finished:
            seq.finished = True
            safe += seq.matcher.flush()
            seq.logprobs.show(safe, finished=True)
            reason = FINISH_LENGTH if output.finish_reason == FINISH_LENGTH else "stop"
            return Piece(index, safe, reason)
        seq.logprobs.show(safe)
        return Piece(index, safe) if safe else None


async def prompt_ids(
    text: TextSide, info: EngineInfo, request: GenerationRequest, context: int
) -> tuple[ChatPlan | None, list[list[int]]]:
    """A call's prompts as the engine gets them: a chat's plan (its tools against the
    template), then each prompt, cut to leave the answer room where the call truncates
    (:func:`~service.api.prompt_fit.fit_prompts`), to token ids (bounded by ``context``
    tokens before any tokenizing), continued as the plan says (a forced tool call's opening).

    Returns:
        ``(plan, ids)``: the :class:`~service.api.chat_plan.ChatPlan` (None unless
        ``request.chat``) and one id list per prompt.

    Raises:
        APIError: 400 ``tools``/``tool_choice``; 400 as
            :func:`~service.api.prompts.encode_prompts` raises.
        engine.text.chat.ChatTemplateError: messages the template cannot render.
    """
    plan = plan_chat(request, text) if request.chat else None
    encoded = await encode_prompts(text, await fit_prompts(text, request, context), info, context)
    if plan is not None:
        encoded = [await continue_prompt(plan, text, ids) for ids in encoded]
    return plan, encoded
