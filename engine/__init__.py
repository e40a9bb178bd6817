"""headroom's inference engine: model loading, paged KV cache, scheduler, sampler.

Torch-free modules that the service may import: ``engine.messages``,
``engine.text`` (chat template, detokenizer, stop strings) and ``engine.config``.
Everything else imports torch.
"""
