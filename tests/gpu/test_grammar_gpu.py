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


def test_the_race_never_draws_a_token_the_mask_took_out():
    """Tokens at -inf (the grammar's mask, a filter) are never drawn, whatever the noise:
    on the GPU tl.log is approximate and once made a removed token's score NaN, which
    argmax took (the default model's constrained answer then broke its grammar)."""
    from kernels.sampling import triton_kernel
    from kernels.sampling.reference import NUM_FPARAMS, NUM_IPARAMS, SEED, STEP, TEMPERATURE, TOP_K

    rows, vocab, steps = 256, 49152, 64
    gen = torch.Generator(device="cuda").manual_seed(0)
    allowed = torch.randint(0, vocab, (rows, 3), device="cuda", generator=gen)
    logits = torch.full((rows, vocab), float("-inf"), device="cuda")
    logits.scatter_(1, allowed, torch.randn(rows, 3, device="cuda", generator=gen))
    fparams = torch.zeros(rows, NUM_FPARAMS, device="cuda")
    fparams[:, TEMPERATURE] = 1.0
    iparams = torch.zeros(rows, NUM_IPARAMS, dtype=torch.int64, device="cuda")
    iparams[:, TOP_K] = vocab
    iparams[:, SEED] = torch.arange(rows, device="cuda")
    bad = 0
    for step in range(steps):
        iparams[:, STEP] = step
        x, row_max = triton_kernel.penalize_and_scale(logits, fparams, None, None)
        tokens = triton_kernel.draw(x, row_max, fparams, iparams)
        bad += int((~(tokens.unsqueeze(1) == allowed).any(dim=1)).sum())
    assert bad == 0, f"{bad} of {rows * steps} draws took a token at -inf"
