"""Out-of-memory isolation on the CPU, with faults injected at each site of a step.

Four requests run together; one of them (the victim) meets ``torch.OutOfMemoryError``
in its prefill forward, its decode forward, or its sampling. A transient fault is
retried away and every output equals the fault-free run; a persistent one fails the
victim alone with ``out_of_memory`` while every other output still equals the fault-free
run. After every step the pages are checked: none leaked, none held twice, and the radix
cache holds only tokens that were committed.

Outputs are compared exactly: greedy rows, and one seeded sampled row (``r0``) whose
random generator a failed sampling must put back.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import time
from dataclasses import dataclass, field

import pytest
import torch
from tiny_engine import PAGE_SIZE, tiny_engine

from engine.common.config import EngineConfig
from engine.common.faults import ENV_VAR
from engine.core.engine import Engine
from engine.wire.messages import GenerateRequest, OomEvent, ReplanWanted, SamplingParams

SITES = ("prefill", "decode", "sample")
SHARED = 8  # tokens of prompt prefix r0, r1 and r3 share: two whole pages

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_new_tokens=12, temperature=0.9, top_k=50, seed=7, ignore_eos=True)


def _prompts() -> dict[str, tuple[list[int], SamplingParams]]:
    g = torch.Generator().manual_seed(3)

    def rand(n: int) -> list[int]:
        return torch.randint(3, 256, (n,), generator=g).tolist()

    shared = rand(SHARED)
    return {
        "r0": (shared + rand(33), SEEDED),
        "r1": (shared + rand(19), GREEDY),
        "r2": (rand(40), GREEDY),
        "r3": (shared + rand(13), GREEDY),
    }


REQUESTS = _prompts()
NEXT = ([7, 8, 9, 10, 11] * 5, GREEDY)  # the request that comes after the trouble


def make_engine(model: str, **overrides) -> Engine:
    # A GPU's prefill chunk (a CPU engine's default is 256, the floor an OOM halves it to).
    return tiny_engine(model, **{"num_pages": 96, "max_prefill_tokens": 2048, **overrides})


@dataclass
class Run:
    """What a run produced, request by request, and the engine's events."""

    out: dict[str, list[int]] = field(default_factory=dict)
    final: dict[str, object] = field(default_factory=dict)  # request id -> final TokenOutput
    events: list[object] = field(default_factory=list)
    steps: int = 0

    @property
    def ooms(self) -> list[OomEvent]:
        return [e for e in self.events if isinstance(e, OomEvent)]

    @property
    def replans(self) -> list[ReplanWanted]:
        return [e for e in self.events if isinstance(e, ReplanWanted)]


def radix_paths(radix) -> list[list[int]]:
    """The token run from the root to every node of the tree."""
    out, stack = [], [(radix.root, [])]
    while stack:
        node, prefix = stack.pop()
        path = prefix + list(node.key)
        if node is not radix.root:
            out.append(path)
        stack.extend((child, path) for child in node.children.values())
    return out


def check_pages(engine: Engine, committed: list[list[int]]) -> None:
    """Every page is free, in the prefix cache, or owned by one running request; the cache
    holds only prefixes of committed token runs; waiting requests hold nothing."""
    sched, radix, alloc = engine.scheduler, engine.radix, engine.allocator
    tree = radix.all_pages()
    own: list[int] = []
    for req in sched.running:
        cached = req.cached_len // engine.config.page_size
        assert set(req.pages[:cached]) <= tree, req.request_id
        own.extend(req.pages[cached:])
    assert len(own) == len(set(own)), "a page held twice"
    assert not (set(own) & tree), "a request's own page is also in the prefix cache"
    assert alloc.num_free + len(tree) + len(own) == alloc.num_usable, "pages leaked"
    for req in sched.waiting:
        assert req.pages == [] and req.kv_len == 0 and req.last_node is None, req.request_id
    for path in radix_paths(radix):
        assert any(seq[: len(path)] == path for seq in committed), (
            f"uncommitted tokens cached: {path}"
        )


def drive(
    engine: Engine, requests: dict, *, history: list | None = None, max_steps: int = 2000
) -> Run:
    """Add ``requests`` and step until the engine is idle, checking pages after every
    step. ``history`` collects the committed token runs of every request this engine
    has seen (prompt + outputs received), across calls."""
    history = [] if history is None else history
    run = Run()
    for rid, (ids, sp) in requests.items():
        engine.add_request(GenerateRequest(request_id=rid, prompt_token_ids=ids, sampling=sp))
        run.out[rid] = []
    mine = {rid: list(ids) for rid, (ids, _) in requests.items()}
    history.extend(mine.values())
    while engine.has_work():
        run.steps += 1
        assert run.steps <= max_steps, "the engine does not converge"
        tree_before = engine.radix.all_pages()
        for o in engine.step():
            run.out[o.request_id].extend(o.token_ids)
            mine[o.request_id].extend(o.token_ids)
            if o.finished:
                run.final[o.request_id] = o
        events = engine.drain_events()
        run.events.extend(events)
        actions = {e.action for e in events if isinstance(e, OomEvent)}
        if actions and actions <= {"retry", "retry_smaller_chunk"}:
            # A plain rolled-back step: nothing of it may enter the prefix cache.
            assert engine.radix.all_pages() <= tree_before
        check_pages(engine, history)
    assert set(run.final) == set(requests)
    return run


@pytest.fixture(scope="module")
def reference(tiny_dir) -> dict[str, list[int]]:
    """Fault-free outputs of the four requests together, and of NEXT."""
    engine = make_engine(tiny_dir)
    history: list[list[int]] = []
    run = drive(engine, REQUESTS, history=history)
    nxt = drive(engine, {"next": NEXT}, history=history)
    assert not run.events and not nxt.events
    return {**run.out, "next": nxt.out["next"]}


def assert_all_pages_back(engine: Engine) -> None:
    """Nothing runs: every page is free or evictable in the cache, and all free once the
    cache is cleared."""
    alloc, radix = engine.allocator, engine.radix
    assert not engine.has_work()
    assert alloc.num_free + radix.evictable_pages() == alloc.num_usable
    radix.clear()
    assert alloc.num_free == alloc.num_usable


def deepest_cached(radix, tokens: list[int]) -> int:
    """How many leading tokens of ``tokens`` the tree holds (read-only walk)."""
    node, pos, ps = radix.root, 0, radix.page_size
    while True:
        child = node.children.get(tuple(tokens[pos : pos + ps]))
        if child is None:
            return pos
        n = 0
        while n < len(child.key) and pos + n < len(tokens) and child.key[n] == tokens[pos + n]:
            n += 1
        pos += n - n % ps
        if n < len(child.key):
            return pos
        node = child


# -- transient faults: the victim succeeds -------------------------------------------------


@pytest.mark.parametrize("times", [1, 2])
@pytest.mark.parametrize("victim", ["r0", "r3"])
@pytest.mark.parametrize("site", SITES)
def test_transient_oom_is_retried_and_changes_no_output(tiny_dir, reference, site, victim, times):
    engine = make_engine(tiny_dir)
    engine.faults.add(site, victim, times)
    run = drive(engine, REQUESTS)
    assert engine.faults.pending == 0, "the fault never fired"
    assert len(run.ooms) == times
    assert all(o.finish_reason == "length" for o in run.final.values())
    assert run.out == {rid: reference[rid] for rid in REQUESTS}
    assert engine.stats().failed == 0
    assert engine.scheduler.max_prefill_tokens < engine.knobs.max_prefill_tokens
    assert run.replans[-1].new_max_prefill_tokens == engine.scheduler.max_prefill_tokens
    assert_all_pages_back(engine)


# -- persistent faults: the victim fails alone ---------------------------------------------


@pytest.mark.parametrize("victim", ["r0", "r3"])
@pytest.mark.parametrize("site", SITES)
def test_persistent_oom_fails_the_victim_alone(tiny_dir, reference, site, victim):
    engine = make_engine(tiny_dir)
    engine.faults.add(site, victim, times=1000)
    history: list[list[int]] = []
    run = drive(engine, REQUESTS, history=history)

    # The victim ends with out_of_memory and a message that gives the sizes.
    final = run.final[victim]
    assert (final.finished, final.finish_reason, final.error_code) == (
        True,
        "error",
        "out_of_memory",
    )
    assert "does not fit even with no other request" in final.error_message
    if site == "prefill":
        assert re.search(r"a prefill chunk of 1[0-6] tokens \(chunk cap 16\b", final.error_message)
    # Everybody else: as if nothing had happened.
    for rid in REQUESTS:
        if rid != victim:
            assert run.final[rid].finish_reason == "length", rid
            assert run.out[rid] == reference[rid], rid
    assert engine.stats().failed == 1

    # The events tell the story: the victim failed last, after the cheaper remedies.
    actions = [(e.request_id, e.action) for e in run.ooms]
    assert actions[-1] == (victim, "failed")
    assert sum(a == "failed" for _, a in actions) == 1
    assert {e.phase for e in run.ooms} <= (
        {"prefill", "decode"} if site != "sample" else {"sample"}
    )
    if site == "decode":
        first_preempt = next(i for i, (_, a) in enumerate(actions) if a == "preempted")
        assert actions[first_preempt][0] == "r3"  # the youngest goes first
        assert first_preempt < len(actions) - 1
    # The engine-wide chunk cap came down to its floor, and a replan was asked for.
    assert engine.scheduler.max_prefill_tokens == 256
    assert run.replans and run.replans[-1].new_max_prefill_tokens == 256
    assert "out of memory" in run.replans[-1].reason

    # Nothing of the victim's failed steps is cached: at most what r1 shares with it
    # (the decode victim had committed its prompt before its decode failed).
    ids = REQUESTS[victim][0]
    if site == "decode":
        assert deepest_cached(engine.radix, ids) >= len(ids) // PAGE_SIZE * PAGE_SIZE
    else:
        assert deepest_cached(engine.radix, ids) == SHARED

    # The engine is still good: the next request succeeds, and every page comes back.
    nxt = drive(engine, {"next": NEXT}, history=history)
    assert nxt.final["next"].finish_reason == "length"
    assert nxt.out["next"] == reference["next"]
    assert_all_pages_back(engine)


def test_oom_raised_inside_the_forward_is_rolled_back(tiny_dir, reference):
    """A real OOM strikes mid-forward, after some layers wrote their keys and values."""
    engine = make_engine(tiny_dir)
    forward = engine.attn.forward
    calls = {"n": 0}

    def flaky(q, k, v, layer, batch, **kwargs):
        calls["n"] += 1
        if calls["n"] in (2, 7):  # the second layer of step 1; a layer of a later step
            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 ..."
            )
        return forward(q, k, v, layer, batch, **kwargs)

    engine.attn.forward = flaky
    run = drive(engine, REQUESTS)
    assert len(run.ooms) == 2
    assert run.ooms[0].message.endswith("retrying with chunks of at most 20 tokens")
    assert "Tried to allocate 20.00 MiB" in run.ooms[0].message
    assert run.out == {rid: reference[rid] for rid in REQUESTS}
    assert_all_pages_back(engine)


def test_faults_from_the_environment(tiny_dir, reference, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "prefill:r1:1,sample:*:1,decode:r2:1")
    engine = make_engine(tiny_dir)
    assert engine.faults.pending == 3
    run = drive(engine, REQUESTS)
    assert engine.faults.pending == 0
    assert [site for site, _ in engine.faults.fired] == ["prefill", "sample", "decode"]
    assert run.out == {rid: reference[rid] for rid in REQUESTS}

    monkeypatch.setenv(ENV_VAR, "explode:r1:1")
    with pytest.raises(ValueError, match=ENV_VAR):
        make_engine(tiny_dir)


def test_c01_default_model_first_request_ooms_next_one_answers(default_model_dir, tokenizer_ids):
    """A first request too long for memory, with the real default model: the first, long request cannot get its prefill
    through and fails fast with out_of_memory; the next, small one answers as it did
    before the trouble."""
    long_ids, short_ids = tokenizer_ids
    sp = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    engine = Engine(EngineConfig(model=default_model_dir, device="cpu", kv_cache=64 << 20, min_context=256))
    history: list[list[int]] = []
    before = drive(engine, {"hello": (short_ids, sp)}, history=history)
    engine.radix.clear()
    engine.faults.add("prefill", "first", times=1000)
    run = drive(engine, {"first": (long_ids, sp)}, history=history)
    assert run.final["first"].error_code == "out_of_memory"
    assert run.steps <= 16, "fails fast"
    assert deepest_cached(engine.radix, long_ids) == 0
    after = drive(engine, {"hello": (short_ids, sp)}, history=history)
    assert after.final["hello"].finish_reason == "length"
    assert after.out == before.out
    assert_all_pages_back(engine)


@pytest.fixture(scope="module")
def tokenizer_ids(default_model_dir):
    from engine.text.chat import encode_chat
    from engine.text.tokenizer import load_tokenizer

    tok = load_tokenizer(default_model_dir)
    long_ids = encode_chat(
        tok, [{"role": "user", "content": "Summarize this. " + "The cat sat on the mat. " * 40}]
    )
    short_ids = encode_chat(tok, [{"role": "user", "content": "Say hello."}])
    return long_ids, short_ids


# -- the worker process lives on -----------------------------------------------------------


def test_worker_process_survives_a_persistent_oom(tiny_dir, reference, monkeypatch):
    from engine.wire.ipc import (
        Heartbeat,
        Outputs,
        Ready,
        Shutdown,
        StatsRequest,
        WorkerConfig,
        WorkerError,
        encode,
        from_worker_decoder,
    )
    from engine.worker.process import worker_main

    monkeypatch.setenv(ENV_VAR, "prefill:r3:1000")  # a spawned child inherits os.environ
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    config = WorkerConfig(
        engine=EngineConfig(model=tiny_dir, device="cpu", page_size=PAGE_SIZE, num_pages=96),
        parent_pid=os.getpid(),
        heartbeat_interval_s=0.2,
    )
    proc = ctx.Process(target=worker_main, args=(theirs, config, None), daemon=True)
    proc.start()
    theirs.close()
    try:

        def receive(timeout: float = 120.0):
            assert ours.poll(timeout), "the worker went quiet"
            return from_worker_decoder.decode(ours.recv_bytes())

        while not isinstance(msg := receive(), Ready):
            assert not isinstance(msg, WorkerError), msg
        out: dict[str, list[int]] = {}
        final = {}

        def run_until_done(rids):
            deadline = time.monotonic() + 120
            while not set(rids) <= set(final):
                assert time.monotonic() < deadline
                msg = receive()
                if isinstance(msg, Outputs):
                    for o in msg.outputs:
                        out.setdefault(o.request_id, []).extend(o.token_ids)
                        if o.finished:
                            final[o.request_id] = o

        for rid, (ids, sp) in REQUESTS.items():
            ours.send_bytes(
                encode(GenerateRequest(request_id=rid, prompt_token_ids=ids, sampling=sp))
            )
        run_until_done(REQUESTS)
        assert final["r3"].error_code == "out_of_memory"
        for rid in ("r0", "r1", "r2"):
            assert out[rid] == reference[rid]
        ours.send_bytes(
            encode(GenerateRequest(request_id="next", prompt_token_ids=NEXT[0], sampling=NEXT[1]))
        )
        run_until_done(["next"])
        assert out["next"] == reference["next"]
        assert proc.is_alive()
        ours.send_bytes(encode(StatsRequest(seq=9)))
        while not (isinstance(msg := receive(), Heartbeat) and msg.seq == 9):
            pass
        assert msg.stats.failed == 1 and msg.stats.running == 0
        ours.send_bytes(encode(Shutdown()))
        proc.join(30)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(5)
