"""headroom's inference engine: model loading, paged KV cache, scheduler, sampler.

Torch-free modules that the service may import: ``engine.wire.messages``,
``engine.text`` (chat template, detokenizer, stop strings) and ``engine.common.config``.
Everything else imports torch.
"""
