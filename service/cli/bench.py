"""``headroom bench``: the benchmarks (not tests) that print the figures of docs/benchmarks.md.

``bench serve`` and ``bench chaos`` drive a running (or started) ``headroom serve``
over HTTP (:mod:`service.bench`); ``bench engine`` and ``bench memory`` run the engine
in this process (:mod:`engine.commands`), imported inside the command, never here.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from service.cli.exits import EXIT_FAILED, EXIT_USAGE, fail
from service.cli.options import (
    KERNEL_SWITCHES,
    FiniteFloatRange,
    config_option,
    count_option,
    device_option,
    max_tokens_option,
    model_option,
    requests_option,
    resolve_or_fail,
    seed_option,
    url_option,
    with_settings,
)
from service.cli.precheck import check_model_before_loading, note_gpu_only_settings
from service.common.settings import parse_size


class _HogSize(FiniteFloatRange):
    """``--hog``: a number of GiB (``2.5``) or a size with its unit (``2560MiB``, as
    ``--device-total`` takes one)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        text = value.strip() if isinstance(value, str) else ""
        if text and not text[-1].isdigit() and text[-1] != ".":
            try:
                value = parse_size(text) / 2**30
            except ValueError as exc:
                self.fail(f"{exc}; or a number of GiB, e.g. 2.5", param, ctx)
        return super().convert(value, param, ctx)


@click.group()
def bench() -> None:
    """Benchmarks (not tests): print the figures of docs/benchmarks.md."""


@bench.command("serve")
@url_option(None, "Base URL of a running headroom serve [default: the running one's, as `headroom status` "
            "finds it, else the configured host and port's (HEADROOM_PORT...)].")
@requests_option(32)
@click.option(
    "-c",
    "--concurrency",
    type=click.IntRange(min=1),
    default=None,
    help="Requests in flight at once, at most -n [default: all of them].",
)
@max_tokens_option(
    64, "Completion tokens per request (EOS ignored, so every request runs this long)."
)
@count_option(
    "--prompt-words", least=1, default=64, help_text="Approximate prompt length, in words."
)
@click.option("--api-key", envvar="HEADROOM_API_KEY", default=None, help="Key for /v1, if set.")
@click.option(
    "--engine/--no-engine",
    "engine_baseline",
    default=True,
    show_default=True,
    help="Also run the engine in-process on the same prompts, for the service's overhead.",
)
@device_option("Device of the in-process engine run.")
@click.option("--client-processes", type=click.IntRange(min=1), default=None,
              help="Processes the client runs its streams in, the requests split between them "
              "[default: one per 16 streams, at most the cores less two].")
def bench_serve(
    url: str | None,
    num_requests: int,
    concurrency: int | None,
    max_tokens: int,
    prompt_words: int,
    api_key: str | None,
    engine_baseline: bool,
    device: str,
    client_processes: int | None,
) -> None:
    """Send N concurrent streaming requests to a running server; print TTFT and ITL
    percentiles, throughput, and the overhead against the engine alone."""
    from service.bench.serve import BenchOptions, BenchRefused, auto_client_processes, run_bench

    if url is None:
        from service.cli.instance import service_address
        from service.common.token import service_url

        settings = resolve_or_fail({}, None)
        url = service_url(*service_address(settings.host, settings.port)[:2])
    concurrency = min(concurrency or num_requests, num_requests)
    options = BenchOptions(
        url=url,
        num_requests=num_requests,
        concurrency=concurrency,
        client_processes=client_processes or auto_client_processes(concurrency),
        max_tokens=max_tokens,
        prompt_words=prompt_words,
        api_key=api_key,
        engine_baseline=engine_baseline,
        device=device,
    )
    try:
        run_bench(options)
    except BenchRefused as exc:
        fail(str(exc), EXIT_USAGE)


@bench.command(
    "chaos",
    epilog="Without --url it starts `headroom serve` itself (logs, token and fault folder "
    "in --workdir) on a simulated 4 GiB card playing a desktop loop (--vram-timeline to "
    "play yours), or on the real card with --hog. Exits 1 when a figure that must be 0 "
    "is not (hung, undocumented failures, wrong outputs, orphans, leaked pages).",
)
@requests_option(1000)
@count_option("-c", "--clients", least=1, default=16, help_text="Concurrent clients.")
@count_option(
    "--kills", least=0, default=10, help_text="Times the worker is SIGKILLed, at random points."
)
@count_option(
    "--ooms",
    least=0,
    default=50,
    help_text="Out-of-memory errors injected at random sites and points.",
)
@max_tokens_option(24, "Completion tokens of a greedy request.")
@url_option(
    None,
    "A running headroom serve (started with "
    "HEADROOM_FAULTS_DIR=--faults-dir for OOMs) [default: start one].",
)
@click.option(
    "--faults-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="With --url: the service's HEADROOM_FAULTS_DIR.",
)
@click.option(
    "--token",
    default=None,
    help="With --url: the local token, to clear the "
    "prefix cache for the leak check [default: this user's].",
)
@model_option("Model of the started service [default: embedded].")
@device_option("Device of the started service.")
@click.option(
    "--vram-timeline",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    default=None,
    help="Timeline file of the simulated card [default: a desktop loop].",
)
@click.option(
    "--hog",
    "hog_gib",
    type=_HogSize(min=0.05),
    default=None,
    metavar="GiB",
    help="Run a second process taking and freeing up to GiB of GPU memory with "
    "torch, and serve against the real card (NVML) instead of a simulated one "
    "(a number of GiB, or a size: 2.5, 2560MiB, 3GB).",
)
@click.option(
    "--hang-timeout",
    "hang_s",
    type=FiniteFloatRange(min=1),
    default=600.0,
    show_default=True,
    help="Seconds after which a request with no ending is hung.",
)
@seed_option(0, "Seed of the mix and timing.")
@click.option(
    "--serve-arg",
    "serve_args",
    multiple=True,
    metavar="ARG",
    help="An argument for the started `headroom serve`, e.g. --serve-arg=--max-prefill-tokens "
    "--serve-arg=512 (repeatable).",
)
@click.option(
    "--workdir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Folder for the started service's log, token and faults [default: a new temporary one].",
)
def bench_chaos(**kwargs: Any) -> None:
    """Send many requests while killing the worker, injecting OOMs and moving the
    desktop's memory; print what succeeded, failed (by code), hung or came out wrong,
    restarts, time back to ready, orphans, leaked pages and TTFT."""
    from service.bench.chaos import run_chaos
    from service.bench.chaos_options import ChaosOptions
    from service.bench.serve import BenchRefused

    if kwargs["url"] is None:
        # Both describe the service --url names; a started one's are in --workdir.
        for name, flag in (("token", "--token"), ("faults_dir", "--faults-dir")):
            if kwargs[name] is not None:
                fail(
                    f"{flag} goes with --url (the service the run starts keeps its token and "
                    "fault folder in --workdir)",
                    EXIT_USAGE,
                )
    if kwargs["hog_gib"] is not None:
        import torch

        if not torch.cuda.is_available():
            fail(
                "--hog needs an NVIDIA GPU and torch's CUDA build (torch sees no CUDA device "
                "here); leave --hog out to play a simulated card",
                EXIT_USAGE,
            )
    opts = ChaosOptions(requests=kwargs.pop("num_requests"), **kwargs)
    try:
        report = run_chaos(opts, out=click.echo)
    except BenchRefused as exc:
        fail(str(exc), EXIT_USAGE)
    except RuntimeError as exc:
        fail(f"chaos run: {exc}")
    problems = report.problems()
    for problem in problems:
        click.echo(f"PROBLEM: {problem}", err=True)
    if problems:
        sys.exit(EXIT_FAILED)


def _int_list(ctx: Any, param: Any, value: str) -> tuple[int, ...]:
    try:
        items = tuple(int(v) for v in value.split(","))  # int() takes surrounding spaces
    except ValueError:  # a word, or an empty item ("1,,2")
        items = ()
    if not items or min(items) < 1:
        raise click.BadParameter(
            f"{value!r}: give positive integers separated by commas, e.g. 1,16"
        )
    return items


def _batch_sizes(ctx: Any, param: Any, value: str) -> tuple[int, ...]:
    """``--batches``: :func:`_int_list`, each at most :data:`engine.bench.llama_cpp.MAX_SEQUENCES`
    sequences. The engine side runs a batch's sequences together (the bench raises
    ``max_running_requests`` to the largest batch, so nothing else bounds it), and
    ``llama-batched-bench``, the comparison, runs no more at once."""
    from engine.bench.llama_cpp import MAX_SEQUENCES

    items = _int_list(ctx, param, value)
    over = [b for b in items if b > MAX_SEQUENCES]
    if over:
        raise click.BadParameter(f"{','.join(map(str, over))}: a batch runs at most {MAX_SEQUENCES} sequences "
                                 f"(as llama.cpp's batched bench); give sizes up to {MAX_SEQUENCES}")
    return items


@bench.command("engine")
@model_option("Hugging Face folder or .gguf file [default: the embedded model].")
@click.option(
    "--shape",
    default=None,
    help="Bench a known model shape with random weights instead of --model "
    "(smollm2-135m, qwen3-0.6b, llama-3.1-8b).",
)
@device_option("auto, cpu or cuda[:N].")
@click.option(
    "--attention-backend",
    type=click.Choice(["auto", "triton", "flashinfer", "torch"]),
    default="auto",
    show_default=True,
    help="Attention kernels of the engine side.",
)
@click.option(
    "--cuda-graphs/--no-cuda-graphs",
    default=True,
    show_default=True,
    help="Replay decode steps as CUDA graphs.",
)
@count_option(
    "--long-prefill-tokens",
    least=0,
    default=8192,
    help_text="Length of the one long prompt measured besides the batches (capped by the "
    "model's context; 0 skips it).",
)
@click.option(
    "--transformers/--no-transformers",
    "transformers_side",
    default=True,
    show_default=True,
    help="Also run transformers' generate, the comparison.",
)
@click.option(
    "--against-llama-cpp",
    metavar="PATH",
    default=None,
    help="Compare with llama.cpp instead of transformers: PATH holds its llama-bench and "
    "llama-batched-bench (built from its source, see docs/benchmarks.md); both run the same "
    "GGUF file (--model, or the embedded model's) on the same cores and threads.",
)
@click.option(
    "--gguf-quantized/--no-gguf-quantized",
    default=None,
    help="Engine side: keep a GGUF's quantized weights quantized (block kernels on CUDA, "
    "the C kernels' blocks or torch's int4 layout on the CPU) instead of dequantizing them at load.  [default: on "
    "the CPU; on CUDA when the model dequantized takes 1 GiB or more]",
)
@click.option(
    "--profile",
    is_flag=True,
    default=False,
    help="Afterwards, print where a decode step's time goes at each --profile-batches "
    "size (host, graph replay, the kernels inside it; CUDA).",
)
@click.option(
    "--profile-batches",
    default="1",
    show_default=True,
    callback=_int_list,
    help="Batch sizes --profile looks at, comma-separated.",
)
@click.option(
    "--batches",
    default="1,16,64",
    show_default=True,
    callback=_batch_sizes,
    help="Batch sizes, comma-separated.",
)
@count_option(
    "--prompt-tokens", least=1, default=128, help_text="Prompt length, in tokens (random ids)."
)
@count_option(
    "--new-tokens",
    least=2,
    default=32,
    help_text="Tokens generated per request (greedy, EOS ignored).",
)
@config_option
@with_settings("kv_cache_dtype", "device_limit", "cpu_layers", *KERNEL_SWITCHES)
def bench_engine(**options: Any) -> None:
    """Prefill and decode tokens/s of the engine against transformers' generate (or
    llama.cpp's benchmarks on the same GGUF file) on the same model, device and dtype, at
    each batch size and on one long prompt; on CUDA each figure also as a share of the
    HBM roofline."""
    if options["shape"] is None:  # a shape's random weights need no files
        check_model_before_loading(options["model"], tokenizer=False, convert=True)
    elif options["model"] is not None:
        fail(f"--shape {options['shape']} benches random weights of that shape instead of a model, so --model "
             f"{options['model']} would be ignored: give --shape or --model, not both", EXIT_USAGE)
    from engine.bench.llama_cpp import LlamaCppFailed
    from engine.bench.model_shapes import SHAPES
    from engine.bench.speed import run_bench_engine
    from engine.common.errors import CudaUnavailable
    from engine.common.load_errors import ModelLoadError
    from engine.common.options import pick
    from kernels.switches import KernelSwitches

    # The KV cache and kernel switches as serve takes them: flags, HEADROOM_* variables,
    # config file.
    own = ("kv_cache_dtype", "device_limit", "cpu_layers")
    settings = resolve_or_fail({name: options.pop(name) for name in (*own, *KERNEL_SWITCHES)},
                               options.pop("config_path"))
    options["kernel_switches"] = pick(settings, KernelSwitches)
    options.update({name: getattr(settings, name) for name in own})
    note_gpu_only_settings(options["device"], settings.cpu_layers, settings.device_limit, settings.device_total)

    shape = options["shape"]
    if shape is not None and shape not in SHAPES:
        fail(f"unknown --shape {shape!r}; known: {', '.join(SHAPES)}", EXIT_USAGE)
    try:
        # The options' names are run_bench_engine's keywords.
        run_bench_engine(**options)
    except ModelLoadError as exc:
        fail(f"cannot load the model: {exc}", EXIT_USAGE)
    except CudaUnavailable as exc:
        fail(str(exc), EXIT_USAGE)
    except ValueError as exc:
        fail(str(exc), EXIT_USAGE)
    except LlamaCppFailed as exc:
        fail(f"llama.cpp's side failed: {exc}", EXIT_FAILED)


# (shape, device limit): random-weight shapes of engine.bench.model_shapes on a capped card.
DEFAULT_MEMORY_CASES = ("qwen3-0.6b:6GiB", "qwen3-0.6b:16GiB", "llama-3.1-8b:24GiB")


@bench.command("memory")
@click.option(
    "--case",
    "cases",
    multiple=True,
    metavar="SHAPE:SIZE",
    help="A model shape (qwen3-0.6b, llama-3.1-8b, or default for the embedded "
    "model) and the device limit to cap it at; repeatable "
    f"[default: {', '.join(DEFAULT_MEMORY_CASES)}].",
)
@count_option("--max-model-len", least=16, default=8192)
@count_option("--max-running-requests", least=2, default=16)
@count_option("--max-prefill-tokens", least=16, default=2048)
def bench_memory(
    cases: tuple[str, ...], max_model_len: int, max_running_requests: int, max_prefill_tokens: int
) -> None:
    """Predicted vs measured memory peak at the plan's worst step, and the KV pool's share
    of the budget, per case (needs a CUDA device)."""
    from engine.bench.model_shapes import SHAPES

    parsed = []
    for case in cases or DEFAULT_MEMORY_CASES:
        shape, sep, size = case.rpartition(":")
        if not sep or (shape != "default" and shape not in SHAPES):
            fail(
                f"--case {case!r}: expected SHAPE:SIZE with SHAPE one of default, "
                f"{', '.join(SHAPES)}, e.g. qwen3-0.6b:6GiB",
                EXIT_USAGE,
            )
        try:
            limit = parse_size(size)
        except ValueError as exc:
            fail(f"--case {case!r}: {exc}", EXIT_USAGE)
        parsed.append(
            (
                None if shape == "default" else shape,
                limit,
                max_model_len,
                max_running_requests,
                max_prefill_tokens,
            )
        )

    import torch

    if not torch.cuda.is_available():
        fail(
            "bench memory needs a CUDA device (it measures real allocator peaks); without "
            "one, `headroom plan --device-total 6GiB` prints the plan of a simulated card",
            EXIT_USAGE,
        )
    from engine.bench.memory import run_bench_memory

    run_bench_memory(parsed)
