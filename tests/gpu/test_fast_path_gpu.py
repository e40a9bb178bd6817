"""The GPU fast path: attention backends, CUDA graphs and the step loop, against
transformers and against the torch backend, and through a live KV pool resize.

Random-weight models of real shapes (a few layers) in bfloat16: their next-token
distributions are flat, so two correct implementations may pick different tokens
where the top two logits are nearly tied. A greedy sequence therefore counts as equal
to the reference up to its first difference only if, at that step, the reference's own
logit for our token is within ``NEAR_TIE`` of its best (and nothing after a difference
is compared: the contexts differ from there).
"""

from __future__ import annotations

import importlib.util
import logging
import os

import pytest
import torch

from engine.bench.model_shapes import SHAPES
from engine.common.config import EngineConfig
from engine.core.engine import Engine
from engine.wire.messages import GenerateRequest, SamplingParams

NEW_TOKENS = 32
# bfloat16 keeps 8 bits of mantissa: logits of size ~10 carry ~0.05 of rounding, and the
# two sides round in different places (fused vs separate ops, another reduction order).
NEAR_TIE = 0.15

BACKENDS = [
    ("triton", True),
    ("triton", False),
    ("torch", False),
    *(pytest.param("flashinfer", graphs, marks=pytest.mark.skipif(
        importlib.util.find_spec("flashinfer") is None, reason="flashinfer is not installed")) for graphs in (True, False)),
]


def _save_shape(name: str, path, layers: int):
    import transformers

    cfg = dict(SHAPES[name], num_hidden_layers=layers)
    for key in ("architectures", "model_type", "torch_dtype"):
        cfg.pop(key)
    config_cls = transformers.Qwen3Config if name.startswith("qwen3") else transformers.LlamaConfig
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config_cls(**cfg), dtype=torch.bfloat16)
    model.save_pretrained(path)
    return model.eval()


@pytest.fixture(scope="module", params=["qwen3-0.6b", "llama-3.1-8b"])
def shape_model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = _save_shape(request.param, path, layers=2)
    g = torch.Generator().manual_seed(1)
    vocab = SHAPES[request.param]["vocab_size"]
    prompts = [torch.randint(10, vocab - 10, (n,), generator=g).tolist() for n in (7, 33, 130, 64)]
    refs = []
    for ids in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids], device="cuda"), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                              do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True,
                              return_dict_in_generate=True)
        refs.append((out.sequences[0, len(ids):].tolist(), [s[0].float().cpu() for s in out.logits]))
    yield str(path), prompts, refs
    del hf
    torch.cuda.empty_cache()


def run_greedy(engine: Engine, prompts: list[list[int]], new_tokens: int = NEW_TOKENS, on_step=None) -> list[list[int]]:
    sp = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    out = {f"r{i}": [] for i in range(len(prompts))}
    for i, ids in enumerate(prompts):
        engine.add_request(GenerateRequest(request_id=f"r{i}", prompt_token_ids=ids, sampling=sp))
    steps = 0
    while engine.has_work():
        for o in engine.step():
            out[o.request_id].extend(o.token_ids)
        steps += 1
        if on_step is not None:
            on_step(engine, steps)
    return [out[f"r{i}"] for i in range(len(prompts))]


def assert_greedy_matches(ours: list[int], ref: list[int], ref_logits: list[torch.Tensor]) -> None:
    for j, (a, b) in enumerate(zip(ours, ref, strict=True)):
        if a != b:
            gap = float(ref_logits[j].max() - ref_logits[j][a])
            assert gap <= NEAR_TIE, f"token {j}: ours {a}, reference {b}, the reference's logit gap {gap:.3f}"
            return


@pytest.mark.parametrize("backend,graphs", BACKENDS)
def test_greedy_matches_transformers(shape_model, backend, graphs, caplog):
    path, prompts, refs = shape_model
    caplog.set_level(logging.INFO, logger="headroom.engine")
    engine = Engine(EngineConfig(model=path, device="cuda", dtype="bfloat16", kv_cache=1 << 30,
                                 attention_backend=backend, cuda_graphs=graphs, max_running_requests=8))
    assert engine.attention_backend == backend
    assert (engine.runner.graphs is not None) == graphs
    replayed = []
    ours = run_greedy(engine, prompts, on_step=lambda e, _: replayed.append(e.runner.replayed))
    for got, (ref, logits) in zip(ours, refs, strict=True):
        assert len(got) == NEW_TOKENS
        assert_greedy_matches(got, ref, logits)
    # With graphs the decode steps replayed them (all but the prefill steps).
    assert (sum(replayed) >= NEW_TOKENS - 1) == graphs
    if graphs:
        assert engine.runner.graphs.captures >= len(engine.runner.graphs.sizes)
    if backend == "flashinfer":
        # The first step of each kind says how long FlashInfer's JIT build took.
        firsts = [r.getMessage() for r in caplog.records if r.getMessage().startswith("flashinfer: first")]
        print("\n" + "\n".join(firsts))
        assert any("first decode step" in m for m in firsts) and any("first prefill step" in m for m in firsts)


def _default_model() -> str:
    gguf = os.environ.get("HEADROOM_TEST_GGUF")
    if not gguf:
        pytest.skip("HEADROOM_TEST_GGUF (the SmolLM2 GGUF) is not set")
    return gguf


def _chat_prompts(engine: Engine, n: int) -> list[list[int]]:
    from engine.text.chat import encode_chat
    from engine.text.tokenizer import load_tokenizer

    tok = load_tokenizer(str(engine.model_dir))
    topics = ["the sea", "bread", "rivers", "chess", "owls", "tea", "volcanoes", "trains"]
    return [encode_chat(tok, [{"role": "user", "content": f"Tell me about {topics[i % len(topics)]}."}])
            for i in range(n)]


def test_default_model_greedy_text_equals_the_torch_backend():
    """Five chat prompts, 64 greedy tokens each, Triton kernels under CUDA graphs against
    the torch backend: the same text. float32, so the comparison is about the kernels'
    logic: bfloat16 rounds differently in a fused kernel than in SDPA, which may flip a
    near-tied pick (the bfloat16 comparisons above allow for that)."""
    gguf = _default_model()
    common = dict(model=gguf, device="cuda", dtype="float32", kv_cache=1 << 30)
    fast = Engine(EngineConfig(**common, attention_backend="triton"))
    assert fast.runner.graphs is not None
    prompts = _chat_prompts(fast, 5)
    got = run_greedy(fast, prompts, new_tokens=64)
    del fast
    torch.cuda.empty_cache()
    ref_engine = Engine(EngineConfig(**common, attention_backend="torch"))
    want = run_greedy(ref_engine, prompts, new_tokens=64)
    from engine.text.tokenizer import load_tokenizer

    tok = load_tokenizer(str(ref_engine.model_dir))
    assert [tok.decode(g) for g in got] == [tok.decode(w) for w in want]
    assert got == want


def _shape_engine(tmp_path, **config) -> Engine:
    """The Qwen3-0.6B shape, 4 layers, random weights, float32 (so a batch of another
    composition, after a rollback, cannot flip a near-tied greedy pick)."""
    from engine.bench.model_shapes import write_shape

    write_shape("qwen3-0.6b", tmp_path, num_hidden_layers=4)
    return Engine(EngineConfig(model=str(tmp_path), device="cuda", dtype="float32", load_format="dummy",
                               attention_backend="triton", **config))


def _random_prompts(n: int, lengths=(40, 77, 130, 200)) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(10, 150000, (lengths[i % len(lengths)] + i,), generator=g).tolist() for i in range(n)]


def test_live_shrink_and_grow_with_graphs_keeps_outputs(tmp_path):
    """Shrink the pool by 1 GiB and grow it back while 8 requests decode under CUDA
    graphs: every output equals the run without resizes. The figures (resize time,
    re-capture time) are printed for the README."""
    engine = _shape_engine(tmp_path, kv_cache=3 << 30, max_running_requests=8)
    graphs = engine.runner.graphs
    assert graphs is not None
    prompts = _random_prompts(8)
    baseline = run_greedy(engine, prompts, new_tokens=96)
    engine.radix.clear()
    start_pages = engine.pool.num_pages
    delta = (1 << 30) // engine.kv_page_bytes
    events = {}
    captures_before = graphs.captures

    def on_step(e, step):
        if step == 20:
            events["shrink"] = e.resize_kv_pool(start_pages - delta, reason="test")
        if step == 21:
            events["recapture_s"] = graphs.capture_seconds
        if step == 50:
            events["grow"] = e.resize_kv_pool(start_pages, reason="test")

    resized = run_greedy(engine, prompts, new_tokens=96, on_step=on_step)
    assert resized == baseline
    shrink, grow = events["shrink"], events["grow"]
    assert shrink.after_pages == start_pages - delta and grow.after_pages == start_pages
    assert not shrink.preempted and not shrink.ended
    assert graphs.captures > captures_before  # the pool moved, so graphs were captured again
    print(f"\n1 GiB shrink {shrink.duration_ms:.1f} ms, grow {grow.duration_ms:.1f} ms; "
          f"{graphs.captures - captures_before} re-captures, {graphs.capture_seconds:.2f} s of capture in all")


def test_injected_oom_under_graphs_rolls_back(tmp_path):
    """Fault injection at the decode and sample sites on the graph path: the steps roll
    back and the outputs equal a clean run's."""
    engine = _shape_engine(tmp_path, kv_cache=1 << 30, max_running_requests=4)
    prompts = _random_prompts(3)
    clean = run_greedy(engine, prompts, new_tokens=24)
    engine.radix.clear()
    engine.faults.add("decode", "r1", times=2)
    engine.faults.add("sample", "r0", times=1)
    faulty = run_greedy(engine, prompts, new_tokens=24)
    assert faulty == clean
    assert engine.runner.graphs is not None
