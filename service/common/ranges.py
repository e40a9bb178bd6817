"""The ranges of the sampling values a caller sets, declared once for every door into
the engine: the API's sampling fields (:class:`service.api.sampling.Sampling`, which
OpenAI's bodies inherit and Ollama's options are converted into) and ``headroom generate``'s
options (:mod:`service.cli.options`). Bounds are inclusive. Plain numbers and no
imports, so the CLI reads them at import and stays light.
"""

# ``seed``: any integer a signed 64-bit integer holds from 0 (one exists in every
# client's language; the engine's generator takes 64 bits).
SEED_MIN = 0
SEED_MAX = (1 << 63) - 1
# OpenAI's range; 0 is greedy.
TEMPERATURE_MIN = 0.0
TEMPERATURE_MAX = 2.0
# ``repetition_penalty`` divides the positive logits of seen tokens: near 0 the quotient
# overflows the float range and the row has no usable value left; below 0.01 (a seen
# token's logit times 100) no sampling needs it.
REPETITION_PENALTY_MIN = 0.01
REPETITION_PENALTY_MAX = 10.0
# 0 answers an empty completion (and, for a text completion with ``echo`` and
# ``logprobs``, scores the prompt); the upper bound is the context.
MAX_TOKENS_MIN = 0
