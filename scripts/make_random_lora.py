"""Random LoRA adapters for the embedded model (or any model tokenloom reads), as PEFT folders: what the LoRA
speed figures in docs/lora.md are measured with, so anyone can make the same ones.

Each adapter trains all seven projections of every decoder layer at the given rank (A ~ N(0, 1/in), B ~
N(0, 0.02^2), alpha = 2 x rank), from its own seed; `--dtype bfloat16` saves the tensors as a bf16-trained
adapter is saved (what `--lora-dtype bfloat16` then holds exactly).

Usage: .venv/bin/python scripts/make_random_lora.py OUT_DIR [--count 4] [--rank 16] [--dtype float32]
           [--model smollm2-135m-instruct]
-> OUT_DIR/a0 ... OUT_DIR/a{count-1}
"""
import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from tokenloom.model.loader import read_arch_config

parser = argparse.ArgumentParser()
parser.add_argument("out_dir")
parser.add_argument("--count", type=int, default=4)
parser.add_argument("--rank", type=int, default=16)
parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
parser.add_argument("--model", default="smollm2-135m-instruct")
args = parser.parse_args()

arch = read_arch_config(args.model)
h, q, kv, m = arch.hidden_size, arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, \
    arch.intermediate_size
shapes = {"self_attn.q_proj": (h, q), "self_attn.k_proj": (h, kv), "self_attn.v_proj": (h, kv),
          "self_attn.o_proj": (q, h), "mlp.gate_proj": (h, m), "mlp.up_proj": (h, m), "mlp.down_proj": (m, h)}
dtype = getattr(torch, args.dtype)
for n in range(args.count):
    g = torch.Generator().manual_seed(n + 1)
    tensors = {}
    for layer in range(arch.num_layers):
        for name, (fan_in, fan_out) in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(args.rank, fan_in, generator=g) / fan_in ** 0.5).to(dtype)
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(fan_out, args.rank, generator=g) * 0.02).to(dtype)
    folder = Path(args.out_dir) / f"a{n}"
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": args.rank, "lora_alpha": 2 * args.rank, "bias": "none",
              "target_modules": sorted(name.split(".")[1] for name in shapes), "base_model_name_or_path": args.model}
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
    print(folder)
