"""What every route does once its request is built (:func:`start_generation`): the
model loaded and named, then the request taken into the engine
(:meth:`service.api.generation.Generation.start`)."""

from __future__ import annotations

import time
from collections.abc import Callable

from service.api.chat_plan import chat_template
from service.api.deadline import request_deadline
from service.api.generation import Generation
from service.api.request import GenerationRequest
from service.api.services import Services
from service.api.thinking import check_thinking


async def start_generation(
    svc: Services,
    model: str | None,
    request: GenerationRequest,
    untemplated: Callable[[GenerationRequest], GenerationRequest] | None = None,
) -> tuple[Generation, str]:
    """What every route does once its request is built: a ready worker (503; an idle
    one is loaded first, the wait kept as :attr:`Generation.load_s`), the model it
    names (404: :meth:`Services.check_model`), then
    :meth:`Generation.start`, of the chat ``untemplated(request)`` gives (or raises)
    where the model's tokenizer has no chat template (Ollama's calls; None: the
    request as it is). The call is counted as started first (:meth:`Services.note_start`,
    kept as :attr:`Generation.start_number`). ``--request-timeout`` counts on the ready clock
    (:mod:`service.api.deadline`), not the load it waited for.

    Raises:
        APIError: 400 naming ``request.thinking_param`` when thinking is asked of a
            model whose template cannot think
            (:func:`service.api.thinking.check_thinking`); as ``untemplated`` raises; as
            :meth:`Generation.start`.

    Returns:
        ``(the started generation, the model name to answer with)``.
    """
    start_number = svc.note_start()
    waited_from = time.perf_counter()
    deadline = request_deadline(svc.supervisor.ready_clock, svc.settings.request_timeout,
                                request.started)
    # Its place among the requests waiting for the engine is taken before the wait
    # for a load: an unload (keep_alive 0, the keep-alive) waits for it.
    ticket = svc.admission.enter()
    try:
        info = await svc.supervisor.ready()
    except BaseException:
        ticket.release()
        raise
    load_s = time.perf_counter() - waited_from
    name = svc.check_model(model, info)
    if request.chat and svc.text is not None:
        template = chat_template(svc.text)
        # ``model or name``: the name the client used, as Ollama's message has it.
        check_thinking(request.thinking, request.thinking_budget, template, model or name, request.thinking_param)
        if untemplated is not None and not template:
            request = untemplated(request)
    gen = await Generation.start(svc, info, request, deadline, ticket)
    gen.load_s = load_s
    gen.start_number = start_number
    return gen, name
