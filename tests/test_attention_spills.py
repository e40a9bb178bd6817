"""The attention kernels' launch configurations compile for sm_90 without register
spills (no GPU needed: Triton compiles to PTX and its bundled ``ptxas -v`` reports the
stack frame). A spilling kernel makes the driver reserve its stack frame for every
thread the GPU can hold, for the life of the process: on an H200 a 10 KB frame cost
2.6 GiB of device memory that the memory plan never saw."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Not imported here: Triton reads TRITON_INTERPRET when it is first imported, and the
# other kernel tests of this session run under the interpreter.
TRITON_SPEC = importlib.util.find_spec("triton")

SCRIPT = r"""
import itertools, json, os, subprocess, sys, tempfile
import torch, triton
from triton.backends.compiler import GPUTarget
import kernels.attention.triton_kernel as K

from triton.backends.nvidia.compiler import get_ptxas

# The ptxas Triton itself uses for sm_90: from Triton 3.9 on that is the newer of its two
# bundled ones, and the other refuses the PTX version Triton then emits.
ptxas = get_ptxas(90).path
target = GPUTarget("cuda", 90, 32)
names = {torch.bfloat16: "bf16", torch.float32: "fp32"}

def frame(fn, sig, consts, warps):
    for c in consts:
        sig[c] = "constexpr"
    src = triton.compiler.ASTSource(fn=fn, signature=sig,
                                    constexprs={(list(sig).index(k),): v for k, v in consts.items()})
    ptx = triton.compile(src, target=target, options={"num_warps": warps}).asm["ptx"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    err = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
                         capture_output=True, text=True, check=True).stderr
    os.unlink(f.name)
    return int(next(l for l in err.splitlines() if "stack frame" in l).split("bytes stack frame")[0].split()[-1])

out = {}
for dtype, dt in names.items():
    prec = "ieee" if dtype == torch.float32 else "tf32"
    for d in (64, 128):
        # The pool in the model's dtype, and (bfloat16 models) pools of q8_0 (int8) and
        # q4_0 (uint8) blocks, dequantized as the tiles load.
        # Each also with soft-capped scores and sinks (Gemma, gpt-oss): the variant of most registers.
        pools = ((0, dt), (1, "i8"), (2, "u8")) if dtype == torch.bfloat16 else ((0, dt),)
        for (fmt, kv), extra in itertools.product(pools, (0, 1)):
            name = (f" KV_FMT={fmt}" if fmt else "") + (" softcap+sinks" if extra else "")
            bn, w = K.decode_config(dtype, d, kv_blocks=fmt > 0)
            sig = {"Q": f"*{dt}", "K": f"*{kv}", "V": f"*{kv}", "PageTable": "*i64", "SeqLens": "*i64",
                   "Out": f"*{dt}", "PartO": "*fp32", "PartLse": "*fp32", "Sinks": f"*{dt}"}
            sig.update({n: "i32" for n in ("stride_qb", "stride_qh", "stride_ks", "stride_kh", "stride_vs",
                                             "stride_vh", "stride_pt", "stride_ob", "stride_oh")})
            sig["scale_log2"], sig["window"], sig["cap_log2"] = "fp32", "i32", "fp32"
            out[f"decode {dt} D={d}{name}"] = frame(K._decode_kernel, sig, dict(
                NUM_HEADS=8, GROUP=8, BLOCK_G=16, HEAD_DIM=d, BLOCK_D=d, PAGE_SIZE=16, BLOCK_N=bn,
                NUM_SPLITS=1 if extra else 4, PRECISION=prec, PDL=1, KV_FMT=fmt, SOFTCAP=extra, SINKS=extra), w)
            bm, bn, w = K.extend_config(dtype, d)
            sig = {"Q": f"*{dt}", "K": f"*{kv}", "V": f"*{kv}", "PageTable": "*i64", "QStarts": "*i64",
                   "PrefixLens": "*i64", "ExtendLens": "*i64", "Out": f"*{dt}", "Sinks": f"*{dt}"}
            sig.update({n: "i32" for n in ("stride_qt", "stride_qh", "stride_ks", "stride_kh", "stride_vs",
                                             "stride_vh", "stride_pt", "stride_ot", "stride_oh")})
            sig["scale_log2"], sig["window"], sig["cap_log2"] = "fp32", "i32", "fp32"
            out[f"extend {dt} D={d}{name}"] = frame(K._extend_kernel, sig, dict(
                GROUP=4, HEAD_DIM=d, BLOCK_D=d, PAGE_SIZE=16, BLOCK_M=bm, BLOCK_N=bn, PRECISION=prec,
                KV_FMT=fmt, SOFTCAP=extra, SINKS=extra), w)
        # The split merge writing o's rows quantized for the int8 GEMV too, and adding sinks.
        sig = {"PartO": "*fp32", "PartLse": "*fp32", "Out": f"*{dt}", "Codes": "*i8", "Scales": "*fp32",
               "Sums": "*i32", "Sinks": f"*{dt}"}
        sig.update({n: "i32" for n in ("stride_ob", "stride_oh", "stride_q", "stride_d", "stride_s")})
        out[f"merge {dt} D={d}"] = frame(K._merge_kernel, sig, dict(
            NUM_HEADS=32, HEAD_DIM=d, BLOCK_D=d, NUM_SPLITS=16, BLOCK_S=16, QUANT=1, PDL=1, SINKS=1), 2)
print(json.dumps(out))
"""


def test_kernel_configs_compile_without_register_spills():
    if TRITON_SPEC is None:
        pytest.skip("triton is not installed")
    ptxas = Path(TRITON_SPEC.origin).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("Triton's bundled ptxas is not here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parent.parent
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    frames = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(frames) == 2 * (12 + 4) + 4  # decode and extend, plain and capped with sinks; merges
    assert frames == {name: 0 for name in frames}, frames
