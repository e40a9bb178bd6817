"""The engine end to end on the CPU: real models, real paged KV cache, real scheduler.

Reference outputs come from transformers running the same weights.
"""

from __future__ import annotations

import pytest
import torch
from model_checks import hf_greedy

from engine.common.config import EngineConfig
from engine.common.errors import RequestRejected
from engine.core.engine import Engine
from engine.text.chat import encode_chat
from engine.text.tokenizer import load_tokenizer
from engine.wire.messages import GenerateRequest, SamplingParams

GREEDY = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "How many legs does a spider have?",
    "Explain what a CPU does in one sentence.",
]


def run_all(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[int]]:
    """Add all requests at once and step until every one finished; returns output ids."""
    out: dict[str, list[int]] = {rid: [] for rid in requests}
    for rid, (ids, sp) in requests.items():
        engine.add_request(GenerateRequest(request_id=rid, prompt_token_ids=ids, sampling=sp))
    done: set[str] = set()
    while engine.has_work():
        for o in engine.step():
            out[o.request_id].extend(o.token_ids)
            if o.finished:
                assert o.finish_reason in ("stop", "length"), o
                done.add(o.request_id)
    assert done == set(requests)
    return out


@pytest.fixture(scope="module")
def default_engine(default_model_dir):
    return Engine(EngineConfig(model=default_model_dir, device="cpu", kv_cache=256 << 20))


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return load_tokenizer(default_model_dir)


@pytest.fixture(scope="module")
def chat_prompts(tokenizer):
    return [encode_chat(tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS]


def test_default_model_greedy_equals_transformers(default_engine, default_model_dir, chat_prompts, tokenizer):
    from transformers import AutoModelForCausalLM

    ours = run_all(default_engine, {f"p{i}": (ids, GREEDY) for i, ids in enumerate(chat_prompts)})
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    for i, ids in enumerate(chat_prompts):
        assert ours[f"p{i}"] == hf_greedy(hf, ids, 32), (PROMPTS[i], tokenizer.decode(ours[f"p{i}"]))
    assert "Paris" in tokenizer.decode(ours["p0"])


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen2", "qwen3_moe", "qwen2_moe", "mixtral", "olmoe"])
def test_tiny_random_models_greedy_equal_transformers(kind, tmp_path, make_tiny_hf_model):
    """32 greedy tokens of three prompts batched together; the mixtures of experts route
    the batch's tokens through their experts in each step."""
    hf = make_tiny_hf_model(kind, tmp_path)
    engine = Engine(EngineConfig(model=str(tmp_path), device="cpu", page_size=4, num_pages=128))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 11, 23)]
    ours = run_all(engine, {f"r{i}": (ids, GREEDY) for i, ids in enumerate(prompts)})
    for i, ids in enumerate(prompts):
        assert ours[f"r{i}"] == hf_greedy(hf, ids, 32)


def _mixed_requests(tokenizer) -> dict[str, tuple[list[int], SamplingParams]]:
    topics = ["the moon", "bread", "rivers", "chess", "owls", "tea", "volcanoes", "trains"]
    reqs = {}
    for i in range(16):
        text = f"Tell me one fact about {topics[i % 8]}." + " Be brief." * (i % 5)
        ids = encode_chat(tokenizer, [{"role": "user", "content": text}])
        if i % 2 == 0:
            sp = SamplingParams(max_new_tokens=4 + i // 2, temperature=0.0, ignore_eos=True)
        else:
            sp = SamplingParams(
                max_new_tokens=4 + i // 2, temperature=0.8, top_p=0.9, top_k=40, seed=100 + i,
                frequency_penalty=0.3 * (i % 3), ignore_eos=True,
            )
        reqs[f"m{i}"] = (ids, sp)
    return reqs


def test_sixteen_requests_together_equal_alone(default_engine, tokenizer):
    reqs = _mixed_requests(tokenizer)
    together = run_all(default_engine, reqs)
    default_engine.radix.clear()
    for rid, req in reqs.items():
        alone = run_all(default_engine, {rid: req})
        assert together[rid] == alone[rid], rid
        assert len(alone[rid]) == req[1].max_new_tokens


def test_shared_system_prompt_hits_radix_cache(default_engine, tokenizer):
    default_engine.radix.clear()
    system = "You are a meticulous assistant. " * 8
    def conv(q):
        return encode_chat(tokenizer, [{"role": "system", "content": system}, {"role": "user", "content": q}])
    first = conv("Name a fruit.")
    run_all(default_engine, {"warm": (first, SamplingParams(max_new_tokens=2, temperature=0))})
    before = default_engine.stats().prefix_hit_tokens
    questions = ["Name a color.", "Name a city.", "Name a tree.", "Name a bird."]
    run_all(default_engine, {f"q{i}": (conv(q), SamplingParams(max_new_tokens=2, temperature=0)) for i, q in enumerate(questions)})
    hit = default_engine.stats().prefix_hit_tokens - before
    # The shared part is the system message; every request reuses its whole pages.
    shared = next(i for i, (a, b) in enumerate(zip(first, conv("Name a color."), strict=False)) if a != b)
    ps = default_engine.config.page_size
    assert hit >= len(questions) * (shared // ps) * ps
    assert hit > 0


def test_a_cpu_engine_prefills_256_tokens_a_step_unless_told(default_model_dir, default_engine, tokenizer):
    """A CPU step of a long prompt is what every other running request waits for its next
    token: 256 prompt tokens a step by default (a GPU's 2,048 took 3-13 s a step on 2
    cores); a 600-token prompt is three steps, and a short request beside it gets a token
    each of them."""
    assert default_engine.knobs.max_prefill_tokens == default_engine.scheduler.max_prefill_tokens == 256
    default_engine.radix.clear()
    long_ids = encode_chat(tokenizer, [{"role": "user", "content": "Tell me about foxes. " * 110}])
    assert 512 < len(long_ids) <= 768
    sp = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    default_engine.add_request(GenerateRequest(request_id="long", prompt_token_ids=long_ids, sampling=sp))
    default_engine.add_request(GenerateRequest(request_id="short", prompt_token_ids=long_ids[:8], sampling=sp))
    first: dict[str, int] = {}
    steps = 0
    while default_engine.has_work():
        steps += 1
        for o in default_engine.step():
            if o.token_ids:
                first.setdefault(o.request_id, steps)
    assert first["long"] == 3  # 256 + 256 + the rest
    assert first["short"] < first["long"]


def test_chunked_prefill_16_tokens_equals_one_chunk(default_model_dir, default_engine, tokenizer):
    chunked = Engine(EngineConfig(model=default_model_dir, device="cpu", max_prefill_tokens=16, kv_cache=64 << 20,
                                  min_context=256))
    text = "Summarize: " + "The quick brown fox jumps over the lazy dog. " * 6
    ids = encode_chat(tokenizer, [{"role": "user", "content": text}])
    assert len(ids) > 4 * 16
    sp = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    default_engine.radix.clear()
    assert run_all(chunked, {"c": (ids, sp)}) == run_all(default_engine, {"c": (ids, sp)})


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_abort_mid_prefill_and_mid_decode_returns_pages(default_model_dir, tokenizer, prefix_cache):
    engine = Engine(EngineConfig(
        model=default_model_dir, device="cpu", max_prefill_tokens=16, kv_cache=32 << 20, min_context=256,
        prefix_cache=prefix_cache,
    ))
    start = engine.allocator.num_free
    ids = encode_chat(tokenizer, [{"role": "user", "content": "Describe a forest in detail. " * 5}])
    sp = SamplingParams(max_new_tokens=50, temperature=0.0, ignore_eos=True)

    def available():
        cached = engine.radix.evictable_pages() if engine.radix else 0
        return engine.allocator.num_free + cached

    engine.add_request(GenerateRequest(request_id="pre", prompt_token_ids=ids, sampling=sp))
    engine.step()  # one 16-token chunk of a longer prompt
    assert engine.allocator.num_free < start
    engine.abort("pre")
    outs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("pre", "abort")]
    assert available() == start

    engine.add_request(GenerateRequest(request_id="dec", prompt_token_ids=ids, sampling=sp))
    got = []
    while len(got) < 5:
        for o in engine.step():
            got.extend(o.token_ids)
    engine.abort("dec")
    assert engine.step()[-1].finish_reason == "abort"
    assert available() == start
    assert not engine.has_work()
    if engine.radix is not None:
        engine.radix.clear()
        assert engine.allocator.num_free == start


def test_preemption_under_page_pressure_keeps_outputs(default_model_dir, default_engine, tokenizer):
    # A pool of 12 pages x 16 tokens cannot hold four requests growing to ~60 tokens each:
    # the youngest gets preempted and recomputed, and every output is still its own.
    small = Engine(EngineConfig(model=default_model_dir, device="cpu", num_pages=13, prefix_cache=False))
    reqs = {}
    for i, topic in enumerate(["salt", "ice", "wind", "gold"]):
        ids = encode_chat(tokenizer, [{"role": "user", "content": f"One word about {topic}."}])
        reqs[f"s{i}"] = (ids, SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True))
    assert sum(len(ids) + 24 for ids, _ in reqs.values()) > 12 * 16
    squeezed = run_all(small, reqs)
    default_engine.radix.clear()
    for rid, req in reqs.items():
        assert squeezed[rid] == run_all(default_engine, {rid: req})[rid]
    assert small.allocator.num_free == small.allocator.num_usable


def test_prompt_longer_than_pool_is_rejected_at_once(default_model_dir):
    engine = Engine(EngineConfig(model=default_model_dir, device="cpu", num_pages=5, page_size=16))
    assert engine.info.max_context_tokens == 64
    with pytest.raises(RequestRejected) as err:
        engine.add_request(GenerateRequest(request_id="big", prompt_token_ids=[5] * 64))
    assert err.value.code == "context_length_exceeded"
    assert "64" in err.value.message
    assert not engine.has_work()
    with pytest.raises(RequestRejected):
        engine.add_request(GenerateRequest(request_id="empty", prompt_token_ids=[]))
    with pytest.raises(RequestRejected):
        engine.add_request(GenerateRequest(request_id="oov", prompt_token_ids=[10**9]))


def test_stop_token_ids_and_eos_end_requests(default_engine, chat_prompts):
    ids = chat_prompts[0]
    free = run_all(default_engine, {"x": (ids, SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True))})["x"]
    stop_at = free[3]
    out = run_all(default_engine, {"y": (ids, SamplingParams(max_new_tokens=20, temperature=0.0, stop_token_ids=(stop_at,)))})["y"]
    assert out == free[: free.index(stop_at) + 1]
    eos = run_all(default_engine, {"z": (ids, SamplingParams(max_new_tokens=64, temperature=0.0))})["z"]
    assert eos[-1] in default_engine.info.eos_token_ids


def test_a_request_whose_logits_cannot_be_sampled_fails_alone(default_engine):
    """A repetition penalty so small it turns logits into +inf: that request ends with
    ``invalid_logits``, the one stepping beside it answers as it does alone, and the
    engine keeps serving."""
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    broken = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True, repetition_penalty=5e-324)
    ids = [1, 504, 3458, 314, 260, 1345]
    alone = run_all(default_engine, {"alone": (ids, greedy)})["alone"]
    default_engine.add_request(GenerateRequest(request_id="bad", prompt_token_ids=ids, sampling=broken))
    default_engine.add_request(GenerateRequest(request_id="good", prompt_token_ids=ids, sampling=greedy))
    out, ended = {"good": []}, {}
    while default_engine.has_work():
        for o in default_engine.step():
            if o.request_id == "good":
                out["good"] += o.token_ids
            if o.finished:
                ended[o.request_id] = o
    assert ended["bad"].finish_reason == "error" and ended["bad"].error_code == "invalid_logits"
    assert ended["good"].finish_reason == "length" and out["good"] == alone
