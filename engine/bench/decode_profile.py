"""Where a decode step's time goes on CUDA, for ``headroom bench engine --profile``: the
step's host parts, the graph replay alone, and the kernels inside the replay (torch
profiler), by kernel and by kind (:data:`KERNEL_KINDS`)."""

from __future__ import annotations

import time

import torch

from engine.core.engine import Engine
from engine.wire.messages import GenerateRequest, SamplingParams


def sync_device(device: torch.device) -> None:
    """Wait for ``device``'s queued work (CUDA); nothing elsewhere."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# Kernel kinds of a decode replay, by the first pattern a kernel's name contains.
KERNEL_KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("_decode_kernel", "_merge_kernel", "BatchDecode", "flashinfer", "VariableLengthMerge",
                   "MergeStates")),
    ("GEMM (cuBLAS / gemv)", ("nvjet", "gemm", "gemv", "cutlass", "xmma", "splitKreduce", "Kernel2")),
    ("residual add + RMSNorm", ("rms_norm",)),
    ("q/k norm + rotary + KV store", ("rotary", "norm_rotate")),
    ("SiLU-and-mul", ("silu",)),
)


def kernel_kind(name: str) -> str:
    """The kind of a profiled kernel (:data:`KERNEL_KINDS`), ``"other"`` when none fits."""
    low = name.lower()
    for kind, patterns in KERNEL_KINDS:
        if any(p.lower() in low for p in patterns):
            return kind
    return "other"


def profile_decode(engine: Engine, batch: int = 1, replays: int = 10, top: int = 25) -> None:
    """Where a decode step's time goes at ``batch`` (CUDA, graphs on): the step's host
    parts, the graph replay alone, and the kernels inside the replay (torch profiler),
    by kernel and by kind, printed. For explaining a figure, not for tests."""
    from torch.profiler import ProfilerActivity, profile

    graphs = engine.runner.graphs
    if graphs is None:
        print("profile: needs CUDA graphs (a CUDA device, a backend that captures)")
        return
    sp = SamplingParams(max_new_tokens=10_000, temperature=0.0, ignore_eos=True)
    vocab = engine.vocab_size
    for i in range(batch):
        ids = [(10 + 31 * i + j) % vocab for j in range(128)]
        engine.add_request(GenerateRequest(request_id=f"profile-{i}", prompt_token_ids=ids, sampling=sp))
    for _ in range(8):  # prefill, then a few decode steps
        engine.step()
    graph = graphs.graph_for(batch)
    if graph is None:
        print(f"profile: no graph captured for batch {batch}")
        return
    sync_device(engine.device)
    t0 = time.perf_counter()
    for _ in range(100):
        graph.replay()
    sync_device(engine.device)
    replay_ms = (time.perf_counter() - t0) * 10
    t0 = time.perf_counter()
    for _ in range(100):
        engine.step()
    sync_device(engine.device)
    step_ms = (time.perf_counter() - t0) * 10
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        sync_device(engine.device)
    rows = []
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        rows.append((t / replays, ev.count / replays, ev.key))
    rows.sort(reverse=True)
    print(f"profile at batch {batch}: step {step_ms:.3f} ms, graph replay alone {replay_ms:.3f} ms "
          f"(host and sampling: the rest); {sum(r[1] for r in rows):.0f} kernels and "
          f"{sum(r[0] for r in rows) / 1e3:.3f} ms of kernel time per replay")
    for t, count, name in rows[:top]:
        print(f"  {t:8.1f} us {count:5.0f}x  {name[:100]}")
    kinds: dict[str, list[float]] = {}
    for t, count, name in rows:
        acc = kinds.setdefault(kernel_kind(name), [0.0, 0.0])
        acc[0] += t
        acc[1] += count
    print(f"profile at batch {batch}, by kind (per replay):")
    for kind, (t, count) in sorted(kinds.items(), key=lambda kv: -kv[1][0]):
        print(f"  {t:8.1f} us {count:5.0f}x  {kind}")
    for i in range(batch):
        engine.abort(f"profile-{i}")
    engine.step()
