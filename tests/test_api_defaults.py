"""A first answer that looks right: unset sampling fields take the model's generation
config (from its folder, a GGUF's sampling metadata, or the default model's card), an
unset max_tokens is capped by --default-max-tokens, and every name the model answers to
is listed. Fast: no server."""

from __future__ import annotations

import json

import gguf
from service_harness import engine_info
from transformers import GenerationConfig

from engine.loader.default_model import DEFAULT_MODEL_SAMPLING, add_default_sampling
from engine.loader.gguf_config import open_reader
from engine.loader.gguf_convert import _write_generation_config
from service.api.openai.schemas import ChatCompletionRequest
from service.api.request import resolve_max_tokens
from service.api.sampling import sampling_params
from service.api.sampling_defaults import (
    SamplingDefaults,
    from_generation_config,
    load_sampling_defaults,
)
from service.api.services import Services
from service.common.settings import DEFAULT_MAX_TOKENS, OPTIONS_BY_NAME
from service.common.settings_sources import resolve


def _chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields)


def test_generation_config_fields_become_defaults(tmp_path):
    GenerationConfig(do_sample=True, temperature=0.6, top_p=0.95, top_k=20).save_pretrained(
        tmp_path
    )
    defaults = load_sampling_defaults(tmp_path)
    assert (defaults.temperature, defaults.top_p, defaults.top_k) == (0.6, 0.95, 20)
    # Not set by the model: OpenAI's.
    assert defaults.min_p == 0.0 and defaults.repetition_penalty == 1.0
    assert defaults.source.endswith("generation_config.json")


def test_no_generation_config_means_openai_defaults(tmp_path):
    assert load_sampling_defaults(tmp_path) == SamplingDefaults()
    # A file with only token ids (what save_pretrained writes for most base models):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert load_sampling_defaults(tmp_path).as_dict() == SamplingDefaults().as_dict()


def test_greedy_and_out_of_range_generation_configs():
    assert from_generation_config({"do_sample": False}, "f").temperature == 0.0
    bad = from_generation_config({"temperature": 7.0, "top_p": 0.0, "top_k": -3}, "f")
    assert bad.as_dict() == SamplingDefaults().as_dict()


def test_request_fields_win_over_model_defaults():
    model = SamplingDefaults(
        temperature=0.2, top_p=0.9, top_k=40, min_p=0.05, repetition_penalty=1.1
    )
    unset = sampling_params(_chat(), 8, 0, model)
    assert (unset.temperature, unset.top_p, unset.top_k) == (0.2, 0.9, 40)
    assert (unset.min_p, unset.repetition_penalty) == (0.05, 1.1)
    explicit = sampling_params(
        _chat(temperature=0, top_p=1, top_k=0, min_p=0, repetition_penalty=1), 8, 0, model
    )
    assert (explicit.temperature, explicit.top_p, explicit.top_k) == (0.0, 1.0, 0)
    assert (explicit.min_p, explicit.repetition_penalty) == (0.0, 1.0)
    # Without model defaults: OpenAI's.
    plain = sampling_params(_chat(), 8, 0)
    assert (plain.temperature, plain.top_p) == (1.0, 1.0)


def test_gguf_sampling_metadata_reaches_generation_config(tmp_path):
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_eos_token_id(2)
    writer.add_float32(gguf.Keys.General.SAMPLING_TEMP, 0.7)
    writer.add_float32(gguf.Keys.General.SAMPLING_TOP_P, 0.8)
    writer.add_int32(gguf.Keys.General.SAMPLING_TOP_K, 20)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    out = tmp_path / "out"
    out.mkdir()
    _write_generation_config(open_reader(path), out)
    defaults = load_sampling_defaults(out)
    assert (defaults.temperature, defaults.top_p, defaults.top_k) == (0.7, 0.8, 20)


def test_default_model_gets_its_card_sampling(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "top_p": 0.5}))
    add_default_sampling(tmp_path)
    written = json.loads((tmp_path / "generation_config.json").read_text())
    assert written["eos_token_id"] == 2 and written["top_p"] == 0.5  # kept
    assert written["temperature"] == DEFAULT_MODEL_SAMPLING["temperature"]
    add_default_sampling(tmp_path)  # idempotent
    assert json.loads((tmp_path / "generation_config.json").read_text()) == written


def test_default_model_dir_has_sampling_defaults(default_model_dir):
    defaults = load_sampling_defaults(default_model_dir)
    assert defaults.temperature == DEFAULT_MODEL_SAMPLING["temperature"]
    assert defaults.top_p == DEFAULT_MODEL_SAMPLING["top_p"]


def test_default_max_tokens_option(tmp_path):
    config = tmp_path / "c.toml"
    config.touch()
    assert resolve({}, env={}, config_path=config).default_max_tokens == DEFAULT_MAX_TOKENS
    s = resolve({}, env={"HEADROOM_DEFAULT_MAX_TOKENS": "64"}, config_path=config)
    assert s.default_max_tokens == 64
    assert OPTIONS_BY_NAME["default_max_tokens"].flag == "--default-max-tokens"
    # Unset max_tokens: the cap, or the rest of the context when that is shorter.
    assert resolve_max_tokens(None, "max_tokens", 10, 2048, prompt_param="m", default=64) == 64
    assert resolve_max_tokens(None, "max_tokens", 2000, 2048, prompt_param="m", default=64) == 48
    assert resolve_max_tokens(500, "max_tokens", 10, 2048, prompt_param="m", default=64) == 500


def test_model_names_include_default(tmp_path):
    config = tmp_path / "c.toml"
    config.touch()
    settings = resolve({"served_model_name": ("alias",)}, env={}, config_path=config)
    svc = Services(settings=settings, supervisor=None)  # type: ignore[arg-type]
    info = engine_info(model_name="SmolLM2")
    assert svc.model_names(info) == ["SmolLM2", "alias", "default"]
    assert svc.check_model("default", info) == "SmolLM2"
    assert svc.check_model("alias", info) == "SmolLM2"
