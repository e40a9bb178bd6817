"""Load a GGUF model with its projections kept in GGUF block format on the device.

The projections (q/k/v, o, gate/up, down, a shared expert's and an untied LM head) whose
tensors are of a type :mod:`kernels.quant` reads become
:class:`~engine.layers.linear.gguf_blocks.QuantLinear` modules holding the file's blocks as
they are; every other tensor (embeddings, norms, routers, biases, projections of other
types) is dequantized into the model dtype, as the converted Hugging Face folder holds
it. llama.cpp's q/k row permutation, and its tiling of Qwen3.5's value heads, are undone
on the blocks' rows (a row of blocks is a row of weights); Qwen3.5's ``ssm_out``, whose
value heads are its columns, stays tiled and its layer tiles its input
(:mod:`engine.loader.gguf_qwen35`).

A mixture of experts' stacked experts (``ffn_gate_exps``/``ffn_up_exps``/``ffn_down_exps``
of qwen3moe, qwen2moe and llama files with experts) become a
:class:`~engine.layers.moe.quant_experts.QuantExperts` per layer, each projection in its own
block type, when all three are types the kernels read (on the CPU: the C kernels of
:mod:`kernels.cpu.moe_experts`, where they build); else they are dequantized at load.

:func:`gguf_weight_size` prices the same choice, tensor by tensor, with the same
function (:func:`kernels.quant.formats.tensor_bytes`), so the memory plan charges what
:func:`load_gguf_quantized` allocates.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.common.config import ModelConfig
from engine.common.load_errors import ModelLoadError, WeightMismatch
from engine.common.units import MiB
from engine.layers.linear.cpu_blocks import BLOCK_TYPES as CPU_BLOCK_TYPES
from engine.layers.linear.cpu_int4 import CODE_BITS, QuantEmbedding, packable, packed_bytes
from engine.layers.linear.cpu_kernels import cpu_kernels
from engine.layers.linear.gguf_blocks import PartSpec, QuantLinear, repack_model_for_kernels
from engine.layers.moe.quant_experts import QuantExperts, quant_experts_for
from engine.loader.gguf_config import ROPE_FREQS
from engine.loader.gguf_gpt_oss import ARCHITECTURES as GPT_OSS_ARCHITECTURES
from engine.loader.gguf_hf_tensors import (
    converted_tensors,
    dequantize_tensor,
    hf_tensors,
    reverse_llama_permute,
)
from engine.loader.gguf_names import (
    EMBEDDINGS,
    check_gguf_tensors,
    expert_targets,
    projection_targets,
)
from engine.loader.gguf_qwen35 import ARCHITECTURES as QWEN35_ARCHITECTURES
from engine.loader.gguf_qwen35 import grouped_rows
from engine.loader.gguf_tensors import open_tensors
from engine.loader.meta_build import build_on_meta, materialize
from engine.loader.weight_size import WeightSize
from kernels.cpu.block_gemv import KQUANT_NAMES
from kernels.cpu.moe_experts import takes as cpu_takes
from kernels.quant.formats import EXPERT_FORMATS, FORMATS, tensor_bytes


def _embeddings_in_blocks(by_name: dict[str, Any], wanted: bool, cpu_blocks: bool) -> str | None:
    """The block type the token embeddings stay in, or None (dequantized): when
    ``wanted`` (the CPU engine's layout), a type :mod:`engine.layers.linear.cpu_int4`
    reads (a lookup dequantizes its rows; a tied LM head is repacked from the same
    blocks), or where the C kernels run (``cpu_blocks``) a K-quant too (a tied head reads
    the same blocks through the C GEMV)."""
    t = by_name.get(EMBEDDINGS)
    if not wanted or t is None:
        return None
    name = t.tensor_type.name
    return name if name in CODE_BITS or (cpu_blocks and name in KQUANT_NAMES) else None


def _experts_in_blocks(by_name: dict[str, Any], config: ModelConfig, gguf_path: Path,
                       experts_in_blocks: bool, cpu_blocks: bool = False) -> dict[str, tuple[str, str, str]]:
    """The expert modules kept in blocks -> their (gate, up, down) types: every layer
    whose three tensors are of types the kernels read, when ``experts_in_blocks``; those
    the C CPU kernels read, when ``cpu_blocks`` (a CPU engine's layout where they build);
    every layer of MXFP4 experts (a quarter of bfloat16's bytes). A layer whose gate and
    up are one tensor (``ffn_gate_up_exps``) is dequantized.

    Raises:
        WeightMismatch: an expert tensor is missing.
    """
    kept = {}
    for module, names in expert_targets(config).items():
        if names[0].replace("ffn_gate_exps", "ffn_gate_up_exps") in by_name:
            continue
        missing = [n for n in names if n not in by_name]
        if missing:
            raise WeightMismatch(f"{gguf_path}: tensor {missing[0]} is missing")
        types = tuple(by_name[n].tensor_type.name for n in names)
        readable = all(t in FORMATS or t in EXPERT_FORMATS for t in types)
        if (experts_in_blocks and readable) or (cpu_blocks and cpu_takes(types)) or set(types) == {"MXFP4"}:
            kept[module] = types
    return kept


def _kept_quantized(tensor: Any, projection_weights: set[str], expert_blocks: set[str] = frozenset()) -> str | None:
    """The block type ``tensor`` stays in on the device, or None (dequantized); experts in
    ``expert_blocks`` (:func:`_experts_in_blocks`) stay in theirs."""
    name = tensor.tensor_type.name
    kept = tensor.name in expert_blocks or (tensor.name in projection_weights and name in FORMATS)
    return name if kept else None


def _hf_shape(tensor: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims innermost first


def gguf_weight_size(gguf_path: str | Path, config: ModelConfig, dtype: torch.dtype, device_type: str = "cuda",
                     cpu_blocks: bool | None = None, file_forms: bool = False) -> WeightSize:
    """What :func:`load_gguf_quantized` allocates for ``gguf_path`` on a ``device_type``
    device, from the file's tensor table (no tensor data is read). On the CPU the
    Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 projections take torch's int4 layout (one or two planes), the
    token embeddings of those types stay in blocks and a tied LM head is repacked from
    them; other block types are dequantized (:mod:`engine.layers.linear.cpu_int4`). Where
    the C CPU kernels run (``cpu_blocks``; None asks :func:`~engine.layers.linear.cpu_kernels.cpu_kernels`)
    Q4_0/Q4_1/Q8_0 and K-quant projections stay in their blocks, a tied head shares the embeddings'
    (:mod:`engine.layers.linear.cpu_blocks`) and routed experts of types they read stay
    in theirs (else dequantized); the experts' bytes are also given per layer, for the
    host tier and expert cache of ``--cpu-experts``. ``file_forms``: a decoder
    layer's ``decoder_layer_bytes`` also count the file's blocks of what the CPU path
    repacks, which a split that may move keeps (:func:`engine.layers.host_layers.file_form`).

    Raises:
        CorruptWeights: the file is not a readable GGUF.
        WeightMismatch: a mixture of experts' expert tensor is missing.
    """
    gguf_path = Path(gguf_path)
    reader = open_tensors(gguf_path)
    projection_weights = {f"{s}.weight" for stems in projection_targets(config).values() for s in stems}
    by_name = {t.name: t for t in reader.tensors}
    layer_of = {n: i for i, names in enumerate(expert_targets(config).values()) for n in names}
    expert_layer_bytes = [0] * len(layer_of and config.moe_layers)
    decoder_layer_bytes = [0] * config.num_layers
    itemsize = torch.empty((), dtype=dtype).element_size()
    quant_count: Counter[str] = Counter()
    quant_bytes: Counter[str] = Counter()
    dense_types: Counter[str] = Counter()
    dense_bytes = 0
    if device_type == "cpu" and cpu_blocks is None:
        cpu_blocks = cpu_kernels() is not None
    embed_type = _embeddings_in_blocks(by_name, device_type == "cpu", bool(cpu_blocks))
    kept_experts = _experts_in_blocks(by_name, config, gguf_path, device_type != "cpu",
                                      device_type == "cpu" and bool(cpu_blocks))
    expert_blocks = {n for m in kept_experts for n in expert_targets(config)[m]}
    for t in reader.tensors:
        if t.name == ROPE_FREQS:
            continue
        kept = stored = _kept_quantized(t, projection_weights, expert_blocks)
        shape = _hf_shape(t)
        if (device_type == "cpu" and kept is not None and t.name not in expert_blocks
                and not (cpu_blocks and kept in CPU_BLOCK_TYPES)):
            kept = "int4" if packable(kept, shape[0]) else None  # else the C GEMV reads the blocks as stored
        if t.name == EMBEDDINGS and embed_type is not None:
            kept = embed_type
        if kept == "int4":
            nbytes = packed_bytes(shape[0], shape[1], t.tensor_type.name)
        else:
            nbytes = tensor_bytes(kept or "dense", shape, itemsize)
        if t.name == EMBEDDINGS and embed_type is not None and config.tie_word_embeddings:
            if cpu_blocks and embed_type in CPU_BLOCK_TYPES:
                head_kind, head = embed_type, 0  # the tied head reads the embeddings' own blocks
            else:
                head_kind, head = "int4", packed_bytes(shape[0], shape[1], embed_type)  # repacked
            quant_count[head_kind] += 1
            quant_bytes[head_kind] += head
        if t.name in layer_of:
            expert_layer_bytes[layer_of[t.name]] += nbytes
        block = t.name.split(".")
        if block[0] == "blk" and block[1].isdecimal() and int(block[1]) < config.num_layers:
            file_form = file_forms and stored is not None and kept != stored and t.name not in expert_blocks
            decoder_layer_bytes[int(block[1])] += nbytes + (tensor_bytes(stored, shape, itemsize) if file_form else 0)
        if kept:
            quant_count[kept] += 1
            quant_bytes[kept] += nbytes
        else:
            dense_types[t.tensor_type.name] += 1
            dense_bytes += nbytes
    rope_cache = config.max_position_embeddings * (config.rotary_dim or config.head_dim) * 4  # float32
    parts = [f"{quant_count[k]} {k} blocks {quant_bytes[k] / MiB:.1f} MiB" for k in sorted(quant_count)]
    if expert_blocks:
        expert_bytes = sum(tensor_bytes(by_name[n].tensor_type.name, _hf_shape(by_name[n]), itemsize) for n in expert_blocks)
        parts.append(f"routed experts {expert_bytes / MiB:.1f} MiB of them")
    if dense_types:
        types = ", ".join(f"{n} {k}" for k, n in sorted(dense_types.items()))
        dtype_name = str(dtype).removeprefix("torch.")
        parts.append(f"{dtype_name} {sum(dense_types.values())} tensors ({types}) {dense_bytes / MiB:.1f} MiB")
    parts.append(f"RoPE cache {rope_cache / MiB:.1f} MiB")  # so the parts add up to the total
    return WeightSize(sum(quant_bytes.values()) + dense_bytes + rope_cache, "; ".join(parts),
                      expert_layer_bytes=tuple(expert_layer_bytes),
                      decoder_layer_bytes=tuple(decoder_layer_bytes),
                      experts_in_blocks=bool(layer_of) and expert_blocks == set(layer_of))


def load_gguf_quantized(
    config: ModelConfig, gguf_path: str | Path, device: torch.device | str, dtype: torch.dtype,
    *, experts_in_blocks: bool | None = None, embeddings_in_blocks: bool = False,
) -> torch.nn.Module:
    """Build the model of ``config`` on ``device`` from ``gguf_path``, projections in
    GGUF blocks where their type allows. Returns the model in eval mode, RoPE cache
    built.

    ``experts_in_blocks``: keep a mixture of experts' routed experts in blocks
    (:class:`~engine.layers.moe.quant_experts.QuantExperts`) where their types allow (False:
    dequantized, MXFP4 aside); default: on CUDA, and on the CPU where the C kernels read them.

    ``embeddings_in_blocks``: the CPU engine's layout (:func:`gguf_weight_size` for
    ``"cpu"`` prices it): token embeddings of a type
    :mod:`engine.layers.linear.cpu_int4` reads stay in blocks
    (:class:`~engine.layers.linear.cpu_int4.QuantEmbedding`) and a tied LM head becomes
    a QuantLinear over the same blocks, for
    :func:`~engine.layers.cpu_pack.pack_model_for_cpu` to repack.

    Raises:
        CorruptWeights: the file is not a readable GGUF.
        WeightMismatch: a tensor is missing or its shape disagrees with ``config``.
    """
    gguf_path = Path(gguf_path)
    device = torch.device(device)
    reader = open_tensors(gguf_path)
    arch = reader.values.get("general.architecture")
    by_name = {t.name: t for t in reader.tensors}
    check_gguf_tensors(config, gguf_path, by_name)
    targets = projection_targets(config)
    projection_weights = {f"{s}.weight" for stems in targets.values() for s in stems}
    cpu_blocks = experts_in_blocks is None and device.type == "cpu" and cpu_kernels() is not None
    if experts_in_blocks is None:
        experts_in_blocks = device.type != "cpu"
    expert_modules = _experts_in_blocks(by_name, config, gguf_path, experts_in_blocks, cpu_blocks)
    model = build_on_meta(config)
    if arch in QWEN35_ARCHITECTURES:  # ssm_out's columns keep llama.cpp's tiled value heads
        for layer in model.model.layers:
            if layer.linear_attn is not None:
                layer.linear_attn.out_proj_tiled = True
    for module_name, stems in targets.items():
        old = model.get_submodule(module_name)
        specs = []
        for stem in stems:
            t = by_name[f"{stem}.weight"]
            specs.append(PartSpec(_hf_shape(t)[0], _kept_quantized(t, projection_weights)))
        if sum(s.rows for s in specs) != old.out_features:
            raise WeightMismatch(f"{gguf_path}: {', '.join(stems)} hold {sum(s.rows for s in specs)} rows, "
                                 f"the config expects {old.out_features} for {module_name}")
        with torch.device("meta"):
            new = QuantLinear(old.in_features, specs, bias=old.bias is not None, dtype=dtype)
        _swap(model, module_name, new)
    embed_type = _embeddings_in_blocks(by_name, embeddings_in_blocks, embeddings_in_blocks and cpu_kernels() is not None)
    if embed_type is not None:
        embed = by_name[EMBEDDINGS]
        rows, cols = _hf_shape(embed)
        if (rows, cols) != (config.vocab_size, config.hidden_size):
            raise WeightMismatch(f"{gguf_path}: tensor {EMBEDDINGS} has shape {(rows, cols)}, the config expects "
                                 f"{(config.vocab_size, config.hidden_size)}")
        with torch.device("meta"):
            blocks = torch.empty((rows, tensor_bytes(embed_type, (1, cols), 0)), dtype=torch.uint8)
            model.model.embed_tokens = QuantEmbedding(blocks, embed_type, cols, dtype)
            # A tied head is made after the blocks are filled, reading the same tensor.
    for module_name, types in expert_modules.items():
        with torch.device("meta"):
            new = quant_experts_for(config, types)
        _swap(model, module_name, new)
    model = model.to(dtype=dtype)  # floating tensors only: the uint8 blocks keep their type
    materialize(model, device)
    model.init_rope_cache()
    expert_weights = {n for m in expert_modules for n in expert_targets(config)[m]}
    with torch.no_grad():
        # After each module, the file's pages read for it leave this process's resident
        # memory (reader.release): the map would otherwise hold the whole file there.
        for module_name, stems in targets.items():
            _fill(model.get_submodule(module_name), [by_name[f"{s}.weight"] for s in stems],
                  [by_name.get(f"{s}.bias") for s in stems], arch, config, gguf_path)
            reader.release()
        if embed_type is not None:
            embed = by_name[EMBEDDINGS]
            blocks = model.model.embed_tokens.blocks
            _copy_in_pieces(blocks, _mapped(embed.data).reshape(blocks.shape), reader)
            if config.tie_word_embeddings:  # the head's one part is the same blocks: no second copy
                with torch.device("meta"):
                    model.lm_head = QuantLinear(model.model.embed_tokens.embedding_dim,
                                                [PartSpec(blocks.shape[0], embed_type)], bias=False, dtype=dtype)
                model.lm_head.part0 = blocks
        for module_name in expert_modules:
            _fill_experts(model.get_submodule(module_name),
                          [by_name[n] for n in expert_targets(config)[module_name]], gguf_path)
            reader.release()
        if device.type == "cuda":
            repack_model_for_kernels(model)
        skip = (projection_weights | {f"{s}.bias" for stems in targets.values() for s in stems} | expert_weights
                | {ROPE_FREQS} | ({EMBEDDINGS} if embed_type is not None else set()))
        origin: dict[str, str] = {}  # a Hugging Face name -> the GGUF tensor it came from
        try:
            model.load_weights(_rest(reader, skip, gguf_path, arch, config, origin))
        except WeightMismatch as e:
            raise WeightMismatch(f"{gguf_path}: {_in_gguf_terms(str(e), origin)}") from None
    return model.eval()


def _swap(model: torch.nn.Module, module_name: str, new: torch.nn.Module) -> None:
    parent, _, leaf = module_name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)


def _fill_experts(module: QuantExperts, tensors: list[Any], gguf_path: Path) -> None:
    """Copy the stacked gate, up and down blocks into ``module``'s buffers."""
    for buf, t in zip((module.gate, module.up, module.down), tensors, strict=True):
        data = torch.from_numpy(np.array(t.data))  # a copy: the file is mapped read-only
        if data.numel() != buf.numel() or _hf_shape(t)[:2] != tuple(buf.shape[:2]):
            raise WeightMismatch(f"{gguf_path}: tensor {t.name} has shape {_hf_shape(t)}, the config expects "
                                 f"{tuple(buf.shape[:2])} rows of experts")
        buf.copy_(data.reshape(buf.shape))


def _rows_in_hf_order(data: torch.Tensor, stem: str, arch: str, config: ModelConfig) -> torch.Tensor:
    """llama.cpp permutes llama's q/k rows and tiles Qwen3.5's value heads; undo it (rows
    of weights or of blocks)."""
    if arch in QWEN35_ARCHITECTURES:
        return grouped_rows(data, stem, config)
    if arch == "llama" and stem.endswith(("attn_q", "attn_k")):
        heads = config.num_heads if stem.endswith("attn_q") else config.num_kv_heads
        return reverse_llama_permute(data, heads)
    return data


def _fill(module: QuantLinear, weights: list[Any], biases: list[Any | None], arch: str, config: ModelConfig,
          gguf_path: Path) -> None:
    views = module.part_views()
    starts = np.cumsum([0] + [spec.rows for spec, _ in views])
    row = 0
    for t in weights:
        stem = t.name.removesuffix(".weight")
        i = int(np.searchsorted(starts, row, side="right")) - 1
        spec, buf = views[i]
        if spec.type_name is None:
            data = torch.from_numpy(np.array(dequantize_tensor(t), dtype=np.float32))
        else:
            data = torch.from_numpy(np.array(t.data))  # a copy: the file is mapped read-only
        data = _rows_in_hf_order(data, stem, arch, config)
        dest = buf.narrow(0, row - int(starts[i]), data.shape[0])
        if tuple(dest.shape) != tuple(data.shape):
            raise WeightMismatch(f"{gguf_path}: tensor {t.name} has shape {tuple(data.shape)}, "
                                 f"its place holds {tuple(dest.shape)}")
        dest.copy_(data)
        row += data.shape[0]
    if module.bias is not None:
        if any(b is None for b in biases):
            raise WeightMismatch(f"{gguf_path}: {weights[0].name} and its neighbours lack a bias the config expects")
        parts = [_rows_in_hf_order(torch.from_numpy(np.array(dequantize_tensor(b), dtype=np.float32)),
                                   b.name.removesuffix(".bias"), arch, config) for b in biases]
        module.bias.copy_(torch.cat(parts))


_PIECE_BYTES = 4 << 20


def _copy_in_pieces(dest: torch.Tensor, src: torch.Tensor, reader: Any) -> None:
    """``dest.copy_(src)`` for ``src`` over the file's memory map, a few MiB of rows at a
    time with the pages read dropped after each (``reader.release``): the page cache may
    map a file in large folios, so the whole source would otherwise count in this
    process's resident memory next to its copy (measured on the default model's 18 MB
    embedding table: 31 MiB above the load's end at once, a few MiB in pieces)."""
    rows = max(1, _PIECE_BYTES // max(1, src[0].numel() * src.element_size()))
    for start in range(0, src.shape[0], rows):
        dest[start:start + rows].copy_(src[start:start + rows])
        reader.release()


def _mapped(data: np.ndarray) -> torch.Tensor:
    """A tensor over a view of the file's read-only memory map, to copy from without a
    transient copy of the whole tensor (torch warns that it cannot write to it; nothing
    does)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.asarray(data))


def _in_gguf_terms(message: str, origin: dict[str, str]) -> str:
    """A load error of the model's Hugging Face names in the file's terms: each tensor
    named as the GGUF names it (the model's name after it), the file's metadata where the
    message blames config.json."""
    for hf_name, gguf_name in origin.items():
        message = message.replace(f"tensor {hf_name} ", f"tensor {gguf_name} ({hf_name}) ")
    return (message.replace("the config expects", "its metadata expects")
            .replace("config.json and the weights disagree", "the file's metadata and its tensors disagree"))


def _rest(reader: Any, skip: set[str], gguf_path: Path, arch: str,
          config: ModelConfig, origin: dict[str, str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor not in a quantized module, dequantized, under its Hugging Face name
    (stacked experts not kept in blocks: one tensor per expert; gpt-oss's paired).
    ``origin``, when given, gets each yielded name's GGUF tensor."""
    names = {"architectures": [config.architecture], "num_attention_heads": config.num_heads,
             "num_key_value_heads": config.num_kv_heads, "num_hidden_layers": config.num_layers,
             "linear_num_key_heads": config.linear_num_key_heads,
             "linear_num_value_heads": config.linear_num_value_heads,
             "linear_key_head_dim": config.linear_key_head_dim,
             "linear_value_head_dim": config.linear_value_head_dim}
    if arch in GPT_OSS_ARCHITECTURES:
        try:
            for item in converted_tensors((t for t in reader.tensors if t.name not in skip), gguf_path, arch, names,
                                          torch.float32):
                yield item
                reader.release()
        except ModelLoadError as e:
            raise WeightMismatch(str(e)) from None
        return
    for t in reader.tensors:
        if t.name in skip:
            continue
        try:
            for hf_name, tensor in hf_tensors(t, gguf_path, arch, names, torch.float32):
                if origin is not None:
                    origin[hf_name] = t.name
                yield hf_name, tensor
        except ModelLoadError:
            raise WeightMismatch(f"tensor {t.name} has no place in the model") from None
        # Each small tensor's read maps a large folio of the file (up to 2 MiB; 60 MiB
        # over the default model's 61 norms): dropped once the model holds its copy.
        reader.release()
