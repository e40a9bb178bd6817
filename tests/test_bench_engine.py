"""``headroom bench engine`` on the CPU, small: both sides run the same cases and the
table ends with the resident-memory lines (figures are measured, never asserted)."""

from __future__ import annotations

import pytest

from engine.bench.speed import run_bench_engine


@pytest.mark.parametrize("transformers_side", [True, False])
def test_bench_engine_runs_both_sides_on_the_cpu(default_model_dir, capsys, transformers_side):
    rows = run_bench_engine(model=None, device="cpu", batches=(1, 2), prompt_tokens=8, new_tokens=3,
                            long_prefill_tokens=0, transformers_side=transformers_side)
    sides = {(r["batch"], r["side"]) for r in rows}
    want = {"headroom", "transformers", "ratio"} if transformers_side else {"headroom"}
    assert sides == {(b, s) for b in (1, 2) for s in want}
    assert all(r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0 for r in rows)
    # The engine's rows carry its own peak (before transformers loads) and the KV cache
    # each case fills: batch x (prompt + new tokens) x the pool's bytes per token.
    ours = [r for r in rows if r["side"] == "headroom"]
    assert all(r["peak_rss_mib"] > 0 for r in ours)
    assert ours[1]["kv_mib"] == pytest.approx(2 * ours[0]["kv_mib"])
    out = capsys.readouterr().out
    assert "on cpu (float32)" in out
    assert "peak RSS of the engine alone" in out
    assert ("peak RSS with transformers' model too" in out) == transformers_side


def test_against_llama_cpp_without_its_tools_names_the_fix(tmp_path):
    """The comparison refuses at once (exit 2, before any model loads), naming where it
    looked and how to build the tools."""
    import os

    from click.testing import CliRunner

    from service.cli import main

    result = CliRunner().invoke(main, ["bench", "engine", "--device", "cpu", "--against-llama-cpp", str(tmp_path)],
                                env={"HEADROOM_CONFIG": os.devnull})
    assert result.exit_code == 2, result.output
    assert f"no executable llama-bench in {tmp_path}, {tmp_path / 'bin'}, {tmp_path / 'build' / 'bin'}" in result.stderr
    assert "cmake --build build --target llama-bench llama-batched-bench" in result.stderr
    result = CliRunner().invoke(main, ["bench", "engine", "--shape", "smollm2-135m", "--against-llama-cpp",
                                       str(tmp_path)], env={"HEADROOM_CONFIG": os.devnull})
    assert result.exit_code == 2 and "give --model FILE.gguf, not --shape" in result.stderr, result.output


def _small_bench(*extra: str):
    """``headroom bench engine`` on the CPU at its smallest, with ``extra`` flags and no
    config file: click's result."""
    import os

    from click.testing import CliRunner

    from service.cli import main

    small = ["bench", "engine", "--device", "cpu", "--batches", "1", "--prompt-tokens", "4", "--new-tokens", "2",
             "--long-prefill-tokens", "0", "--no-transformers"]
    return CliRunner().invoke(main, [*small, *extra], env={"HEADROOM_CONFIG": os.devnull})


def test_bench_engine_takes_the_kv_cache_dtype_as_serve_does(default_model_dir, tmp_path):
    """``--kv-cache-dtype`` reaches the engine side (the table names the cache it ran);
    against llama.cpp, whose side runs its own f16 cache, anything but f16 (the same
    bytes) or auto is refused at once."""
    result = _small_bench("--kv-cache-dtype", "q8_0")
    assert result.exit_code == 0, result.output
    assert "KV cache q8_0" in result.stdout
    result = _small_bench("--kv-cache-dtype", "q4_0", "--against-llama-cpp", str(tmp_path))
    assert result.exit_code == 2 and "--kv-cache-dtype f16 (the same bytes) or auto, not q4_0" in result.stderr, \
        result.output


@pytest.mark.parametrize("layout", [".", "bin", "build/bin"])
def test_llama_cpp_tools_are_found_where_a_build_puts_them(tmp_path, layout):
    from engine.bench.llama_cpp import LlamaCppTools

    folder = tmp_path / layout
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("llama-bench", "llama-batched-bench"):
        (folder / name).write_text("#!/bin/sh\n")
        (folder / name).chmod(0o755)
    tools = LlamaCppTools.find(tmp_path)
    assert tools.bench == folder / "llama-bench" and tools.batched == folder / "llama-batched-bench"
    assert LlamaCppTools.find(folder / "llama-bench") == tools  # the file itself
    assert tools.threads >= 1


def test_llama_cpp_paths_that_are_no_build_are_named(tmp_path):
    """An empty path searched the current folder, another file its own folder, and a
    llama-bench without its exec bit read as "no executable llama-bench" there."""
    from engine.bench.llama_cpp import LlamaCppTools

    with pytest.raises(ValueError, match="--against-llama-cpp: an empty path"):
        LlamaCppTools.find(" ")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="notes.txt: a file that is not llama-bench"):
        LlamaCppTools.find(tmp_path / "notes.txt")
    (tmp_path / "llama-bench").write_text("#!/bin/sh\n")
    with pytest.raises(ValueError, match=f"{tmp_path / 'llama-bench'} is not executable; `chmod \\+x` it"):
        LlamaCppTools.find(tmp_path)


def _fake_llama_cpp(folder, names=("llama-bench", "llama-batched-bench")):
    """``folder`` holding executable stand-ins for llama.cpp's tools: each leaves a file
    named after itself in ``folder`` when run (so a test sees that none ran)."""
    for name in names:
        (folder / name).write_text(f"#!/bin/sh\ntouch '{folder}/{name}.ran'\nexit 1\n")
        (folder / name).chmod(0o755)


def _bench_against(folder, *flags):
    import os

    from click.testing import CliRunner

    from service.cli import main

    return CliRunner().invoke(main, ["bench", "engine", "--device", "cpu", "--prompt-tokens", "4", "--new-tokens", "2",
                                     "--long-prefill-tokens", "0", "--against-llama-cpp", str(folder), *flags],
                              env={"HEADROOM_CONFIG": os.devnull})


def test_batches_above_one_without_llama_batched_bench_are_refused_at_once(default_model_dir, tmp_path):
    """With llama-bench alone, a batch above 1 (which only llama-batched-bench measures)
    is refused before either side runs, naming the tool; --batches 1 is not refused."""
    _fake_llama_cpp(tmp_path, ("llama-bench",))
    result = _bench_against(tmp_path, "--batches", "1,2")
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("headroom: error: --batches 2 needs llama-batched-bench"), result.stderr
    assert "--target llama-batched-bench" in result.stderr and "or give --batches 1" in result.stderr
    assert result.stdout == "" and not list(tmp_path.glob("*.ran"))
    from engine.bench.llama_cpp import LlamaCppTools

    LlamaCppTools.find(tmp_path).check_batches((1,))


@pytest.mark.parametrize("against_llama_cpp", [False, True])
def test_batches_above_256_sequences_are_refused_at_once(default_model_dir, tmp_path, against_llama_cpp):
    """A batch of more than 256 sequences is refused before anything loads, naming
    --batches and 256, where the engine side took any size (--batches 100000 on the CPU
    ran for minutes); llama-batched-bench, the comparison, runs no more either. The prompt
    over the model's context would be refused next: the batch sizes are checked first,
    and 256 passes to that check."""
    _fake_llama_cpp(tmp_path)
    llama = ("--against-llama-cpp", str(tmp_path)) if against_llama_cpp else ()
    result = _small_bench("--batches", "1,300,100000", "--prompt-tokens", "9000", *llama)
    assert result.exit_code == 2, result.output
    assert ("Invalid value for '--batches': 300,100000: a batch runs at most 256 sequences (as llama.cpp's batched "
            "bench); give sizes up to 256") in result.stderr, result.stderr
    assert result.stdout == "" and not list(tmp_path.glob("*.ran"))
    result = _small_bench("--batches", "1,256", "--prompt-tokens", "9000", *llama)
    assert result.exit_code == 2 and "--prompt-tokens 9000 + --new-tokens 2" in result.stderr, result.output
    from engine.bench.llama_cpp import LlamaCppTools

    LlamaCppTools.find(tmp_path).check_batches((1, 2, 256))


@pytest.mark.parametrize(("prompt_tokens", "new_tokens"), [(9000, 32), (8190, 32)])
def test_requests_longer_than_the_models_context_are_refused_at_once(default_model_dir, prompt_tokens, new_tokens):
    """A prompt over the embedded model's 8192-token context (a RequestRejected traceback
    before), or a prompt that fits with too many new tokens (let through before, its
    decode cut short), is refused before the model loads, naming the context and the flags."""
    import os

    from click.testing import CliRunner

    from service.cli import main

    result = CliRunner().invoke(main, ["bench", "engine", "--device", "cpu", "--batches", "1", "--prompt-tokens",
                                       str(prompt_tokens), "--new-tokens", str(new_tokens), "--long-prefill-tokens",
                                       "0", "--no-transformers"], env={"HEADROOM_CONFIG": os.devnull})
    assert result.exit_code == 2, result.output
    assert result.stderr == (f"headroom: error: --prompt-tokens {prompt_tokens} + --new-tokens {new_tokens} = "
                             f"{prompt_tokens + new_tokens} tokens per request, more than LlamaForCausalLM's context "
                             "of 8192 tokens: lower --prompt-tokens or --new-tokens so that they add up to at most "
                             "8192\n")
    assert result.stdout == ""


def test_split_options_reach_the_engine_side(default_model_dir):
    """``--cpu-layers`` and ``--device-limit`` are serve's settings on bench engine too:
    the engine side checks them as serve does (the default model has 30 layers)."""
    result = _small_bench("--cpu-layers", "40")
    assert result.exit_code == 2, result.output
    assert "--cpu-layers 40: LlamaForCausalLM has 30 decoder layers" in result.stderr
    # ... without "or --device cpu" where that is the flag given
    assert "on --device cpu every layer runs on the CPU already" in result.stderr
    assert "or --device cpu to run" not in result.stderr
    result = _small_bench("--device-limit", "0")
    assert result.exit_code == 2 and "--device-limit: must be more than 0 bytes" in result.stderr, result.output
    # On the CPU they have no effect: said in a line, and the bench runs.
    result = _small_bench("--cpu-layers", "2")
    assert result.exit_code == 0, result.output
    assert "headroom: note: --cpu-layers 2: no effect on the CPU" in result.stderr


@pytest.mark.parametrize("num_layers", [30, 32])
def test_llama_cpp_offloads_what_the_engine_keeps_on_the_gpu(num_layers):
    """Against llama.cpp on a split engine, ``-ngl`` puts as many decoder layers and the
    output layer on the GPU as the engine keeps there. llama.cpp's rule (its
    ``llama_model::load_tensors``): of ``n_layer + 1`` layers, the output layer last, those
    from ``n_layer + 1 - ngl`` on are offloaded."""
    from engine.bench.llama_cpp import ALL_LAYERS, gpu_layers_for_split

    assert gpu_layers_for_split(num_layers, 0) == ALL_LAYERS
    for cpu_layers in (1, 5, num_layers - 1):
        ngl = gpu_layers_for_split(num_layers, cpu_layers)
        first_on_gpu = max(num_layers + 1 - ngl, 0)
        decoder_on_gpu = sum(1 for il in range(num_layers) if il >= first_on_gpu)
        assert decoder_on_gpu == num_layers - cpu_layers
        assert num_layers >= first_on_gpu  # the output layer (index n_layer) is on the GPU


@pytest.mark.parametrize(("script", "needle"), [
    ("#!/bin/sh\necho hello\n", "printed no llama-bench result (its output starts 'hello')"),
    ("#!/bin/sh\necho '{\"avg_ts\": 1}'\n", "printed no llama-bench result (its output starts '{\"avg_ts\": 1}')"),
    ("not a program\n", "Exec format error"),
])
def test_a_llama_bench_that_is_not_llama_cpps_is_named_with_the_fix(default_model_dir, tmp_path, script, needle):
    """A program under llama-bench's name that prints no result of llama.cpp's, or that
    this machine cannot run, fails the command (exit 1) naming the file and how to build
    the tools, where it ended in json's "Expecting value" (exit 2) or an OSError traceback."""
    (tmp_path / "llama-bench").write_text(script)
    (tmp_path / "llama-bench").chmod(0o755)
    result = _bench_against(tmp_path, "--batches", "1")
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith("headroom: error: llama.cpp's side failed: "), result.stderr
    assert needle in result.stderr and str(tmp_path / "llama-bench") in result.stderr
    assert "is it llama.cpp's llama-bench? build it with `cmake -B build" in result.stderr
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_a_shape_with_a_model_is_refused_at_once(default_model_dir):
    """--shape benches random weights instead of --model: given both, the model was
    checked, then ignored without a word, the table naming the shape's run."""
    result = _small_bench("--shape", "smollm2-135m", "--model", str(default_model_dir))
    assert result.exit_code == 2, result.output
    assert "--shape smollm2-135m benches random weights of that shape instead of a model" in result.stderr
    assert "give --shape or --model, not both" in result.stderr and result.stdout == ""


def test_bench_engine_reads_the_config_file_given(tmp_path, default_model_dir):
    """``--config FILE``, as the other commands that read the settings take it (bench
    engine read only HEADROOM_CONFIG and the default file)."""
    config = tmp_path / "config.toml"
    config.write_text('kv_cache_dtype = "q9_0"\n')
    result = _small_bench("--config", str(config))
    assert result.exit_code == 2, result.output
    assert f"--kv-cache-dtype ({config}): 'q9_0' is not one of" in result.stderr
