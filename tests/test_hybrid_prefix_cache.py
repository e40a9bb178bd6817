"""The prefix cache of hybrid linear-attention models: the linear layers' states kept at
page boundaries beside the cached pages (engine.scheduler.prefix_states), so a repeated
prompt or an agent's next turn computes only what is new, with the tokens of a cold run
(tiny random Qwen3-Next configs, dense and MoE)."""

from __future__ import annotations

import pytest
import torch
from model_checks import tiny_pair

from engine.common.config import EngineConfig
from engine.core.engine import Engine
from engine.kvcache.allocator import PageAllocator
from engine.kvcache.radix import RadixCache
from engine.wire.messages import GenerateRequest, SamplingParams

pytest.importorskip("transformers")

VOCAB = 256
PAGE = 4
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=["qwen3_next_dense", "qwen3_next"])
def path(request, tmp_path_factory, make_tiny_hf_model):
    return tiny_pair(request.param, tmp_path_factory.mktemp(request.param), make_tiny_hf_model, VOCAB)[4]


def _engine(path, **knobs) -> Engine:
    return Engine(EngineConfig(model=str(path), device="cpu", page_size=PAGE, num_pages=256, **knobs))


def _run(engine: Engine, rid: str, ids: list[int]) -> tuple[list[int], int]:
    """One request alone: its output ids and how many prompt tokens came from the cache."""
    engine.add_request(GenerateRequest(request_id=rid, prompt_token_ids=ids, sampling=GREEDY))
    out, cached = [], None
    while engine.has_work():
        for o in engine.step():
            out += o.token_ids
            if cached is None:
                cached = o.cached_tokens
    return out, cached or 0


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_a_repeated_prompt_starts_from_the_checkpoint_at_its_last_whole_page(path):
    cached, cold = _engine(path), _engine(path, prefix_cache=False)
    ids = _ids(23, 1)
    want, _ = _run(cold, "cold", ids)
    first, hit0 = _run(cached, "a", ids)
    again, hit = _run(cached, "b", ids)
    assert first == again == want
    # The prompt's prefill ended on its last whole page (20 tokens), then the tail of 3.
    assert (hit0, hit) == (0, 20)
    assert cached.scheduler.prefix_states.restored == 1


def test_the_next_turn_reuses_the_whole_conversation_so_far(path):
    """Turn 2 = turn 1's prompt and answer plus a new message: it starts from the decode
    checkpoint at the answer's last whole page and answers as a cold run does."""
    cached, cold = _engine(path), _engine(path, prefix_cache=False)
    prompt = _ids(23, 2)
    answer, _ = _run(cached, "t1", prompt)
    turn2 = prompt + answer + _ids(9, 3)
    got, hit = _run(cached, "t2", turn2)
    want, _ = _run(cold, "cold", turn2)
    assert got == want
    # 23 + 12 tokens, of which 34 were computed (the last sampled one never is): the
    # checkpoint at 32 holds.
    assert hit == 32


def test_a_prefix_shared_up_to_a_chunk_boundary_restarts_there(path):
    """A long prompt leaves a checkpoint at each prefill chunk's end: a prompt that parts
    from it later in the text reuses everything up to the last of those before the
    parting."""
    cached, cold = _engine(path, max_prefill_tokens=16), _engine(path, prefix_cache=False)
    base = _ids(50, 4)
    _run(cached, "long", base)
    other = base[:37] + _ids(10, 5)
    got, hit = _run(cached, "other", other)
    assert got == _run(cold, "cold", other)[0]
    assert hit == 32  # chunks end at 16, 32, 48: 32 is the last before token 37


def test_few_checkpoint_slots_give_the_oldest_back_and_stay_correct(path):
    """One running request: one checkpoint slot, reused least recently used first."""
    cached, cold = _engine(path, max_running_requests=1), _engine(path, prefix_cache=False)
    assert cached.states.checkpoints == 1
    prompts = [_ids(18, 10 + i) for i in range(3)]
    answers = []
    for i, ids in enumerate(prompts):
        answers.append(_run(cached, f"p{i}", ids)[0])
        assert answers[-1] == _run(cold, f"c{i}", ids)[0]
    assert cached.states.num_free_checkpoints == 0
    # The slot holds the last conversation's latest decode checkpoint (18 + 12 tokens, 29
    # computed: 28); the earlier ones were given back as the later ones came.
    turn2 = prompts[2] + answers[2] + _ids(5, 13)
    got, hit = _run(cached, "next", turn2)
    assert (got, hit) == (_run(cold, "cn", turn2)[0], 28)
    assert _run(cached, "again0", prompts[0]) == (answers[0], 0)


def test_clearing_the_cache_gives_every_checkpoint_back(path):
    cached = _engine(path)
    for i in range(3):
        _run(cached, f"r{i}", _ids(30, 20 + i))
    assert cached.states.num_free_checkpoints < cached.states.checkpoints
    cached.radix.clear()
    assert cached.states.num_free_checkpoints == cached.states.checkpoints


def test_a_match_ends_at_the_deepest_node_holding_states():
    released = []
    radix = RadixCache(PageAllocator(64), PAGE, release_state=released.append)
    alloc = radix.allocator
    tokens = list(range(24))
    _, mid = radix.insert(tokens[:8], alloc.alloc(2))
    _, end = radix.insert(tokens, [*_pages_of(radix, tokens[:8]), *alloc.alloc(4)])
    assert radix.match_prefix(tokens)[0] == []  # no states anywhere: only the empty prefix
    assert radix.attach_state(mid, 7) and not radix.attach_state(mid, 8)
    pages, node = radix.match_prefix(tokens)
    assert node is mid and len(pages) == 2
    assert radix.attach_state(end, 9)
    assert radix.match_prefix(tokens)[1] is end
    assert not radix.attach_state(radix.root, 5)  # the empty prefix needs none
    assert radix.drop_lru_state() and released == [7]  # mid was used longest ago
    radix.clear()
    assert released == [7, 9]


def _pages_of(radix: RadixCache, tokens: list[int]) -> list[int]:
    saved, radix.release_state = radix.release_state, None
    try:
        return radix.match_prefix(tokens)[0]
    finally:
        radix.release_state = saved


def test_the_turns_bench_scores_an_answer_teacher_forced(path):
    """engine.bench.hybrid_turns' check where a GPU's cached and cold answers part in
    bfloat16: the cold engine scores the answer after the prompt; its own greedy answer
    sits at gap 0, one with a token swapped for another sits that token's gap below."""
    from engine.bench.hybrid_turns import largest_gap

    cold = _engine(path, prefix_cache=False)
    prompt = _ids(23, 4)
    answer, _ = _run(cold, "a", prompt)
    assert largest_gap(cold, prompt, answer) < 1e-4
    swapped = answer[:5] + [(answer[5] + 1) % VOCAB] + answer[6:]
    assert largest_gap(cold, prompt, swapped) > 1e-3
