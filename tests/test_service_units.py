"""Fast service tests without a server: settings resolution, body decoding, max_tokens,
Host/Origin rules, the security middleware on a stub app, and the torch-free rule."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from service.api.openai.schemas import ChatCompletionRequest
from service.api.request import resolve_max_tokens, stop_strings
from service.common.errors import APIError, decode_body
from service.common.origins import host_name, is_loopback_host
from service.common.settings import DEFAULT_PORT, SettingsError
from service.common.settings_sources import resolve
from service.http.security import SecurityMiddleware

# -- settings -----------------------------------------------------------------------------


def test_settings_precedence_flags_env_file_default(tmp_path):
    config = tmp_path / "config.toml"
    config.write_text(
        'port = 9000\nhost = "127.0.0.2"\nlog_level = "debug"\n'
        'cors_origin = ["app://a"]\n[serve]\nmax_running_requests = 8\n'
    )
    env = {"HEADROOM_PORT": "9001", "HEADROOM_HOST": "127.0.0.3"}
    s = resolve({"port": 9002}, env=env, config_path=config)
    assert s.port == 9002  # flag
    assert s.host == "127.0.0.3"  # environment over file
    assert s.log_level == "debug"  # file
    assert s.max_running_requests == 8  # file, [serve] table
    assert s.cors_origin == ("app://a",)
    assert s.page_size == 16  # default
    assert s.sources["port"] == "--port"
    assert s.sources["host"] == "HEADROOM_HOST"


def test_settings_defaults_and_lists_from_env(tmp_path):
    env = {"HEADROOM_CORS_ORIGIN": "a://x, b://y", "HEADROOM_PREFIX_CACHE": "off"}
    s = resolve({}, env=env, config_path=_empty(tmp_path))
    assert s.port == DEFAULT_PORT == 8427
    assert s.host == "127.0.0.1"
    assert s.cors_origin == ("a://x", "b://y")
    assert s.prefix_cache is False
    assert s.engine_config().prefix_cache is False


def test_plan_knobs_reach_the_engine_config(tmp_path):
    config = tmp_path / "config.toml"
    config.write_text('reserve = "1GiB"\nmin_context = 1024\n[serve]\nkv_cache = 268435456\n')
    env = {"HEADROOM_DEVICE_TOTAL": "6GiB", "HEADROOM_DEVICE_DISPLAY": "off"}
    flags = {
        "device_free": "5.5GiB",
        "device_limit": "4GB",
        "max_prefill_tokens": 512,
        "max_running_requests": 4,
        "max_model_len": 2048,
        "page_size": 32,
    }
    ec = resolve(flags, env=env, config_path=config).engine_config()
    assert ec.reserve == 1 << 30
    assert ec.min_context == 1024
    assert ec.kv_cache == 256 << 20
    assert ec.device_total == 6 << 30
    assert ec.device_free == int(5.5 * (1 << 30))
    assert ec.device_display is False
    assert ec.device_limit == 4 * 10**9
    assert (ec.max_prefill_tokens, ec.max_running_requests, ec.max_model_len, ec.page_size) == (
        512,
        4,
        2048,
        32,
    )
    # Defaults: everything automatic, a simulated card drives a display.
    default = resolve({}, env={}, config_path=_empty(tmp_path)).engine_config()
    assert default.reserve is None and default.device_total is None
    assert default.kv_cache is None and default.device_limit is None
    assert default.device_display is True
    assert resolve({"reserve": "auto"}, env={}, config_path=_empty(tmp_path)).reserve is None


@pytest.mark.parametrize(
    ("flags", "env", "needle"),
    [
        ({"reserve": "lots"}, {}, "--reserve: 'lots' is not a size; write auto or e.g. 6GiB"),
        ({}, {"HEADROOM_KV_CACHE": "2 gigs"}, "environment HEADROOM_KV_CACHE: kv_cache"),
        ({"device_free": "1GiB"}, {}, "needs --device-total"),
        ({"device_total": "1GiB", "device_free": "2GiB"}, {}, "must not exceed"),
        ({"device_total": "0"}, {}, "more than 0 bytes"),
        ({"min_context": 0}, {}, "--min-context"),
    ],
)
def test_plan_knob_errors_name_their_source(tmp_path, flags, env, needle):
    with pytest.raises(SettingsError) as info:
        resolve(flags, env=env, config_path=_empty(tmp_path))
    assert needle in str(info.value)


def _empty(tmp_path: Path) -> Path:
    path = tmp_path / "empty.toml"
    path.write_text("")
    return path


@pytest.mark.parametrize(
    ("file_text", "env", "needle"),
    [
        ("prot = 1\n", {}, "unknown setting 'prot'"),
        ("port = 'x'\n", {}, 'port = "x" is not a valid integer (use a whole number, e.g. 4)'),
        ("device = true\n", {}, 'device = true is not a valid string (write it in quotes: device = "...")'),
        ("port = [\n", {}, "not valid TOML"),
        ("", {"HEADROOM_PORT": "eighty"}, "HEADROOM_PORT"),
        ("", {"HEADROOM_PORT": "70000"}, "not a TCP port"),
        ("", {"HEADROOM_STALL_TIMEOUT_S": "0.1"}, "longer than"),
        ("gguf_quantized = 3\n", {}, "gguf_quantized = 3 is not a valid boolean (use true/false, on/off, yes/no or 1/0 or auto)"),
        ("", {"HEADROOM_GGUF_QUANTIZED": "maybe"}, "(use true/false, on/off, yes/no or 1/0 or auto)"),
        ("", {"HEADROOM_PREFIX_CACHE": "maybe"}, "is not a valid boolean (use true/false, on/off, yes/no or 1/0)"),
    ],
)
def test_settings_errors_name_their_source(tmp_path, file_text, env, needle):
    config = tmp_path / "config.toml"
    config.write_text(file_text)
    with pytest.raises(SettingsError) as info:
        resolve({}, env=env, config_path=config)
    assert needle in str(info.value)


@pytest.mark.parametrize(("text", "value"), [("auto", None), ("on", True), ("0", False)])
def test_gguf_quantized_takes_auto_as_unset(tmp_path, text, value):
    """Unset means by device and size (on for the CPU; on CUDA from 1 GiB dequantized); "auto" says so explicitly."""
    settings = resolve({}, env={"HEADROOM_GGUF_QUANTIZED": text}, config_path=_empty(tmp_path))
    assert settings.gguf_quantized is value


def test_explicit_config_file_must_exist(tmp_path):
    with pytest.raises(SettingsError, match="does not exist"):
        resolve({}, env={}, config_path=tmp_path / "nope.toml")


def test_serve_help_documents_every_option():
    from click.testing import CliRunner

    from service.cli.commands import main
    from service.common.settings import OPTIONS

    text = CliRunner().invoke(main, ["serve", "--help"], terminal_width=200).output
    for option in OPTIONS:
        assert option.flag in text
        assert option.env in text
    assert "8427" in text
    assert "--config" in text


# -- request bodies and limits ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "param", "needle"),
    [
        (b"", None, "empty"),
        (b"{oops", None, "not valid JSON"),
        (b'{"messages": [{"role": "user", "content": "hi"}],\n "n": 1,,}', None,
         "object keys must be strings at line 2, column 9, near ',}'"),
        (b'{"messages": [{"role": "user"', None, "the body ends before the JSON does"),
        (b"[]", None, "JSON object"),
        (b"{}", "messages", "messages"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": "x"}', "max_tokens", "int"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}', "temperature",
         "temperature: Expected `float"),
        (b'{"messages": [1]}', "messages[0]", "object"),
        (
            b'{"messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": 3}}',
            "stream_options.include_usage",
            "bool",
        ),
        (b'{"messages": [{}], "logit_bias": {"5": "x"}}', "logit_bias", "logit_bias (a value inside it): Expected"),
        (b'{"messages": [{"content": 1e400}]}', "messages[0]", "(a value inside it): Number out of range (larger than"),
        (b'{"messages": [{}], "temperature": 1e400}', "temperature", "temperature: Number out of range (larger than a 64"),
    ],
)
def test_decode_body_errors(raw, param, needle):
    with pytest.raises(APIError) as info:
        decode_body(raw, ChatCompletionRequest)
    assert info.value.status == 400
    assert info.value.param == param
    assert needle in info.value.message


def test_a_bom_and_lone_surrogates_decode_and_a_multipart_body_is_named():
    """A UTF-8 byte order mark before the JSON is skipped (RFC 8259 lets a reader), an
    unpaired UTF-16 surrogate escape (text cut inside an emoji by a client counting UTF-16
    units) becomes U+FFFD where msgspec refused the body, a pair stays its character and
    an escaped backslash before "ud800" stays text; a multipart form's body is refused
    saying so."""
    def content(raw: bytes) -> str:
        return decode_body(raw, ChatCompletionRequest).messages[0]["content"]

    assert content(b'\xef\xbb\xbf{"messages": [{"role": "user", "content": "hi"}]}') == "hi"
    assert content(b'{"messages": [{"role": "user", "content": "cut \\ud83d here \\ude00"}]}') == "cut \ufffd here \ufffd"
    assert content(b'{"messages": [{"role": "user", "content": "\\ud83d"}]}') == "\ufffd"
    assert content(b'{"messages": [{"role": "user", "content": "\\ud83d\\ude00 \\\\ud800"}]}') == "\U0001f600 \\ud800"
    with pytest.raises(APIError) as info:
        decode_body(b'--boundary\r\nContent-Disposition: form-data; name="file"\r\n\r\n{}', ChatCompletionRequest)
    assert info.value.status == 400 and "multipart form" in info.value.message
    assert "Content-Type: application/json" in info.value.message


def test_resolve_max_tokens():
    kw = {"prompt_param": "messages"}
    assert resolve_max_tokens(None, "max_tokens", 10, 100, **kw) == 90  # rest of the context
    assert resolve_max_tokens(None, "max_tokens", 10, 100, default=16, **kw) == 16
    assert resolve_max_tokens(None, "max_tokens", 95, 100, default=16, **kw) == 5
    assert resolve_max_tokens(0, "max_tokens", 100, 100, **kw) == 0
    assert resolve_max_tokens(90, "max_tokens", 10, 100, **kw) == 90
    with pytest.raises(APIError) as info:
        resolve_max_tokens(-1, "max_completion_tokens", 10, 100, **kw)
    assert info.value.param == "max_completion_tokens"
    with pytest.raises(APIError) as info:
        resolve_max_tokens(91, "max_tokens", 10, 100, **kw)
    assert info.value.code == "context_length_exceeded"
    assert "100" in info.value.message and "101" in info.value.message
    with pytest.raises(APIError) as info:
        resolve_max_tokens(None, "max_tokens", 100, 100, **kw)
    assert info.value.param == "messages"


def test_stop_strings():
    assert stop_strings(None) == []
    assert stop_strings("x") == ["x"]
    assert stop_strings(["a", "b"]) == ["a", "b"]
    with pytest.raises(APIError, match="options.stop cannot contain an empty string") as refused:
        stop_strings(["a", "", "b"], "options.stop")
    assert refused.value.status == 400 and refused.value.param == "options.stop"


# -- Host and Origin rules ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("header", "name", "loopback"),
    [
        ("localhost:8427", "localhost", True),
        ("LOCALHOST", "localhost", True),
        ("tauri.localhost", "tauri.localhost", True),
        ("127.0.0.1:1", "127.0.0.1", True),
        ("127.1.2.3", "127.1.2.3", True),
        ("[::1]:8427", "::1", True),
        ("::1", "::1", True),
        ("localhost.", "localhost", True),
        ("evil.example:8427", "evil.example", False),
        ("localhost.evil.example", "localhost.evil.example", False),
        ("10.0.0.1", "10.0.0.1", False),
        ("[::1", "[::1", False),
    ],
)
def test_host_rules(header, name, loopback):
    assert host_name(header) == name
    assert is_loopback_host(name) is loopback


async def _stub_app(scope, receive, send):
    """Records that it was reached; answers 200 "reached"."""
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"reached"})


def _call(app, method: str, path: str, headers: dict[str, str]) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
            return await c.request(method, path, headers=headers)

    return asyncio.run(go())


def test_middleware_preflight_and_origins():
    app = SecurityMiddleware(_stub_app, allowed_origins=["weird+scheme://x", "::::"])
    r = _call(
        app,
        "OPTIONS",
        "/v1/chat/completions",
        {"Origin": "weird+scheme://x", "Access-Control-Request-Method": "POST"},
    )
    assert r.status_code == 204 and r.content == b""
    assert r.headers["access-control-allow-origin"] == "weird+scheme://x"
    r = _call(app, "GET", "/api/health", {"Origin": "https://tauri.localhost"})
    assert r.text == "reached"
    assert r.headers["access-control-allow-origin"] == "https://tauri.localhost"
    r = _call(app, "GET", "/api/health", {"Origin": "https://evil.example"})
    assert r.status_code == 403
    assert r.json()["error"]["code"] == "origin"
    r = _call(app, "GET", "/v1/models", {"Origin": "tauri://localhost"})
    assert r.text == "reached"  # the API key is the /v1 router's guard's (test_api_hardening)
    assert r.headers["access-control-allow-origin"] == "tauri://localhost"  # readable by the app
    r = _call(app, "GET", "/api/health", {"Host": "rebind.example"})
    assert r.status_code == 403


def test_wildcard_origin():
    app = SecurityMiddleware(_stub_app, allowed_origins=["*"])
    r = _call(app, "GET", "/", {"Origin": "https://anything.example"})
    assert r.headers["access-control-allow-origin"] == "https://anything.example"


# -- the service never imports torch -------------------------------------------------------------------


def test_service_modules_never_import_torch(default_model_dir):
    code = f"""
import asyncio, importlib, pkgutil, sys
import service
import service.cli.commands, service.http.app, service.bench.serve, service.supervision.worker_process
# service.tray.app is the tray's own process: pystray opens the display when imported.
for module in pkgutil.walk_packages(service.__path__, "service."):
    if not module.name.endswith("__main__") and module.name != "service.tray.app":
        importlib.import_module(module.name)
import service.bench.chaos, service.bench.chaos_requests, service.http.shutdown
from service.http.app import create_app
from service.common.settings_sources import resolve
from service.api.text import TextSide
create_app(resolve({{}}, env={{"HEADROOM_CONFIG": "/dev/null"}}))
text = asyncio.run(TextSide.load({default_model_dir!r}))
assert text.tokenizer.encode("hello")
bad = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
assert not bad, bad
print("ok")
"""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


@pytest.mark.slow
def test_running_service_has_no_torch_loaded(real_server):
    maps = Path(f"/proc/{real_server.proc.pid}/maps")
    if not maps.exists():
        pytest.skip("needs /proc")
    assert "libtorch" not in maps.read_text()
    worker_maps = Path(f"/proc/{real_server.worker_pid()}/maps").read_text()
    assert "libtorch" in worker_maps  # the check above can see torch where it is


# -- engine errors and events ---------------------------------------------------------------------


def test_engine_errors_map_out_of_memory_to_503_with_retry_after():
    from service.api.engine_errors import engine_error

    oom = engine_error("out_of_memory", "out of device memory: ...")
    assert oom.status == 503
    assert oom.code == "out_of_memory" and oom.type == "server_error"
    assert int(oom.headers["Retry-After"]) >= 1
    other = engine_error("something_else", None)
    assert other.status == 500 and other.code == "something_else" and not other.headers
    assert engine_error(None, None).code == "engine_error"


def test_engine_events_cross_the_pipe_and_are_kept_as_request_errors():
    from engine.wire.ipc import EngineEvents, encode, from_worker_decoder
    from engine.wire.messages import OomEvent, ReplanWanted
    from service.events.hub import EventHub
    from service.events.schemas import DEFAULT_KEEP_REQUEST_ERRORS
    from service.supervision.engine_events_to_ui import EngineEventsToUI

    failed = OomEvent(
        request_id="chatcmpl-1-0", phase="prefill", tokens_in_step=16, action="failed", message="m"
    )
    retried = OomEvent(
        request_id="chatcmpl-2-0", phase="decode", tokens_in_step=1, action="preempted", message="p"
    )
    replan = ReplanWanted(reason="r", new_max_prefill_tokens=256)
    message = EngineEvents([failed, retried, replan])
    assert from_worker_decoder.decode(encode(message)) == message

    hub = EventHub()
    svc = EngineEventsToUI(hub, None)
    for event in message.events:
        svc.record_engine_event(event)
    snap = hub.snapshot()
    assert [(e.request_id, e.code, e.phase, e.action) for e in snap.request_errors] == [
        ("chatcmpl-1-0", "out_of_memory", "prefill", "failed"),
        ("chatcmpl-2-0", "out_of_memory", "decode", "preempted"),
    ]
    counts = svc.counts
    assert (counts.oom_steps, counts.oom_failed_requests, counts.replans) == (2, 1, 1)
    assert snap.counters is not None
    assert (snap.counters.oom_steps, snap.counters.oom_failed_requests) == (2, 1)
    assert snap.counters.replans == 1
    for _ in range(DEFAULT_KEEP_REQUEST_ERRORS + 5):
        svc.record_engine_event(failed)
    assert len(hub.snapshot().request_errors) == DEFAULT_KEEP_REQUEST_ERRORS


def test_watchdog_kills_a_stalled_worker_once_until_it_is_reaped():
    """A killed worker stays the supervisor's until reaped: the watchdog kills it once, saying why."""
    import asyncio
    import time
    from types import SimpleNamespace

    from service.common.engine_states import State
    from service.supervision.liveness import Liveness
    from service.supervision.watchdog import watch
    kills, causes = [], []
    worker = SimpleNamespace(pid=4242, exited=False, started_at=time.monotonic())
    worker.kill = lambda: kills.append(time.monotonic())
    supervisor = SimpleNamespace(
        config=SimpleNamespace(
            worker=SimpleNamespace(heartbeat_interval_s=0.05),
            stall_timeout_s=0.01,
            start_timeout_s=60.0,
        ),
        worker=worker,
        state=State.READY,
        link=SimpleNamespace(liveness=Liveness(time.monotonic() - 10.0)),
        idle_due=lambda now: False,  # no --keep-alive
        kill_hung=lambda cause: (causes.append(cause), worker.kill()),
    )

    async def run() -> None:
        task = asyncio.create_task(watch(supervisor))
        deadline = time.monotonic() + 30.0
        while not kills and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)  # six more checks with the killed worker not yet reaped
        task.cancel()

    asyncio.run(run())
    assert len(kills) == 1
    assert causes[0].startswith("hung: it sent no heartbeat for") and causes[0].endswith("stall timeout of 0.01 s")


def test_a_full_queue_is_a_503_with_retry_after_counted_in_words():
    from service.api.admission import QUEUE_FULL, Admission

    admission = Admission(1)
    ticket = admission.enter()
    with pytest.raises(APIError) as info:
        admission.enter()
    refused = info.value
    assert (refused.status, refused.code) == (503, QUEUE_FULL) and refused.headers["Retry-After"] == "1"
    assert refused.message.startswith("1 request is already waiting for the engine")
    ticket.release()
    admission.enter()  # the place is free again
