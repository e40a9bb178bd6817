"""A call of several sequences (OpenAI's ``n``) holding every decode slot, and a chat
arriving behind it, through the engine (engine.scheduler.fair_share): the chat runs to
its end while the call is still decoding, and the call's sequence that gave its slot
back is recomputed into the same greedy ids it has alone."""

from __future__ import annotations

import torch

from engine.common.config import EngineConfig
from engine.core.engine import Engine
from engine.wire.messages import GenerateRequest, SamplingParams

CALL = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)


def _engine(folder) -> Engine:
    return Engine(EngineConfig(model=str(folder), device="cpu", page_size=4, num_pages=256, max_running_requests=4))


def _add_call(engine: Engine, prompts: list[list[int]]) -> None:
    for i, ids in enumerate(prompts):
        engine.add_request(GenerateRequest(request_id=f"call-{i}", prompt_token_ids=ids, sampling=CALL, group="call"))


def _collect(engine: Engine, out: dict[str, list[int]], finished: list[str]) -> None:
    for o in engine.step():
        out.setdefault(o.request_id, []).extend(o.token_ids)
        if o.finished:
            assert o.finish_reason == "length", o
            finished.append(o.request_id)


def test_a_chat_behind_a_call_holding_every_slot_ends_first_and_the_call_is_unchanged(tmp_path, make_tiny_hf_model):
    make_tiny_hf_model("llama", tmp_path)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 256, (7 + 3 * i,), generator=g).tolist() for i in range(4)]

    alone, finished = {}, []
    engine = _engine(tmp_path)
    _add_call(engine, prompts)
    while engine.has_work():
        _collect(engine, alone, finished)

    together, finished = {}, []
    engine = _engine(tmp_path)
    _add_call(engine, prompts)
    for _ in range(4):
        _collect(engine, together, finished)
    assert len(engine.scheduler.running) == 4  # the call holds every slot
    engine.add_request(GenerateRequest(request_id="chat", prompt_token_ids=prompts[0][:5],
                                       sampling=SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)))
    while "chat" not in finished:
        _collect(engine, together, finished)
    assert finished == ["chat"]  # the call's sequences all still decoding
    assert len(together["chat"]) == 3
    while engine.has_work():
        _collect(engine, together, finished)
    assert sorted(finished) == ["call-0", "call-1", "call-2", "call-3", "chat"]
    assert {rid: ids for rid, ids in together.items() if rid != "chat"} == alone
    engine.radix.clear()
    assert engine.allocator.num_free == engine.allocator.num_usable
