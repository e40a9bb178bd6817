"""``headroom models`` and ``headroom pull``: the local model store
(:mod:`engine.loader.store`, :mod:`engine.loader.pull`). Torch-free."""

from __future__ import annotations

import json

import click

from service.cli.exits import EXIT_FAILED, EXIT_USAGE, JsonErrorsCommand, fail


@click.command(cls=JsonErrorsCommand, context_settings={"allow_extra_args": True})
@click.option("--json", "as_json", is_flag=True, help="Print the list as JSON.")
@click.pass_context
def models(ctx: click.Context, as_json: bool) -> None:
    """List the models in the local store (fetched with `headroom pull`): name,
    architecture, quantization, size on disk and context, and the embedded default
    model served without --model. Pass a store name to --model. Models are files:
    remove one by deleting its folder in the store."""
    from engine.common.units import fmt_bytes
    from engine.loader.store import embedded_default, list_store, store_dir

    if ctx.args:
        fail(f"`headroom models` has no subcommand {ctx.args[0]!r}: it only lists the local store "
             f"(--json adds each model's path). Models are files: remove one by deleting its "
             f"models--OWNER--NAME folder in the store ({store_dir()}); fetch one with "
             f"`headroom pull REPO[:FILE.gguf]`", EXIT_USAGE)

    stored = list_store()
    default = embedded_default()
    found = ([default] if default is not None else []) + stored
    if as_json:
        click.echo(json.dumps([
            {"name": m.name, "path": str(m.path), "architecture": m.architecture, "quantization": m.quantization,
             "size_bytes": m.size_bytes, "context_tokens": m.context_tokens, "embedded": m.embedded}
            for m in found
        ]))
        return
    rows = [("NAME", "ARCHITECTURE", "QUANTIZATION", "SIZE", "CONTEXT")]
    rows += [(m.name + (" (embedded default, served without --model)" if m.embedded else ""), m.architecture,
              m.quantization, fmt_bytes(m.size_bytes), f"{m.context_tokens:,}" if m.context_tokens else "?")
             for m in found]
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for r in rows if found else []:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())
    if not stored:
        click.echo(f"no models in the store ({store_dir()}) yet: fetch one with `headroom pull REPO[:FILE.gguf]`")


@click.command()
@click.argument("spec", metavar="REPO[:FILE]")
def pull(spec: str) -> None:
    """Fetch a model from the Hugging Face Hub into the local store: REPO (owner/name)
    for a Hugging Face folder (config, safetensors, tokenizer), REPO:FILE.gguf for one
    GGUF file. Resumes an interrupted download; honours HF_ENDPOINT, HF_TOKEN and
    HF_HUB_OFFLINE. Then serve it with `--model REPO[:FILE.gguf]`."""
    from engine.loader.pull import PullError
    from engine.loader.pull import pull as fetch

    try:
        pulled = fetch(spec)
    except PullError as exc:
        fail(str(exc), EXIT_USAGE if exc.usage else EXIT_FAILED)
    click.echo(f"pulled {pulled.name} into {pulled.path}")
    click.echo(f"serve it with: headroom serve --model {pulled.name}")
