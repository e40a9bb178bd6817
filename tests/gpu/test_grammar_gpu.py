"""Structured output on the GPU sampling path: the bitmask applied on the device equals
the CPU's, and the default model's constrained answers validate on CUDA."""

from __future__ import annotations

import json

import jsonschema_rs
import torch

from engine.common.config import EngineConfig
from engine.core.engine import Engine
from engine.sampling.grammar import apply_grammars
from engine.text.chat import encode_chat
from engine.text.tokenizer import load_tokenizer
from engine.wire.messages import GenerateRequest, SamplingParams

# Every value bounded (an enum, a boolean) and no other property, so each answer closes
# within the tokens given (without additionalProperties, seeded answers of the default
# model go on with properties of their own past 64 tokens).
SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Lyon", "Nice"]}, "capital": {"type": "boolean"}},
          "required": ["city", "capital"], "additionalProperties": False}


def test_device_bitmask_equals_cpu_and_answers_validate(default_model_dir):
    engine = Engine(EngineConfig(model=default_model_dir, device="cuda"))
    grammars = engine._grammars()
    schema = json.dumps(SCHEMA)
    matchers = [grammars.matcher(schema), None, grammars.matcher(schema)]
    logits = torch.randn(3, engine.info.vocab_size, generator=torch.Generator().manual_seed(0))
    on_gpu = apply_grammars(logits.cuda(), matchers).cpu()
    on_cpu = apply_grammars(logits, matchers)
    assert torch.equal(on_gpu, on_cpu)
    assert torch.isinf(on_gpu[0]).sum() > 0 and torch.equal(on_gpu[1], logits[1])

    tokenizer = load_tokenizer(default_model_dir)
    prompt = encode_chat(tokenizer, [{"role": "user", "content": "Describe Paris as JSON."}])
    for i in range(8):
        sp = SamplingParams(max_new_tokens=64, temperature=1.0, seed=i, json_schema=schema)
        engine.add_request(GenerateRequest(request_id=f"j{i}", prompt_token_ids=prompt, sampling=sp))
    out: dict[str, list[int]] = {f"j{i}": [] for i in range(8)}
    reasons = {}
    while engine.has_work():
        for o in engine.step():
            out[o.request_id] += o.token_ids
            if o.finished:
                reasons[o.request_id] = (o.finish_reason, o.error_code, o.error_message)
    for rid, ids in out.items():
        text = tokenizer.decode(ids, skip_special_tokens=True)
        assert reasons[rid][0] == "stop", (rid, text, ids, reasons[rid])
        jsonschema_rs.validate(SCHEMA, json.loads(text))
