"""The host side of CUDA-graph decode for backends that plan on the host (FlashInfer):
the page lists built from a step's sequence lengths and page table, and what
:class:`engine.core.cuda_graphs.DecodeGraphs` hands the backend before a replay (padding rows
included). Both run on the CPU; the captured replay itself is tested on the GPU
(``tests/gpu/test_fast_path_gpu.py``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.core.cuda_graphs import DecodeGraphs
from engine.layers.attention.base import AttentionBackend
from engine.layers.attention.flashinfer_backend import paged_kv_csr
from engine.scheduler.request import Request
from engine.scheduler.scheduler import StepItem
from engine.wire.messages import SamplingParams


def reference_csr(seq_lens, table, ps):
    """Row by row, as FlashInfer documents its paged layout."""
    indptr, indices, last = [0], [], []
    for n, row in zip(seq_lens, table, strict=True):
        pages = max(-(-int(n) // ps), 1)
        indices += [int(p) for p in row[:pages]] if n > 0 else [0]
        indptr.append(indptr[-1] + pages)
        last.append(max(int(n) - (pages - 1) * ps, 1))
    return indptr, indices, last


@pytest.mark.parametrize("ps", [1, 4, 16])
def test_paged_kv_csr_matches_the_row_by_row_layout(ps):
    g = np.random.default_rng(0)
    width = 9
    seq_lens = np.array([1, ps, ps + 1, 3 * ps - 1, 0, width * ps, 0], dtype=np.int64)
    table = g.integers(1, 500, size=(len(seq_lens), width + 3))
    indptr, indices, last = paged_kv_csr(seq_lens, table, ps)
    assert all(a.dtype == np.int32 for a in (indptr, indices, last))
    want = reference_csr(seq_lens, table, ps)
    assert (indptr.tolist(), indices.tolist(), last.tolist()) == want
    # Padding rows (length 0) read one entry of the null page, whatever their table holds.
    assert indices[indptr[4]] == 0 and last[4] == 1


def test_paged_kv_csr_refuses_a_table_too_narrow():
    with pytest.raises(ValueError, match="needs 3 pages; the page table holds 2"):
        paged_kv_csr(np.array([9]), np.zeros((1, 2), dtype=np.int64), 4)


class PlanRecorder(AttentionBackend):
    """A backend that keeps what graph_plan was given (copies: the host buffer is reused)."""

    def __init__(self):
        self.planned = []

    def graph_plan(self, batch_size, seq_lens, page_table):
        self.planned.append((batch_size, np.array(seq_lens), np.array(page_table)))

    def prepare(self, batch):
        raise AssertionError("not run on the CPU")

    def attend(self, q, layer, batch):
        raise AssertionError("not run on the CPU")


def _decode_item(rid: str, prompt: int, out: int, pages: list[int]) -> StepItem:
    req = Request(request_id=rid, prompt_ids=list(range(prompt)), sampling=SamplingParams(), state=None, arrival=0,
                  output_ids=list(range(out)), pages=pages)
    return StepItem(req=req, start=prompt + out - 1, num_tokens=1, new_pages=[], admitted=False)


def test_decode_graphs_plan_the_backend_before_each_replay_with_padding_rows():
    """Three decode rows run at the captured size 4: the backend is planned for 4 rows,
    the three sequences' lengths after the step and their pages, the fourth a padding
    row of length 0; the page lists it builds are the real rows' and one null entry."""
    rec = PlanRecorder()
    graphs = DecodeGraphs(None, rec, torch.device("cpu"), page_size=4, max_batch=8, max_context_tokens=64)
    items = [_decode_item("a", 5, 2, [7, 3]), _decode_item("b", 1, 0, [9]), _decode_item("c", 12, 1, [2, 4, 6, 8])]
    padded = graphs.size_for(len(items))
    assert padded == 4
    graphs._fill(items, padded)
    (b, seq, table), = rec.planned
    assert b == 4 and seq.tolist() == [7, 1, 13, 0]
    assert table.shape == (4, 16)
    indptr, indices, last = paged_kv_csr(seq, table, 4)
    assert indptr.tolist() == [0, 2, 3, 7, 8]
    assert indices.tolist() == [7, 3, 9, 2, 4, 6, 8, 0]
    assert last.tolist() == [3, 1, 1, 1]


def test_decode_graphs_plan_the_capture_inputs():
    """Before a capture the backend is planned over the dummy inputs the capture records
    with: every row one token long on the null page."""
    rec = PlanRecorder()
    graphs = DecodeGraphs(None, rec, torch.device("cpu"), page_size=4, max_batch=8, max_context_tokens=64)
    graphs._fill_dummy(8)
    (b, seq, table), = rec.planned
    assert b == 8 and seq.tolist() == [1] * 8 and not table.any()


def test_profile_groups_kernels_by_kind():
    """The decode profile's table by kind: names as the profiler reports our Triton
    kernels, cuBLAS's and FlashInfer's."""
    from engine.bench.decode_profile import kernel_kind

    assert kernel_kind("_decode_kernel") == kernel_kind("_merge_kernel") == "attention"
    assert kernel_kind("BatchDecodeWithPagedKVCacheKernel<...>") == "attention"
    assert kernel_kind("nvjet_sm90_tst_64x8_64x16_4x1_v_bz_splitK_TNT") == "GEMM (cuBLAS / gemv)"
    assert kernel_kind("_rms_norm_kernel") == "residual add + RMSNorm"
    assert kernel_kind("_rotary_store_kernel") == "q/k norm + rotary + KV store"
    assert kernel_kind("_silu_and_mul_kernel") == "SiLU-and-mul"
    assert kernel_kind("void at::native::vectorized_elementwise_kernel<4, ...>") == "other"
