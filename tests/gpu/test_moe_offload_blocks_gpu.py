"""A GGUF mixture of experts kept in block format on CUDA with some layers' routed
experts in pinned host memory (``--cpu-experts``): both tiers of the expert cache hold
the file's blocks, a copy moves blocks, a cached expert runs the Triton fused MoE over
blocks on slot ids, a CPU run dequantizes the host tier's blocks.

1. Tiny random-weight files (a Qwen3-MoE as a Q4_K_M file holds its experts, one sparse
   layer of 8 experts; a Mixtral in Q8_0, two sparse layers of 4 experts, the last one
   offloaded as ``--cpu-experts 1`` puts it), read into host memory as the engine reads
   them, offloaded, moved to CUDA; 32 greedy steps for two prompts against the same file
   all resident in blocks on CUDA, with placements that copy (3 slots: hits and
   evictions), stream (1 slot, fewer than top-2), run on the CPU, or follow the
   measured costs (decode's bus reads switched off for these), or read the host blocks
   in place over the bus (engine.layers.moe.bus_reads); and a cache halved mid-run. float32: the greedy ids are equal and
   every step's logits within 1e-3 of the largest (summation order: a streamed wave
   adds its rows one expert at a time, a CPU run is a float32 CPU matmul where the
   kernel rounds nothing either). bfloat16: the hybrid model is fed the resident
   model's greedy ids and every step's logits are within 2**-5 of the largest (the
   kernel tests' tolerance: the kernel rounds its products to bfloat16, a CPU run does
   not, and the waves' sums round in another order), since on a random model's flat
   logits one such rounding can flip a free-running greedy id.
2. The engine with ``--gguf-quantized --cpu-experts 1`` planned for an 8 GiB card
   (``--device-limit``): the plan's host tier and slots are block bytes, the loaded host
   tier is pinned blocks, and the greedy ids equal ``--cpu-experts none``'s.
3. ``headroom serve --device cuda --gguf-quantized --cpu-experts 1`` on the Mixtral file
   answers a chat completion, and its counters show the expert cache at work.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from model_checks import engine_greedy, halved_cache_run, paged_greedy

from kernels.switches import using

gguf = pytest.importorskip("gguf")

from test_gguf_convert import VOCAB, write_gguf  # noqa: E402
from test_gguf_moe_quant import write_tiny_moe_gguf  # noqa: E402

from engine.layers.moe.expert_costs import ALWAYS_COPY, ALWAYS_CPU  # noqa: E402
from engine.layers.moe.expert_stacks import BlockStack  # noqa: E402
from engine.layers.moe.offload import offload_experts  # noqa: E402
from engine.loader.gguf_convert import convert_gguf  # noqa: E402
from engine.loader.gguf_quant import load_gguf_quantized  # noqa: E402
from engine.loader.hf_config import load_model_config  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
STEPS = 32
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 2**-5}
FILES = ["qwen3moe-q4_k_m", "mixtral-q8_0"]


def _write(kind: str, folder, make_tiny_hf_model):
    """(GGUF path, config) of the tiny ``kind`` file in ``folder``."""
    if kind == "qwen3moe-q4_k_m":
        return write_tiny_moe_gguf(folder, make_tiny_hf_model)
    path = folder / "mixtral.gguf"
    write_gguf(path, "llama", make_tiny_hf_model("mixtral", None, vocab_size=VOCAB))
    return path, load_model_config(convert_gguf(path, folder / "hf"))


def _prompts() -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(5)
    return {"a": torch.randint(3, VOCAB, (9,), generator=gen).tolist(),
            "b": torch.randint(3, VOCAB, (30,), generator=gen).tolist()}


def _assert_close(logits: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    diff, scale = float((logits - ref).abs().max()), max(1.0, float(ref.abs().max()))
    assert diff <= TOLERANCE[dtype] * scale, (diff, scale)


def _decode(runner, forced: dict[str, list[int]] | None = None) -> tuple[dict[str, list[int]], torch.Tensor]:
    """:func:`_prompts` prefilled, then :data:`STEPS` decode steps, each feeding the
    greedy id (or ``forced``'s id of that step). Returns (the ids fed, every step's
    logits ``[STEPS + 1, B, V]`` float32)."""
    prompts = _prompts()
    seen = [runner.step(prompts)]
    fed: dict[str, list[int]] = {k: [] for k in prompts}
    for i in range(STEPS):
        for j, k in enumerate(prompts):
            fed[k].append(forced[k][i] if forced is not None else int(seen[-1][j].argmax()))
        seen.append(runner.step({k: [ids[-1]] for k, ids in fed.items()}))
    return fed, torch.stack(seen).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize(("placement", "slots"), [("copy", 3), ("stream", 1), ("cpu", 2), ("measured", 2), ("bus", 2),
                                                  ("bus", 0)])
@pytest.mark.parametrize("kind", FILES)
def test_experts_in_host_blocks_give_the_all_resident_greedy_ids(kind, placement, slots, dtype, tmp_path,
                                                                 make_tiny_hf_model, paged_runner):
    path, config = _write(kind, tmp_path, make_tiny_hf_model)
    resident = load_gguf_quantized(config, path, "cuda", dtype)
    ref, ref_logits = _decode(paged_runner(resident, config, device="cuda"))
    del resident
    # As the engine loads a hybrid plan: the CUDA layout read into host memory, the
    # last MoE layer's experts offloaded to pinned blocks, the rest moved to the card.
    hybrid = load_gguf_quantized(config, path, "cpu", dtype, experts_in_blocks=True)
    costs = {"copy": ALWAYS_COPY, "stream": ALWAYS_COPY, "cpu": ALWAYS_CPU, "measured": None, "bus": None}[placement]
    stores, counters = offload_experts(hybrid, config.moe_layers[-1:], slots, costs, device=torch.device("cuda"))
    hybrid.to("cuda")
    # Decode steps read missing experts over the bus unless switched off (the step-time
    # placements above are the prefill path's, checked here on decode steps).
    with using(expert_bus_reads=placement == "bus"):
        got, logits = _decode(paged_runner(hybrid, config, device="cuda"), None if dtype == torch.float32 else ref)
    print(f"\n{kind} {placement} {slots} slots {dtype}: {counters}; costs {stores[0].costs}; max |diff| "
          f"{float((logits - ref_logits).abs().max()):.2e} of {float(ref_logits.abs().max()):.2e}")
    assert got == ref
    _assert_close(logits, ref_logits, dtype)
    store = stores[0]
    assert isinstance(store.host, BlockStack) and isinstance(store.cache, BlockStack)
    assert all(t.is_pinned() and t.dtype == torch.uint8 for t in store.host.tensors)
    assert all(t.is_cuda and t.dtype == torch.uint8 and t.shape[0] == slots for t in store.cache.tensors)
    assert store.slot_bytes == sum(t[0].nbytes for t in store.host.tensors)
    # The measured copy is of the blocks.
    assert placement != "measured" or store.costs.expert_bytes == store.slot_bytes
    assert counters.hits + counters.misses > 0
    assert counters.misses == counters.copies + counters.cpu_runs + counters.bus_reads
    if placement == "bus":  # pinned host blocks read by the kernel in place
        assert counters.bus_reads > 0 and counters.copies == counters.cpu_runs == 0
    if placement == "copy":
        assert counters.hits > 0 and counters.cpu_runs == 0
        assert (counters.evictions > 0) == (slots < config.num_experts)
    if placement == "stream":  # one slot for top-2: the second expert of a step streams
        assert counters.streamed > 0 and counters.cpu_runs == 0
    if placement == "cpu":
        assert counters.copies == 0 and counters.cpu_runs == counters.misses > 0
    for e, slot in store.slot_of.items():
        assert all(torch.equal(c[slot].cpu(), h[e]) for c, h in zip(store.cache.tensors, store.host.tensors,
                                                                    strict=True))


@pytest.mark.parametrize("kind", FILES)
def test_a_cache_of_blocks_halved_mid_run_keeps_the_greedy_ids(kind, tmp_path, make_tiny_hf_model, paged_runner):
    path, config = _write(kind, tmp_path, make_tiny_hf_model)
    resident = load_gguf_quantized(config, path, "cuda", torch.float32)
    ref, ref_logits = paged_greedy(paged_runner(resident, config, device="cuda"), _prompts(), STEPS)
    hybrid = copy.deepcopy(resident)  # every MoE layer offloaded from the card: blocks to pinned host memory
    got, logits, _ = halved_cache_run(paged_runner(hybrid, config, device="cuda"), _prompts(), STEPS, hybrid, config)
    assert got == ref
    _assert_close(logits, ref_logits, torch.float32)


def test_the_engine_keeps_a_gguf_in_blocks_with_cpu_experts(tmp_path, make_tiny_hf_model, monkeypatch):
    """--gguf-quantized --cpu-experts 1 on CUDA: no dequantizing fallback; the plan
    prices the host tier and the slots in block bytes, the engine holds pinned blocks,
    and greedy ids equal --cpu-experts none's. Decode reads the missing experts over the
    bus inside the CUDA graphs (replayed), and a cache resized mid-run (the graphs
    captured again over the new slots) changes no id."""
    from engine.common.config import EngineConfig

    path, config = _write("mixtral-q8_0", tmp_path, make_tiny_hf_model)
    monkeypatch.setenv("HEADROOM_CACHE_DIR", str(tmp_path / "cache"))  # the file's conversion goes there

    def greedy(cpu_experts: str, on_step=None):
        return engine_greedy(EngineConfig(model=str(path), device="cuda", dtype="float32", gguf_quantized=True,
                                          cpu_experts=cpu_experts, max_running_requests=4, device_limit=8 << 30),
                             _prompts(), 16, on_step)

    whole, ref = greedy("none")
    layer_bytes = sum(b.nbytes for b in whole.model.model.layers[config.moe_layers[-1]].mlp.experts.buffers())
    assert whole.quantized_gguf == path and not whole.expert_stores
    del whole  # its pool and weights back to the card before the next engine plans
    gc.collect()
    torch.cuda.empty_cache()
    hybrid, got = greedy("1", lambda engine, i: i == 8 and engine.resize_expert_cache(1))
    assert got == ref
    graphs = hybrid.runner.graphs
    assert graphs is not None and graphs.replays > 0 and graphs.captures > len(graphs.sizes)  # captured again
    assert hybrid.expert_cache_slots == 1
    assert hybrid.quantized_gguf == path
    store = hybrid.expert_stores[0]
    assert isinstance(store.host, BlockStack) and all(t.is_pinned() for t in store.host.tensors)
    assert hybrid.plan.cpu_expert_layers == 1 and hybrid.plan.expert_slot_bytes == store.slot_bytes
    assert store.slot_bytes * config.num_experts == layer_bytes
    lines = {e.name: e for e in hybrid.plan.ledger}
    assert "GGUF blocks" in lines["expert cache"].source
    assert lines["expert cache"].bytes == hybrid.plan.expert_cache_slots * store.slot_bytes
    stats = hybrid.stats()
    assert stats.expert_cache_hits + stats.expert_cache_misses > 0
    assert stats.expert_cache_misses == stats.expert_copies + stats.expert_cpu_runs + stats.expert_bus_reads
    # Copies come only from the start's 2,048-token profile pass, a chunk long enough to
    # stage (engine.layers.moe.staged_prefill): each expert of the host layer once.
    assert stats.expert_bus_reads > 0 and stats.expert_cpu_runs == 0
    assert stats.expert_copies <= config.num_experts


@pytest.mark.timeout(600)
def test_serve_answers_a_chat_completion_with_gguf_experts_in_host_blocks(tmp_path, make_tiny_hf_model):
    from service_harness import ServerProcess

    path, _ = _write("mixtral-q8_0", tmp_path, make_tiny_hf_model)
    server = ServerProcess(tmp_path, ["--model", str(path), "--device", "cuda", "--gguf-quantized",
                                      "--cpu-experts", "1", "--max-running-requests", "4", "--device-limit", "8GiB"],
                           {"HEADROOM_CACHE_DIR": str(tmp_path / "cache")})
    try:
        server.wait_ready()
        with server.client(timeout=300) as http:
            r = http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8, "temperature": 0})
            assert r.status_code == 200, r.text
            body = r.json()
            assert isinstance(body["choices"][0]["message"]["content"], str)
            assert body["usage"]["completion_tokens"] > 0
            status = http.get("/api/status").json()
        plan = status["plan"]["plan"]
        assert plan["cpu_expert_layers"] == 1 and plan["expert_cache_slots"] > 0, plan
        counters = status["counters"]["engine"]
        assert counters["expert_cache_hits"] + counters["expert_cache_misses"] > 0, counters
    except AssertionError:
        print(server.log())
        raise
    finally:
        server.stop()
