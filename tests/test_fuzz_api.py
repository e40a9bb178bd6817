"""schemathesis over the service's own OpenAPI document (``/schema/openapi.json``),
against a real ``headroom serve`` with the default model.

Every operation of ``/v1`` and ``/api`` (but ``/api/control/restart``, which would
reload the model each time) gets :data:`CASES_PER_OPERATION` generated requests
valid against the schema and as many invalid ones, with the secrets they need.
Completions are kept short: ``max_tokens``/``max_completion_tokens``/``max_output_tokens``
at most 4 and ``n`` at most 2 (the engine runs on the CPU). Each answer must be one the document
declares, in the declared shape, and no 5xx but the documented 503s; the server must
be healthy after. The test prints the case count (``-s`` shows it).
"""

from __future__ import annotations

import os

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)
from service_harness import ServerProcess, serving

pytestmark = pytest.mark.slow

KEY = "sk-fuzz-0123456789"
CASES_PER_OPERATION = int(os.environ.get("HEADROOM_FUZZ_CASES", "25"))
SKIPPED = {"/api/control/restart"}
# The answer is declared (status, content type, body shape) and invalid data is refused.
# Not "valid data is accepted": a body valid by the schema may still be refused with a
# 400 for what a schema does not say (a prompt longer than the context, a role the chat
# template does not know, a field set to a value we do not support).
CHECKS = [
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
]


@pytest.fixture(scope="module")
def server(tmp_path_factory, default_model_dir):
    proc = ServerProcess(
        tmp_path_factory.mktemp("fuzz"),
        ["--num-pages", "256", "--api-key", KEY, "--request-timeout", "120"],
    )
    yield from serving(proc)


def _shorten(body: object) -> None:
    """Keep a generated completion cheap to run."""
    if not isinstance(body, dict):
        return
    for field in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        value = body.get(field)
        if value is None or (isinstance(value, int) and not isinstance(value, bool) and value > 4):
            body[field] = 4
    if isinstance(body.get("n"), int) and not isinstance(body["n"], bool) and body["n"] > 2:
        body["n"] = 2
    if isinstance(body.get("best_of"), int) and not isinstance(body["best_of"], bool):
        body["best_of"] = body.get("n", 1)


# Ollama's routes take the API key as /v1 does; the control routes take the local token.
OLLAMA_PATHS = {"/api/chat", "/api/generate", "/api/tags", "/api/ps", "/api/show", "/api/version"}


def _secret_for(path: str, token: str) -> str:
    return KEY if path.startswith("/v1") or path in OLLAMA_PATHS else token


def _fuzz_one(operation, mode, headers, label, counts, statuses, problems) -> None:
    """Run :data:`CASES_PER_OPERATION` cases of one operation in one mode."""

    @settings(
        max_examples=CASES_PER_OPERATION,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case) -> None:
        _shorten(case.body)
        response = case.call(headers=headers, timeout=300)
        counts[label] = counts.get(label, 0) + 1
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        if response.status_code >= 500:
            code = (response.json().get("error") or {}).get("code")
            if response.status_code != 503 or code not in ("queue_full", "out_of_memory"):
                problems.append(f"{label}: {response.status_code} {response.text[:300]}")
        try:
            case.validate_response(response, checks=CHECKS)
        except (AssertionError, FailureGroup) as exc:
            problems.append(f"{label}: {str(exc)[:600]} {response.text[:200]}")

    try:
        run()
    except Unsatisfiable:
        # Nothing to make invalid (an operation without a body or parameters).
        assert mode is GenerationMode.NEGATIVE, label


def test_fuzz_the_api_against_its_own_schema(server):
    schema = schemathesis.openapi.from_url(server.base_url + "/schema/openapi.json")
    token = server.token
    counts: dict[str, int] = {}
    statuses: dict[int, int] = {}
    problems: list[str] = []

    for result in schema.get_all_operations():
        operation = result.ok()
        if operation.path in SKIPPED:
            continue
        headers = {"Authorization": f"Bearer {_secret_for(operation.path, token)}"}
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            label = f"{operation.method.upper()} {operation.path} {mode.value}"
            _fuzz_one(operation, mode, headers, label, counts, statuses, problems)

    total = sum(counts.values())
    print(f"fuzz: {total} cases over {len(counts)} operation/mode pairs; statuses {statuses}")
    for label, n in sorted(counts.items()):
        print(f"  {label}: {n}")
    assert not problems, "\n".join(problems[:20])
    # Each operation valid, each with a body invalid (OpenAI's, control, Ollama's).
    assert len(counts) >= 6 + 5 + 6 + 3, counts
    # Healthy after: ready again (a fuzzed pause, resume or unload may have left the
    # worker reloading), and a plain request still answers.
    server.wait_ready()
    assert server.health().status_code == 200
    r = httpx.post(
        server.base_url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=120,
    )
    assert r.status_code == 200, r.text
