"""Models by name: ``headroom pull`` against a local Hub (``tests/hub_server.py``, which
huggingface_hub reaches through ``HF_ENDPOINT``: the real client, over HTTP),
``headroom models`` listing the store, and ``--model NAME`` loading from it."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from hub_server import HubServer
from service_harness import headroom_command

gguf = pytest.importorskip("gguf")

from test_gguf_convert import VOCAB, write_gguf  # noqa: E402

GGUF_REPO, GGUF_FILE = "acme/tiny-GGUF", "tiny-q8_0.gguf"
FOLDER_REPO = "acme/tiny"


@pytest.fixture(scope="module")
def built_cpu_kernels(default_model_dir) -> Path:
    """The folder of this session's CPU kernel library (built here if no test built it
    yet), in the session's cache: a test that runs ``headroom`` in a cache folder of its
    own links its ``kernels`` folder here rather than compile the kernels again."""
    from engine.common.cache_dir import cache_root
    from kernels.cpu.build import load_any

    folder = cache_root() / "kernels"
    load_any(str(folder))
    return folder


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory, make_tiny_hf_model) -> dict[str, dict[str, bytes]]:
    """Two repositories: a tiny Qwen2 GGUF (Q8_0) with a README, and the same model as a
    Hugging Face folder (converted from it) with a pytorch ``.bin`` a pull must skip."""
    from engine.loader.gguf_convert import convert_gguf

    tmp = tmp_path_factory.mktemp("hub")
    path = tmp / GGUF_FILE
    write_gguf(path, "qwen2", make_tiny_hf_model("qwen2", None, vocab_size=VOCAB))
    folder = convert_gguf(path, tmp / "folder")
    # What a Hugging Face repository holds: not the record of the GGUF it came from.
    files = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file() and p.name != "gguf_source.json"}
    files["pytorch_model.bin"] = b"not for headroom"
    return {
        GGUF_REPO: {GGUF_FILE: path.read_bytes(), "README.md": b"# tiny\n"},
        FOLDER_REPO: files,
        "acme/two-ggufs": {"a.gguf": b"GGUF", "b.gguf": b"GGUF"},
    }


def headroom(args: list[str], cache: Path, **env: str) -> subprocess.CompletedProcess:
    inherited = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_ENDPOINT")}
    full = {**inherited, "HEADROOM_CONFIG": os.devnull, "HEADROOM_CACHE_DIR": str(cache),
            "HF_HUB_DISABLE_TELEMETRY": "1", **env}
    return subprocess.run([*headroom_command(), *args], capture_output=True, text=True, timeout=300, env=full)


def test_a_cut_download_resumes_where_it_stopped(tmp_path):
    """The connection drops halfway through a file: the pull goes on from the bytes it
    has (a Range request), and the stored file is whole. (The client writes in 10 MiB
    chunks, so the file is larger than two.)"""
    big = os.urandom(24 << 20)
    with HubServer({"acme/big-GGUF": {"big.gguf": big}}, cut_once=("acme/big-GGUF/big.gguf",)) as hub:
        got = headroom(["pull", "acme/big-GGUF:big.gguf"], tmp_path / "cache", HF_ENDPOINT=hub.url)
        assert got.returncode == 0, got.stderr
        ranges = [r for m, p, r in hub.requests if m == "GET" and p.endswith("big.gguf") and r]
    assert ranges and int(ranges[0].removeprefix("bytes=").rstrip("-")) >= 10 << 20, hub.requests
    assert "resume" in got.stderr  # the client said so
    (stored,) = (tmp_path / "cache" / "hub").rglob("big.gguf")
    assert stored.read_bytes() == big


def test_pull_lists_the_store_and_serves_by_name(tiny_files, tmp_path, built_cpu_kernels):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "kernels").symlink_to(built_cpu_kernels, target_is_directory=True)  # built once per session
    with HubServer(tiny_files) as hub:
        got = headroom(["pull", f"{GGUF_REPO}:{GGUF_FILE}"], cache, HF_ENDPOINT=hub.url)
        assert got.returncode == 0, got.stderr
        assert f"pulled {GGUF_REPO}:{GGUF_FILE}" in got.stdout
        assert f"--model {GGUF_REPO}:{GGUF_FILE}" in got.stdout

        folder = headroom(["pull", FOLDER_REPO], cache, HF_ENDPOINT=hub.url)
        assert folder.returncode == 0, folder.stderr
        fetched = {p.rsplit("/", 1)[-1] for m, p, _ in hub.requests if m == "GET" and f"{FOLDER_REPO}/resolve" in p}
        assert "model.safetensors" in fetched and "config.json" in fetched and "tokenizer.json" in fetched
        assert "pytorch_model.bin" not in fetched  # only what headroom loads

    stored = {p.name: p for p in (cache / "hub").rglob("*.gguf")}
    assert stored[GGUF_FILE].read_bytes() == tiny_files[GGUF_REPO][GGUF_FILE]

    listing = headroom(["models", "--json"], cache)
    assert listing.returncode == 0, listing.stderr
    by_name = {m["name"]: m for m in json.loads(listing.stdout) if not m["embedded"]}
    assert set(by_name) == {FOLDER_REPO, f"{GGUF_REPO}:{GGUF_FILE}"}
    gguf_model, folder_model = by_name[f"{GGUF_REPO}:{GGUF_FILE}"], by_name[FOLDER_REPO]
    assert (gguf_model["architecture"], gguf_model["quantization"]) == ("qwen2", "Q8_0")
    assert gguf_model["size_bytes"] == len(tiny_files[GGUF_REPO][GGUF_FILE])
    assert folder_model["architecture"] == "Qwen2ForCausalLM"
    assert folder_model["size_bytes"] == sum(
        len(b) for n, b in tiny_files[FOLDER_REPO].items() if n != "pytorch_model.bin")
    assert gguf_model["context_tokens"] == folder_model["context_tokens"] > 0
    table = headroom(["models"], cache).stdout
    assert "NAME" in table and "QUANTIZATION" in table and f"{GGUF_REPO}:{GGUF_FILE}" in table

    # --model takes a store name: the full name, or the name without its owner.
    for name in (f"{GGUF_REPO}:{GGUF_FILE}", "tiny"):
        gen = headroom(["generate", "--model", name, "--device", "cpu", "--max-tokens", "2", "--raw", "he"],
                       cache, HF_HUB_OFFLINE="1")
        assert gen.returncode == 0, gen.stderr
    planned = headroom(["plan", "--model", f"{GGUF_REPO}:{GGUF_FILE}", "--device-total", "6GiB"], cache)
    assert planned.returncode == 0, planned.stderr
    # The GGUF's conversion: metadata only, the CPU kept the file's blocks and the plan read the config.
    (converted,) = (cache / "models").glob("tiny-q8_0-*")
    assert (converted / "config.json").is_file() and not list(converted.glob("*.safetensors"))
    unknown = headroom(["generate", "--model", "acme/nothing", "--raw", "he"], cache)
    assert unknown.returncode == 2 and "no such name in the store" in unknown.stderr


def test_resolve_model_finds_store_names(tiny_files, tmp_path, monkeypatch):
    """In process: a store name resolves to its snapshot folder, and the served name is
    the repository's."""
    from engine.loader.default_model import model_display_name
    from engine.loader.resolve import resolve_model

    cache = tmp_path / "cache"
    with HubServer(tiny_files) as hub:
        assert headroom(["pull", FOLDER_REPO], cache, HF_ENDPOINT=hub.url).returncode == 0
    monkeypatch.setenv("HEADROOM_CACHE_DIR", str(cache))
    folder = resolve_model(FOLDER_REPO)
    assert (folder / "config.json").is_file() and folder.parent.name == "snapshots"
    assert model_display_name(folder) == FOLDER_REPO


@pytest.mark.parametrize(
    ("spec", "env", "code", "needle"),
    [
        ("acme/tiny", {"HF_HUB_OFFLINE": "1"}, 1, "offline: HF_HUB_OFFLINE is set"),
        ("acme/tiny", {"HF_ENDPOINT": "http://127.0.0.1:9"}, 1, "offline: cannot reach http://127.0.0.1:9"),
        ("tiny", {}, 2, "is not REPO[:FILE]"),
        ("a--b/c", {}, 2, "'a--b/c' is not a repository name the Hub accepts: Cannot have -- or .."),
        (f"{'a' * 97}/x", {}, 2, "is not a repository name the Hub accepts"),
        ("acme/tiny:model.safetensors", {}, 2, "is not a .gguf file"),
        ("acme/nothing", {}, 1, "no such repository"),
        (f"{GGUF_REPO}:other.gguf", {}, 1, f"has no file 'other.gguf' (its GGUF files: {GGUF_FILE})"),
        ("acme/two-ggufs", {}, 1, "headroom pull acme/two-ggufs:b.gguf"),
    ],
)
def test_pull_failures_say_why(tiny_files, tmp_path, spec, env, code, needle):
    with HubServer(tiny_files) as hub:
        got = headroom(["pull", spec], tmp_path / "cache", **{"HF_ENDPOINT": hub.url, **env})
    assert got.returncode == code, (got.stdout, got.stderr)
    assert needle in got.stderr, got.stderr
    assert "Traceback" not in got.stderr


def test_the_api_answers_to_the_store_name_the_model_was_served_by(tmp_path):
    """``--model acme/tiny-GGUF:tiny-q8_0.gguf`` serves a folder named after the file; a
    request naming the store name is for that model too (a path is no name)."""
    from dataclasses import replace

    from service_harness import engine_info

    from service.api.services import Services
    from service.common.settings import ServeSettings

    info = engine_info(model_name="tiny-q8_0")
    by_name = Services(settings=replace(ServeSettings(), model=f"{GGUF_REPO}:{GGUF_FILE}"), supervisor=None)
    assert by_name.model_names(info) == ["tiny-q8_0", f"{GGUF_REPO}:{GGUF_FILE}", "default"]
    assert by_name.check_model(f"{GGUF_REPO}:{GGUF_FILE}", info) == "tiny-q8_0"  # accepted, not 404
    by_path = Services(settings=replace(ServeSettings(), model=str(tmp_path)), supervisor=None)
    assert by_path.model_names(info) == ["tiny-q8_0", "default"]
