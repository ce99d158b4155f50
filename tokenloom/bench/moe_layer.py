"""`tokenloom bench moe`: the mixture-of-experts layers of a decode step timed five ways at decode batch sizes, and
(with `--save-model DIR`) a random Qwen3-MoE folder of the same layer shape for `tokenloom bench decode`, whose
`-tp 2 --enable-expert-parallel` run gives the expert-parallel figure.

The five ways, on the same weights and routing:
- grouped: tokenloom's FusedMoE path (pairs sorted by expert, one GEMM pair per active expert), with
  stacked weights and with each expert prepacked for oneDNN (what the CPU engine runs);
- per-expert masks: transformers' reference loop (a one-hot mask per expert, then the same GEMMs);
- per-token loop: every (token, expert) pair on its own (what grouping avoids);
- dense: a SwiGLU MLP with the same active parameters per token (top_k x expert width), the floor.
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from tokenloom.model.layers.fused_moe import grouped_experts
from tokenloom.model.layers.moe import select_experts
from tokenloom.model.layers.onednn_layout import pack_weight


def add_moe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--expert-width", type=int, default=256, help="each expert's intermediate size")
    p.add_argument("--layers", type=int, default=8, help="MoE layers of distinct weights per timed step (default 8)")
    p.add_argument("--batch-sizes", default="1,8,32", help="tokens per step (default 1,8,32)")
    p.add_argument("--repeats", type=int, default=30, help="timed calls per figure (median reported)")
    p.add_argument("--save-model", default=None, metavar="DIR",
                   help="also write a random 4-layer Qwen3-MoE of this layer shape to DIR (needs transformers)")
    p.add_argument("--json", dest="json_path", default=None)
    p.set_defaults(func=run_moe)


def _per_expert_masks(x, w13, w2, weights, ids):
    """transformers' Qwen3MoeExperts.forward loop, on the same stacked weights."""
    out = torch.zeros_like(x)
    inter = w2.shape[-1]
    mask = F.one_hot(ids, num_classes=w13.shape[0]).permute(2, 1, 0)
    for expert in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero():
        slot, token = torch.where(mask[expert[0]])
        gate, up = F.linear(x[token], w13[expert[0]]).split(inter, dim=-1)
        out.index_add_(0, token, F.linear(F.silu(gate) * up, w2[expert[0]]) * weights[token, slot, None])
    return out


def _per_token(x, w13, w2, weights, ids):
    out = torch.zeros_like(x)
    inter = w2.shape[-1]
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist()):
            gate, up = F.linear(x[t:t + 1], w13[e]).split(inter, dim=-1)
            out[t:t + 1] += w * F.linear(F.silu(gate) * up, w2[e])
    return out


def _interleaved_medians(fns: dict, repeats: int) -> dict[str, float]:
    """Median ms of each function, timed in rounds (one call of each per round) so that a noisy machine's
    slow spells fall on all of them alike."""
    times = {name: [] for name in fns}
    for name, fn in fns.items():
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * sorted(t)[len(t) // 2] for name, t in times.items()}


@torch.inference_mode()
def time_layers(hidden: int, experts: int, top_k: int, width: int, layers: int, batch: int,
                repeats: int) -> dict[str, float]:
    """ms for `batch` tokens through `layers` MoE layers of distinct random weights (so that, as in a real
    decode step, the experts come from memory rather than from a cache that holds one layer)."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g) * 0.02

    moe = [(rand(experts, 2 * width, hidden), rand(experts, hidden, width), rand(experts, hidden))
           for _ in range(layers)]
    dense_weights = [(rand(2 * top_k * width, hidden), rand(hidden, top_k * width)) for _ in range(layers)]
    x = torch.randn(batch, hidden, generator=g)

    def routed(impl):
        def run():
            return [impl(x, w13, w2, *select_experts(F.linear(x, router), top_k, renormalize=True))
                    for w13, w2, router in moe]
        return run

    def dense():
        outs = []
        for w13, w2 in dense_weights:
            gate, up = F.linear(x, w13).split(top_k * width, dim=-1)
            outs.append(F.linear(F.silu(gate) * up, w2))
        return outs

    packed = [([pack_weight(w) for w in w13], [pack_weight(w) for w in w2], router) for w13, w2, router in moe]

    def routed_packed():
        return [grouped_experts(x, w13, w2, *select_experts(F.linear(x, router), top_k, renormalize=True))
                for w13, w2, router in packed]

    grouped = routed(grouped_experts)()
    for reference in (routed_packed(), routed(_per_expert_masks)(), routed(_per_token)()):
        for a, b in zip(grouped, reference):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    return _interleaved_medians({"grouped": routed(grouped_experts), "grouped_prepacked": routed_packed,
                                 "per_expert_masks": routed(_per_expert_masks),
                                 "per_token_loop": routed(_per_token), "dense_same_active": dense}, repeats)


def save_random_qwen3_moe(folder: str, hidden: int, experts: int, top_k: int, width: int) -> None:
    """A random Qwen3-MoE (4 layers, 8 heads of 64, vocab 4096) saved as safetensors by transformers."""
    import transformers  # lazy: transformers is optional (the test extra)
    config = transformers.Qwen3MoeConfig(vocab_size=4096, hidden_size=hidden, intermediate_size=4 * hidden,
                                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                                         head_dim=64, num_experts=experts, num_experts_per_tok=top_k,
                                         moe_intermediate_size=width, norm_topk_prob=True,
                                         max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)


def run_moe(ns) -> int:
    results = {"hidden": ns.hidden, "experts": ns.experts, "top_k": ns.top_k, "expert_width": ns.expert_width,
               "layers": ns.layers,
               "threads": torch.get_num_threads(), "ms": {}}
    print(f"{ns.layers} MoE layers: hidden {ns.hidden}, {ns.experts} experts of width {ns.expert_width}, "
          f"top-{ns.top_k}, {torch.get_num_threads()} threads (median of {ns.repeats})")
    for batch in (int(b) for b in ns.batch_sizes.split(",")):
        ms = time_layers(ns.hidden, ns.experts, ns.top_k, ns.expert_width, ns.layers, batch, ns.repeats)
        results["ms"][batch] = ms
        print(f"  {batch:>4} tokens: " + ", ".join(f"{k} {v:.3f} ms" for k, v in ms.items()), flush=True)
    if ns.save_model:
        save_random_qwen3_moe(ns.save_model, ns.hidden, ns.experts, ns.top_k, ns.expert_width)
        print(f"saved a random 4-layer Qwen3-MoE of this shape to {ns.save_model}")
    if ns.json_path:
        with open(ns.json_path, "w") as f:
            json.dump(results, f, indent=2)
    return 0
