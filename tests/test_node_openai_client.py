"""The official ``openai`` Node client (npm, a devDependency of ui-bridge, installed by
``make test``'s ``npm ci``) streams a chat answer and a forced tool call from a real
``headroom serve`` of the default model. The model's own template has no tool support,
so the server gets a copy of the model whose template renders tools in the Hermes
``<tool_call>`` format (its weights linked, not copied); the call's arguments are
grammar-constrained, so they parse and match the schema."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from service_harness import ServerProcess
from test_api_tools import QWEN_LIKE

pytestmark = pytest.mark.slow

UI_BRIDGE = Path(__file__).resolve().parent.parent / "ui-bridge"
SCRIPT = UI_BRIDGE / "scripts" / "openai-node-check.mjs"
TOKENIZER_FILES = ("tokenizer", "special_tokens", "chat_template", "vocab", "merges", "added_tokens")


@pytest.fixture(scope="module")
def tools_server(tmp_path_factory, default_model_dir):
    if shutil.which("node") is None or not (UI_BRIDGE / "node_modules" / "openai").is_dir():
        pytest.skip("needs node and ui-bridge's npm packages (cd ui-bridge && npm ci)")
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("default-with-tools")
    for f in Path(default_model_dir).iterdir():
        if not f.name.startswith(TOKENIZER_FILES):
            (folder / f.name).symlink_to(f)
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    tokenizer.chat_template = QWEN_LIKE
    tokenizer.save_pretrained(folder)
    server = ServerProcess(tmp_path_factory.mktemp("node-serve"), ["--model", str(folder), "--device", "cpu"])
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def test_node_openai_client_streams_chat_and_tool_call(tools_server):
    run = subprocess.run(
        ["node", str(SCRIPT), tools_server.base_url], cwd=UI_BRIDGE, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert "Paris" in got["chat"]["text"] and got["chat"]["chunks"] > 2
    assert got["chat"]["finish"] in ("stop", "length")
    assert got["tools"]["finish"] == "tool_calls"
    (call,) = got["tools"]["calls"]
    assert call["name"] == "get_weather" and call["id"]
    arguments = json.loads(call["arguments"])
    assert isinstance(arguments.get("city"), str)
