"""The engine's commands: what ``headroom generate``, ``headroom plan`` and
``headroom bench engine|memory`` run on top of the engine's core (``engine.core.engine``,
the scheduler, the KV cache, the models, the memory plan).

Nothing in the core imports from here; the CLI (``service.cli.commands``,
``service.cli.bench``) imports each command lazily, so ``headroom --help`` does not load
torch.
"""
