"""A split model's boundary moved while requests run (``--cpu-layers auto``,
:mod:`engine.layers.split_move`, ``Engine.move_split``): on the CPU the "device" is the
CPU too, but the moved layers go through the split path (their own host pool, the CPU
path's layers), so every request running across a move, down and back up, must give the
unsplit run's greedy ids, which are transformers'.
"""

from __future__ import annotations

import pytest
from model_checks import hf_greedy
from test_engine import run_all
from tiny_engine import tiny_engine

from engine.common.config import EngineConfig
from engine.core.engine import Engine
from engine.wire.messages import (
    BY_CONTROL,
    REPLAN_MOVE_LAYERS,
    GenerateRequest,
    Replanned,
    SamplingParams,
)

LAYERS = 4
STEPS = 10
GREEDY = SamplingParams(max_new_tokens=STEPS, temperature=0.0, ignore_eos=True)
SHARED = [11, 40, 7, 93, 120, 5, 61, 200, 17, 3]  # two pages of 4 and part of a third
PROMPTS = {"a": SHARED + [44, 9], "b": [150, 31, 77, 8, 2, 190, 66]}
LATE = {"c": SHARED + [101]}  # after the moves: a prefix-cache hit on "a"'s pages


@pytest.fixture(scope="module")
def llama(tmp_path_factory, make_tiny_hf_model):
    """A tiny random Llama of :data:`LAYERS` layers: ``(folder, transformers model)``."""
    path = tmp_path_factory.mktemp("tiny-llama-move")
    hf = make_tiny_hf_model("llama", path, num_hidden_layers=LAYERS)
    return str(path), hf


def _moves(engine: Engine) -> list[Replanned]:
    return [e for e in engine.drain_events() if isinstance(e, Replanned) and e.action == REPLAN_MOVE_LAYERS]


def _check_pools(engine: Engine) -> None:
    host = engine.model.host_layers
    cpu = engine.cpu_layers
    assert engine.pool.num_layers == LAYERS - cpu and len(engine.pool.k_buffers) == LAYERS - cpu
    if cpu == 0:
        assert host is None
        return
    assert host.start == LAYERS - cpu and len(host.layers) == cpu == host.pool.num_layers
    assert host.pool.num_pages == engine.pool.num_pages  # one page count, one allocator
    for i, layer in enumerate(engine.model.model.layers):
        assert layer.self_attn.layer == (i if i < host.start else i - host.start)


def _step_until_decoding(engine: Engine, outputs: dict[str, list[int]]) -> None:
    """Step until every request has its first token (its prompt prefilled)."""
    for _ in range(50):
        if all(outputs[rid] for rid in PROMPTS):
            return
        for o in engine.step():
            outputs[o.request_id].extend(o.token_ids)
    raise AssertionError(f"prefill did not finish: {outputs}")


def test_requests_decode_across_moves_down_and_up_as_unsplit(llama):
    """Prefill unsplit, decode across a move of 2 layers down, one more, then all back
    up; a prompt sharing "a"'s cached prefix after: every id is transformers'."""
    path, hf = llama
    engine = tiny_engine(path, 64, cpu_layers="auto")
    assert engine.cpu_layers == 0 and engine.max_cpu_layers == LAYERS - 1
    outputs: dict[str, list[int]] = {rid: [] for rid in PROMPTS}
    for rid, ids in PROMPTS.items():
        engine.add_request(GenerateRequest(request_id=rid, prompt_token_ids=ids, sampling=GREEDY))
    _step_until_decoding(engine, outputs)
    kv_before = engine.pool.nbytes
    plan = [(2, 3), (3, 2), (1, 1), (0, 2)]  # (cpu layers, steps after the move)
    for cpu, steps in plan:
        assert engine.move_split(cpu, reason="test", origin=BY_CONTROL) == cpu
        _check_pools(engine)
        [event] = _moves(engine)
        assert event.after_cpu_layers == cpu and event.origin == BY_CONTROL and event.reason == "test"
        assert event.after_bytes == kv_before * (LAYERS - cpu) // LAYERS
        assert (event.moved_bytes > 0) == (event.after_cpu_layers > event.before_cpu_layers)
        for _ in range(steps):
            for o in engine.step():
                outputs[o.request_id].extend(o.token_ids)
    while engine.has_work():
        for o in engine.step():
            outputs[o.request_id].extend(o.token_ids)
    engine.move_split(2)
    hits = engine.stats().prefix_hit_tokens
    late = run_all(engine, {rid: (ids, GREEDY) for rid, ids in LATE.items()})
    assert engine.stats().prefix_hit_tokens > hits  # "c" read "a"'s pages, two layers of them from the host
    for rid, out in {**outputs, **late}.items():
        assert out == hf_greedy(hf, {**PROMPTS, **LATE}[rid], STEPS), rid


def test_a_live_shrink_after_a_move_moves_the_host_pages_too(llama):
    """The KV pool shrinks under a running request once the split moved: the host pool
    follows it and the request's output is still transformers'."""
    path, hf = llama
    engine = tiny_engine(path, 64, cpu_layers="auto")
    hog = engine.allocator.alloc(40)  # the request's pages are high: a shrink relocates them
    outputs = {"a": []}
    engine.add_request(GenerateRequest(request_id="a", prompt_token_ids=PROMPTS["a"], sampling=GREEDY))
    for o in engine.step():
        outputs["a"].extend(o.token_ids)
    engine.move_split(1)
    engine.allocator.free(hog)
    result = engine.resize_kv_pool(24)
    assert result.relocated_pages > 0 and engine.model.host_layers.pool.num_pages == 24
    while engine.has_work():
        for o in engine.step():
            outputs["a"].extend(o.token_ids)
    _check_pools(engine)
    assert outputs["a"] == hf_greedy(hf, PROMPTS["a"], STEPS)


def test_a_fixed_count_is_never_moved(llama):
    path, _ = llama
    engine = tiny_engine(path, 16, cpu_layers="3")
    assert engine.max_cpu_layers == 0 and "--cpu-layers 3 is fixed" in engine.split_fixed_reason
    for asked in (0, 2, 3):
        with pytest.raises(ValueError, match="--cpu-layers 3 is fixed: the split moves live only with --cpu-layers auto"):
            engine.move_split(asked)
    assert engine.cpu_layers == 3 and engine.model.host_layers.start == 1 and not _moves(engine)


def test_a_move_down_stops_at_what_the_host_holds(llama):
    """Each layer moved takes its float32 weights and its KV for every page in host
    memory: a move asks for no more layers than fit in what is available, and refuses
    when not one does."""
    import torch

    from engine.loader.weight_size import layer_weight_bytes

    path, _ = llama
    engine = tiny_engine(path, 16, cpu_layers="auto")
    weights = layer_weight_bytes(engine.model_config, torch.float32)
    kv = engine.pool.nbytes // LAYERS  # float32 on both sides
    two = weights[-1] + weights[-2] + 2 * kv
    assert engine.layers_host_holds(0, 3, available=two) == 2
    assert engine.layers_host_holds(0, 3, available=two - 1) == 1
    assert engine.layers_host_holds(1, 3, available=two) == 3  # from 1 on: layers 2 and 1 to move
    assert engine.layers_host_holds(0, 3, available=None) == 3  # the OS does not say: no limit
    with pytest.raises(ValueError, match=r"moving decoder layer 3 to the CPU needs .* of host memory and 1 byte is "
                       "available: free host memory first"):
        engine.layers_host_holds(0, 3, available=1)
    assert engine.move_split(2) == 2  # this machine holds two tiny layers


def test_out_of_range_is_refused_naming_the_range(llama):
    path, _ = llama
    engine = tiny_engine(path, 16, cpu_layers="auto")
    for bad in (-1, LAYERS):
        with pytest.raises(ValueError, match=f"choose 0 to {LAYERS - 1} \\(one stays on the device\\)"):
            engine.move_split(bad)
    assert engine.move_split(0) == 0 and not _moves(engine)  # no change, no event


@pytest.mark.slow
def test_default_gguf_moves_from_its_planned_split_and_back():
    """The default model (Q4_1 blocks, 30 layers) on a small simulated card starts split
    (auto), its GGUF projections kept in the file's form; moved up to none and down to
    more than the plan's, its greedy ids stay the unsplit engine's, and the plan reports
    the split now."""
    pytest.importorskip("gguf")
    from engine.loader.default_model import default_gguf_path

    config = dict(model=str(default_gguf_path()), device="cpu", device_display=False, max_running_requests=4,
                  min_context=512)
    split = Engine(EngineConfig(device_total=8 << 30, device_limit=900 << 20, **config))
    start = split.cpu_layers
    assert 0 < start < 29 and len(split.model.host_layers.file_forms) == start
    fixed = split.plan.fixed_bytes
    prompts = {"a": [1, 504, 3458, 282, 260, 2682, 30, 216], "b": [1, 12268, 253, 1109, 1352, 1]}
    sampling = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    outputs: dict[str, list[int]] = {rid: [] for rid in prompts}
    for rid, ids in prompts.items():
        split.add_request(GenerateRequest(request_id=rid, prompt_token_ids=ids, sampling=sampling))
    for cpu in (0, start + 2, start):
        for o in split.step():
            outputs[o.request_id].extend(o.token_ids)
        split.move_split(cpu)
        assert split.info.plan.cpu_layers == cpu and (cpu == 0) == (split.info.plan.split_note == "")
    assert split.plan.fixed_bytes == fixed  # back where it started
    while split.has_work():
        for o in split.step():
            outputs[o.request_id].extend(o.token_ids)
    del split
    whole = run_all(Engine(EngineConfig(kv_cache=128 << 20, **config)), {rid: (ids, sampling)
                                                                         for rid, ids in prompts.items()})
    assert outputs == whole


def test_a_layer_repacked_for_the_gpu_goes_to_the_host_in_the_files_layout(tmp_path):
    """What a move down from CUDA does to a layer's GGUF projections, on the CPU: a layer
    whose Q6_K parts the loader repacked for the GPU kernels (``Q6_K_P``) goes to the
    host packed for the CPU path, and the form kept to move it back up is the file's
    blocks, byte for byte, Q6_K again."""
    import torch
    from test_gguf_quant import _small_k_quant_gguf

    from engine.layers.linear.gguf_blocks import QuantLinear
    from engine.layers.split_move import _to_host_form
    from engine.loader.gguf_quant import load_gguf_quantized

    config, path = _small_k_quant_gguf(tmp_path, 0)
    layer = load_gguf_quantized(config, path, "cpu", torch.float32).model.layers[1]
    stored = {n: [(p, w.clone()) for p, w in m.part_views()] for n, m in layer.named_modules()
              if isinstance(m, QuantLinear)}
    for m in layer.modules():
        if isinstance(m, QuantLinear):
            m.repack_for_kernels()  # the device's layout
    assert any(p.type_name == "Q6_K_P" for m in layer.modules() if isinstance(m, QuantLinear) for p in m.parts)
    forms = _to_host_form(layer, None)
    assert not any(isinstance(m, QuantLinear) for m in layer.modules()), "packed for the CPU path"
    assert set(forms) == set(stored)
    for name, module in forms.items():
        kept = module.part_views()
        assert [p for p, _ in kept] == [p for p, _ in stored[name]], name
        assert all(torch.equal(w, s) for (_, w), (_, s) in zip(kept, stored[name], strict=True)), name


def test_a_split_that_may_move_prices_the_k_quant_file_form_it_keeps(tmp_path, monkeypatch, make_tiny_hf_model):
    """A GGUF of Q4_K projections split on a GPU: where the C CPU kernels build, a host
    layer keeps its Q4_K blocks as the file holds them (the C GEMV reads them), so the
    form a layer moves back up with is the same tensors and a split that may move
    (``auto``) costs what a fixed one does; without the C kernels the CPU path repacks
    the blocks (to int4) and a split that may move keeps the file's blocks beside them,
    its host price per layer the fixed split's plus those blocks' bytes. (The weights'
    format is read from the file's tensor table: no GPU is needed to price it.)"""
    import gguf
    import numpy as np
    import torch
    from test_gguf_convert import VOCAB, _gguf_name, write_gguf

    from engine.core.startup import weight_format
    from engine.loader.hf_config import load_model_config
    from engine.loader.resolve import resolve_model
    from kernels.quant.formats import tensor_bytes
    from kernels.quant.synthetic import random_blocks

    hf = make_tiny_hf_model("llama", None, vocab_size=VOCAB, hidden_size=256, intermediate_size=512,
                            num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=LAYERS)
    rng, override, file_bytes = np.random.default_rng(3), {}, [0] * LAYERS
    for name, param in hf.named_parameters():
        if name.endswith("proj.weight"):
            rows, cols = param.shape
            override[_gguf_name(name)] = (random_blocks("Q4_K", rows, cols, rng), gguf.GGMLQuantizationType.Q4_K)
            file_bytes[int(name.split(".")[2])] += tensor_bytes("Q4_K", (rows, cols), 4)
    path = tmp_path / "q4_k.gguf"
    write_gguf(path, "llama", hf, override=override)
    monkeypatch.setenv("HEADROOM_CACHE_DIR", str(tmp_path / "cache"))
    folder = resolve_model(str(path))  # the GGUF's metadata as a config (no weight converted)
    mc = load_model_config(folder)

    def host_prices(cpu_layers: str) -> tuple[int, ...]:
        config = EngineConfig(model=str(path), device="cuda", gguf_quantized=True, cpu_layers=cpu_layers)
        return weight_format(config, torch.device("cuda"), torch.bfloat16, mc, folder).size.host_layer_bytes

    from engine.layers.linear.cpu_kernels import cpu_kernels

    fixed, movable = host_prices("2"), host_prices("auto")
    assert all(f > 0 for f in file_bytes) and len(fixed) == LAYERS
    kept_apart = [0] * LAYERS if cpu_kernels() is not None else file_bytes
    assert [m - f for m, f in zip(movable, fixed, strict=True)] == kept_apart
