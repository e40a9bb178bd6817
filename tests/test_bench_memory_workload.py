"""``headroom bench memory``'s workload reaches the plan's worst step and ends: ``B - 1``
requests decoding while the long prompt is prefilled in full chunks, also when
prefilling all the long prompts takes more steps than a request of 32 new tokens lives
(the 16 GiB case's proportions, scaled down to a tiny model on the CPU)."""

from __future__ import annotations

from engine.bench.memory import worst_step_workload
from engine.common.config import EngineConfig
from engine.core.engine import Engine


def test_worst_step_workload_reaches_the_worst_step_and_ends(tmp_path, make_tiny_hf_model):
    make_tiny_hf_model("qwen3", tmp_path, vocab_size=256, max_position_embeddings=2048)
    b, chunk = 16, 256
    engine = Engine(EngineConfig(model=str(tmp_path), device="cpu", dtype="float32", num_pages=1000,
                                 max_model_len=2048, max_running_requests=b, max_prefill_tokens=chunk))
    # 15 prompts of ~900 tokens at 256 per step: about 55 prefill steps, more than 32.
    seen = []
    run = engine.runner.run

    def recording(plan):
        decoding = sum(1 for it in plan.items if it.num_tokens == 1 and it.req.request_id.startswith("long-"))
        chunked = [it.num_tokens for it in plan.items if it.req.request_id == "chunked"]
        seen.append((decoding, chunked[0] if chunked else 0))
        return run(plan)

    engine.runner.run = recording
    worst_step_workload(engine)
    assert not engine.has_work()
    # The worst step: all B - 1 long requests decode next to a full chunk of the long prompt.
    assert any(d == b - 1 and c == chunk - (b - 1) for d, c in seen), max(seen)
