"""The ``headroom`` command: the group :func:`main` with ``serve`` (:mod:`service.cli.serve`),
``bench ...`` (:mod:`service.cli.bench`), ``service ...`` (:mod:`service.cli.autostart`),
``doctor`` (:mod:`service.cli.doctor`), ``token``, ``status``, ``tray`` (:mod:`service.tray.app`), and the engine's commands run in
this process (``generate``, ``plan``).

This module stays light at import (click only): the worker is started with the
*spawn* method, which re-imports the parent's main script (this console script) in
the child, and the worker must never import Litestar. Commands import what they need
inside their function; commands that run the engine in-process (``generate``,
``bench engine``) import engine modules there, never here. The options are declared
once, in :mod:`service.cli.options`.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import click

from service.cli.autostart import service as service_group
from service.cli.bench import bench
from service.cli.doctor import doctor
from service.cli.exits import EXIT_FAILED, EXIT_USAGE, JsonErrorsCommand, errors_as_json, fail
from service.cli.models import models, pull
from service.cli.options import (
    KERNEL_SWITCHES,
    FiniteFloatRange,
    config_option,
    max_tokens_option,
    resolve_or_fail,
    seed_option,
    warn_unknown_variables,
    with_settings,
)
from service.cli.precheck import check_model_before_loading
from service.cli.serve import serve
from service.common.ranges import MAX_TOKENS_MIN, TEMPERATURE_MAX, TEMPERATURE_MIN
from service.common.version import headroom_version


class _Headroom(click.Group):
    """The command group; a runtime folder that cannot be used (a bad
    ``HEADROOM_RUNTIME_DIR``) is one line naming it, exit 2, from any command."""

    def invoke(self, ctx: click.Context) -> Any:
        from service.common.paths import RuntimeDirError

        try:
            return super().invoke(ctx)
        except RuntimeDirError as exc:
            fail(str(exc), EXIT_USAGE)


@click.group(cls=_Headroom, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(
    version=headroom_version(), prog_name="headroom", message="%(prog)s %(version)s"
)
def main() -> None:
    """headroom: a local LLM service that plans every byte of GPU memory."""
    warn_unknown_variables()


main.add_command(serve)
main.add_command(service_group)
main.add_command(doctor)
main.add_command(bench)
main.add_command(models)
main.add_command(pull)


@main.command(
    epilog="The token guards the control routes (/api/control/*) and the event socket "
    "(/api/events); send it as 'Authorization: Bearer <token>'. It is created (owner-only) "
    "on first use; HEADROOM_CONFIG_DIR moves its folder."
)
@config_option
@with_settings("host", "port")
def token(config_path: Path | None, **flags: Any) -> None:
    """Print the local token's file and the dashboard's address with the token: the
    running headroom serve's (where `headroom status` finds it), else the configured
    host and port's."""
    settings = resolve_or_fail(flags, config_path)
    from service.cli.instance import service_address
    from service.common.token import dashboard_url, load_or_create_token, token_path

    host, port, info = service_address(settings.host, settings.port)
    path = Path(info["token_file"]) if info and info.get("token_file") else token_path()
    try:
        value = load_or_create_token(path)
    except OSError as exc:
        fail(f"cannot read or create the local token {path}: {exc}")
    click.echo(f"token file: {path}")
    click.echo(f"dashboard:  {dashboard_url(host, port, value)}")


@main.command(
    epilog="The tray follows the service through its public API: the event socket and the "
    "control routes, with the local token (the file `headroom token` names). It needs the "
    "`tray` extra: pip install 'headroom[tray]'."
)
@config_option
@with_settings("host", "port")
def tray(config_path: Path | None, **flags: Any) -> None:
    """Show the running service in the desktop's tray: its state as the icon's colour,
    headroom and KV pool in the tooltip; pause, restart, reserve and start at login in
    the menu."""
    settings = resolve_or_fail(flags, config_path)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)-7s %(name)s: %(message)s")
    try:
        from service.tray.app import TrayApp
    except ImportError as exc:
        fail(f"the tray needs pystray and Pillow: pip install 'headroom[tray]' ({exc})")
    except Exception as exc:  # pystray picks its backend at import: no display is an error there
        fail(f"no desktop tray to show the icon in: {exc}")
    import pystray

    from service.tray.host import tray_host_problem

    problem = tray_host_problem(pystray.Icon.__module__)
    if problem is not None:
        fail(problem)
    from service.common.token import dashboard_url, load_or_create_token, token_path

    try:
        value = load_or_create_token()
    except OSError as exc:
        fail(f"cannot read or create the local token {token_path()}: {exc}")
    base_url = dashboard_url(settings.host, settings.port).removesuffix("/ui/")
    TrayApp(base_url, settings.host, settings.port, value).run()


@main.command()
def status() -> None:
    """Ask the running headroom serve how it is: its state, model and GPU headroom.

    Exits 0 when one answers, 1 when none runs (or it does not answer)."""
    from service.cli.instance import running

    info = running()
    if info is None:
        fail("no headroom service is running (start one with `headroom serve`)")
    import httpx

    url = info.get("url", "")
    try:
        health = httpx.get(f"{url}/api/health", timeout=5.0).json()
        snapshot = httpx.get(f"{url}/api/status", timeout=10.0).json()
    except (httpx.HTTPError, ValueError) as exc:
        fail(f"headroom (pid {info.get('pid')}) on {url} does not answer: {exc}")
    from engine.memory.plan import fmt_bytes

    click.echo(f"headroom {info.get('version', '?')} on {url} (pid {info.get('pid')})")
    click.echo(f"state:    {health.get('status')}")
    if health.get("reason"):
        click.echo(f"reason:   {health['reason']}")
    click.echo(f"model:    {health.get('model') or '(none loaded yet)'}")
    vram = snapshot.get("vram") or {}
    if vram.get("source") not in (None, "none"):
        click.echo(
            f"headroom: {fmt_bytes(vram['headroom_bytes'])} ({fmt_bytes(vram['free_bytes'])} "
            f"free of {fmt_bytes(vram['total_bytes'])}, reserve {fmt_bytes(vram['reserve_bytes'])})"
        )
    else:
        click.echo("headroom: no GPU watched (CPU mode)")


# Engine options (declared on engine.common.config.EngineConfig) that generate and plan share
# with serve: same flags, variables and config keys.
_MODEL_OPTIONS = ("model", "device", "dtype", "gguf_quantized", "quantization", "kv_cache_dtype", "cpu_layers")
_PLAN_KNOBS = (
    "reserve",
    "device_limit",
    "max_prefill_tokens",
    "max_running_requests",
    "max_model_len",
    "min_context",
    "cpu_experts",
    "tensor_parallel_size",
    "sliding_kv_ring",
)


def _note_flags_the_service_ignored(flags: dict[str, Any]) -> None:
    """One line on stderr naming the engine flags typed for ``generate`` that the running
    service's answer did not use (it keeps its own settings); ``--local`` would."""
    from service.common.settings import OPTIONS_BY_NAME

    typed = [OPTIONS_BY_NAME[name].flag for name, value in flags.items()
             if value not in (None, ()) and name not in ("model", "api_key")]
    if typed:
        click.echo(f"headroom: note: the running headroom serve answered with its own settings; {', '.join(typed)} "
                   "took no effect (--local runs the engine in this process with them)", err=True)


@main.command(
    epilog="Engine settings (--model, --reserve, --max-model-len...) are serve's: they "
    "are also read from HEADROOM_* variables and the config file. One prompt runs, so "
    "the plan holds one request (--max-running-requests 1)."
)
@max_tokens_option(
    256, "Most tokens to generate (0: none, as the API's max_tokens 0).", least=MAX_TOKENS_MIN
)
@click.option(
    "--temperature",
    type=FiniteFloatRange(TEMPERATURE_MIN, TEMPERATURE_MAX),
    default=None,
    help="Sampling temperature; 0 is greedy. Unset: the model's recommended sampling "
    "(its generation_config.json or GGUF sampling metadata, as the API's unset fields).",
)
@seed_option(None, "Seed of the sampler (same seed, same reply).")
@click.option(
    "--chat/--raw",
    default=True,
    show_default=True,
    help="Wrap the prompt in the model's chat template as a user message, or send it as is.",
)
@click.option(
    "--local",
    is_flag=True,
    help="Load the engine in this process even when a headroom serve runs (by default "
    "the running service answers, with its own model and settings).",
)
@config_option
@with_settings(
    *_MODEL_OPTIONS,
    "max_model_len",
    "max_prefill_tokens",
    "reserve",
    "device_limit",
    "min_context",
    "api_key",
    *KERNEL_SWITCHES,
)
@click.argument("prompt")
def generate(
    prompt: str,
    max_tokens: int,
    temperature: float | None,
    seed: int | None,
    chat: bool,
    local: bool,
    config_path: Path | None,
    **flags: Any,
) -> None:
    """Stream one reply to PROMPT to stdout: from the running headroom serve when one
    answers (its model and settings), else with the engine in this process."""
    settings = resolve_or_fail(flags, config_path)
    if not chat and not prompt:
        fail("the prompt is empty; pass the text to complete (or leave out --raw to send it as a chat message)",
             EXIT_USAGE)
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:  # argv bytes that are not UTF-8, kept as surrogates
        raw = prompt[exc.start:exc.end].encode("utf-8", "surrogateescape")
        fail(f"the prompt is not UTF-8 text (byte 0x{raw[0]:02x} after {exc.start} characters); pass it as "
             "UTF-8 (a UTF-8 terminal or locale, e.g. LANG=C.UTF-8)", EXIT_USAGE)
    if not local:
        from service.cli.instance import running
        from service.cli.via_service import generate_on_service

        info = running()
        if info is not None and generate_on_service(
            info, prompt=prompt, chat=chat, model=settings.model, max_tokens=max_tokens,
            temperature=temperature, seed=seed, api_key=settings.api_key,
        ):
            _note_flags_the_service_ignored(flags)
            return
    check_model_before_loading(settings.model, tokenizer=True, convert=True)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    from dataclasses import replace

    from engine.commands.generate import GenerationFailed, run_generate
    from engine.common.errors import CudaUnavailable, PlanDoesNotFit, RequestRejected
    from engine.common.load_errors import ModelLoadError
    from engine.text.chat import NO_CHAT_TEMPLATE, ChatTemplateError, NoChatTemplate
    from service.api.sampling_defaults import load_sampling_defaults

    config = replace(settings.engine_config(), max_running_requests=1)
    try:
        run_generate(
            model=settings.model,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=temperature,
            seed=seed,
            chat=chat,
            config=config,
            model_defaults=lambda folder: load_sampling_defaults(folder).as_dict(),
        )
    except ModelLoadError as exc:
        fail(f"cannot load the model: {exc}", EXIT_USAGE)
    except CudaUnavailable as exc:
        fail(str(exc), EXIT_USAGE)
    except PlanDoesNotFit as exc:
        fail(str(exc))
    except NoChatTemplate:
        fail(f"{NO_CHAT_TEMPLATE}; pass --raw to send the prompt as it is", EXIT_USAGE)
    except ChatTemplateError as exc:
        fail(f"{exc.message}; pass --raw to send the prompt without the chat template")
    except RequestRejected as exc:
        if exc.code != "context_length_exceeded":
            fail(f"the prompt cannot run: {exc.message}", EXIT_USAGE)
        fix = "shorten the prompt"
        if settings.max_model_len is not None:
            fix += f" or raise --max-model-len (now {settings.max_model_len})"
        fail(f"the prompt cannot run: {exc.message}; {fix}", EXIT_USAGE)
    except GenerationFailed as exc:
        hint = (
            "; free device memory (close other GPU applications) or lower "
            "--max-prefill-tokens, then try again"
            if exc.code == "out_of_memory"
            else ""
        )
        click.echo()
        fail(f"{exc.message}{hint}")
    except ValueError as exc:  # a bad config value the engine refused (dtype, device)
        fail(str(exc), EXIT_USAGE)
    except KeyboardInterrupt:
        click.echo()
        sys.exit(130)


@main.command(
    cls=JsonErrorsCommand,
    epilog="Without a GPU, plan for a simulated one: --device-total 6GiB --device-free "
    "5.5GiB. Sizes: 6GiB, 5.5GiB, 512MiB, 6GB (decimal) or bytes. Settings are serve's: "
    "also read from HEADROOM_* variables and the config file. Exits 0 when the plan "
    "fits, 1 when it does not (with what would fix it), 2 for a usage error. With "
    "--json, stdout is always one JSON object: the plan (its 'fits' false on exit 1), "
    "or on exit 2 {\"error\": MESSAGE, \"exit_code\": 2} (the message also on stderr); "
    "only a command line click cannot parse (an unknown option) prints usage text alone."
)
@config_option
@with_settings(
    *_MODEL_OPTIONS,
    "device_total",
    "device_free",
    "device_display",
    *_PLAN_KNOBS,
    "page_size",
    "num_pages",
    "kv_cache",
    *KERNEL_SWITCHES,
)
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
def plan(config_path: Path | None, as_json: bool, **flags: Any) -> None:
    """Print the memory plan (the ledger from device total to KV pages) for a model and a
    device, without loading the weights or serving."""
    if as_json:
        errors_as_json()
    settings = resolve_or_fail(flags, config_path)
    check_model_before_loading(settings.model, tokenizer=False, convert=True)

    from engine.commands.plan import (
        CpuWithoutPlan,
        NoDevice,
        cpu_holdings,
        plan_with_pool,
        planned_setup,
        render,
        render_cpu,
    )
    from engine.common.errors import CudaUnavailable
    from engine.common.load_errors import ModelLoadError

    try:
        config = settings.engine_config()
        try:
            device, dtype = planned_setup(config)
        except CpuWithoutPlan:
            holdings = cpu_holdings(config)
            click.echo(render_cpu(holdings, as_json))
            if not holdings.fits:
                sys.exit(EXIT_FAILED)
            return
        memory_plan, fixed = plan_with_pool(config)
    except (NoDevice, CudaUnavailable) as exc:
        fail(str(exc), EXIT_USAGE)
    except ModelLoadError as exc:
        fail(f"cannot read the model: {exc}", EXIT_USAGE)
    except ValueError as exc:
        fail(str(exc), EXIT_USAGE)
    click.echo(render(memory_plan, as_json, f"{str(dtype).removeprefix('torch.')} on {device}", fixed))
    if not memory_plan.fits:
        sys.exit(EXIT_FAILED)


if __name__ == "__main__":
    main()
