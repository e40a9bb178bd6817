"""Build the CPU kernels (the C files of :data:`SOURCES`, sharing the headers of
:data:`HEADERS`) at first use and load them.

The C sources are compiled by the machine's C compiler (``$CC``, else ``cc``, ``gcc`` or
``clang`` on the PATH) for the machine itself (``-march=native``: AVX2 or AVX-512 where
the CPU has them) with OpenMP, into ``<cache>/kernels/``, named by a hash of the sources,
the flags, the compiler and the CPU's features (``-march=native`` picks the vector build:
AVX-512 BW (block_gemm.c's tile, with VNNI's vpdpwssd where the CPU has it), AVX2, or plain C), so a change to any of them builds anew and an unchanged one
loads in milliseconds. The sources compile to objects in parallel, one compiler a core,
then link. A build writes into a temporary folder and renames the library: a build stopped
half-way or two processes building at once never leave a broken library under the final
name. The library links ``libgomp.so.1``; loaded after torch, the dynamic linker hands it
torch's own copy, so the kernels' threads are torch's intra-op pool, not a second pool
competing for the same cores.

Where no compiler is found or the build fails, :func:`load` returns None and says why
(:func:`why_not`); callers keep torch's kernels then. The ``cpu_kernels`` switch
(:mod:`kernels.switches`; ``--no-cpu-kernels``, ``HEADROOM_CPU_KERNELS=0``) turns the C
kernels off (to compare, or where a build misbehaves).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kernels.switches import current

log = logging.getLogger("headroom.kernels")

SOURCES = ("block_gemv.c", "block_gemm.c", "kquant.c", "kquant8.c", "kquant_gemm.c", "mxfp4.c", "moe_experts.c", "moe_job.c",
           "decode_layer.c", "layer_rows.c", "rows16.c", "rows16_many.c", "interleave.c", "gated_delta.c")
HEADERS = ("activation.h", "blocks.h", "layer.h", "rows16.h", "tile512.h")
_HERE = Path(__file__).resolve().parent
_why_not: list[str] = []
# What :func:`why_not` says when the ``cpu_kernels`` switch is off.
SWITCHED_OFF = "switched off (cpu_kernels: --no-cpu-kernels, HEADROOM_CPU_KERNELS=0)"


def _flags(openmp: bool) -> list[str]:
    machine = platform.machine().lower()
    arch = ["-march=native"] if machine in ("x86_64", "amd64", "i686") else ["-mcpu=native"]
    return ["-O3", *arch, "-fPIC", "-shared", "-std=c11", *(["-fopenmp"] if openmp else [])]


def compiler() -> str | None:
    """The C compiler to build with: ``$CC``, else the first of cc, gcc, clang found."""
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc) or cc
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return path
    return None


_STALE_S = 600  # a temporary build file this old was left by a build that was killed


def _cpu_features() -> bytes:
    """What ``-march=native`` compiles for: the CPU's model and feature flags (Linux's
    /proc/cpuinfo), else the platform's processor name. Part of a build's name, so a cache
    shared with another kind of CPU never loads a library this one cannot run."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({ln for ln in lines if ln.split(":")[0].strip() in ("flags", "Features", "model name")})).encode()
    except OSError:
        return f"{platform.machine()} {platform.processor()}".encode()


def _targets(cc: str, folder: Path) -> list[tuple[bool, Path]]:
    """``(openmp, library path)`` of each build, OpenMP first: named by a hash of the
    sources, the flags, the compiler and the CPU."""
    text = b"".join((_HERE / name).read_bytes() for name in (*SOURCES, *HEADERS)) + _cpu_features()
    return [(openmp, folder / f"headroom_cpu_{hashlib.sha256(text + ' '.join([cc, *_flags(openmp)]).encode()).hexdigest()[:16]}.so")
            for openmp in (True, False)]


def _build(cc: str, folder: Path) -> tuple[Path, bool]:
    """The library in ``folder``, built if no build of these sources is there yet (with
    OpenMP if the compiler takes it): ``(path, openmp)``.

    Raises:
        RuntimeError: the compiler failed both with and without OpenMP; the message has
            the end of its output, or its exit status.
        OSError: the folder cannot be written.
    """
    targets = _targets(cc, folder)
    for openmp, target in targets:
        if target.exists():  # a compiler that refuses -fopenmp tries it once, not at every start
            return target, openmp
    folder.mkdir(parents=True, exist_ok=True)
    now = time.time()
    for old in folder.glob(".build-*"):  # a killed build's folder (or file, from older builds)
        try:
            if now - old.stat().st_mtime > _STALE_S:
                shutil.rmtree(old) if old.is_dir() else old.unlink()
        except OSError:
            pass
    errors = []
    for openmp, target in targets:
        with tempfile.TemporaryDirectory(dir=folder, prefix=".build-") as tmp:
            said = _compile_and_link(cc, openmp, Path(tmp))
            if said is None:
                os.replace(Path(tmp) / "lib.so", target)
                return target, openmp
            errors.append(said)
    raise RuntimeError(f"{cc} could not build the CPU kernels: {errors[-1]}")


def _compile_and_link(cc: str, openmp: bool, tmp: Path, extra_flags: tuple[str, ...] = ()) -> str | None:
    """Compile each source to an object in ``tmp``, all at once (one compiler a core:
    the sources take seconds each at -O3), then link them into ``tmp/lib.so``. Returns
    None, or what the compiler said when a step failed. ``extra_flags`` follow the
    build's own (tests build variants: ``-mno-avx512f``...)."""
    flags = [f for f in _flags(openmp) if f != "-shared"] + list(extra_flags)
    objects = [tmp / (name.removesuffix(".c") + ".o") for name in SOURCES]
    commands = [[cc, *flags, "-c", str(_HERE / name), "-o", str(obj)] for name, obj in zip(SOURCES, objects, strict=True)]
    with ThreadPoolExecutor(max_workers=max(1, min(len(commands), os.cpu_count() or 1))) as pool:
        results = list(pool.map(_run, commands))
    failed = next((said for said in results if said is not None), None)
    if failed is not None:
        return failed
    return _run([cc, *_flags(openmp), *map(str, objects), "-o", str(tmp / "lib.so"), "-lm"])


def build_variant(folder: Path, extra_flags: tuple[str, ...]) -> ctypes.CDLL:
    """The library built with ``extra_flags`` after the engine's own (OpenMP on), in
    ``folder``, compiled as the engine's build is (a compiler a core), declared: the
    tests' builds for other CPUs (``-mno-avx512f``, ``-mno-avx512vnni``).

    Raises:
        RuntimeError: the compiler failed; the message has the end of its output.
    """
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler")
    said = _compile_and_link(cc, True, Path(folder), extra_flags)
    if said is not None:
        raise RuntimeError(said)
    return _declare(ctypes.CDLL(str(Path(folder) / "lib.so")))


def _run(command: list[str]) -> str | None:
    """Run one compiler step: None, or the end of what it said on failure."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    if done.returncode == 0:
        return None
    said = (done.stderr or done.stdout).strip()
    return said[-600:] if said else f"it exited with status {done.returncode} and said nothing"


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    c_int, c_i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
    lib.hr_simd_level.restype = c_int
    lib.hr_simd_level.argtypes = []
    lib.hr_work_bytes.restype = c_i64
    lib.hr_work_bytes.argtypes = [c_i64, c_i64]
    lib.hr_block_gemv.restype = c_int
    lib.hr_block_gemv.argtypes = [c_int, ptr, c_i64, c_i64, ptr, c_i64, ptr, c_i64, ptr, c_int, c_int]
    lib.hr_rows16_available.restype = c_int
    lib.hr_rows16_available.argtypes = []
    lib.hr_quantize_row.restype = None
    lib.hr_quantize_row.argtypes = [ptr, c_i64, ptr, ptr, ptr]
    lib.hr_quantize_row8.restype = None
    lib.hr_quantize_row8.argtypes = [ptr, c_i64, ptr, ptr, ptr]
    lib.hr_dequantize_rows.restype = c_int
    lib.hr_dequantize_rows.argtypes = [c_int, ptr, c_i64, c_i64, c_i64, ptr, c_int]
    lib.hr_rows16_dequantize.restype = c_int
    lib.hr_rows16_dequantize.argtypes = [c_int, ptr, c_i64, c_i64, ptr, c_i64, ptr]
    lib.hr_moe_work_bytes.restype = c_i64
    lib.hr_moe_work_bytes.argtypes = [c_i64, c_i64, c_i64, c_i64]
    lib.hr_moe_experts.restype = c_int
    lib.hr_moe_experts.argtypes = [ptr, c_i64, c_i64, c_i64, ptr, ptr, c_i64, ptr, ptr, c_i64, ptr, ptr, ptr,
                                   c_int, c_int, c_int, ptr, ptr, ctypes.c_float, ctypes.c_float, ptr, ptr, c_int,
                                   c_int]
    lib.hr_moe_routed_work_bytes.restype = c_i64
    lib.hr_moe_routed_work_bytes.argtypes = [c_i64, c_i64, c_i64, c_i64, c_i64]
    lib.hr_moe_routed.restype = c_int
    lib.hr_moe_routed.argtypes = [ptr, c_i64, c_i64, c_i64, ptr, ptr, c_i64, c_i64, c_int, ptr, ptr, ptr, c_int,
                                  c_int, c_int, ptr, ptr, ctypes.c_float, ctypes.c_float, ptr, ptr, c_int, c_int]
    lib.hr_moe_job_work_bytes.restype = c_i64
    lib.hr_moe_job_work_bytes.argtypes = [c_i64, c_i64, c_i64, c_i64, c_i64]
    lib.moe_cpu_job.restype = None
    lib.moe_cpu_job.argtypes = [ptr]
    lib.hr_gdn_decode.restype = c_int
    lib.hr_gdn_decode.argtypes = [ptr, c_i64, c_i64, c_i64, c_i64, c_i64, c_i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr,
                                  ptr, ptr, ptr, ptr, c_int]
    lib.hr_rows16_interleave.restype = c_int
    lib.hr_rows16_interleave.argtypes = [c_int, ptr, c_i64, c_i64, ptr, c_int]
    lib.hr_decode_scratch_bytes.restype = c_i64
    lib.hr_decode_scratch_bytes.argtypes = [ptr, c_i64, c_i64]
    lib.hr_decode_layer.restype = c_int
    lib.hr_decode_layer.argtypes = [ptr, ptr, ptr, ptr, ptr, c_i64]
    lib.hr_layer_in.restype = c_int
    lib.hr_layer_in.argtypes = [ptr, ptr, ptr, ptr, ptr]
    lib.hr_layer_out.restype = c_int
    lib.hr_layer_out.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr]
    lib.hr_quantize_kv.restype = None
    lib.hr_quantize_kv.argtypes = [c_int, ptr, c_i64, c_i64, ptr]
    return lib


def load(cache_dir: str) -> ctypes.CDLL | None:
    """The built library (built once per process), or None where the kernels cannot
    run: switched off (read at each call, :data:`SWITCHED_OFF`), no compiler, a failed
    build, or a CPU without AVX2 (the plain C build is slower than torch's own kernels;
    it is kept for tests, :func:`load_any`).

    Args:
        cache_dir: the folder the library is built into (headroom's cache).
    """
    if not current().cpu_kernels:
        _why_not.append(SWITCHED_OFF)
        return None
    return _load_fast(cache_dir)


@functools.cache
def _load_fast(cache_dir: str) -> ctypes.CDLL | None:
    """:func:`load` past the switch: the library where the CPU has AVX2."""
    lib = load_any(cache_dir)
    if lib is not None and lib.hr_simd_level() < 1:
        _why_not.append("this CPU has no AVX2: torch's kernels are faster than the plain C build")
        return None
    return lib


@functools.cache
def load_any(cache_dir: str) -> ctypes.CDLL | None:
    """:func:`load` without the switch and the AVX2 check (tests call the plain C path
    on any machine)."""
    import torch  # noqa: F401  (torch's libgomp first: the kernels share its thread pool)

    cc = compiler()
    if cc is None:
        _why_not.append("no C compiler found (set CC, or install gcc or clang)")
        return None
    try:
        path, openmp = _build(cc, Path(cache_dir))
        lib = _declare(ctypes.CDLL(str(path)))
    except (RuntimeError, OSError) as exc:
        _why_not.append(str(exc))
        return None
    log.info("CPU kernels: %s (%s, %s)", path, simd_name(lib),
             "OpenMP threads" if openmp else f"one thread: {cc} takes no -fopenmp")
    return lib


def simd_name(lib: ctypes.CDLL) -> str:
    """The vector build of a loaded library, in words (``hr_simd_level``: 0 plain C, 1
    AVX2, 2 AVX-512 with block_gemm.c's tile)."""
    return ("plain C", "AVX2", "AVX-512")[lib.hr_simd_level()]


def why_not() -> str | None:
    """Why the last :func:`load` returned None, or None."""
    return _why_not[-1] if _why_not else None
