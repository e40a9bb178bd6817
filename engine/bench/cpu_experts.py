"""Time one MoE layer's CPU experts for a step: the C kernels over the GGUF blocks
(:mod:`kernels.cpu.moe_experts`, all routed experts in one call) against the torch path
they replace (each expert's blocks dequantized by ``gguf``, then two float32 GEMMs).

    python -m engine.bench.cpu_experts --tokens 1 4 --threads 2
    python -m engine.bench.cpu_experts --tokens 1 4 --no-torch --ab 15
    python -m engine.bench.cpu_experts --tokens 1 4 --no-torch --ab-bits 15
    python -m engine.bench.cpu_experts --tokens 1 4 --no-torch --rows16

Random blocks of Qwen3-30B-A3B's shape by default (H=2048, I=768, 128 experts, top-8,
Q4_K gate/up, Q6_K down: a Q4_K_M file's types); each token routes to ``--top-k``
distinct random experts, drawn afresh each call (64 routings in turn, so the blocks
come from memory as a model's next layer's do, not from the last call's cache). Prints
per step the seconds (median of ``--repeats`` calls), the layer's tokens/s (tokens /
step time) and GB/s of expert blocks read (the distinct routed experts' bytes, on
average over the routings, / step time; each is read once a step). ``--rows16`` adds the C
kernels over the same experts interleaved by 16 rows per expert (the CPU engine's layout
where the build has AVX-512, :mod:`kernels.cpu.rows16`).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import statistics
import time

import numpy as np
import torch

from kernels.quant.formats import tensor_bytes
from kernels.quant.synthetic import random_blocks


def random_experts(types: tuple[str, str, str], num: int, hidden: int, inter: int,
                   seed: int = 0) -> list[torch.Tensor]:
    """Random ``gate``/``up`` ``[E, I, bytes]`` and ``down`` ``[E, H, bytes]`` uint8 blocks."""
    rng = np.random.default_rng(seed)
    return [torch.from_numpy(random_blocks(t, num * rows, cols, rng, scale=1e-3).reshape(num, rows, -1))
            for t, rows, cols in ((types[0], inter, hidden), (types[1], inter, hidden), (types[2], hidden, inter))]


def interleaved(lib, stacks: list[torch.Tensor], types: tuple[str, str, str]):
    """(the stacks, their types) as the CPU engine loads them
    (:meth:`~engine.layers.moe.quant_experts.QuantExperts.interleave_rows16`); None where
    ``lib``'s build does not multiply that layout."""
    from engine.layers.moe.quant_experts import QuantExperts
    from kernels.cpu import rows16

    if not rows16.available(lib):
        return None
    gate, up, down = stacks
    with torch.device("meta"):
        experts = QuantExperts(gate.shape[0], down.shape[1], gate.shape[1], types)
    experts.gate, experts.up, experts.down = gate, up, down
    experts.interleave_rows16(lib)
    return [experts.gate, experts.up, experts.down], experts.types


_DRAWS = 64  # routings a row cycles through: its experts come from memory, as a model's next layer's do


def _route(t: int, experts: int, top_k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``ids`` ``[t, top_k]`` (distinct a token) and their ``weights``, random."""
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(t)])
    return ids, torch.rand(t, top_k, generator=gen)


def _fresh(draws: list, step, *experts):
    """A call of ``step(ids, weights, *experts)`` on the next of ``draws`` each time."""
    turn = itertools.cycle(draws)
    return lambda: step(*next(turn), *experts)


def timed(fn) -> float:
    """Seconds of one call of ``fn``."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _c_step(lib, threads: int, x, tokens, ids, weights, gate, up, down, types) -> None:
    from kernels.cpu.moe_experts import moe_experts

    moe_experts(lib, x, tokens, ids.flatten(), weights.flatten(), gate, up, down, types, threads=threads)


def _torch_step(x, tokens, ids, weights, gate, up, down, types) -> None:
    """The path the C kernels replace: each routed expert dequantized, then its MLP."""
    from engine.layers.moe.expert_costs import expert_mlp
    from kernels.moe.quant_reference import expert_weights

    out = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():
        sel, ks = torch.where(ids == e)
        y = expert_mlp(x[sel], *expert_weights(gate, up, down, types, e, torch.float32))
        out.index_add_(0, sel, y * weights[sel, ks, None])


def _ab(step, rounds: int, t: int, read: int, switch: str = "cpu_block_gemm", values: tuple = (False, True)) -> None:
    """Print the step's median ms and GB/s with the kernel switch ``switch`` at its two
    ``values`` (default: ``cpu_block_gemm`` off and on), alternating."""
    from engine.bench.cpu_block_gemm import alternate

    step()
    got = alternate(lambda: timed(step), rounds, switch, values)
    off, on = (statistics.median(got[v]) for v in values)
    print(f"  {t} token(s), C kernels {switch} {values[0]} -> {values[1]}: {off * 1e3:8.2f} -> {on * 1e3:8.2f} ms a step ({off / on:.2f}x), "
          f"{read / off / 1e9:6.2f} -> {read / on / 1e9:6.2f} GB/s of blocks")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--types", default="Q4_K,Q4_K,Q6_K", help="gate,up,down GGML types")
    parser.add_argument("--threads", type=int, default=None, help="default: the cores this process may use")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-torch", action="store_true", help="skip the torch dequantizing path")
    parser.add_argument("--ab", type=int, default=0, metavar="ROUNDS",
                        help="also the C kernels with the cpu_block_gemm switch off and on, alternating, "
                             "ROUNDS each, medians (the K-quant AVX-512 tile against the AVX2 row product)")
    parser.add_argument("--ab-bits", type=int, default=0, metavar="ROUNDS",
                        help="also the C kernels with the cpu_kquant_act_bits switch at 16 and 8, alternating, "
                             "ROUNDS each, medians (the K-quants' 16-bit activation codes against 8-bit ones)")
    parser.add_argument("--rows16", action="store_true",
                        help="also the C kernels over the experts interleaved by 16 rows per expert (AVX-512 builds)")
    args = parser.parse_args()

    from engine.layers.linear.cpu_kernels import cpu_kernels
    from kernels.cpu import build
    from kernels.cpu.threads import default_threads

    lib = cpu_kernels()
    if lib is None:
        raise SystemExit(f"the C CPU kernels do not build here: {build.why_not()}")
    types = tuple(args.types.split(","))
    h, i = args.hidden, args.intermediate
    threads = args.threads or default_threads()
    torch.set_num_threads(threads)
    gate, up, down = random_experts(types, args.experts, h, i)
    x16 = interleaved(lib, [gate, up, down], types) if args.rows16 else None
    if args.rows16 and x16 is None:
        print("--rows16: this build does not multiply interleaved blocks (no AVX-512)")
    expert_bytes = sum(tensor_bytes(t, shape, 0) for t, shape in zip(types, ((i, h), (i, h), (h, i)), strict=True))
    simd = build.simd_name(lib)
    print(f"H={h} I={i} E={args.experts} top-{args.top_k} {'/'.join(types)}: {expert_bytes / 1e6:.2f} MB an expert; "
          f"{threads} threads, {simd} build")
    gen = torch.Generator().manual_seed(0)
    for t in args.tokens:
        draws = [_route(t, args.experts, args.top_k, gen) for _ in range(_DRAWS)]
        x = torch.randn(t, h, generator=gen)
        tokens = torch.arange(t).repeat_interleave(args.top_k)
        read = statistics.mean(len(torch.unique(ids)) * expert_bytes for ids, _ in draws)
        c_kernels = functools.partial(_c_step, lib, threads, x, tokens)
        rows = {"C kernels": _fresh(draws, c_kernels, gate, up, down, types)}
        if x16 is not None:
            rows["C kernels, x16"] = _fresh(draws, c_kernels, *x16[0], x16[1])
        if not args.no_torch:
            rows["torch dequantize"] = _fresh(draws, functools.partial(_torch_step, x, tokens), gate, up, down, types)
        if args.ab:
            _ab(rows["C kernels"], args.ab, t, read)
        if args.ab_bits:
            _ab(rows["C kernels"], args.ab_bits, t, read, "cpu_kquant_act_bits", ("16", "8"))
        for name, fn in rows.items():
            fn()  # first touch
            s = statistics.median(timed(fn) for _ in range(args.repeats))
            print(f"  {t} token(s), {name:16s}: {s * 1e3:8.2f} ms a step, {t / s:8.1f} tokens/s, "
                  f"{read / s / 1e9:6.2f} GB/s of blocks")

if __name__ == "__main__":
    main()
