"""The transformers baseline for `bench throughput --compare-transformers` (needs transformers installed)."""
from __future__ import annotations

import os
import time

import torch
from tqdm import tqdm


def run_transformers(model_path: str, prompts: list[list[int]], output_len: int, batch: int,
                     dtype: torch.dtype = torch.float32) -> dict:
    try:
        from transformers import AutoModelForCausalLM  # lazy: transformers is optional (the test extra)
    except ImportError:
        raise RuntimeError("--compare-transformers needs the transformers package (pip install transformers)")
    if os.path.isdir(model_path):
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    else:
        model = _from_gguf(model_path)
    model = model.to(dtype).eval()
    tokens = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for i in tqdm(range(0, len(prompts), batch), desc="transformers", unit="batch"):
            ids = torch.tensor(prompts[i:i + batch])  # equal lengths: no padding needed
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                                 min_new_tokens=output_len, do_sample=False, pad_token_id=0)
            tokens += (out.shape[1] - ids.shape[1]) * ids.shape[0]
    elapsed = time.perf_counter() - start
    return {"elapsed_s": elapsed, "output_tokens_per_s": tokens / elapsed, "batch": batch,
            "dtype": str(dtype).removeprefix("torch.")}


def _from_gguf(path: str):
    """transformers' own GGUF config mapping and dequantization, without `accelerate`
    (which from_pretrained(gguf_file=...) insists on)."""
    from transformers import AutoConfig, AutoModelForCausalLM  # lazy: transformers is optional (the test extra)
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint  # lazy: as above
    folder, name = os.path.split(path)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    model.tie_weights()
    return model
