"""Logprobs from the engine against transformers' log-softmax of the same weights:
generated tokens (greedy, sampled, with logit_bias), prompt tokens in chunks (echo),
and requests that ask for nothing get nothing."""

from __future__ import annotations

import pytest
import torch

from engine.common.config import EngineConfig
from engine.core.engine import Engine
from engine.wire.messages import GenerateRequest, SamplingParams, TokenOutput

TOL = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, make_tiny_hf_model):
    path = tmp_path_factory.mktemp("tiny_qwen3")
    hf = make_tiny_hf_model("qwen3", path)
    # Prefill chunks of 8 tokens: a scored prompt spans several steps.
    engine = Engine(EngineConfig(model=str(path), device="cpu", page_size=4, num_pages=256, max_prefill_tokens=8))
    return hf, engine


def run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[TokenOutput]]:
    for rid, (ids, sp) in requests.items():
        engine.add_request(GenerateRequest(request_id=rid, prompt_token_ids=ids, sampling=sp))
    out: dict[str, list[TokenOutput]] = {rid: [] for rid in requests}
    while engine.has_work():
        for o in engine.step():
            out[o.request_id].append(o)
    return out


def hf_logprobs(hf, ids: list[int], bias: dict[int, float] | None = None) -> torch.Tensor:
    """``[len(ids), V]``: row ``p`` is the log-softmax predicting token ``p + 1``."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()
    for token, b in (bias or {}).items():
        logits[:, token] += b
    return torch.log_softmax(logits, dim=-1)


def check_records(records, ref: torch.Tensor, targets: list[int], k: int) -> None:
    assert len(records) == len(targets)
    for rec, row, target in zip(records, ref, targets, strict=True):
        assert rec.token_id == target
        assert abs(rec.logprob - row[target].item()) < TOL
        top = row.topk(k)
        assert len(rec.top_ids) == len(rec.top_logprobs) == k
        assert rec.top_logprobs == sorted(rec.top_logprobs, reverse=True)
        assert torch.allclose(torch.tensor(rec.top_logprobs), top.values, atol=TOL)
        for tid, lp in zip(rec.top_ids, rec.top_logprobs, strict=True):
            assert abs(row[tid].item() - lp) < TOL


def test_generated_and_prompt_logprobs_match_transformers(tiny):
    hf, engine = tiny
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 256, (21,), generator=g).tolist()
    other = torch.randint(3, 256, (9,), generator=g).tolist()
    bias = {7: 5.0, 11: -100.0}
    requests = {
        "greedy": (prompt, SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True, logprobs=5,
                                          prompt_logprobs=3)),
        "sampled": (prompt, SamplingParams(max_new_tokens=6, temperature=1.0, seed=5, ignore_eos=True,
                                           logprobs=0, logit_bias=tuple(bias.items()))),
        "plain": (other, SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)),
    }
    out = run(engine, requests)

    greedy = [t for o in out["greedy"] for t in o.token_ids]
    ref = hf_logprobs(hf, prompt + greedy)
    records = [r for o in out["greedy"] for r in o.logprobs]
    check_records(records, ref[len(prompt) - 1 : -1], greedy, 5)
    # The prompt's logprobs come once, with the first output: the first token has none.
    scored = [o.prompt_logprobs for o in out["greedy"] if o.prompt_logprobs is not None]
    assert len(scored) == 1 and len(scored[0]) == len(prompt) and scored[0][0] is None
    check_records(scored[0][1:], ref[: len(prompt) - 1], prompt[1:], 3)

    sampled = [t for o in out["sampled"] for t in o.token_ids]
    assert 11 not in sampled
    ref = hf_logprobs(hf, prompt + sampled, bias)
    check_records([r for o in out["sampled"] for r in o.logprobs], ref[len(prompt) - 1 : -1], sampled, 0)

    assert all(o.logprobs is None and o.prompt_logprobs is None for o in out["plain"])


def test_scored_prompt_skips_the_prefix_cache(tiny):
    """A prompt already cached is still scored whole (a cached prefix has no logits)."""
    hf, engine = tiny
    prompt = list(range(40, 80))
    sp = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    run(engine, {"warm": (prompt, sp)})
    out = run(engine, {"scored": (prompt, SamplingParams(max_new_tokens=1, temperature=0.0, prompt_logprobs=1))})
    scored = out["scored"][0].prompt_logprobs
    assert scored[0] is None and all(r is not None for r in scored[1:])
    check_records(scored[1:], hf_logprobs(hf, prompt)[:-1], prompt[1:], 1)


def test_logprobs_beyond_twenty_are_rejected(tiny):
    _, engine = tiny
    from engine.common.errors import RequestRejected

    with pytest.raises(RequestRejected, match="logprobs"):
        engine.add_request(GenerateRequest(request_id="x", prompt_token_ids=[5, 6],
                                           sampling=SamplingParams(logprobs=21)))
