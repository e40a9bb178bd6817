"""A step's inputs as the runner uploads them: every field of the ForwardBatch from the
plan's items, against the definition (slot = page * page_size + offset, rows in order)."""

from __future__ import annotations

import torch

from engine.core.step_inputs import StepInputs, token_at
from engine.scheduler.request import Request
from engine.scheduler.scheduler import StepItem
from engine.wire.messages import SamplingParams


def _req(rid: str, prompt: list[int], output: list[int], pages: list[int]) -> Request:
    return Request(request_id=rid, prompt_ids=prompt, sampling=SamplingParams(), state=None, arrival=0,
                   output_ids=output, pages=pages)


def test_mixed_step_fields_follow_the_definition():
    ps = 4
    a = _req("a", list(range(100, 110)), [], [7, 3, 9])  # chunk of 6 after a 4-token prefix
    b = _req("b", [1, 2, 3, 4, 5], [6, 7], [2, 5])  # decode of its 8th token (position 7)
    c = _req("c", [40, 41, 42], [], [8])  # a whole prompt in one chunk
    items = [StepItem(a, 4, 6, [], False), StepItem(b, 6, 1, [], False), StepItem(c, 0, 3, [], True)]
    batch = StepInputs(torch.device("cpu"), ps).build(items, is_decode=False)

    want_ids, want_pos, want_slots = [], [], []
    for it in items:
        for p in range(it.start, it.start + it.num_tokens):
            want_ids.append(token_at(it.req, p))
            want_pos.append(p)
            want_slots.append(it.req.pages[p // ps] * ps + p % ps)
    assert batch.input_ids.tolist() == want_ids
    assert want_ids[:6] == list(range(104, 110)) and want_ids[6] == 7
    assert batch.positions.tolist() == want_pos
    assert batch.out_slots.tolist() == want_slots
    assert batch.prefix_lens.tolist() == [4, 6, 0]
    assert batch.extend_lens.tolist() == [6, 1, 3]
    # a's chunk reaches its prompt's end (4 + 6 == 10), so all three sample.
    assert [it.samples for it in items] == [True, True, True]
    assert batch.logits_indices.tolist() == [5, 6, 9]
    assert batch.page_table.tolist() == [[7, 3, 9], [2, 5, 0], [8, 0, 0]]
    seq, prefix, ext, starts = batch.device_meta()
    assert (seq.tolist(), prefix.tolist(), ext.tolist(), starts.tolist()) == ([10, 7, 3], [4, 6, 0], [6, 1, 3], [0, 6, 7])
    assert batch.page_table_cpu.tolist() == batch.page_table.tolist()


def test_rows_that_do_not_sample_get_no_logits_row():
    a = _req("a", list(range(20)), [], [1, 2, 3, 4, 5])
    b = _req("b", [5], [6], [6])
    items = [StepItem(a, 0, 8, [], True), StepItem(b, 1, 1, [], False)]  # a's first chunk of 8
    batch = StepInputs(torch.device("cpu"), 4).build(items, is_decode=False)
    assert batch.logits_indices.tolist() == [8]  # b's row only
    assert batch.num_tokens == 9 and batch.batch_size == 2


def test_graph_batch_sizes_ladder():
    from engine.core.cuda_graphs import graph_batch_sizes

    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]  # the largest is always captured
    assert graph_batch_sizes(3) == [1, 2, 3]
    assert graph_batch_sizes(1) == [1]


def test_prefill_graph_sizes_ladder():
    from engine.core.prefill_graphs import prefill_graph_sizes

    assert prefill_graph_sizes(512) == [16, 32, 64, 128, 256, 512]
    assert prefill_graph_sizes(300) == [16, 32, 64, 128, 256, 300]  # the largest is always captured
    assert prefill_graph_sizes(16) == [16]
    assert prefill_graph_sizes(5) == [5]
    assert prefill_graph_sizes(0) == []


def test_a_prefill_graph_takes_one_unscored_sequence_that_fits():
    from engine.core.prefill_graphs import graph_size_for

    sizes = [16, 32, 64, 128]
    a = _req("a", list(range(100, 140)), [], [1, 2, 3])
    b = _req("b", [1, 2, 3], [], [4])
    assert graph_size_for([StepItem(a, 0, 40, [], True)], sizes) == 64
    assert graph_size_for([StepItem(a, 32, 8, [], False)], sizes) == 16
    assert graph_size_for([StepItem(b, 0, 3, [], True), StepItem(a, 0, 40, [], True)], sizes) is None
    assert graph_size_for([StepItem(a, 0, 40, [], True)], [16, 32]) is None  # longer than the largest
    scored = _req("s", list(range(100, 140)), [], [1, 2, 3])
    scored.sampling = SamplingParams(prompt_logprobs=2)
    assert graph_size_for([StepItem(scored, 0, 40, [], True)], sizes) is None


def test_prefill_graph_inputs_follow_the_step_inputs():
    """The replay's buffer for a chunk after a cached prefix: the same ids, positions,
    slots, lengths, logits row and page table as the eager step's batch, then padding
    rows of token 0 at position 0 written to the null page."""
    import numpy as np

    from engine.core.prefill_graphs import write_inputs

    ps, t, padded, width = 4, 32, 16, 5
    a = _req("a", list(range(100, 115)), [], [7, 3, 9, 6])
    item = StepItem(a, 4, 11, [], False)
    batch = StepInputs(torch.device("cpu"), ps).build([item], is_decode=False)
    h = np.full(3 * t + 5 + width, -1, dtype=np.int64)
    write_inputs(h, item, padded, t, ps)
    k = item.num_tokens
    assert h[:k].tolist() == batch.input_ids.tolist()
    assert h[t : t + k].tolist() == batch.positions.tolist()
    assert h[2 * t : 2 * t + k].tolist() == batch.out_slots.tolist()
    for section in (0, t, 2 * t):
        assert h[section + k : section + padded].tolist() == [0] * (padded - k)
    meta = [batch.seq_lens_device, batch.prefix_lens_device, batch.extend_lens_device, batch.extend_starts_device]
    assert h[3 * t : 3 * t + 4].tolist() == [int(m[0]) for m in meta]
    assert int(h[3 * t + 4]) == k - 1  # the last token's row
    assert h[3 * t + 5 :].tolist() == [7, 3, 9, 6, 0]
