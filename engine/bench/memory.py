"""``headroom bench memory``: the plan's predicted peak against the measured one, and
the KV pool's share of the budget.

On a CUDA device the engine starts under an allocator cap equal to the planned device
size (``--device-limit``), runs a workload that reaches the plan's worst step (B-1 long
requests decoding while one long prompt is prefilled in max-size chunks) and compares
the caching allocator's peak reservation and NVML's view of the process with the plan.
Without CUDA it prints the plan of a simulated card (no measurement).
"""

from __future__ import annotations

import tempfile
import time

import torch

from engine.bench.model_shapes import write_shape
from engine.common.config import EngineConfig
from engine.common.units import GiB
from engine.core.engine import Engine
from engine.memory.plan import MemoryPlan
from engine.wire.messages import GenerateRequest, SamplingParams


def kv_share(plan: MemoryPlan) -> float:
    """KV pool / (budget - weights): the share of what the model leaves that holds KV."""
    weights = sum(e.bytes for e in plan.ledger if e.name in ("weights", "routed expert weights"))
    return plan.kv_pool_bytes / max(plan.budget_bytes - weights, 1)


def predicted_allocator_bytes(plan: MemoryPlan) -> int:
    """What the plan says the caching allocator will hold at the worst step: every
    charged line but the CUDA context, which lives outside the allocator."""
    runtime = next(e.bytes for e in plan.ledger if e.name == "CUDA context and runtime")
    return plan.fixed_bytes - runtime + plan.kv_pool_bytes


def worst_step_workload(engine: Engine) -> None:
    """Reach the profile's worst step for real: ``B - 1`` requests decoding at long
    contexts while one prompt near the context limit is prefilled in full chunks.

    The long requests generate enough tokens to outlast every prefill step (theirs and
    the long prompt's): one that finished early would leave the step smaller than the
    worst, and the wait for all ``B - 1`` to decode would never end.

    Raises:
        RuntimeError: the engine ran out of work before the ``B - 1`` requests decoded.
    """
    b = engine.knobs.max_running_requests
    ctx = engine.max_context_tokens
    chunk = engine.knobs.max_prefill_tokens
    per_req = min(ctx, (engine.allocator.num_usable * engine.config.page_size) // b) - 64
    # Steps until the long prompt's last chunk: all prompts, chunk by chunk, each step's
    # token budget shared with the decode rows.
    prefill_steps = -(-b * per_req // max(chunk - b, 1))
    long_new = prefill_steps + 16
    vocab = engine.vocab_size
    g = torch.Generator().manual_seed(0)
    sp = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)
    sp_long = SamplingParams(max_new_tokens=long_new, temperature=0.0, ignore_eos=True)
    for i in range(b - 1):
        ids = torch.randint(10, vocab, (max(per_req - long_new - 8, 1),), generator=g).tolist()
        engine.add_request(GenerateRequest(request_id=f"long-{i}", prompt_token_ids=ids, sampling=sp_long))
    while len([r for r in engine.scheduler.running if r.output_ids]) < b - 1:
        if not engine.has_work():
            raise RuntimeError("the long requests finished before all of them were decoding together")
        engine.step()
    ids = torch.randint(10, vocab, (per_req,), generator=g).tolist()
    engine.add_request(GenerateRequest(request_id="chunked", prompt_token_ids=ids, sampling=sp))
    while engine.has_work():
        engine.step()


def measure(shape: str | None, *, device_limit_bytes: int, max_model_len: int, max_running: int,
            max_prefill_tokens: int) -> dict:
    """Start an engine on ``shape`` (random weights) capped at ``device_limit_bytes`` and
    report predicted vs measured peaks."""
    with tempfile.TemporaryDirectory() as tmp:
        model = str(write_shape(shape, tmp)) if shape else None
        total = torch.cuda.get_device_properties(0).total_memory
        # The allocator stops where the card would: the limit minus the CUDA context.
        torch.cuda.init()
        free, _ = torch.cuda.mem_get_info()
        context = total - free - torch.cuda.memory_reserved()
        torch.cuda.set_per_process_memory_fraction(min((device_limit_bytes - context) / total, 1.0))
        started = time.perf_counter()
        engine = Engine(EngineConfig(
            model=model, load_format="dummy" if shape else "auto", device_limit=device_limit_bytes,
            reserve=0, max_model_len=max_model_len, max_running_requests=max_running,
            max_prefill_tokens=max_prefill_tokens,
        ))
        plan = engine.plan
        assert plan is not None
        ready_s = time.perf_counter() - started
        # The plan's lines: what is not KV cache, and where each figure comes from.
        print(f"plan of {shape or 'the default model'} at {device_limit_bytes / GiB:.1f} GiB "
              f"(engine ready in {ready_s:.1f} s):\n{plan.table()}", flush=True)
        torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        worst_step_workload(engine)
        print(f"worst-step workload: {time.perf_counter() - started:.1f} s", flush=True)
        measured = torch.cuda.max_memory_reserved()
        allocated = torch.cuda.max_memory_allocated()
        predicted = predicted_allocator_bytes(plan)
        from engine.memory.device import probe_nvml

        snap = probe_nvml(0)
        row = {
            "model": shape or "default (SmolLM2-135M)",
            "device_limit_gib": device_limit_bytes / GiB,
            "predicted_gib": predicted / GiB,
            "measured_gib": measured / GiB,
            "allocated_gib": allocated / GiB,
            "error_pct": 100 * (measured - predicted) / predicted,
            "kv_share_pct": 100 * kv_share(plan),
            "kv_pool_gib": plan.kv_pool_bytes / GiB,
            "nvml_process_gib": (snap.total_bytes - snap.free_bytes) / GiB if snap else float("nan"),
        }
        del engine
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(1.0)
        return row


def _measure_case(case: tuple[str | None, int, int, int, int]) -> dict:
    s, d, m, r, p = case
    return measure(s, device_limit_bytes=d, max_model_len=m, max_running=r, max_prefill_tokens=p)


def run_bench_memory(cases: list[tuple[str | None, int, int, int, int]]) -> list[dict]:
    """Each case: (shape or None for the default model, device limit bytes, max model
    len, max running requests, max prefill tokens). Prints a table."""
    import multiprocessing as mp

    # One fresh process per case: NVML's view and the allocator start clean each time.
    ctx = mp.get_context("spawn")
    rows = []
    for case in cases:
        with ctx.Pool(1) as pool:
            rows.append(pool.apply(_measure_case, (case,)))
    print(f"{'model':<24} {'limit GiB':>9} {'predicted GiB':>13} {'measured GiB':>12} {'alloc GiB':>9} {'error %':>8} "
          f"{'KV share %':>10} {'KV GiB':>7} {'NVML GiB':>8}")
    for r in rows:
        print(f"{r['model']:<24} {r['device_limit_gib']:>9.1f} {r['predicted_gib']:>13.3f} {r['measured_gib']:>12.3f} "
              f"{r['allocated_gib']:>9.3f} {r['error_pct']:>8.2f} {r['kv_share_pct']:>10.1f} {r['kv_pool_gib']:>7.2f} {r['nvml_process_gib']:>8.2f}")
    return rows
