"""headroom's inference engine: model loading, paged KV cache, scheduler, sampler.

Torch-free modules that the service may import: ``engine.wire`` (the worker's messages),
``engine.text`` (chat template, detokenizer, stop strings), ``engine.common`` (configs,
options, units, errors; not ``forward_batch`` or ``faults``), ``engine.memory`` (the plan) and ``engine.models.registry``
(the supported architectures). Most of the rest imports torch.
"""
