"""``headroom bench engine``: prefill and decode speed of the engine against
transformers' ``generate`` on the same model, device and dtype, in one run (or against
llama.cpp's benchmarks on the same GGUF file and cores: :mod:`engine.bench.llama_cpp`).

Prompts are random token ids of one length (no padding on either side), outputs are
greedy with EOS ignored, so both sides do exactly the same work. Besides the batch
sizes, one long prompt (8k tokens, or the model's context if shorter) measures prefill.

On CUDA each figure is also given as a share of the HBM roofline: the tokens/s the step
would reach if it did nothing but read its bytes at the device's measured copy
bandwidth. Bytes per step: every weight once, plus the KV cache the step reads (decode:
each sequence's whole context at the mid-point of generation; prefill: the context up
to each chunk). Bandwidth: a device-to-device copy of 1 GiB, counted as bytes read plus
bytes written per second. Prefill is compute-bound, so its share is small by nature;
decode at small batch is bandwidth-bound and its share says how close to the hardware
the step loop runs.
"""

from __future__ import annotations

import dataclasses
import gc
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.bench.decode_profile import profile_decode, sync_device
from engine.bench.model_shapes import write_shape
from engine.common.config import EngineConfig
from engine.core.engine import Engine
from engine.core.footprint import kv_bytes_per_token
from engine.wire.messages import GenerateRequest, SamplingParams
from engine.worker.cpu_threads import fit_between_steps
from kernels.switches import KernelSwitches

LONG_PREFILL_TOKENS = 8192


@dataclass(frozen=True)
class Speed:
    """Tokens per second: ``prefill`` (prompt tokens / time to every first token) and
    ``decode`` (tokens after the first / the time after the first)."""

    prefill_tok_s: float
    decode_tok_s: float


def engine_speed(engine: Engine, prompts: list[list[int]], new_tokens: int,
                 between_steps: Callable[[], None] = lambda: None) -> Speed:
    """Run ``prompts`` together through ``engine``; the prefix cache is cleared first so
    the prompts are computed, not looked up. ``between_steps`` runs before each step (the
    CPU's thread fitting, as in the worker's loop)."""
    if engine.radix is not None:
        engine.radix.clear()
    sp = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(GenerateRequest(request_id=f"bench-{i}", prompt_token_ids=ids, sampling=sp))
    sync_device(engine.device)
    t0 = time.perf_counter()
    first: set[str] = set()
    t_first = None
    while engine.has_work():
        between_steps()
        for out in engine.step():
            if out.token_ids:
                first.add(out.request_id)
        if t_first is None and len(first) == len(prompts):
            sync_device(engine.device)
            t_first = time.perf_counter()
    sync_device(engine.device)
    t_end = time.perf_counter()
    assert t_first is not None
    prompt_tokens = sum(len(p) for p in prompts)
    return Speed(prompt_tokens / (t_first - t0), len(prompts) * (new_tokens - 1) / max(t_end - t_first, 1e-9))


def transformers_speed(model, prompts: list[list[int]], new_tokens: int, device: torch.device) -> Speed:
    """The same work through ``model.generate`` (static batch, its own KV cache)."""
    ids = torch.tensor(prompts, device=device)
    mask = torch.ones_like(ids)
    kw = dict(attention_mask=mask, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        sync_device(device)
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        sync_device(device)
        t1 = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
        sync_device(device)
        t2 = time.perf_counter()
    prefill_s = t1 - t0
    decode_s = max((t2 - t1) - prefill_s, 1e-9)
    return Speed(ids.numel() / prefill_s, len(prompts) * (new_tokens - 1) / decode_s)


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + bytes written), from
    ``repeats`` copies of ``nbytes`` timed with CUDA events."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        dst.copy_(src)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1000
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes * repeats / seconds


@dataclass(frozen=True)
class Roofline:
    """Tokens/s at the HBM roofline (see the module docstring) for one measured case."""

    weight_bytes: int
    kv_bytes_per_token: int
    bandwidth: float  # bytes/s

    def decode(self, batch: int, context: int) -> float:
        """Decode tokens/s if a step of ``batch`` sequences of ``context`` tokens only read
        its bytes."""
        step_bytes = self.weight_bytes + batch * context * self.kv_bytes_per_token
        return batch * self.bandwidth / step_bytes

    def prefill(self, tokens: int, chunk: int, num_seqs: int) -> float:
        """Prefill tokens/s for ``tokens`` prompt tokens over ``num_seqs`` sequences run in
        steps of ``chunk`` tokens: each step reads every weight and the context so far."""
        steps = max(-(-tokens // chunk), 1)
        per_seq = tokens // max(num_seqs, 1)
        # Causal prefill reads on average half of each sequence's context per token block.
        kv = num_seqs * per_seq * self.kv_bytes_per_token * (steps + 1) / 2
        return tokens * self.bandwidth / (steps * self.weight_bytes + kv)


def _shape_folder(shape: str) -> str:
    """A folder holding only ``config.json`` of a shape of :mod:`engine.bench.model_shapes`
    (random weights: ``load_format="dummy"``)."""
    folder = tempfile.mkdtemp(prefix=f"headroom-bench-{shape}-")
    write_shape(shape, folder)
    return folder


def _hf_model(engine: Engine, shape: str | None):
    from transformers import AutoConfig, AutoModelForCausalLM

    if shape is None:
        from engine.loader.gguf_convert import ensure_gguf_weights

        ensure_gguf_weights(engine.model_dir)  # a GGUF's conversion holds no float weights until read
        hf = AutoModelForCausalLM.from_pretrained(engine.model_dir, dtype=engine.dtype)
    else:
        with torch.device(engine.device):
            hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(engine.model_dir), dtype=engine.dtype)
    return hf.to(engine.device).eval()


def run_bench_engine(
    *, model: str | None, device: str, batches: tuple[int, ...], prompt_tokens: int, new_tokens: int, seed: int = 0,
    shape: str | None = None, attention_backend: str = "auto", cuda_graphs: bool = True,
    long_prefill_tokens: int = LONG_PREFILL_TOKENS, transformers_side: bool = True, profile: bool = False,
    profile_batches: tuple[int, ...] = (1,), gguf_quantized: bool | None = None,
    kernel_switches: KernelSwitches | None = None, against_llama_cpp: str | None = None,
    kv_cache_dtype: str = "auto", device_limit: int | None = None, cpu_layers: str = "auto",
) -> list[dict]:
    """Measure both sides at each batch size and on one long prompt; returns one row per
    (case, side) and prints a table. Each side runs once untimed first (warm-up).

    Args:
        shape: a name of :data:`engine.bench.model_shapes.SHAPES` to bench with random
            weights instead of ``model``.
        long_prefill_tokens: the long prompt's length (capped by the model's context; 0
            skips it).
        transformers_side: also run transformers' ``generate`` (the comparison).
        profile: afterwards, print where a decode step's time goes at each of
            ``profile_batches`` (:func:`profile_decode`).
        gguf_quantized: the engine keeps a GGUF ``model``'s projections quantized
            (``--gguf-quantized``).
        kernel_switches: the engine's kernel switches (``--quant-int8``, ...; the
            defaults when None).
        against_llama_cpp: the folder of llama.cpp's ``llama-bench`` and
            ``llama-batched-bench``: they are the comparison instead of transformers, on
            the same GGUF file (``model``, or the embedded model's), threads and cores
            (:mod:`engine.bench.llama_cpp`).
        kv_cache_dtype: the engine's ``--kv-cache-dtype`` (against llama.cpp, whose side
            runs its default f16 cache: ``f16``, the same bytes, or ``auto``).
        device_limit: plan as on a GPU of this many bytes (``--device-limit``).
        cpu_layers: the engine's ``--cpu-layers`` (a dense model's last layers on the
            CPU). On CUDA llama.cpp's side offloads as many layers as the engine keeps on
            the GPU (``-ngl``), every one when the engine is not split.

    Raises:
        ValueError: ``against_llama_cpp`` without its tools, with a model that is not
            a GGUF file, with a ``kv_cache_dtype`` other than ``auto`` or ``f16``, or with
            ``batches`` its tools cannot run (:meth:`LlamaCppTools.check_batches`);
            ``prompt_tokens + new_tokens`` over the model's context
            (:func:`check_request_length`).

    The engine runs every case before transformers is loaded, so the table ends with the
    engine's own peak resident memory (``peak_rss_mib`` in its rows: the process's peak
    after that case, load included; the KV cache a case fills is ``kv_mib``), then the
    process's peak with transformers' model too.
    """
    if against_llama_cpp is not None and kv_cache_dtype not in ("auto", "f16"):
        raise ValueError(f"--against-llama-cpp compares llama.cpp's default KV cache (f16): run it with "
                         f"--kv-cache-dtype f16 (the same bytes) or auto, not {kv_cache_dtype}")
    llama_cpp = None if against_llama_cpp is None else _llama_cpp_side(against_llama_cpp, model, shape)
    if llama_cpp is not None:
        llama_cpp[0].check_batches(batches)
    if llama_cpp is not None:
        model = str(llama_cpp[1])  # the very file llama.cpp reads
    if shape is not None:
        model = _shape_folder(shape)
    check_request_length(model, prompt_tokens, new_tokens)
    engine = Engine(EngineConfig(
        model=model, device=device, load_format="dummy" if shape is not None else "auto",
        attention_backend=attention_backend, cuda_graphs=cuda_graphs,
        max_running_requests=max(64, *batches), gguf_quantized=gguf_quantized, kv_cache_dtype=kv_cache_dtype,
        device_limit=device_limit, cpu_layers=cpu_layers,
        **dataclasses.asdict(kernel_switches or KernelSwitches()),
    ))
    on_cuda = engine.device.type == "cuda"
    # The engine side fits its CPU threads to the free cores between steps, as the worker does
    # on any device (a busy core stalls every step; a split's CPU layers took torch's default
    # count, not the cores served); transformers gets what is set.
    between_steps = fit_between_steps(engine.config.cpu_threads)
    roof = None
    kv_per_token = kv_bytes_per_token(engine.model_config, engine.kv_dtype)
    if on_cuda:
        roof = Roofline(engine.info.weight_bytes, kv_per_token, copy_bandwidth(engine.device))
    g = torch.Generator().manual_seed(seed)
    vocab = engine.vocab_size
    chunk = engine.knobs.max_prefill_tokens
    cases = [(b, prompt_tokens, new_tokens) for b in batches]
    # The long prompt also decodes a few tokens: decode speed at a long context.
    long_new = 16
    long_len = min(long_prefill_tokens, engine.max_context_tokens - long_new - 1)
    if long_prefill_tokens > 0 and long_len > prompt_tokens:
        cases.append((1, long_len, long_new))
    prompts = {case: [torch.randint(10, vocab, (case[1],), generator=g).tolist() for _ in range(case[0])]
               for case in cases}
    ours: dict[tuple, tuple[Speed, int]] = {}
    for case in cases:
        _, _, ntok = case
        engine_speed(engine, prompts[case], min(4, ntok))  # warm-up
        ours[case] = engine_speed(engine, prompts[case], ntok, between_steps), peak_rss_bytes()
    engine_peak = peak_rss_bytes()
    setting = _setting(engine, prompt_tokens, new_tokens)
    if profile and on_cuda:
        for b in profile_batches:
            profile_decode(engine, batch=b)
    theirs: dict[tuple, Speed] = {}
    their_side = "transformers" if llama_cpp is None else "llama.cpp"
    if llama_cpp is not None:
        tools, gguf = llama_cpp
        if on_cuda:  # as many layers on the GPU as the engine side keeps there
            layers, cpu_layers = engine.model_config.num_layers, engine.cpu_layers
            tools = tools.offloading(layers, cpu_layers)
            if cpu_layers:
                print(f"split: the last {cpu_layers} of {layers} decoder layers on the CPU; llama.cpp -ngl "
                      f"{tools.gpu_layers} (as many layers and the output layer on the GPU)")
            # llama.cpp gets the card the engine held (its KV cache for 64 sequences did not fit beside it).
            del engine
            gc.collect()
            torch.cuda.empty_cache()
        for b, plen, ntok in cases:
            prefill, decode = tools.speed(gguf, b, plen, ntok)
            theirs[(b, plen, ntok)] = Speed(prefill, float("nan") if decode is None else decode)
    elif transformers_side:
        hf = _hf_model(engine, shape)
        for case in cases:
            _, _, ntok = case
            transformers_speed(hf, prompts[case], min(4, ntok), engine.device)  # warm-up
            theirs[case] = transformers_speed(hf, prompts[case], ntok, engine.device)
    rows = []
    for case in cases:
        b, plen, ntok = case
        label = f"{b}x{plen}"
        speed, peak = ours[case]
        row = {"case": label, "batch": b, "prompt_tokens": plen, "side": "headroom",
               "prefill_tok_s": speed.prefill_tok_s, "decode_tok_s": speed.decode_tok_s,
               "peak_rss_mib": peak / 2**20, "kv_mib": b * (plen + ntok) * kv_per_token / 2**20}
        sides = [(row, speed)]
        if case in theirs:
            sides.append(({"case": label, "batch": b, "prompt_tokens": plen, "side": their_side,
                           "prefill_tok_s": theirs[case].prefill_tok_s, "decode_tok_s": theirs[case].decode_tok_s},
                          theirs[case]))
        for r, sp in sides:
            if roof is not None:
                r["prefill_roofline_share"] = sp.prefill_tok_s / roof.prefill(b * plen, chunk, b)
                r["decode_roofline_share"] = sp.decode_tok_s / roof.decode(b, plen + ntok // 2)
            rows.append(r)
        if case in theirs:
            rows.append({"case": label, "batch": b, "prompt_tokens": plen, "side": "ratio",
                         "prefill_tok_s": speed.prefill_tok_s / theirs[case].prefill_tok_s,
                         "decode_tok_s": speed.decode_tok_s / theirs[case].decode_tok_s})
    _print_table(setting, rows, roof)
    print(f"peak RSS of the engine alone: {engine_peak / 2**20:.0f} MiB (load and every case, before "
          f"transformers is loaded; each case's KV cache in its row)")
    if transformers_side and llama_cpp is None:
        print(f"peak RSS with transformers' model too: {peak_rss_bytes() / 2**20:.0f} MiB (the same process)")
    return rows


def check_request_length(model: str | None, prompt_tokens: int, new_tokens: int) -> None:
    """Refuse, before the model loads, requests of ``prompt_tokens + new_tokens`` tokens
    that ``model``'s context (``max_position_embeddings``, tokens) cannot hold.

    Raises:
        ValueError: the sum is over the context; the message names it and the flags.
        ModelLoadError: ``model`` has no readable config.
    """
    from engine.loader.hf_config import load_model_config
    from engine.loader.resolve import resolve_model

    mc = load_model_config(resolve_model(model))
    context, total = mc.max_position_embeddings, prompt_tokens + new_tokens
    if total > context:
        raise ValueError(f"--prompt-tokens {prompt_tokens} + --new-tokens {new_tokens} = {total} tokens per request, "
                         f"more than {mc.architecture}'s context of {context} tokens: lower --prompt-tokens or "
                         f"--new-tokens so that they add up to at most {context}")


def _llama_cpp_side(path: str, model: str | None, shape: str | None):
    """llama.cpp's tools at ``path`` and the GGUF file both sides run (``model``, or the
    embedded model's file)."""
    from pathlib import Path

    from engine.bench.llama_cpp import LlamaCppTools
    from engine.loader.default_model import default_gguf_path

    if shape is not None:
        raise ValueError("--against-llama-cpp runs llama.cpp on a GGUF file: give --model FILE.gguf, not --shape")
    gguf = default_gguf_path() if model is None else Path(model)
    if gguf.suffix != ".gguf" or not gguf.is_file():
        raise ValueError(f"--against-llama-cpp runs llama.cpp on the same GGUF file: {model} is not one")
    return LlamaCppTools.find(path), gguf


def peak_rss_bytes() -> int:
    """The process's peak resident set size in bytes (``getrusage``'s ``ru_maxrss``, in
    KiB on Linux)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _setting(engine: Engine, prompt_tokens: int, new_tokens: int) -> str:
    info = engine.info
    return (f"model {info.model_name} on {info.device} ({info.dtype}), attention {engine.attention_backend}, KV cache "
            f"{info.kv_cache_dtype}, CUDA graphs {'on' if engine.runner.graphs is not None else 'off'}; "
            f"prompt {prompt_tokens} tokens, {new_tokens} new tokens, greedy")


def _print_table(setting: str, rows: list[dict], roof: Roofline | None) -> None:
    print(setting)
    if roof is not None:
        print(f"HBM roofline: {roof.bandwidth / 1e12:.2f} TB/s measured copy bandwidth, "
              f"{roof.weight_bytes / 2**20:.1f} MiB of weights, {roof.kv_bytes_per_token} KV bytes per token")
    head = f"{'case':>10}  {'side':<12} {'prefill tok/s':>14} {'decode tok/s':>13} {'peak RSS MiB':>12} {'KV MiB':>7}"
    if roof is not None:
        head += f" {'prefill % roof':>14} {'decode % roof':>13}"
    print(head)
    for r in rows:
        if r["side"] == "ratio":
            line = f"{r['case']:>10}  {r['side']:<12} {r['prefill_tok_s']:>13.2f}x {r['decode_tok_s']:>12.2f}x"
        else:
            line = f"{r['case']:>10}  {r['side']:<12} {r['prefill_tok_s']:>14.1f} {r['decode_tok_s']:>13.1f}"
            line += (f" {r['peak_rss_mib']:>12.0f} {r['kv_mib']:>7.1f}" if "peak_rss_mib" in r else f" {'':>12} {'':>7}")
            if "decode_roofline_share" in r:
                line += f" {100 * r['prefill_roofline_share']:>13.1f}% {100 * r['decode_roofline_share']:>12.1f}%"
        print(line)
