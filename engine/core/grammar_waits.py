"""Structured output's waiting room: a request with a JSON schema waits here while its
grammar compiles in the background (the steps go on), and goes to the scheduler once
the grammar is ready; a compile that fails or runs past its time ends the request with
``error_code`` :data:`~engine.wire.messages.ERROR_INVALID_SCHEMA`.

:class:`GrammarWaits` is a part of :class:`engine.core.engine.Engine` (it uses the
engine's ``scheduler``, ``model_dir``, ``vocab_size`` and ``model_config``).
"""

from __future__ import annotations

import time
from concurrent import futures

from engine.sampling.grammar import GrammarCompiler, GrammarError
from engine.scheduler.request import Request
from engine.wire.messages import ERROR_INVALID_SCHEMA, FINISH_ERROR, TokenOutput


class GrammarWaits:
    """The engine's grammar waits (see the module docstring)."""

    _grammar_compiler: GrammarCompiler | None = None
    # Requests waiting for their grammar's compile: (request, future, deadline).
    _compiling: list[tuple[Request, futures.Future, float]]

    def _admit_compiled(self) -> list[TokenOutput]:
        """Requests whose grammar has compiled go to the scheduler; those whose compile
        failed or ran past its time end with ``error_code`` :data:`ERROR_INVALID_SCHEMA`."""
        if not self._compiling:
            return []
        if not self.scheduler.has_work():
            # Nothing else to run: wait a little for a compile rather than spin.
            futures.wait([f for _, f, _ in self._compiling], timeout=0.01, return_when=futures.FIRST_COMPLETED)
        failed, waiting = [], []
        now = time.monotonic()
        for request, future, deadline in self._compiling:
            if future.done():
                try:
                    request.state.matcher = self._grammars().matcher_of(future.result())
                except GrammarError as exc:
                    failed.append(self._failed(request, str(exc)))
                    continue
                self.scheduler.add(request)
            elif now > deadline:
                failed.append(self._failed(request, self._grammars().timeout_message()))
            else:
                waiting.append((request, future, deadline))
        self._compiling = waiting
        return failed


    @staticmethod
    def _failed(request: Request, message: str) -> TokenOutput:
        return TokenOutput(request_id=request.request_id, token_ids=[], finished=True, finish_reason=FINISH_ERROR,
                           error_code=ERROR_INVALID_SCHEMA, error_message=message,
                           prompt_tokens=len(request.prompt_ids))


    def _grammars(self) -> GrammarCompiler:
        """The JSON-schema compiler, made on the first structured-output request."""
        if self._grammar_compiler is None:
            self._grammar_compiler = GrammarCompiler(
                self.model_dir, self.vocab_size, list(self.model_config.eos_token_ids)
            )
        return self._grammar_compiler
