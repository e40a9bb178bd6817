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
