"""What a new user hit, each as it was met: a KV cache too small for one request
accepted, the embedded model missing from ``headroom models``, ``headroom generate``
loading a second engine beside a running server (and its error against a service with
``--api-key`` naming no way to give the key), a refused request's log line without
its reason, and a ``--num-pages`` pool below one ``--min-context`` served without a word."""

from __future__ import annotations

import os
import subprocess

import httpx
import pytest
from click.testing import CliRunner
from service_harness import headroom_command, wait_for

from engine.common.config import EngineConfig
from engine.common.errors import SettingRefused
from engine.memory.fixed_pool import unplanned_pool
from service.cli.commands import main

QUESTION = "What is the capital of France?"


class _Model:
    max_position_embeddings = 8192


def test_a_kv_cache_below_one_min_context_is_refused_with_the_size_that_fits():
    page_bytes = 46080 * 16  # SmolLM2-135M's float32 keys and values of 16 tokens
    with pytest.raises(SettingRefused, match=r"--kv-cache 1 KiB holds 0 tokens") as info:
        unplanned_pool(EngineConfig(kv_cache=1024), _Model, page_bytes)
    assert "one --min-context of 2048 tokens" in str(info.value)
    assert "give at least --kv-cache 90MiB" in str(info.value)
    # 90 MiB holds it (128 pages, the null page apart), and so does a smaller
    # --min-context (or --max-model-len) on less.
    assert unplanned_pool(EngineConfig(kv_cache=90 << 20), _Model, page_bytes).pages == 2048 // 16 + 1
    assert unplanned_pool(EngineConfig(kv_cache=8 << 20, min_context=128), _Model, page_bytes).pages == 12
    assert unplanned_pool(EngineConfig(kv_cache=8 << 20, max_model_len=160), _Model, page_bytes).pages == 12


@pytest.mark.slow
def test_serve_with_a_tiny_kv_cache_exits_naming_the_fix(start_server):
    server = start_server(["--kv-cache", "1KiB"], wait=False)
    code = server.proc.wait(timeout=300)
    assert code != 0
    log = server.log()
    assert "--kv-cache 1 KiB holds 0 tokens" in log and "--min-context" in log, log
    assert "Traceback" not in log


def test_models_lists_the_embedded_default_model(tmp_path, default_model_dir):
    result = CliRunner().invoke(main, ["models"], env={"HEADROOM_CACHE_DIR": str(tmp_path), "HEADROOM_CONFIG": os.devnull})
    assert result.exit_code == 0, result.output
    header, default, *rest = result.output.splitlines()
    assert default.startswith("SmolLM2-135M-Instruct.Q4_1 (embedded default, served without --model)")
    assert "Q4_1" in default and "8,192" in default
    assert "no models in the store" in rest[-1] and "headroom pull" in rest[-1]


@pytest.mark.slow
def test_generate_answers_from_the_running_server(real_server):
    env = {**os.environ, "HEADROOM_CONFIG": os.devnull, "HEADROOM_RUNTIME_DIR": real_server.env["HEADROOM_RUNTIME_DIR"]}
    result = subprocess.run(
        [*headroom_command(), "generate", "--max-tokens", "8", "--temperature", "0", QUESTION],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout and result.stdout.endswith("\n")
    # The server answered it (its call's log line), and no engine loaded here.
    wait_for(lambda: "/v1/chat/completions status=200 prompt_tokens=" in real_server.log(), 30, "the call's log line")
    assert "loading the engine here" not in result.stderr and "took no effect" not in result.stderr
    # Engine flags typed here are the service's to set: said on stderr, not silently dropped.
    raw = subprocess.run(
        [*headroom_command(), "generate", "--max-tokens", "4", "--temperature", "0", "--raw", "--kv-cache-dtype",
         "q8_0", "--reserve", "1GiB", "The capital of France is"],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert raw.returncode == 0 and raw.stdout.strip(), raw.stderr
    assert "/v1/completions status=200" in real_server.log()
    assert ("the running headroom serve answered with its own settings; --kv-cache-dtype, --reserve took no effect "
            "(--local runs the engine in this process with them)") in raw.stderr


@pytest.mark.slow
def test_a_refused_request_logs_its_reason(real_server):
    r = httpx.post(real_server.base_url + "/v1/chat/completions",
                   json={"model": "default", "messages": [{"role": "user", "content": "hi"}], "temperature": 9},
                   timeout=30)
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    # The server is shared: earlier tests' refusals are in its log too, so the line is
    # found by this refusal's own message.
    line = wait_for(
        lambda: next((x for x in real_server.log().splitlines() if "POST /v1/chat/completions -> 400" in x
                      and message in x), None),
        30, "the refusal's log line",
    )
    assert "param=temperature" in line
    r = httpx.post(real_server.base_url + "/api/chat", json={"model": "nope", "messages": [{"role": "user", "content": "hi"}]},
                   timeout=30)
    assert r.status_code == 404
    wait_for(lambda: any("POST /api/chat -> 404" in x and "nope" in x for x in real_server.log().splitlines()),
             30, "the unknown model's log line")


@pytest.mark.slow
def test_generate_against_a_service_with_an_api_key_names_how_to_give_it(start_server):
    server = start_server(["--api-key", "sk-user-0123"], fake=True)
    env = {**os.environ, "HEADROOM_CONFIG": os.devnull, "HEADROOM_RUNTIME_DIR": server.env["HEADROOM_RUNTIME_DIR"]}
    env.pop("HEADROOM_API_KEY", None)

    def generate(*args: str, env=env) -> subprocess.CompletedProcess:
        return subprocess.run([*headroom_command(), "generate", "--max-tokens", "2", *args, "hi"],
                              capture_output=True, text=True, timeout=120, env=env)

    refused = generate()
    assert refused.returncode == 1
    assert "a valid API key is required" in refused.stderr
    for fix in ("--api-key KEY", "HEADROOM_API_KEY=KEY", "--local"):
        assert fix in refused.stderr, refused.stderr
    wrong = generate("--api-key", "sk-not-it")
    assert wrong.returncode == 1 and "the key given is not its key" in wrong.stderr
    for answered in (generate("--api-key", "sk-user-0123"), generate(env={**env, "HEADROOM_API_KEY": "sk-user-0123"})):
        assert answered.returncode == 0, answered.stderr
        assert answered.stdout.strip() and "loading the engine here" not in answered.stderr


@pytest.mark.slow
def test_generate_through_a_service_names_max_tokens_past_the_context(start_server):
    """The service checks prompt + max_tokens against the context as the API does; the
    CLI says so in its own words (the flag, not the API field) and names --local, whose
    engine generates until the context is full."""
    server = start_server([], fake=True)
    env = {**os.environ, "HEADROOM_CONFIG": os.devnull, "HEADROOM_RUNTIME_DIR": server.env["HEADROOM_RUNTIME_DIR"]}
    refused = subprocess.run([*headroom_command(), "generate", "--max-tokens", "1000000", "hi"],
                             capture_output=True, text=True, timeout=120, env=env)
    assert refused.returncode == 2, refused.stderr
    assert "refused --max-tokens 1000000 with this prompt" in refused.stderr, refused.stderr
    assert "--local" in refused.stderr and " max_tokens" not in refused.stderr, refused.stderr
    # A prompt past the context by itself: --local would refuse it too, so it is not named.
    too_long = subprocess.run([*headroom_command(), "generate", "--max-tokens", "5", "--raw", "word " * 3000],
                              capture_output=True, text=True, timeout=120, env=env)
    assert too_long.returncode == 2, too_long.stderr
    assert "refused the prompt" in too_long.stderr and "--local" not in too_long.stderr, too_long.stderr


@pytest.mark.slow
def test_generate_does_not_load_a_second_engine_behind_a_paused_service(start_server):
    """A service paused to give its memory back (game mode) answered 503, and generate
    loaded the model in its own process, taking the memory again; it refuses, naming the
    resume route and --local."""
    server = start_server([], fake=True)
    env = {**os.environ, "HEADROOM_CONFIG": os.devnull, "HEADROOM_RUNTIME_DIR": server.env["HEADROOM_RUNTIME_DIR"]}
    httpx.post(server.base_url + "/api/control/pause", headers={"Authorization": f"Bearer {server.token}"},
               timeout=60).raise_for_status()
    refused = subprocess.run([*headroom_command(), "generate", "--max-tokens", "2", "hi"],
                             capture_output=True, text=True, timeout=120, env=env)
    assert refused.returncode == 1, refused.stderr
    assert "is paused, its memory given back" in refused.stderr, refused.stderr
    assert "/api/control/resume" in refused.stderr and "--local" in refused.stderr, refused.stderr
    assert "loading the engine here" not in refused.stderr


@pytest.mark.slow
def test_a_pool_below_one_min_context_is_served_with_a_warning_and_refuses_what_cannot_fit(start_server):
    """``--num-pages 4 --page-size 16`` holds 48 tokens: the worker's start-up log warns,
    naming the numbers and the fix; a request that can never fit the pool is answered
    at once with a 400 in its API's shape (streaming or not; Ollama's cut it instead), and
    a short one is served."""
    server = start_server(["--num-pages", "4", "--page-size", "16"])
    log = server.log()
    assert "WARNING headroom.engine: --num-pages 4 holds 48 tokens" in log, log
    assert "less than one --min-context of 2048 tokens" in log and "give --num-pages 129 or more" in log
    long = " ".join(["hello world"] * 100)
    with server.client(timeout=60) as http:
        for stream in (False, True):
            r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": long}],
                                                        "stream": stream})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["code"] == "context_length_exceeded" and "maximum context length is 48 tokens" in error["message"]
        r = http.post("/v1/completions", json={"prompt": "hi there", "max_tokens": 60})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
        # Anthropic's max_tokens is cut to what the context leaves (docs/api.md); a prompt is not.
        r = http.post("/v1/messages", json={"model": "default", "max_tokens": 60,
                                            "messages": [{"role": "user", "content": long}]})
        assert r.status_code == 400 and r.json()["type"] == "error", r.text
        # Ollama's routes cut a prompt to fit the context, as Ollama does (docs/api.md).
        r = http.post("/api/generate", json={"model": "default", "prompt": long, "stream": False})
        assert r.status_code == 200 and r.json()["prompt_eval_count"] == 47, r.text
        r = http.post("/v1/completions", json={"prompt": "hi there", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
