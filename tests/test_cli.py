"""The ``headroom`` command line: ``generate``, ``plan``, ``bench memory`` and ``serve``'s
plan failure, run as a user runs them (the console script in a subprocess) where the
process boundary matters, and in-process (click's runner) where only the output does.

Every test depends on ``default_model_dir``, which points ``HEADROOM_CACHE_DIR`` at the
session's converted default model; subprocesses inherit it.
"""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest
from click.testing import CliRunner
from service_harness import headroom_command

from service.cli.commands import main

QUESTION = "What is the capital of France?"


def run_headroom(args: list[str], timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*headroom_command(), *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, "HEADROOM_CONFIG": os.devnull},
    )


def invoke(args: list[str]):
    """In-process run (torch is imported once for the whole module, not per command)."""
    return CliRunner().invoke(main, args, env={"HEADROOM_CONFIG": os.devnull})


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


# -- generate ------------------------------------------------------------------------------------


def test_generate_streams_a_greedy_answer(default_model_dir):
    result = run_headroom(["generate", "--max-tokens", "8", "--temperature", "0", QUESTION])
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "Traceback" not in result.stderr


def test_generate_missing_model_names_the_path(default_model_dir, tmp_path):
    missing = tmp_path / "no-such-model"
    result = run_headroom(["generate", "--model", str(missing), QUESTION], timeout_s=60)
    assert result.returncode != 0
    assert str(missing) in result.stderr
    assert "--model" in result.stderr  # the fix
    assert "Traceback" not in result.stderr


def test_generate_prompt_too_long_says_what_to_do(default_model_dir):
    result = run_headroom(["generate", "--max-model-len", "16", "--raw", "word " * 40])
    assert result.returncode == 2, result.stderr  # the input's fault, as through a service
    assert "the prompt cannot run" in result.stderr
    assert "shorten the prompt" in result.stderr and "--max-model-len" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("args", "field", "value"),
    [
        (["--seed", "-5"], "seed", -5),
        (["--seed", str(1 << 63)], "seed", 1 << 63),
        (["--temperature", "2.5"], "temperature", 2.5),
        (["--max-tokens", "-1"], "max_tokens", -1),
    ],
)
def test_generate_refuses_what_the_api_refuses(args, field, value):
    """One declaration of each range (service.common.ranges) for both doors: a value the
    API refuses is a usage error of `headroom generate`, before the model loads."""
    import msgspec

    from service.api.openai.schemas import CompletionRequest

    result = invoke(["generate", *args, QUESTION])
    assert result.exit_code == 2 and f"Invalid value for '{args[0]}'" in result.output, result.output
    with pytest.raises(msgspec.ValidationError, match=f"at `\\$.{field}`"):
        msgspec.json.decode(msgspec.json.encode({"prompt": "x", field: value}), type=CompletionRequest)


def test_generate_takes_max_tokens_0_as_the_api_does(default_model_dir):
    """The API's max_tokens 0 is an empty completion; generate's is an empty reply."""
    result = invoke(["generate", "--max-tokens", "0", "--seed", "0", QUESTION])
    assert result.exit_code == 0, result.output
    assert result.output == "\n"


# -- plan ----------------------------------------------------------------------------------------


def test_plan_that_fits_prints_the_ledger_and_exits_0(default_model_dir):
    result = run_headroom(["plan", "--device-total", "6GiB", "--device-free", "5.5GiB"])
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "KV cache pool" in out and "fits: yes" in out
    assert "simulated device (6.00 GiB)" in out
    assert "512.0 MiB" in out  # 6 GiB - 5.5 GiB: used by other processes


def test_plan_on_a_tight_card_lowers_the_context_as_serve_would(default_model_dir):
    # Float32 weights (the CPU's int4 repacking would leave room for the whole context).
    result = invoke(["plan", "--device", "cpu", "--device-total", "4GiB", "--device-free", "3GiB", "--reserve", "1GiB",
                     "--no-gguf-quantized"])
    assert result.exit_code == 0, result.output
    out = result.stdout
    # The dtype serve would use on this machine's device (float32 on a CPU).
    assert "simulated device (4.00 GiB), float32 on cpu" in out
    assert "context 8,192 -> 7,120 tokens: 1.00 GiB held by other processes" in out
    assert "fits: yes, with a lowered context (--min-context 2048)" in out


def test_plan_that_does_not_fit_exits_1_naming_the_knobs(default_model_dir):
    result = invoke(["plan", "--device-total", "1GiB"])
    assert result.exit_code == 1, result.output
    out = result.stdout
    assert "KV cache pool" in out  # the ledger comes with the message
    assert "does not fit" in out
    # The knobs, each in the direction that frees memory.
    assert "--reserve 563 MiB → 282 MiB" in out
    assert "--min-context 2048 → 512" in out
    assert "--max-running-requests 64 → 16" in out


def test_plan_knobs_move_the_plan(default_model_dir):
    base = json.loads(invoke(["plan", "--device-total", "6GiB", "--json"]).stdout)
    moved = invoke(
        [
            "plan",
            "--device-total",
            "6GiB",
            "--reserve",
            "0",
            "--device-limit",
            "4GiB",
            "--max-prefill-tokens",
            "512",
            "--max-running-requests",
            "8",
            "--max-model-len",
            "4096",
            "--json",
        ]
    )
    assert moved.exit_code == 0, moved.output
    plan = json.loads(moved.stdout)
    ledger = {e["name"]: e for e in plan["ledger"]}
    assert ledger["device total"]["bytes"] == 4 << 30
    assert ledger["desktop reserve"]["bytes"] == 0
    assert plan["max_prefill_tokens"] == 512 and plan["max_running_requests"] == 8
    assert plan["max_context_tokens"] == 4096
    assert base["fits"] and plan["fits"]
    # No display: no automatic reserve.
    no_display = json.loads(
        invoke(["plan", "--device-total", "6GiB", "--no-device-display", "--json"]).stdout
    )
    assert {e["name"]: e["bytes"] for e in no_display["ledger"]}["desktop reserve"] == 0
    short = json.loads(
        invoke(["plan", "--device-total", "6GiB", "--min-context", "1024", "--json"]).stdout
    )
    assert short["min_context_tokens"] == 1024
    larger = json.loads(invoke(["plan", "--device-total", "6GiB", "--device-limit", "8GiB", "--json"]).stdout)
    total = {e["name"]: e for e in larger["ledger"]}["device total"]
    assert total["bytes"] == 6 << 30 and "--device-limit 8.00 GiB is larger: the card's size applies" in total["source"]


def test_plan_json_parses(default_model_dir):
    result = invoke(["plan", "--device-total", "6GB", "--device-free", "5GB", "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert plan["fits"] is True
    assert plan["simulated"] is True
    ledger = {e["name"]: e["bytes"] for e in plan["ledger"]}
    assert ledger["device total"] == 6 * 10**9  # GB is decimal
    assert ledger["used by other processes"] == 10**9
    assert ledger["KV cache pool"] == plan["kv_pool_bytes"] > 0


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--device-total", "6gibs"], "--device-total: '6gibs' is not a size"),
        (["--device-total", "6GiB", "--device-free", "lots"], "--device-free: 'lots'"),
        (["--device-total", "6GiB", "--reserve", "-1GiB"], "--reserve"),
        (["--device-total", "6GiB", "--device-limit", "big"], "--device-limit"),
        (["--device-free", "1GiB"], "needs --device-total"),
        (["--device-total", "1GiB", "--device-free", "2GiB"], "must not exceed --device-total"),
        (["--device-total", "99999999999999999999TiB"], "--device-total: '99999999999999999999TiB' is more than 1 PiB"),
        (["--device-total", "6GiB", "--reserve", "2000TiB"], "--reserve: '2000TiB' is more than 1 PiB"),
    ],
)
def test_plan_bad_sizes_name_the_flag(args, needle):
    result = invoke(["plan", *args])
    assert result.exit_code == 2, result.output
    assert needle in result.stderr
    assert "Traceback" not in result.output


def test_plan_without_a_gpu_shows_the_cpu_and_how_to_simulate_a_card(default_model_dir):
    if cuda_available():
        pytest.skip("a CUDA device is present")
    result = invoke(["plan"])
    assert result.exit_code == 0, result.output
    assert "on cpu (float32)" in result.stdout and "--device-total SIZE" in result.stdout


def test_bench_memory_needs_cuda():
    if cuda_available():
        pytest.skip("a CUDA device is present")
    result = invoke(["bench", "memory"])
    assert result.exit_code == 2
    assert "needs a CUDA device" in result.stderr


# -- serve ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", ["tpu", "", "cuda:abc", "cuda:", "CPU"])
@pytest.mark.parametrize("command", [["serve", "--port", "0"], ["plan", "--device-total", "4GiB"],
                                     ["bench", "engine"], ["generate", "hi"]])
def test_a_device_that_is_not_one_is_refused_at_once(command, device):
    """Not a worker that waits for a GPU forever: exit 2 naming the accepted values."""
    result = invoke([*command, "--device", device])
    assert result.exit_code == 2, result.output
    assert "use auto, cpu, cuda or cuda:N" in result.stderr
    assert "Traceback" not in result.output


def test_serve_on_cuda_with_a_cpu_build_of_torch_names_the_fix():
    """Waiting for the GPU cannot help a torch built without CUDA: exit 2 at once."""
    from service.cli.precheck import torch_without_gpu_support

    if torch_without_gpu_support() is None:
        pytest.skip("this torch is a GPU build")
    result = invoke(["serve", "--port", "0", "--device", "cuda:0"])
    assert result.exit_code == 2, result.output
    assert "is built without CUDA" in result.stderr and "--device cpu" in result.stderr


@pytest.mark.parametrize("rule", ["prefill", "slow:*:1", "nowhere:*:1", "decode:req:0"])
def test_serve_refuses_a_malformed_fault_rule_before_the_model_loads(rule):
    """The test hook's rules are read at serve time (torch-free), not by the worker after a
    model load that ends in a traceback."""
    result = CliRunner().invoke(main, ["serve", "--port", "0"],
                                env={"HEADROOM_CONFIG": os.devnull, "HEADROOM_FAULTS": rule})
    assert result.exit_code == 2, result.output
    assert f"HEADROOM_FAULTS rule {rule!r}" in result.stderr and "fix or unset it" in result.stderr
    assert "Traceback" not in result.output


def test_the_torch_build_is_read_without_importing_torch(tmp_path, monkeypatch):
    import importlib.util

    from service.cli import precheck

    pkg = tmp_path / "torch"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    spec = importlib.util.spec_from_file_location("torch", pkg / "__init__.py")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: spec)
    (pkg / "version.py").write_text("__version__ = '2.13.0+cpu'\ncuda: Optional[str] = None\nhip: Optional[str] = None\n")
    assert precheck.torch_without_gpu_support() == "2.13.0+cpu"
    (pkg / "version.py").write_text("__version__ = '2.11.0+cu130'\ncuda: Optional[str] = '13.0'\nhip: Optional[str] = None\n")
    assert precheck.torch_without_gpu_support() is None
    (pkg / "version.py").write_text("__version__ = '2.9.0+rocm6.4'\ncuda: Optional[str] = None\nhip: Optional[str] = '6.4'\n")
    assert precheck.torch_without_gpu_support() is None


def test_serve_plan_that_does_not_fit_exits_at_once_with_the_plan_message(default_model_dir):
    started = time.monotonic()
    result = run_headroom(["serve", "--port", "0", "--device-total", "1GiB"], timeout_s=90)
    took_s = time.monotonic() - started
    assert result.returncode != 0
    err = result.stderr
    assert "the engine could not start: the memory plan does not fit" in err
    assert "--min-context 2048 → 512" in err  # the fix travels to the user
    assert "restarting the worker" not in err  # a misfit is not retried
    assert "Traceback" not in err
    assert took_s < 60


def test_plan_takes_the_kv_cache_dtype_and_fp8_flags_as_serve_does(default_model_dir):
    """`headroom plan` has serve's --kv-cache-dtype and --quantization: FP8 halves the KV
    bytes per token and prices the projections at one byte."""
    base = ["plan", "--device", "cuda", "--device-total", "8GiB"]
    auto = invoke(base)
    fp8 = invoke([*base, "--kv-cache-dtype", "fp8", "--quantization", "fp8"])
    assert auto.exit_code == 0, auto.output
    assert fp8.exit_code == 0, fp8.output
    assert "(float8_e4m3fn)" in fp8.stdout and "(float8_e4m3fn)" not in auto.stdout
    assert "FP8" in fp8.stdout and "FP8" not in auto.stdout


# -- settings the model cannot honour, refused before the port opens ---------------------------


@pytest.mark.parametrize(
    ("kind", "args", "needle"),
    [
        ("llama", ["--tensor-parallel-size", "3", "--device", "cpu"],
         "--tensor-parallel-size 3 cannot split LlamaForCausalLM: its 4 attention heads do not divide by 3"),
        ("qwen3_moe", ["--cpu-experts", "2"],
         "--cpu-experts 2: Qwen3MoeForCausalLM has 1 mixture-of-experts layers; use --cpu-experts 1 or fewer"),
    ],
)
def test_serve_refuses_what_the_model_cannot_honour_before_the_port_opens(
    kind, args, needle, tmp_path, make_tiny_hf_model
):
    make_tiny_hf_model(kind, tmp_path)
    # Reading the model's config imports transformers (slow on a busy machine).
    result = run_headroom(["serve", "--port", "0", "--model", str(tmp_path), *args], timeout_s=600)
    assert result.returncode == 2, result.stderr
    assert f"headroom: error: {needle}" in result.stderr
    assert "listening" not in result.stderr and "Traceback" not in result.stderr


def test_plan_refuses_cpu_experts_above_the_moe_layers(tmp_path, make_tiny_hf_model):
    make_tiny_hf_model("qwen3_moe", tmp_path)
    result = invoke(["plan", "--model", str(tmp_path), "--device", "cpu", "--device-total", "1GiB",
                     "--cpu-experts", "3"])
    assert result.exit_code == 2, result.output
    assert "use --cpu-experts 1 or fewer" in result.output


def test_serve_refuses_fp8_weights_with_gguf_blocks_before_the_port_opens():
    result = invoke(["serve", "--port", "0", "--quantization", "fp8", "--gguf-quantized"])
    assert result.exit_code == 2, result.output
    assert "--quantization: fp8 does not go with --gguf-quantized" in result.output
    assert "drop one of the two" in result.output


def test_plan_with_tensor_parallel_is_one_ranks_plan(tmp_path, make_tiny_hf_model):
    """`headroom plan --tensor-parallel-size 2` prices rank 0 as the engine builds it:
    half the KV heads, so half the KV bytes per token, and fewer weight bytes."""
    make_tiny_hf_model("llama", tmp_path)
    base = ["plan", "--model", str(tmp_path), "--device", "cpu", "--device-total", "4GiB", "--reserve", "0"]
    whole = invoke([*base, "--json"])
    split = invoke([*base, "--json", "--tensor-parallel-size", "2"])
    assert whole.exit_code == 0 and split.exit_code == 0, split.output
    one, rank = json.loads(whole.stdout), json.loads(split.stdout)
    assert (one["tensor_parallel_size"], rank["tensor_parallel_size"]) == (1, 2)
    assert (one["kv_heads"], rank["kv_heads"]) == (2, 1)
    assert rank["kv_bytes_per_token"] * 2 == one["kv_bytes_per_token"]
    weights = {p["name"]: p["bytes"] for p in one["ledger"]}["weights"]
    assert {p["name"]: p["bytes"] for p in rank["ledger"]}["weights"] < weights
    text = invoke([*base, "--tensor-parallel-size", "2"]).stdout
    assert "tensor parallel: the plan of one rank of 2; weights split 2 ways, 1 KV heads per rank" in text
    refused = invoke([*base, "--tensor-parallel-size", "3"])
    assert refused.exit_code == 2 and "use --tensor-parallel-size 2, or 1" in refused.output


@pytest.mark.parametrize("command", [["generate", "hi"], ["plan"], ["bench", "engine", "--batches", "1"]])
def test_cuda_asked_of_a_cpu_build_of_torch_names_the_install(command):
    """generate, plan and bench as serve: a torch without CUDA gets the install that
    helps, not a traceback or the driver's hints (exit 2)."""
    from service.cli.precheck import torch_without_gpu_support

    if torch_without_gpu_support() is None:
        pytest.skip("this torch is a GPU build")
    result = invoke([*command, "--device", "cuda"])
    assert result.exit_code == 2, result.output
    assert "is built without CUDA" in result.stderr and "--device cpu" in result.stderr
    assert "Traceback" not in result.output and "nvidia_uvm" not in result.stderr


def test_a_cache_folder_that_cannot_be_written_is_named(tmp_path):
    """The default model's first conversion into a cache folder that is a file: exit 2
    naming HEADROOM_CACHE_DIR, no traceback."""
    blocked = tmp_path / "cache"
    blocked.write_text("not a folder")
    result = CliRunner().invoke(main, ["generate", "hi", "--device", "cpu"],
                                env={"HEADROOM_CONFIG": os.devnull, "HEADROOM_CACHE_DIR": str(blocked)})
    assert result.exit_code == 2, result.output
    assert "HEADROOM_CACHE_DIR" in result.stderr and "Traceback" not in result.output


@pytest.mark.parametrize("batches", ["1,,2", "abc", "0", "1,-4", ""])
def test_bench_engine_refuses_a_bad_batch_list(batches):
    result = invoke(["bench", "engine", "--device", "cpu", "--batches", batches])
    assert result.exit_code == 2
    assert "give positive integers separated by commas, e.g. 1,16" in result.output


# -- kernel switches ---------------------------------------------------------------------------


def test_generate_hands_its_kernel_switches_to_the_in_process_engine(monkeypatch):
    """``headroom generate --no-quant-int8 --kernels torch`` (and a ``HEADROOM_*``
    variable) reach the engine config the in-process engine starts from."""
    from engine.commands import generate as generate_command

    seen = {}
    monkeypatch.setattr(generate_command, "run_generate", lambda **kw: seen.update(kw))
    result = CliRunner().invoke(main, ["generate", "--no-quant-int8", "--kernels", "torch", "hi"],
                                env={"HEADROOM_CONFIG": os.devnull, "HEADROOM_PDL": "off"})
    assert result.exit_code == 0, result.output
    config = seen["config"]
    assert (config.quant_int8, config.kernels, config.pdl, config.quant_int8_fuse) == (False, "torch", False, False)


@pytest.mark.parametrize("command", ["generate", "plan"])
def test_a_bad_kernel_switch_is_refused_naming_its_flag_or_variable(command):
    args = [command] + (["hi"] if command == "generate" else [])
    by_flag = CliRunner().invoke(main, [command, "--kernels", "tritn", *args[1:]], env={"HEADROOM_CONFIG": os.devnull})
    assert by_flag.exit_code == 2 and "--kernels: 'tritn' is not one of auto, torch" in by_flag.output
    by_env = CliRunner().invoke(main, args, env={"HEADROOM_CONFIG": os.devnull, "HEADROOM_QUANT_INT8": "maybe"})
    assert by_env.exit_code == 2
    assert 'environment HEADROOM_QUANT_INT8: quant_int8 = "maybe" is not a valid boolean' in by_env.output


def test_generate_without_a_temperature_samples_as_the_model_recommends(tmp_path, make_tiny_hf_model,
                                                                        smollm_tokenizer):
    """An unset --temperature means the model's own sampling (its generation_config.json),
    as the API's unset fields do: a folder recommending top_k 1 answers the greedy reply
    whatever the seed (generate sent temperature 0.7 and no top_k, so seeds parted)."""
    make_tiny_hf_model("qwen3", tmp_path, vocab_size=len(smollm_tokenizer))
    smollm_tokenizer.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_k": 1}))
    common = ["generate", "--local", "--model", str(tmp_path), "--device", "cpu", "--max-tokens", "12", "--raw",
              "The capital of France"]
    greedy = invoke([*common, "--temperature", "0"])
    assert greedy.exit_code == 0, greedy.output
    assert greedy.output.strip(), "twelve tokens spell some text"
    for seed in ("1", "2", "3"):
        result = invoke([*common, "--seed", seed])
        assert result.exit_code == 0, result.output
        assert result.output == greedy.output
