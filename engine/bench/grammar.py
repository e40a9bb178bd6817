"""Constrained decoding's cost per token against unconstrained, same model and device.

``python -m engine.bench.grammar [--model DIR] [--device cpu|cuda] [--batches 1,8]
[--tokens 48]`` runs ``B`` sampled requests of one chat prompt twice: free text, then
each constrained to a JSON schema (an object holding an array of strings, so answers
run long), and prints the decode time per token both ways and the difference. Only
decode steps are timed (from the step after every request's first token), the grammar
is compiled before timing, and each sequence ends at ``--tokens`` or at its end token.
On the CPU the grammar's per-step work (the bitmask fill, the matcher's advance) is
plain host time; on CUDA the bitmask goes to the device asynchronously
(:func:`engine.sampling.grammar.apply_grammars`).
"""

from __future__ import annotations

import argparse
import json
import time

from engine.common.config import EngineConfig
from engine.core.engine import Engine
from engine.text.chat import encode_chat
from engine.text.tokenizer import load_tokenizer
from engine.wire.messages import GenerateRequest, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {"cities": {"type": "array", "items": {"type": "string"}}},
    "required": ["cities"],
}
PROMPT = "List as many cities of Europe as you can, as JSON."


def decode_ms_per_token(engine: Engine, prompt: list[int], sp: SamplingParams, batch: int, tag: str) -> tuple[float, int]:
    """``(milliseconds per decoded token, decoded tokens)`` over the decode steps of
    ``batch`` requests run together."""
    for i in range(batch):
        engine.add_request(GenerateRequest(request_id=f"{tag}-{i}", prompt_token_ids=prompt, sampling=sp))
    started: set[str] = set()
    tokens, elapsed = 0, 0.0
    while engine.has_work():
        timing = len(started) == batch
        t0 = time.perf_counter()
        outputs = engine.step()
        dt = time.perf_counter() - t0  # the step's outputs are host lists: its sync is in
        step_tokens = 0
        for o in outputs:
            if o.token_ids:
                started.add(o.request_id)
                step_tokens += len(o.token_ids)
        if timing:
            elapsed += dt
            tokens += step_tokens
    return (1000.0 * elapsed / tokens if tokens else float("nan")), tokens


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model folder or GGUF (default: the embedded default model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batches", default="1,8", help="comma-separated batch sizes")
    p.add_argument("--tokens", type=int, default=48, help="max new tokens per request")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    engine = Engine(EngineConfig(model=args.model, device=args.device, kv_cache=256 << 20)
                    if args.device == "cpu" else EngineConfig(model=args.model, device=args.device))
    tokenizer = load_tokenizer(str(engine.model_dir))
    prompt = encode_chat(tokenizer, [{"role": "user", "content": PROMPT}])
    schema = json.dumps(SCHEMA)
    engine._grammars().compile(schema).result()  # compile time is not decode time
    free = SamplingParams(max_new_tokens=args.tokens, temperature=1.0, seed=args.seed, ignore_eos=True)
    constrained = SamplingParams(max_new_tokens=args.tokens, temperature=1.0, seed=args.seed, json_schema=schema)
    print(f"model {engine.info.model_name} on {engine.device}, vocab {engine.info.vocab_size}, "
          f"up to {args.tokens} new tokens per request")
    print(f"{'batch':>5} {'free ms/tok':>12} {'json ms/tok':>12} {'extra ms/tok':>13} {'json tokens':>12}")
    decode_ms_per_token(engine, prompt, free, 1, "warm")  # first-step costs out of the figures
    for batch in (int(b) for b in args.batches.split(",")):
        f_ms, _ = decode_ms_per_token(engine, prompt, free, batch, f"free{batch}")
        c_ms, c_tokens = decode_ms_per_token(engine, prompt, constrained, batch, f"json{batch}")
        print(f"{batch:>5} {f_ms:>12.3f} {c_ms:>12.3f} {c_ms - f_ms:>13.3f} {c_tokens:>12}")


if __name__ == "__main__":
    main()
