"""Where the Triton kernel tests run: compiled on CUDA when there is a GPU, else in
Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``).

Import this before anything imports ``triton``: ``TRITON_INTERPRET=1`` is read when a
kernel is decorated (``conftest.py`` sets it too, before any test module is imported).
The interpreter's ``int()`` of a scalar (used by ``range`` with a runtime bound)
converts a one-element array, which NumPy 2.4 and later reject; scalars are re-read
through ``.item()`` here, so loops with runtime bounds work.
"""

from __future__ import annotations

import os

import pytest
import torch

INTERPRETING = not torch.cuda.is_available()
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

if INTERPRETING:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        from triton.runtime import interpreter as _interp
    except ImportError:  # no triton: the tests that need it skip themselves
        _interp = None
    if _interp is not None and hasattr(_interp, "_patch_lang_tensor"):
        _original = _interp._patch_lang_tensor

        def _patch_lang_tensor(tensor, scope):
            _original(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0].item()))

        _interp._patch_lang_tensor = _patch_lang_tensor

    if _interp is not None and hasattr(_interp, "_patch_lang") and hasattr(_interp, "_get_np_dtype"):
        # Speed only, the same arithmetic: the interpreter re-patches ``triton.language``
        # (``inspect.getmembers`` over its modules) at every call of a ``@triton.jit``
        # helper inside a kernel, though the launch already patched those modules for
        # its whole grid (a fifth of an interpreted test's time), and rebuilds a dtype
        # table at every op. A helper whose language modules the running launch patched
        # is not patched again; the dtype of each Triton type is looked up once.
        _patch_lang_original = _interp._patch_lang
        _langs_of: dict[int, tuple[dict, frozenset]] = {}
        _launches: list[set] = []  # the language modules the running launch has patched

        def _langs(fn) -> frozenset:
            g = fn.__globals__
            hit = _langs_of.get(id(g))
            if hit is None or hit[0] is not g:
                tl = _interp.tl
                hit = _langs_of[id(g)] = (g, frozenset(id(v) for v in g.values()
                                                      if isinstance(v, type(os)) and v in (tl, tl.core)))
            return hit[1]

        class _AlreadyPatched:
            def restore(self) -> None:
                pass

        def _patch_lang(fn):
            if not _launches:
                return _patch_lang_original(fn)
            langs = _langs(fn)
            if langs <= _launches[-1]:  # patched earlier in this launch; those patches hold
                return _AlreadyPatched()
            _launches[-1].update(langs)
            return _patch_lang_original(fn)

        _grid_call = _interp.GridExecutor.__call__

        def _launch(self, *args, **kwargs):
            _launches.append(set())
            try:
                return _grid_call(self, *args, **kwargs)
            finally:
                _launches.pop()

        _interp.GridExecutor.__call__ = _launch
        _interp._patch_lang = _patch_lang
        _np_dtype_original = _interp._get_np_dtype
        _np_dtypes: dict = {}

        def _get_np_dtype(tt_dtype):
            try:
                hit = _np_dtypes.get(tt_dtype)
            except TypeError:  # an unhashable type: not cached
                return _np_dtype_original(tt_dtype)
            if hit is None:
                hit = _np_dtypes[tt_dtype] = _np_dtype_original(tt_dtype)
            return hit

        _interp._get_np_dtype = _get_np_dtype

        # A block type's shape checks and name are worked out once per (element type, shape).
        _block_init = _interp.tl.block_type.__init__
        _block_fields: dict = {}

        def _block_type_init(self, element_ty, shape):
            try:
                key = (element_ty, tuple(shape))
                hit = _block_fields.get(key)
            except TypeError:  # an unhashable dimension: worked out each time
                return _block_init(self, element_ty, shape)
            if hit is None:
                _block_init(self, element_ty, shape)
                _block_fields[key] = (self.shape, self.numel, self.name)
            else:
                self.element_ty = element_ty
                self.shape, self.numel, self.name = hit

        _interp.tl.block_type.__init__ = _block_type_init

        # The overflow check of every integer add, sub and mul (the interpreter's
        # sanitize_overflow) computes the result again as int64 Triton ops and compares it
        # with the type's range, op by op (two fifths of an integer-heavy kernel's time),
        # for a device_assert that only asserts with the interpreter's debug option, off
        # by default: then nothing is computed; with it on, the exact int64 results are
        # checked in NumPy at once, and the interpreter's own check (raising its error)
        # runs where one is out of range.
        import numpy as np

        _semantic = _interp.interpreter_semantic
        _sanitize_original = _semantic.binary_op_sanitize_overflow_impl
        _exact = {"add": np.add, "sub": np.subtract, "mul": np.multiply}

        def _sanitize_overflow(lhs, rhs, binary_op):
            options = _semantic.builder.options
            if not options.debug or not options.sanitize_overflow:
                return None  # what the interpreter's check asserts then: nothing
            ty = lhs.type.scalar
            op = _exact.get(getattr(binary_op, "__name__", None))
            if op is None or ty != rhs.type.scalar or not ty.is_int() or ty.int_bitwidth >= 64:
                return _sanitize_original(lhs, rhs, binary_op)
            got = op(lhs.handle.data.astype(np.int64), rhs.handle.data.astype(np.int64))
            if not ((got <= ty.get_int_max_value()) & (got >= ty.get_int_min_value())).all():
                return _sanitize_original(lhs, rhs, binary_op)
            return None

        _semantic.binary_op_sanitize_overflow_impl = _sanitize_overflow


def kernel_device() -> str:
    """``"cuda"`` or ``"cpu"`` (interpreted); skips the test when neither can run Triton."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no CUDA device and triton was imported without TRITON_INTERPRET=1")
    return "cpu"


def run_compiler_script(name: str, timeout: float, args: tuple[str, ...] = ()):
    """Run ``tests/<name>`` with ``args`` in a child process without ``TRITON_INTERPRET``
    (Triton's mode is fixed when it is first imported, and this session imports it
    interpreted), the project root on ``PYTHONPATH``. Returns the ``CompletedProcess``
    (text output)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).with_name(name)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, str(script), *args], env=env, capture_output=True, text=True, timeout=timeout)


def skip_without_ptxas() -> None:
    """Skip the test when Triton or the ptxas it uses for sm_90 is not usable here."""
    pytest.importorskip("triton")
    from triton.backends.nvidia.compiler import get_ptxas

    try:
        get_ptxas(90)
    except Exception as e:  # noqa: BLE001 - any failure means no usable ptxas here
        pytest.skip(f"Triton's ptxas for sm_90 is not usable here ({e})")
