"""The Triton paged-attention kernels against their torch references.

Without CUDA they run under Triton's interpreter (``TRITON_INTERPRET=1``, set here before
Triton is imported) on CPU tensors: slow, so the shapes are small, but every index,
mask and page-boundary path is the one the GPU runs.
"""

from __future__ import annotations

import pytest
import torch
from triton_interpret import DEVICE

pytest.importorskip("triton")

from kernels.attention.reference import paged_decode_ref, paged_extend_ref  # noqa: E402
from kernels.attention.triton_kernel import decode_num_splits, paged_decode, paged_extend  # noqa: E402


def _pool(num_kv_heads: int, head_dim: int, num_pages: int, page_size: int, dtype, g):
    shape = (num_pages * page_size, num_kv_heads, head_dim)
    k = torch.randn(shape, generator=g).to(dtype)
    v = torch.randn(shape, generator=g).to(dtype)
    return k.to(DEVICE), v.to(DEVICE)


def _page_table(lens: list[int], page_size: int, num_pages: int, g) -> torch.Tensor:
    """Distinct, shuffled pages per sequence (page 0 stays the null page), padded with 0."""
    need = [-(-n // page_size) for n in lens]
    perm = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()
    width = max(max(need), 1) + 1  # a spare column: the kernels must not read past a length
    table = torch.zeros(len(lens), width, dtype=torch.int64)
    at = 0
    for b, n in enumerate(need):
        table[b, :n] = torch.tensor(perm[at : at + n])
        at += n
    return table.to(DEVICE)


def _tol(dtype):
    return dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,lens,splits",
    [
        (4, 4, 64, [1, 5, 16, 17], None),  # GQA 1, odd lengths around a page
        (6, 2, 64, [33, 3], 3),  # GQA 3, ranges that end mid-page
        (8, 2, 128, [47, 64, 1], 4),  # GQA 4, head dim 128
        (8, 1, 64, [100], 16),  # GQA 8, more ranges than blocks: empty ranges
        (4, 4, 64, [0, 9], 2),  # a padded (empty) row gives zeros
    ],
)
def test_decode_matches_reference(heads, kv_heads, head_dim, lens, splits):
    g = torch.Generator().manual_seed(len(lens) * 31 + heads)
    page_size, num_pages = 16, 24
    k_buf, v_buf = _pool(kv_heads, head_dim, num_pages, page_size, torch.float32, g)
    table = _page_table(lens, page_size, num_pages, g)
    q = torch.randn(len(lens), heads, head_dim, generator=g).to(DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int64, device=DEVICE)
    scale = head_dim**-0.5
    ref = paged_decode_ref(q, k_buf, v_buf, table, seq_lens, page_size, scale)
    got = paged_decode(q, k_buf, v_buf, table, seq_lens, page_size, scale, num_splits=splits, block_n=16)
    torch.testing.assert_close(got, ref, **_tol(torch.float32))
    if 0 in lens:
        assert got[lens.index(0)].abs().max() == 0


# Triton's interpreter has no bfloat16 arithmetic (NumPy has no such type): half
# precision is checked in float16 there and in bfloat16 on a GPU.
HALF = torch.bfloat16 if DEVICE == "cuda" else torch.float16


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("heads,kv_heads,head_dim,splits", [(8, 2, 64, 4), (4, 4, 128, 2), (6, 2, 32, 3)])
def test_decode_merge_quantizes_its_output_as_the_quantizing_launch(dtype, heads, kv_heads, head_dim, splits):
    """``quantize=True``: the split merge writes the same output, and its rows quantized
    for the o projection's int8 GEMV equal ``quantize_activations`` of that output bit
    for bit (a padded empty row included); one split (no merge) and a head dim that is
    not a power of two of whole groups hand back None, for the GEMV to quantize."""
    from kernels.quant.triton_activations import quantize_activations

    g = torch.Generator().manual_seed(heads * 7 + head_dim)
    page_size, num_pages, lens = 16, 24, [37, 0, 5]
    k_buf, v_buf = _pool(kv_heads, head_dim, num_pages, page_size, dtype, g)
    table = _page_table(lens, page_size, num_pages, g)
    q = torch.randn(len(lens), heads, head_dim, generator=g).to(dtype).to(DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int64, device=DEVICE)
    plain = paged_decode(q, k_buf, v_buf, table, seq_lens, page_size, 0.125, num_splits=splits, block_n=16)
    out, q8 = paged_decode(q, k_buf, v_buf, table, seq_lens, page_size, 0.125, num_splits=splits, block_n=16,
                           quantize=True)
    assert torch.equal(out, plain)
    want = quantize_activations(out.view(len(lens), heads * head_dim))
    for field in ("codes", "scales", "sums"):
        assert torch.equal(getattr(q8, field), getattr(want, field)), field
    assert q8.dtype == dtype
    one = paged_decode(q, k_buf, v_buf, table, seq_lens, page_size, 0.125, num_splits=1, block_n=16, quantize=True)
    assert one[1] is None and torch.equal(one[0], paged_decode(q, k_buf, v_buf, table, seq_lens, page_size, 0.125,
                                                               num_splits=1, block_n=16))


def test_decode_merge_leaves_quantizing_to_the_gemv_for_odd_head_dims():
    g = torch.Generator().manual_seed(3)
    k_buf, v_buf = _pool(2, 96, 8, 16, torch.float32, g)
    table = _page_table([20], 16, 8, g)
    q = torch.randn(1, 4, 96, generator=g).to(DEVICE)
    out, q8 = paged_decode(q, k_buf, v_buf, table, torch.tensor([20], device=DEVICE), 16, 0.1, num_splits=4,
                           block_n=16, quantize=True)
    assert q8 is None
    torch.testing.assert_close(out, paged_decode_ref(q, k_buf, v_buf, table, torch.tensor([20], device=DEVICE), 16, 0.1))


def test_decode_half_precision_and_default_split_count():
    g = torch.Generator().manual_seed(7)
    page_size, num_pages = 4, 40
    lens = [13, 29]
    k_buf, v_buf = _pool(2, 64, num_pages, page_size, HALF, g)
    table = _page_table(lens, page_size, num_pages, g)
    q = torch.randn(2, 8, 64, generator=g).to(HALF).to(DEVICE)
    seq_lens = torch.tensor(lens, device=DEVICE)
    assert decode_num_splits(2, 2) > 1  # the default splits a small batch
    got = paged_decode(q, k_buf, v_buf, table, seq_lens, page_size, 0.125, block_n=16)
    ref = paged_decode_ref(q, k_buf, v_buf, table, seq_lens, page_size, 0.125)
    assert got.dtype == HALF
    torch.testing.assert_close(got, ref, **_tol(torch.bfloat16))


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,prefix,extend",
    [
        (4, 4, 64, [0], [21]),  # plain prefill, odd length
        (6, 2, 64, [16, 0, 5], [3, 17, 1]),  # GQA 3: prefix on a page boundary, a fresh one, a decode row
        (8, 2, 128, [7, 32], [18, 16]),  # GQA 4, head dim 128, prefix + extend across pages
        (8, 1, 64, [0, 40], [33, 9]),  # GQA 8, blocks past a short extend
    ],
)
def test_extend_matches_reference(heads, kv_heads, head_dim, prefix, extend):
    g = torch.Generator().manual_seed(sum(extend) + heads)
    page_size, num_pages = 16, 24
    lens = [p + e for p, e in zip(prefix, extend, strict=True)]
    k_buf, v_buf = _pool(kv_heads, head_dim, num_pages, page_size, torch.float32, g)
    table = _page_table(lens, page_size, num_pages, g)
    total = sum(extend)
    q = torch.randn(total, heads, head_dim, generator=g).to(DEVICE)
    starts = torch.tensor([0, *torch.tensor(extend).cumsum(0)[:-1].tolist()], device=DEVICE)
    prefix_t = torch.tensor(prefix, device=DEVICE)
    extend_t = torch.tensor(extend, device=DEVICE)
    scale = head_dim**-0.5
    ref = paged_extend_ref(q, k_buf, v_buf, table, starts, prefix_t, extend_t, page_size, scale)
    got = paged_extend(q, k_buf, v_buf, table, starts, prefix_t, extend_t, page_size, scale,
                       max_extend=max(extend), block_m=16, block_n=16)
    torch.testing.assert_close(got, ref, **_tol(torch.float32))


def test_decode_and_extend_agree_on_a_one_token_extend():
    """A decode row is an extend of one token after its prefix: both kernels agree."""
    g = torch.Generator().manual_seed(3)
    page_size, num_pages = 8, 16
    lens = [9, 24]
    k_buf, v_buf = _pool(2, 64, num_pages, page_size, torch.float32, g)
    table = _page_table(lens, page_size, num_pages, g)
    q = torch.randn(2, 4, 64, generator=g).to(DEVICE)
    one = torch.ones(2, dtype=torch.int64, device=DEVICE)
    seq_lens = torch.tensor(lens, device=DEVICE)
    dec = paged_decode(q, k_buf, v_buf, table, seq_lens, page_size, 0.125, block_n=16)
    ext = paged_extend(q, k_buf, v_buf, table, torch.arange(2, device=DEVICE), seq_lens - 1, one, page_size, 0.125,
                       max_extend=1, block_m=16, block_n=16)
    torch.testing.assert_close(dec, ext, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window,splits", [(8, 3), (20, None), (1, 2)])
def test_sliding_window_decode_matches_reference(window, splits):
    """A sliding-window layer reads its last ``window`` keys: the ranges split the window
    (empty ranges where a row is shorter), rows shorter than it read all."""
    g = torch.Generator().manual_seed(window)
    page_size, num_pages, lens = 16, 24, [1, 5, 30, 47]
    k_buf, v_buf = _pool(2, 64, num_pages, page_size, torch.float32, g)
    table = _page_table(lens, page_size, num_pages, g)
    q = torch.randn(len(lens), 6, 64, generator=g).to(DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int64, device=DEVICE)
    ref = paged_decode_ref(q, k_buf, v_buf, table, seq_lens, page_size, 0.125, window=window)
    assert not torch.allclose(ref, paged_decode_ref(q, k_buf, v_buf, table, seq_lens, page_size, 0.125))
    got = paged_decode(q, k_buf, v_buf, table, seq_lens, page_size, 0.125, num_splits=splits, block_n=16,
                       window=window)
    torch.testing.assert_close(got, ref, **_tol(torch.float32))


@pytest.mark.parametrize("window", [6, 17])
def test_sliding_window_extend_matches_reference(window):
    """Rows of one query block whose windows start past the block's first keys see none
    of them (no NaN from an all-masked block), a prefix longer than the window is skipped."""
    g = torch.Generator().manual_seed(window + 100)
    page_size, num_pages = 16, 24
    prefix, extend = [0, 20, 5], [21, 9, 1]
    lens = [p + e for p, e in zip(prefix, extend, strict=True)]
    k_buf, v_buf = _pool(2, 64, num_pages, page_size, torch.float32, g)
    table = _page_table(lens, page_size, num_pages, g)
    q = torch.randn(sum(extend), 4, 64, generator=g).to(DEVICE)
    starts = torch.tensor([0, *torch.tensor(extend).cumsum(0)[:-1].tolist()], device=DEVICE)
    prefix_t, extend_t = torch.tensor(prefix, device=DEVICE), torch.tensor(extend, device=DEVICE)
    ref = paged_extend_ref(q, k_buf, v_buf, table, starts, prefix_t, extend_t, page_size, 0.125, window=window)
    got = paged_extend(q, k_buf, v_buf, table, starts, prefix_t, extend_t, page_size, 0.125,
                       max_extend=max(extend), block_m=16, block_n=16, window=window)
    torch.testing.assert_close(got, ref, **_tol(torch.float32))


# (softcap, sinks, window): a cap below the scores' spread, sinks that take a sizeable share.
FEATURES = [(1.5, False, 0), (0.0, True, 0), (1.5, True, 0), (1.5, True, 7)]


def _features(softcap, sinks, heads, g):
    return dict(softcap=softcap, sinks=(torch.randn(heads, generator=g) * 2).to(DEVICE) if sinks else None)


@pytest.mark.parametrize("softcap,sinks,window", FEATURES)
@pytest.mark.parametrize("splits", [1, 3, 16])
def test_softcap_and_sinks_decode_match_reference(softcap, sinks, window, splits):
    """Capped scores and sinks, with and without a window, over one range or several (the
    merge adds each sink once; 16 ranges leave some empty); a padded row stays zeros."""
    g = torch.Generator().manual_seed(splits * 7 + window + int(sinks))
    page_size, num_pages, lens = 16, 24, [0, 5, 30, 47]
    k_buf, v_buf = _pool(2, 64, num_pages, page_size, torch.float32, g)
    table = _page_table(lens, page_size, num_pages, g)
    q = torch.randn(len(lens), 6, 64, generator=g).to(DEVICE) * 3
    seq_lens = torch.tensor(lens, dtype=torch.int64, device=DEVICE)
    extra = _features(softcap, sinks, 6, g)
    ref = paged_decode_ref(q, k_buf, v_buf, table, seq_lens, page_size, 0.125, window=window, **extra)
    plain = paged_decode_ref(q, k_buf, v_buf, table, seq_lens, page_size, 0.125, window=window)
    assert not torch.allclose(ref, plain, atol=1e-2)
    got = paged_decode(q, k_buf, v_buf, table, seq_lens, page_size, 0.125, num_splits=splits, block_n=16,
                       window=window, **extra)
    torch.testing.assert_close(got, ref, **_tol(torch.float32))
    assert not got[0].any()


@pytest.mark.parametrize("softcap,sinks,window", FEATURES)
def test_softcap_and_sinks_extend_match_reference(softcap, sinks, window):
    """Prefill and extend over a cached prefix, several query blocks per sequence."""
    g = torch.Generator().manual_seed(window + 200 + int(sinks))
    page_size, num_pages = 16, 24
    prefix, extend = [0, 20, 5], [21, 9, 1]
    lens = [p + e for p, e in zip(prefix, extend, strict=True)]
    k_buf, v_buf = _pool(2, 64, num_pages, page_size, torch.float32, g)
    table = _page_table(lens, page_size, num_pages, g)
    q = torch.randn(sum(extend), 4, 64, generator=g).to(DEVICE) * 3
    starts = torch.tensor([0, *torch.tensor(extend).cumsum(0)[:-1].tolist()], device=DEVICE)
    prefix_t, extend_t = torch.tensor(prefix, device=DEVICE), torch.tensor(extend, device=DEVICE)
    extra = _features(softcap, sinks, 4, g)
    args = (q, k_buf, v_buf, table, starts, prefix_t, extend_t, page_size, 0.125)
    ref = paged_extend_ref(*args, window=window, **extra)
    assert not torch.allclose(ref, paged_extend_ref(*args, window=window), atol=1e-2)
    got = paged_extend(*args, max_extend=max(extend), block_m=16, block_n=16, window=window, **extra)
    torch.testing.assert_close(got, ref, **_tol(torch.float32))
