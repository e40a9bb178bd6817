"""Write a random-weight mixture-of-experts checkpoint whose router prefers some experts,
to measure an expert cache under a realistic routing skew through ``headroom serve``.

    python -m engine.bench.skewed_moe OUT --shape qwen3-30b-a3b --layers 12 \\
        --tokenizer DIR --zipf 0.85

Random routers spread tokens evenly over the experts, so every cache misses alike; real
routers do not (a few experts of a layer take much of the traffic). Here each layer's
experts get a popularity ``p_e ~ 1 / rank_e ** zipf`` (a random rank order per layer),
built into the weights, not into the engine: every embedding row shares one direction
``u``, each router row adds ``c_e * u``, so after the RMSNorm a token's router logits
carry a fixed offset per expert that follows ``log p_e`` beside the random part (the
offset is scaled to the random part's spread, as Gumbel top-k sampling of ``p`` would
be). The other projections are small, so the shared direction survives the layers.
The writer prints how many of layer 0's experts take 90 % of its routings over random
tokens: the measure published for real routers (for Qwen3-30B-A3B, about 58-65 of 128
over prose, code and math, where an even spread needs about 115); ``--zipf 0.85`` gives
about that.

The tokenizer, chat template and generation config come from ``--tokenizer`` (a model
folder, e.g. the converted default model); the vocabulary and special ids follow it.
Safetensors shards, one per layer, with ``model.safetensors.index.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.bench.model_shapes import SHAPES

# The standard deviation of a Gumbel(0, 1) variable, pi / sqrt(6): the offsets are set
# so that top-k over offset + noise picks like Gumbel top-k sampling of p would.
GUMBEL_STD = math.pi / math.sqrt(6)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                   "special_tokens_map.json")
SHARED_SCALE = 4.0  # the shared direction's RMS against the embedding's random part (1.0)
ROUTER_STD = 0.02
PROJECTION_STD = 0.004


def zipf_offsets(num_experts: int, zipf: float, generator: torch.Generator) -> torch.Tensor:
    """``[E]`` float32 log-popularities ``-zipf * log(rank)`` in a random rank order, mean 0."""
    ranks = torch.randperm(num_experts, generator=generator).float() + 1
    logp = -zipf * ranks.log()
    return logp - logp.mean()


def write_skewed_moe(out: Path, shape: str, layers: int, tokenizer: Path, zipf: float, seed: int = 0,
                     **overrides) -> int:
    """Write the checkpoint (see the module docstring) into ``out``; returns how many of
    layer 0's experts, the most used first, take 90 % of its top-k routings over 4096
    random tokens. ``overrides`` replace entries of the shape's config (smaller sizes for
    tests).

    Raises:
        KeyError: ``shape`` is not a mixture of experts of ``engine.bench.model_shapes``.
        FileNotFoundError: ``tokenizer`` has no ``tokenizer.json``.
    """
    cfg = {**SHAPES[shape], **overrides}
    if "num_experts" not in cfg:
        raise KeyError(f"{shape} is not a mixture-of-experts shape")
    tok_cfg = json.loads((tokenizer / "config.json").read_text()) if (tokenizer / "config.json").exists() else {}
    if not (tokenizer / "tokenizer.json").exists():
        raise FileNotFoundError(f"{tokenizer} has no tokenizer.json")
    vocab = tok_cfg.get("vocab_size", cfg["vocab_size"])
    cfg.update(num_hidden_layers=layers, vocab_size=vocab, torch_dtype="bfloat16",
               bos_token_id=tok_cfg.get("bos_token_id", cfg.get("bos_token_id")),
               eos_token_id=tok_cfg.get("eos_token_id", cfg.get("eos_token_id")))
    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (tokenizer / name).exists():
            shutil.copy(tokenizer / name, out / name)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(seed)
    h, e, i = cfg["hidden_size"], cfg["num_experts"], cfg["moe_intermediate_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    u = torch.randn(h, generator=g)
    u = u / u.norm()

    # The bulk (the experts) is drawn on the GPU when there is one: a CPU generator would
    # take minutes over a full-size model.
    dg = torch.Generator(device).manual_seed(seed)

    def rand(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=dg, device=device) * std).to(torch.bfloat16)

    shard_map: dict[str, str] = {}

    def save(tensors: dict[str, torch.Tensor], file: str) -> None:
        save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(out / file))
        shard_map.update(dict.fromkeys(tensors, file))

    embed = torch.randn(vocab, h, generator=g) + SHARED_SCALE * math.sqrt(h) * u
    save({"model.embed_tokens.weight": embed.to(torch.bfloat16), "model.norm.weight": torch.ones(h),
          "lm_head.weight": rand(vocab, h, std=ROUTER_STD)}, "embed.safetensors")
    # After the RMSNorm (RMS 1: length sqrt(h)) a token is the shared part, length
    # sqrt(h) * s / sqrt(1 + s^2) along u, plus its own part, length sqrt(h) / sqrt(1 + s^2);
    # the router's random rows turn the latter into logits of spread ROUTER_STD times it.
    along_u = math.sqrt(h) * SHARED_SCALE / math.sqrt(1 + SHARED_SCALE**2)
    noise = ROUTER_STD * math.sqrt(h) / math.sqrt(1 + SHARED_SCALE**2)
    experts_for_90 = e
    for layer in range(layers):
        p = f"model.layers.{layer}."
        offsets = zipf_offsets(e, zipf, g) * noise / GUMBEL_STD
        router = torch.randn(e, h, generator=g) * ROUTER_STD
        # Without their own part along u, the random rows would add a fixed offset per
        # expert of their own (spread ROUTER_STD * along_u), a skew larger than the one asked.
        router -= (router @ u)[:, None] * u[None, :]
        router += (offsets / along_u)[:, None] * u[None, :]
        t = {p + "input_layernorm.weight": torch.ones(h), p + "post_attention_layernorm.weight": torch.ones(h),
             p + "self_attn.q_proj.weight": rand(q, h, std=PROJECTION_STD),
             p + "self_attn.k_proj.weight": rand(kv, h, std=PROJECTION_STD),
             p + "self_attn.v_proj.weight": rand(kv, h, std=PROJECTION_STD),
             p + "self_attn.o_proj.weight": rand(h, q, std=PROJECTION_STD),
             p + "self_attn.q_norm.weight": torch.ones(cfg["head_dim"]),
             p + "self_attn.k_norm.weight": torch.ones(cfg["head_dim"]),
             p + "mlp.gate.weight": router.to(torch.bfloat16)}
        for x in range(e):
            t[p + f"mlp.experts.{x}.gate_proj.weight"] = rand(i, h, std=PROJECTION_STD)
            t[p + f"mlp.experts.{x}.up_proj.weight"] = rand(i, h, std=PROJECTION_STD)
            t[p + f"mlp.experts.{x}.down_proj.weight"] = rand(h, i, std=PROJECTION_STD)
        save(t, f"layer{layer:03d}.safetensors")
        if layer == 0:
            tokens = embed[torch.randint(0, vocab, (4096,), generator=g)]
            normed = tokens * torch.rsqrt(tokens.pow(2).mean(-1, keepdim=True) + 1e-6)
            picks = (normed @ router.t()).topk(cfg["num_experts_per_tok"], dim=-1).indices.flatten()
            counts = torch.bincount(picks, minlength=e).sort(descending=True).values
            covered = counts.cumsum(0).float() / counts.sum()
            experts_for_90 = int((covered < 0.9).sum()) + 1
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": shard_map}))
    return experts_for_90


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--shape", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--tokenizer", type=Path, required=True, help="a model folder with tokenizer.json")
    ap.add_argument("--zipf", type=float, default=0.85, help="expert popularity ~ 1/rank**zipf (0: no skew)")
    ap.add_argument("--experts", type=int, default=None, help="routed experts per layer [default: the shape's]")
    args = ap.parse_args()
    extra = {} if args.experts is None else {"num_experts": args.experts}
    covering = write_skewed_moe(args.out, args.shape, args.layers, args.tokenizer, args.zipf, **extra)
    print(f"wrote {args.out}: {args.shape} with {args.layers} layers, zipf {args.zipf}; {covering} experts "
          "take 90 % of layer 0's routings")


if __name__ == "__main__":
    main()
