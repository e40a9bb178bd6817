"""``headroom serve``, ``plan`` and ``generate`` refusing what cannot work at once, with
exit 2 and one line naming the fix, before a port is bound or a model loads: a dtype
that is none, a ``--model`` that names no model, a CUDA attention backend on the CPU, a
``--kv-cache`` below one ``--min-context``, an empty served name, an empty raw prompt, a
count past any machine; with ``plan --json``, the refusal as a JSON object on stdout too;
``models`` given a subcommand it does not have (``rm``)."""

from __future__ import annotations

import json
import os
import shutil

import click
import pytest
from click.testing import CliRunner

from service.cli.commands import main


def invoke(args: list[str]):
    return CliRunner().invoke(main, args, env={"HEADROOM_CONFIG": os.devnull})


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--dtype", "int3"], "--dtype: 'int3' is not one of auto, float32, bfloat16, float16"),
        (["--model", "/etc/passwd"], "--model: /etc/passwd is a file but not a .gguf; pass a Hugging Face model folder"),
        (["--model", ""], "--model: is empty; leave --model out for the default model"),
        (["--served-model-name", ""], "--served-model-name: is empty; give a name"),
        (["--served-model-name", ":latest"], "--served-model-name: ':latest' is a tag without a model name"),
        (["--served-model-name", "a b"], "--served-model-name: 'a b' holds a space or a control character"),
        (["--served-model-name", "a\nb"], "--served-model-name: 'a\\nb' holds a space or a control character"),
    ],
)
def test_serve_refuses_at_once_what_names_nothing(args, needle):
    result = invoke(["serve", "--port", "0", *args])
    assert result.exit_code == 2, result.output
    assert f"headroom: error: {needle}" in result.stderr
    assert "listening" not in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("command", [["status"], ["token"], ["serve"], ["generate", "hi"]])
def test_a_runtime_folder_that_cannot_be_made_is_one_line_naming_the_variable(tmp_path, command):
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    got = CliRunner().invoke(main, command, env={"HEADROOM_CONFIG": os.devnull, "HEADROOM_RUNTIME_DIR": str(a_file)})
    assert got.exit_code == 2, got.output
    assert got.stderr.strip() == (f"headroom: error: HEADROOM_RUNTIME_DIR={str(a_file)!r} cannot be headroom's runtime "
                                  "folder (a file, not a folder): set it to a folder you can write, or unset it")


def test_models_says_it_has_no_subcommand_and_how_models_are_removed():
    """`headroom models rm NAME` was click's bare "Got unexpected extra arguments"."""
    result = invoke(["models", "rm", "SmolLM2-135M-Instruct"])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("headroom: error: `headroom models` has no subcommand 'rm': it only lists"), \
        result.stderr
    assert "remove one by deleting its models--OWNER--NAME folder in the store (" in result.stderr
    assert "unexpected extra" not in result.output
    assert invoke(["models", "--json"]).exit_code == 0


@pytest.mark.parametrize("backend", ["flashinfer", "triton"])
def test_serve_refuses_a_cuda_attention_backend_on_the_cpu_before_starting(backend):
    """The worker refused it once started (exit 1, after the port opened); now serve does,
    before anything starts, naming both flags and the fix."""
    result = invoke(["serve", "--port", "0", "--device", "cpu", "--attention-backend", backend])
    assert result.exit_code == 2, result.output
    assert result.stderr == (f"headroom: error: --attention-backend {backend} runs CUDA kernels, and --device cpu runs "
                             "on the CPU: use --attention-backend auto or torch there, or --device cuda\n")
    assert "listening" not in result.output


def test_serve_refuses_a_folder_that_holds_no_model(tmp_path):
    result = invoke(["serve", "--port", "0", "--model", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert f"--model: {tmp_path} holds no config.json and no .gguf file" in result.stderr


@pytest.mark.parametrize("command", [["serve", "--port", "0"], ["plan"], ["generate", "--local", "hi"]])
def test_a_broken_config_is_named_first_by_every_command(tmp_path, command):
    """serve named the missing tokenizer of a folder whose config.json is not JSON, plan
    the config: fixing the tokenizer first would still leave the broken config."""
    (tmp_path / "config.json").write_text("{not json")
    (tmp_path / "model.safetensors").write_bytes(b"")
    result = invoke([*command, "--model", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert f"{tmp_path / 'config.json'} is not valid JSON" in result.stderr, result.stderr


@pytest.mark.parametrize(("args", "page"), [(["--device", "cpu"], "720 KiB"), (["--kv-cache-dtype", "fp8"], "180 KiB")])
def test_serve_refuses_a_kv_cache_below_one_min_context_before_the_port_opens(default_model_dir, args, page):
    """The model's config is on disk: its KV bytes per token are known without loading it
    (float32 on the CPU, one byte in FP8)."""
    result = invoke(["serve", "--port", "0", "--model", default_model_dir, "--kv-cache", "1KiB", *args])
    assert result.exit_code == 2, result.output
    assert f"--kv-cache 1 KiB holds 0 tokens of this model ({page} a page of 16 tokens)" in result.stderr
    assert "less than one --min-context of 2048 tokens: give at least --kv-cache" in result.stderr
    assert "listening" not in result.output


@pytest.mark.parametrize("command", ["serve", "plan"])
@pytest.mark.parametrize(("size", "needle"), [
    ("\uff11GiB", "--kv-cache: '\uff11GiB' is not a size; write e.g. 6GiB"),  # a full-width digit
    ("1EiB", "--kv-cache: '1EiB' is more than 1 PiB"),
    ("1" * 30, f"--kv-cache: '{'1' * 30}' is more than 1 PiB"),
])
def test_serve_and_plan_read_a_kv_cache_size_alike(command, size, needle):
    """One parser for both: only ASCII digits (``int()`` reads a full-width 1 as 1, so
    "\uff11GiB" was 1 GiB), and an exbibyte is beyond any machine, as a 30-digit count
    of bytes is, rather than text that is no size."""
    args = ["serve", "--port", "0"] if command == "serve" else ["plan"]
    result = invoke([*args, "--kv-cache", size])
    assert result.exit_code == 2, result.output
    assert f"headroom: error: {needle}" in result.stderr, result.output
    if "not a size" in needle:
        assert "ASCII digits, then B, K/KiB" in result.stderr and "E/EiB" in result.stderr


def test_generate_says_an_empty_raw_prompt_is_empty():
    result = invoke(["generate", "--local", "--raw", ""])
    assert result.exit_code == 2, result.output
    assert "the prompt is empty; pass the text to complete" in result.stderr
    assert "shorten" not in result.stderr


def test_generate_refuses_a_temperature_that_is_no_number():
    """nan is in no range (it compares false with both bounds): a usage error, where it
    went to the service's JSON body (a ValueError traceback) or to the engine."""
    result = invoke(["generate", "--local", "--temperature", "nan", "hi"])
    assert result.exit_code == 2, result.output
    assert "'--temperature': 'nan' is not a finite number" in result.stderr
    from service.cli.options import FiniteFloatRange

    with pytest.raises(click.BadParameter, match="not a finite number"):
        FiniteFloatRange(min=1).convert("inf", None, None)  # bench chaos --hang-timeout's type


def test_generate_refuses_a_prompt_that_is_not_utf8_naming_the_byte():
    """Bytes of another encoding on the command line are refused before anything loads,
    where the service's client or the tokenizer ended in a traceback."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "service.cli", "generate", "--local", b"ab\xff"],
                          capture_output=True, env={**os.environ, "HEADROOM_CONFIG": os.devnull}, timeout=120)
    err = done.stderr.decode(errors="replace")
    assert done.returncode == 2, err
    assert "the prompt is not UTF-8 text (byte 0xff after 2 characters)" in err and "LANG=C.UTF-8" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("flag", ["--page-size", "--max-running-requests", "--max-prefill-tokens"])
def test_plan_refuses_a_count_beyond_any_machine_naming_the_flag(flag):
    """A count of 10^20 (pages, requests, tokens) is a typo: refused with exit 2 naming
    the flag, as serve refuses it before its worker starts (which it crashed: no C or
    wire integer holds it), not planned as a pool of 4 * 10^18 MiB."""
    result = invoke(["plan", flag, str(10**20)])
    assert result.exit_code == 2, result.output
    assert f"{flag}: {10**20} is more than 2,147,483,647" in result.stderr
    assert "Traceback" not in result.output


@pytest.mark.parametrize(("args", "needle"), [
    (["--kv-cache", "lots"], "--kv-cache: 'lots' is not a size"),
    (["--kv-cache", "1MiB"], "--kv-cache 1 MiB holds 16 tokens of this model"),
    (["--model", "/nonexistent"], "model not found: /nonexistent"),
])
def test_plan_json_prints_a_refusal_a_script_can_parse(default_model_dir, args, needle):
    """``plan --json`` refused (exit 2) printed its line on stderr and nothing on stdout,
    so a script parsing stdout got no JSON; now stdout is ``{"error", "exit_code"}``, the
    line still on stderr. Without ``--json`` stdout stays empty."""
    model = [] if "--model" in args else ["--model", default_model_dir]
    result = invoke(["plan", "--json", *model, *args])
    assert result.exit_code == 2, result.output
    refusal = json.loads(result.stdout)
    assert refusal["exit_code"] == 2 and refusal["error"].startswith(needle), refusal
    assert result.stderr.strip() == f"headroom: error: {refusal['error']}"
    plain = invoke(["plan", *model, *args])
    assert plain.exit_code == 2 and plain.stdout == "" and needle in plain.stderr, plain.output


@pytest.mark.parametrize(("command", "needle"), [
    (["plan", "--json", "--max-model-len", "abc"], "Invalid value for '--max-model-len': 'abc' is not a valid integer"),
    (["plan", "--json", "--bogus"], "No such option '--bogus'"),
    (["models", "--json", "--bogus"], "No such option '--bogus'"),
])
def test_a_usage_error_click_finds_is_json_too_under_json(command, needle):
    """click's own refusals (a value of the wrong type, an unknown option) came before the
    command ran: stdout held nothing though --json promises one JSON object."""
    result = invoke(command)
    assert result.exit_code == 2, result.output
    refusal = json.loads(result.stdout)
    assert refusal["exit_code"] == 2 and refusal["error"].startswith(needle), refusal
    assert needle in result.stderr


@pytest.mark.parametrize("command", [["generate", "--local", "--max-tokens", "2", "hi"], ["serve", "--port", "0"]])
def test_a_folder_without_its_tokenizer_is_refused_before_loading(tmp_path, make_tiny_hf_model, command):
    """generate loaded the engine, then died in a traceback at the tokenizer; serve bound its
    port and started a worker first. Both now run one check before loading anything."""
    make_tiny_hf_model("qwen3", tmp_path)
    result = invoke([*command[:1], "--model", str(tmp_path), *command[1:]])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == (f"headroom: error: cannot load the model: no loadable tokenizer in {str(tmp_path)!r}: "
                                     "tokenizer.json is missing (copy it from the model's Hugging Face repository)")
    assert "Traceback" not in result.output and "listening" not in result.output


def _word_tokenizer(folder) -> None:
    """A tokenizer.json of two words: these refusals are about the weights."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    Tokenizer(WordLevel({"hi": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(folder / "tokenizer.json"))


@pytest.mark.parametrize("command", [["plan"], ["plan", "--json"], ["serve", "--port", "0"],
                                     ["generate", "--local", "hi"], ["bench", "engine"]])
def test_a_folder_whose_safetensors_are_gone_is_refused_before_planning_or_loading(
        tmp_path, make_tiny_hf_model, command):
    """plan priced the weights from the config ("exact", fits: true) and the load failed
    later; now plan, serve (before its worker), generate and bench engine refuse it with
    the loader's message. The check reads no tensor data."""
    make_tiny_hf_model("qwen3", tmp_path)
    (tmp_path / "model.safetensors").unlink()
    _word_tokenizer(tmp_path)
    result = invoke([*command, "--model", str(tmp_path)])
    message = f"cannot load the model: {tmp_path} holds no model.safetensors or model.safetensors.index.json"
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == f"headroom: error: {message}"
    if "--json" in command:
        assert json.loads(result.stdout) == {"error": message, "exit_code": 2}
    else:
        assert result.stdout == ""


def test_a_vocab_only_gguf_is_refused_as_one(tmp_path, make_tiny_hf_model):
    """A GGUF of metadata and tokenizer without tensors (as llama.cpp's ggml-vocab-*.gguf)
    was planned; its load failed at blk.0.attn_q.weight. plan refuses it from the file's
    tensor table, and serve too once its config is converted (serve converts nothing:
    before that its worker refuses it); the refusal says the file holds no tensors rather
    than naming the first one it lacks."""
    from test_gguf_convert import VOCAB, write_gguf

    path = tmp_path / "vocab-only.gguf"
    write_gguf(path, "qwen3", make_tiny_hf_model("qwen3", None, vocab_size=VOCAB), tensors=False)
    message = (f"headroom: error: cannot load the model: {path}: the file holds no tensors (a vocabulary-only "
               "GGUF); download the model's GGUF with its weights")
    for command in (["plan"], ["generate", "--local", "hi"], ["serve", "--port", "0"]):
        result = invoke([*command, "--model", str(path)])
        assert result.exit_code == 2, (command, result.output)
        assert result.stderr.strip() == message, command
        assert "listening" not in result.output


@pytest.mark.parametrize("keep", [0, 2_000, "half"])
def test_a_truncated_safetensors_file_is_refused_naming_it(tmp_path, make_tiny_hf_model, keep):
    """plan said "weights ... exact" and exit 0 for a model.safetensors cut short (0 bytes,
    2,000 bytes, half its size); the load said "corrupt or truncated" later. The check
    reads the file's header and refuses a file shorter than its tensors' last end."""
    make_tiny_hf_model("qwen3", tmp_path)
    _word_tokenizer(tmp_path)
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:len(data) // 2 if keep == "half" else keep])
    for command in (["plan"], ["plan", "--json"], ["generate", "--local", "hi"], ["serve", "--port", "0"]):
        result = invoke([*command, "--model", str(tmp_path)])
        assert result.exit_code == 2, (command, result.output)
        error = result.stderr.strip()
        assert error.startswith(f"headroom: error: cannot load the model: {weights} is truncated: "), error
        assert error.endswith("; delete it and download or convert the model again"), error
        assert "listening" not in result.output and "Traceback" not in result.output
        if "--json" in command:
            assert json.loads(result.stdout)["exit_code"] == 2


def test_generate_in_chat_mode_on_a_model_without_a_chat_template_names_raw(tmp_path, make_tiny_hf_model):
    """It exited 1 naming /v1/completions (an API call, not this command's fix) and --raw;
    it is a usage error naming --raw alone, and --raw answers."""
    make_tiny_hf_model("qwen3", tmp_path)
    _word_tokenizer(tmp_path)  # a tokenizer.json alone: no chat template
    result = invoke(["generate", "--local", "--model", str(tmp_path), "--max-tokens", "2", "hi"])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == ("headroom: error: this model's tokenizer has no chat template, so it cannot "
                                     "render messages; pass --raw to send the prompt as it is"), result.stderr
    raw = invoke(["generate", "--local", "--raw", "--model", str(tmp_path), "--max-tokens", "2", "hi"])
    assert raw.exit_code == 0, raw.output


def test_a_truncated_gguf_is_refused_naming_it(tiny_gguf):
    """A GGUF shorter than its last tensor's end: plan and generate refused it, while serve
    (which converts nothing) bound its port and its worker failed; serve reads the file's
    tensor table before the port opens too."""
    data = tiny_gguf.read_bytes()
    tiny_gguf.write_bytes(data[:-100])
    for command in (["plan"], ["generate", "--local", "hi"], ["serve", "--port", "0"]):
        result = invoke([*command, "--model", str(tiny_gguf)])
        assert result.exit_code == 2, (command, result.output)
        error = result.stderr.strip()
        assert error.startswith(f"headroom: error: cannot load the model: {tiny_gguf} is not a readable GGUF file "
                                "(tensor "), error
        assert error.endswith("-byte file: it is truncated); download it again"), error
        assert "listening" not in result.output


@pytest.mark.parametrize("cut", ["counts", "key-values", "tensor table"])
def test_a_gguf_cut_inside_its_header_is_refused_as_truncated(tiny_gguf, cut):
    """A GGUF cut inside its header (before its counts, in its key-values, in its tensor
    table) said "not a readable GGUF file (unpack_from requires a buffer of at least N
    bytes ...)"; it says the file is truncated and to download it again, as a file cut in
    its tensor data does."""
    from engine.loader.gguf_tensors import open_tensors

    data = tiny_gguf.read_bytes()
    data_start = min(t.data_offset for t in open_tensors(tiny_gguf).tensors)
    keep = {"counts": 12, "key-values": 200, "tensor table": data_start - 40}[cut]
    tiny_gguf.write_bytes(data[:keep])
    result = invoke(["plan", "--model", str(tiny_gguf)])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == (f"headroom: error: cannot load the model: {tiny_gguf} is not a readable GGUF "
                                     f"file (its header goes on past the end of the {keep:,}-byte file: it is "
                                     "truncated, shorter than its header says); download it again"), result.stderr


@pytest.mark.parametrize("command", [["plan"], ["serve", "--port", "0"]])
@pytest.mark.parametrize(("args", "needle"), [
    (["--page-size", "100000"], "--page-size 100000 is larger than LlamaForCausalLM's context of 8192 tokens: "
                                "give at most 8192 (the default is 16)"),
    (["--min-context", "100000"], "--min-context 100000 is more than LlamaForCausalLM's context of 8192 tokens: "
                                  "give at most 8192"),
])
def test_a_page_or_min_context_beyond_the_models_context_is_refused(default_model_dir, command, args, needle):
    """The default model's context is 8192 tokens: a page larger than it, or a
    --min-context no request can get, is refused before planning or serving, where the
    plan silently cut --min-context to the context."""
    result = invoke([*command, *args])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == f"headroom: error: {needle}"
    assert "listening" not in result.output


def test_plan_takes_a_page_size_that_is_no_power_of_two(default_model_dir):
    """The KV kernels address a slot as page * page_size + offset, so a page size of at
    least one token that fits the context is planned, not refused; --max-model-len caps
    --min-context, as its help says."""
    result = invoke(["plan", "--page-size", "7", "--min-context", "4096", "--max-model-len", "2048"])
    assert result.exit_code == 0, result.output
    assert "x 7 tokens" in result.output


@pytest.mark.parametrize("name", ["default", "DEFAULT:latest", "SmolLM2-135M-Instruct.Q4_1", "SmolLM2-135M-Instruct.Q4_1:latest"])
def test_model_takes_the_names_the_apis_and_models_give_the_embedded_model(name, default_model_dir):
    """`headroom models` lists the embedded model by its file's name and every API takes
    `default`: --model takes both (a file or store name of that name would come first)."""
    result = invoke(["plan", "--model", name, "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["model"].startswith("SmolLM2-135M-Instruct"), result.stdout


def test_a_conversion_without_its_tokenizer_names_the_folder_to_delete(tiny_gguf):
    """A GGUF's conversion in the store that lost its tokenizer.json (a half-copied cache
    folder) was refused with "copy it from the model's Hugging Face repository", where
    the fix is to delete the conversion, which headroom redoes from the file."""
    from engine.loader.default_model import converted_dir

    assert invoke(["plan", "--model", str(tiny_gguf)]).exit_code == 0
    folder = converted_dir(tiny_gguf)
    (folder / "tokenizer.json").unlink()
    for command in (["generate", "--local", "hi"], ["serve", "--port", "0"]):
        result = invoke([*command, "--model", str(tiny_gguf)])
        assert result.exit_code == 2, (command, result.output)
        assert result.stderr.strip() == (f"headroom: error: cannot load the model: {folder}, the conversion of "
                                         f"{tiny_gguf}, has no tokenizer.json (a half-written or damaged copy): "
                                         "delete that folder, and the next start converts the file again")
        assert "listening" not in result.output
    shutil.rmtree(folder)  # as the message says
    assert invoke(["plan", "--model", str(tiny_gguf)]).exit_code == 0
    assert (folder / "tokenizer.json").is_file()


@pytest.mark.timeout(300)
def test_serve_refuses_a_cache_folder_it_cannot_write_before_starting(tiny_gguf, tmp_path, monkeypatch):
    """A GGUF not converted yet, with HEADROOM_CACHE_DIR a file (or a folder that cannot
    be written): plan refused it at once, but serve opened its port, started its worker
    and exited 1 only when the worker failed to write the conversion, after a screen of
    log. Now serve refuses it before starting, in plan's words, and writes nothing."""
    cache = tmp_path / "cache-is-a-file"
    cache.write_text("x")
    monkeypatch.setenv("HEADROOM_CACHE_DIR", str(cache))
    monkeypatch.setenv("HEADROOM_RUNTIME_DIR", str(tmp_path / "runtime"))
    expected = (f"headroom: error: cannot load the model: cannot write the conversion of {tiny_gguf.name} under "
                f"{cache / 'models'} ([Errno 20] Not a directory: '{cache / 'models'}'); point HEADROOM_CACHE_DIR "
                "at a writable folder")
    for command in (["plan"], ["serve", "--port", "0"]):
        result = invoke([*command, "--model", str(tiny_gguf)])
        assert result.exit_code == 2, (command, result.output)
        assert result.stderr.strip() == expected, (command, result.output)
        assert "listening" not in result.output
    assert cache.read_text() == "x"


@pytest.mark.parametrize("content", [b"hello\n", b"hello, this is text\n", b"GG"])
def test_a_file_that_is_no_gguf_is_refused_as_such_however_short(tmp_path, content):
    """A 6-byte text file named .gguf was called a truncated download ("its header goes on
    past the end of the 6-byte file"), while one of 8 bytes or more got "GGUF magic
    invalid"; a file whose first bytes are not GGUF's is named as no GGUF at all, with
    what to give instead. Two bytes of the magic alone are a truncated GGUF."""
    model = tmp_path / "x.gguf"
    model.write_bytes(content)
    result = invoke(["plan", "--model", str(model)])
    assert result.exit_code == 2, result.output
    error = result.stderr.strip()
    if content == b"GG":
        assert error.endswith("it is truncated, shorter than its header says); download it again"), error
    else:
        assert error == (f"headroom: error: cannot load the model: {model} is not a GGUF file (its first bytes are "
                         f"{content[:4]!r}, not b'GGUF'): give a .gguf file as llama.cpp writes it, or a Hugging "
                         "Face model's folder"), error
