"""The near-tie rule for greedy text of a quantized path against its float reference:
where the two answers part, the reference itself was near a tie. Scored by the
reference (teacher-forced, ``prompt_logprobs``), every token the quantized path chose is
within :data:`NEAR_TIE` of the reference's best at that place."""

from __future__ import annotations

from engine.core.engine import Engine
from engine.wire.messages import GenerateRequest, SamplingParams

# How far below the float32 reference's best token a quantized path's greedy choice may
# score, in the reference's own log-probabilities (= logits). Measured on the 5 greedy
# prompts with quantized weights: where the paths part, the reference's top two were at
# most 0.1 apart.
NEAR_TIE = 0.25


def assert_near_ties(reference: Engine, prompts: list[list[int]], ours: list[list[int]], label: str) -> None:
    """Score ``ours[i]`` (output ids after ``prompts[i]``) with ``reference`` and assert
    each token within :data:`NEAR_TIE` of the reference's best; ``label`` names the
    scoring requests and the failures."""
    scoring = SamplingParams(max_new_tokens=1, temperature=0.0, prompt_logprobs=1)
    for i, (ids, out) in enumerate(zip(prompts, ours, strict=True)):
        reference.add_request(GenerateRequest(request_id=f"score-{label}-{i}", prompt_token_ids=ids + out,
                                              sampling=scoring))
        scored = None
        while reference.has_work():
            for o in reference.step():
                if o.prompt_logprobs is not None:
                    scored = o.prompt_logprobs[len(ids):]
        assert scored is not None and len(scored) == len(out)
        for t, lp in enumerate(scored):
            assert lp.token_id == out[t]
            assert lp.logprob >= lp.top_logprobs[0] - NEAR_TIE, (label, i, t)
