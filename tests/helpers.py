"""Shared test helpers: a flat-batch forward over a contiguous KV allocation, tiny HF model folders,
transformers references, and a minimal driver for EngineCore.

Importable from any test module as ``import helpers`` (tests/conftest.py puts this folder on sys.path).
"""
from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Sequence

import pytest
import torch

from tokenloom.model.layers.attention import AttentionMetadata, PrefillChunk

# Where conftest leaves the number of tests a session collected when it collected the whole suite.
WHOLE_SUITE_COUNT = pytest.StashKey[int]()


# ---------------------------------------------------------------------------------------------
# Our model over one flat batch, with a simple contiguous KV allocation
# ---------------------------------------------------------------------------------------------
def allocate_contiguous(model, prompts: Sequence[Sequence[int]], block_size: int, extra_tokens: int = 0):
    """KV caches ``[2, blocks, block_size, kv_heads, head_dim]`` per layer, and for each sequence a
    table of consecutive blocks with room for its prompt plus ``extra_tokens``."""
    cfg = model.config
    param = next(model.parameters())
    tables, next_block = [], 0
    for p in prompts:
        n = -(-(len(p) + extra_tokens) // block_size)
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    caches = [torch.zeros(2, max(next_block, 1), block_size, cfg.num_kv_heads, cfg.head_dim,
                          dtype=param.dtype, device=param.device) for _ in range(cfg.num_layers)]
    return caches, tables


@torch.inference_mode()
def flat_prefill(model, chunks: Sequence[tuple[Sequence[int], int]], tables: Sequence[Sequence[int]],
                 caches: list[torch.Tensor], block_size: int) -> torch.Tensor:
    """One forward over a flat batch of prefill chunks, through the real AttentionMetadata interface.

    ``chunks[i] = (token_ids, start)``: sequence i's tokens at positions start..start+len-1 (earlier
    positions must already be in its KV blocks). Returns the logits of each chunk's last token [B, V]."""
    device = next(model.parameters()).device
    ids, pos, slots, prefills, last_rows = [], [], [], [], []
    for (tokens, start), table in zip(chunks, tables):
        first = len(ids)
        end = start + len(tokens)
        ids.extend(tokens)
        pos.extend(range(start, end))
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
        prefills.append(PrefillChunk(first, len(ids), end, torch.tensor(table, device=device)))
        last_rows.append(len(ids) - 1)
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.long, device=device), num_decodes=0,
                             decode_block_tables=None, decode_context_lens=None, decode_mask=None,
                             prefills=prefills)
    hidden = model(torch.tensor(ids, dtype=torch.long, device=device),
                   torch.tensor(pos, dtype=torch.long, device=device), caches, meta)
    return model.compute_logits(hidden[torch.tensor(last_rows, device=device)])


def last_logits(model, prompts: Sequence[Sequence[int]], block_size: int = 16,
                split_at: int | None = None) -> torch.Tensor:
    """Our model's logits at each prompt's last position [B, V], all prompts in one flat batch.

    With ``split_at``, every prompt longer than it is prefilled in two flat batches (its first
    ``split_at`` tokens, then the rest attending to them through the paged KV cache)."""
    caches, tables = allocate_contiguous(model, prompts, block_size)
    if split_at is not None:
        heads = [(p[:split_at], 0) for p in prompts]
        flat_prefill(model, heads, tables, caches, block_size)
        return flat_prefill(model, [(p[split_at:], split_at) if len(p) > split_at else (p, 0) for p in prompts],
                            tables, caches, block_size)
    return flat_prefill(model, [(p, 0) for p in prompts], tables, caches, block_size)


@torch.inference_mode()
def sequence_logits(model, tokens: Sequence[int], block_size: int = 16) -> torch.Tensor:
    """Our model's logits at every position of one sequence computed alone, in one forward [T, V]."""
    caches, tables = allocate_contiguous(model, [tokens], block_size)
    device = next(model.parameters()).device
    n = len(tokens)
    meta = AttentionMetadata(slot_mapping=torch.arange(n, device=device) + tables[0][0] * block_size,
                             num_decodes=0, decode_block_tables=None, decode_context_lens=None, decode_mask=None,
                             prefills=[PrefillChunk(0, n, n, torch.tensor(tables[0], device=device))])
    hidden = model(torch.tensor(list(tokens), device=device), torch.arange(n, device=device), caches, meta)
    return model.compute_logits(hidden)


def greedy_mismatch(model, prompt: Sequence[int], continuation: Sequence[int]) -> str | None:
    """None if ``continuation`` is the greedy continuation of ``prompt`` computed alone (every token is the
    argmax of our model's logits given the prompt and the tokens before it); else where and by how much not.

    One forward over prompt + continuation checks all of it: by induction, greedy decoding of the prompt
    alone produces exactly this sequence."""
    logits = sequence_logits(model, list(prompt) + list(continuation[:-1]))[len(prompt) - 1:]
    best = logits.argmax(-1).tolist()
    for i, (got, want) in enumerate(zip(continuation, best)):
        if got != want:
            gap = float(logits[i, want] - logits[i, got])
            return (f"prompt of {len(prompt)} tokens: new token {i} is {got}, greedy alone gives {want} "
                    f"(logit gap {gap:.2e})")
    return None


# ---------------------------------------------------------------------------------------------
# transformers references
# ---------------------------------------------------------------------------------------------
@torch.inference_mode()
def hf_last_logits(hf_model, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
    """transformers' logits at each prompt's last position, one unpadded forward per prompt [B, V]."""
    return torch.stack([hf_model(torch.tensor([list(p)])).logits[0, -1].float() for p in prompts])


@torch.inference_mode()
def hf_greedy(hf_model, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """transformers ``generate(do_sample=False)`` for exactly ``max_new_tokens`` tokens (EOS ignored)."""
    from transformers import GenerationConfig
    gen = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=0, eos_token_id=None,
                           pad_token_id=0, num_beams=1)
    ids = torch.tensor([list(prompt)])
    saved = hf_model.generation_config.eos_token_id  # generate() falls back to the model's EOS otherwise
    hf_model.generation_config.eos_token_id = None
    try:
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)
    finally:
        hf_model.generation_config.eos_token_id = saved
    tokens = out[0, len(prompt):].tolist()
    assert len(tokens) == max_new_tokens
    return tokens


@torch.inference_mode()
def hf_greedy_batch(hf_model, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers ``generate(do_sample=False)`` over a left-padded batch (with its attention mask), exactly
    ``max_new_tokens`` tokens per prompt (EOS ignored). Far cheaper on CPU than one call per prompt, whose
    decode steps each re-read all the weights."""
    from transformers import GenerationConfig
    gen = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=0, eos_token_id=None,
                           pad_token_id=0, num_beams=1)
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    saved = hf_model.generation_config.eos_token_id
    hf_model.generation_config.eos_token_id = None
    try:
        out = hf_model.generate(ids, attention_mask=mask, generation_config=gen)
    finally:
        hf_model.generation_config.eos_token_id = saved
    tokens = out[:, width:].tolist()
    assert all(len(t) == max_new_tokens for t in tokens)
    return tokens


def describe_divergence(hf_model, prompt: Sequence[int], got: Sequence[int], want: Sequence[int]) -> str:
    """Where two greedy continuations first differ, and transformers' top-2 logit gap there (a near tie
    would explain a flip; a large gap means a real bug)."""
    i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    msg = f"prompt of {len(prompt)} tokens: outputs differ first at new token {i}"
    if i < min(len(got), len(want)):
        row = hf_log_softmax(hf_model, list(prompt) + list(want[:i]))[-1]
        top = row.topk(2)
        msg += (f" (ours {got[i]}, transformers {want[i]}; transformers' top-2 logprob gap there "
                f"{float(top.values[0] - top.values[1]):.2e})")
    return msg


@torch.inference_mode()
def hf_log_softmax(hf_model, token_ids: Sequence[int]) -> torch.Tensor:
    """log_softmax of transformers' logits over a whole sequence [T, V]; row t predicts token t+1."""
    return torch.log_softmax(hf_model(torch.tensor([list(token_ids)])).logits[0].float(), dim=-1)


def load_hf_from_gguf(path: str, dtype: torch.dtype = torch.float32):
    """transformers' model for a GGUF file: its own config mapping and dequantization, without accelerate
    (which ``from_pretrained(gguf_file=...)`` insists on)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    folder, name = os.path.split(path)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False)
    allowed_missing = {"lm_head.weight"} if config.tie_word_embeddings else set()
    assert set(missing) <= allowed_missing and not unexpected, (missing, unexpected)
    model.tie_weights()
    return model.eval()


# ---------------------------------------------------------------------------------------------
# Tiny random HF models, saved as folders our engine loads
# ---------------------------------------------------------------------------------------------
TINY_COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                   initializer_range=0.2, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)

TINY_VARIANTS = {
    "llama": ("LlamaConfig", {}),
    "llama3_rope": ("LlamaConfig", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    "llama_tied_gqa": ("LlamaConfig", {"tie_word_embeddings": True, "num_key_value_heads": 2}),
    "mistral": ("MistralConfig", {"num_key_value_heads": 2, "sliding_window": None}),
    "qwen2": ("Qwen2Config", {"num_key_value_heads": 2, "tie_word_embeddings": False}),
    "qwen3": ("Qwen3Config", {"num_key_value_heads": 2, "head_dim": 32, "tie_word_embeddings": False}),
}


# Mixture of experts (tests/unit/test_moe.py, test_expert_parallel.py): 8 experts, top-2; each family's routing.
TINY_MOE = dict(num_key_value_heads=2, tie_word_embeddings=False, num_experts_per_tok=2)
TINY_MOE_VARIANTS = {
    # top-k renormalized (norm_topk_prob), q/k norms, layer 1 keeps a dense MLP.
    "qwen3_moe": ("Qwen3MoeConfig", {**TINY_MOE, "num_experts": 8, "moe_intermediate_size": 32, "head_dim": 32,
                                     "norm_topk_prob": True, "mlp_only_layers": [1]}),
    # softmax, top-2, renormalized; experts as wide as the MLP.
    "mixtral": ("MixtralConfig", {**TINY_MOE, "num_local_experts": 8, "sliding_window": None}),
    # no renormalization, a shared expert behind a sigmoid gate, q/k/v biases.
    "qwen2_moe": ("Qwen2MoeConfig", {**TINY_MOE, "num_experts": 8, "moe_intermediate_size": 32,
                                     "shared_expert_intermediate_size": 48, "norm_topk_prob": False}),
}


def build_tiny_model(kind: str, seed: int = 0):
    """A tiny random transformers model of ``kind`` (see TINY_VARIANTS, TINY_MOE_VARIANTS), float32, eval mode.

    Norm weights and biases are randomized too (HF initializes them to 1 and 0), so a loader that
    drops or swaps them cannot pass."""
    import transformers
    config_cls, overrides = {**TINY_VARIANTS, **TINY_MOE_VARIANTS}[kind]
    config = getattr(transformers, config_cls)(**{**TINY_COMMON, **overrides})
    if kind == "qwen2":
        assert config.model_type == "qwen2"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.3 * torch.randn_like(p))
    return model


def build_tp3_model(seed: int = 0):
    """A tiny random Llama whose 6 query and 3 KV heads three tensor-parallel ranks can share."""
    import transformers
    config = transformers.LlamaConfig(**{**TINY_COMMON, "hidden_size": 96, "intermediate_size": 192,
                                         "num_attention_heads": 6, "num_key_value_heads": 3})
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def tensor_metas_json(model) -> str:
    """The JSON list of {name, dtype, shape} an engine receives weights by (in state_dict order)."""
    return json.dumps([{"name": n, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
                       for n, t in model.state_dict().items()])


# Tiny random Gemma 3 (text): windowed and global layers with their own rotary bases, a query scale that is not
# head_dim**-0.5, final-logit soft-capping (tests/unit/test_gemma3.py, test_lora.py).
TINY_GEMMA3_WINDOW = 8


def build_tiny_gemma3(seed: int = 0):
    """3 layers (windowed, global, windowed), window 8, random (1 + w) norms; float32, eval mode."""
    import transformers
    config = transformers.Gemma3TextConfig(
        **{**TINY_COMMON, "num_hidden_layers": 3, "num_key_value_heads": 2, "head_dim": 16},
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], sliding_window=TINY_GEMMA3_WINDOW,
        query_pre_attn_scalar=24, final_logit_softcapping=30.0,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:  # HF initializes Gemma's norms to 0 (a scale of 1): make every one count
                p.copy_(0.3 * torch.randn_like(p))
    return hf


LORA_ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_peft_adapter(hf_model, folder: str, r: int = 8, alpha: int = 16, targets: Sequence[str] = LORA_ALL_TARGETS,
                      seed: int = 0, use_rslora: bool = False, round_to: torch.dtype | None = None):
    """A random LoRA adapter made by PEFT on a copy of `hf_model` (B non-zero), saved to `folder` as PEFT saves
    one; returns (folder, the PEFT model: the reference). `round_to`: its weights rounded to that dtype (kept
    float32), as an adapter trained and saved in it holds them."""
    import copy

    from peft import LoraConfig, get_peft_model
    torch.manual_seed(seed)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False,
                        use_rslora=use_rslora)
    peft_model = get_peft_model(copy.deepcopy(hf_model), config).eval()
    if round_to is not None:
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.data = param.data.to(round_to).float()
    peft_model.save_pretrained(folder)
    return folder, peft_model


def save_tiny_model(model, folder: str) -> str:
    """save_pretrained (safetensors) plus a minimal generation_config.json."""
    model.save_pretrained(folder, safe_serialization=True)
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": 2, "do_sample": False}, f)
    return folder


# GGUF architecture of each dense tiny variant, and the GGUF name of each HF layer tensor (llama.cpp's).
TINY_GGUF_ARCH = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}
_GGUF_LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
_GGUF_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}


def write_tiny_gguf(hf_model, kind: str, path: str, storage: dict[str, str], sliding_window: int | None = None) -> str:
    """A GGUF file of a dense tiny variant's weights (TINY_VARIANTS `kind`), each tensor stored as the first
    `storage` entry (GGML type name) whose key ends its GGUF name, else F32. q/k rows are written as they are,
    not in llama.cpp's rope order: the file is a model of its own, for tests that compare our paths with each
    other rather than with transformers."""
    import gguf
    import numpy as np
    cfg = hf_model.config
    writer = gguf.GGUFWriter(path, TINY_GGUF_ARCH[kind])
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    if sliding_window:
        writer.add_sliding_window(sliding_window)
    for name, tensor in hf_model.state_dict().items():
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", name)
        gguf_name = f"blk.{m[1]}.{_GGUF_LAYER[m[2]]}.{m[3]}" if m else _GGUF_TOP[name]
        array = np.ascontiguousarray(tensor.detach().float().numpy())
        qtype = gguf.GGMLQuantizationType[next((t for end, t in storage.items() if gguf_name.endswith(end)), "F32")]
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, array)
        else:
            writer.add_tensor(gguf_name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ---------------------------------------------------------------------------------------------
# Driving EngineCore directly (token ids in, token ids out)
# ---------------------------------------------------------------------------------------------
def make_request(rid: str, prompt: Sequence[int], params, priority: int = 0, cache_salt: str | None = None,
                 eos_token_ids: Sequence[int] = (2,), arrival_time: float | None = None):
    from tokenloom.core.messages import EngineCoreRequest
    return EngineCoreRequest(request_id=rid, prompt_token_ids=list(prompt), sampling_params=params,
                             arrival_time=time.time() if arrival_time is None else arrival_time,
                             priority=priority, eos_token_ids=list(eos_token_ids), cache_salt=cache_salt)


def greedy_params(max_tokens: int = 32, **kw):
    from tokenloom.core.sampling_params import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def run_to_completion(core, max_steps: int = 100_000, on_step=None) -> dict[tuple[str, int], list[int]]:
    """Step an EngineCore until idle; returns the generated token ids per (request_id, index)."""
    out: dict[tuple[str, int], list[int]] = {}
    steps = 0
    while core.has_unfinished_requests():
        for o in core.step():
            out.setdefault((o.request_id, o.index), []).extend(o.new_token_ids)
        steps += 1
        if on_step is not None:
            on_step(core, steps)
        assert steps < max_steps, "engine did not finish"
    return out


def generate_tokens(core, prompts: Sequence[Sequence[int]], params, prefix: str = "r") -> list[list[int]]:
    """Add every prompt to ``core`` at once, run to completion, return outputs in prompt order."""
    params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
    for i, (p, sp) in enumerate(zip(prompts, params_list)):
        core.add_request(make_request(f"{prefix}{i}", p, sp))
    out = run_to_completion(core)
    return [out.get((f"{prefix}{i}", 0), []) for i in range(len(prompts))]


def random_prompts(n: int, lengths: Sequence[int], vocab: int, seed: int = 0, low: int = 3) -> list[list[int]]:
    """``n`` prompts of token ids in [low, vocab) with the given lengths (cycled)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(low, vocab, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------
# Tiny random LLaVA: a CLIP tower (28-pixel images, 7-pixel patches: 16 image tokens), a tiny Llama, a word-level
# tokenizer with the <image> token, CLIP's image processor config and a LLaVA-style chat template
# ---------------------------------------------------------------------------------------------
TINY_LLAVA_IMAGE_TOKEN = 511
TINY_LLAVA_WORDS = ("USER: ASSISTANT: what is in this picture ? and that one describe the image compare two images "
                    "a an cat dog red blue green one two three tell me more about it please . , !").split()
TINY_LLAVA_TEMPLATE = (
    "{% for message in messages %}{{ message['role'].upper() }}: "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}<image> "
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %} "
    "{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}")


def build_tiny_llava(folder: str, seed: int = 0, select_strategy: str = "default", feature_layer=-2):
    """A tiny random transformers LlavaForConditionalGeneration saved to `folder` with its tokenizer, image
    processor config and chat template; returns the model (float32, eval mode), the reference."""
    import transformers
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    text = transformers.LlamaConfig(**{**TINY_COMMON, "num_key_value_heads": 2})
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                           num_attention_heads=4, image_size=28, patch_size=7, projection_dim=16)
    config = transformers.LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=TINY_LLAVA_IMAGE_TOKEN,
        vision_feature_layer=feature_layer, vision_feature_select_strategy=select_strategy,
        image_seq_length=16 + (select_strategy == "full"))
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith(".bias") or "class_embedding" in name:
                p.copy_(0.3 * torch.randn_like(p))
            elif "vision_tower" in name or "projector" in name:
                p.copy_(0.2 * torch.randn_like(p))
    model.save_pretrained(folder, safe_serialization=True)
    save_tiny_vlm_tokenizer(folder, TINY_LLAVA_IMAGE_TOKEN, ["<image>"], TINY_LLAVA_TEMPLATE)
    CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}).save_pretrained(folder)
    return model


def save_tiny_vlm_tokenizer(folder: str, first_special: int, specials: list[str], template: str) -> None:
    """A word-level tokenizer over TINY_LLAVA_WORDS, padded with filler words up to `first_special`, then the image
    tokens `specials` in order; saved with `template` and a greedy generation config, as a VLM folder needs."""
    import transformers  # lazy: a test reference, loaded by the tests that build models only
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": 2, "do_sample": False}, f)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for word in TINY_LLAVA_WORDS:
        vocab.setdefault(word, len(vocab))
    while len(vocab) < first_special:
        vocab[f"w{len(vocab)}"] = len(vocab)
    inner = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=inner, bos_token="<s>", eos_token="</s>",
                                                     unk_token="<unk>")
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    assert tokenizer.convert_tokens_to_ids(specials[0]) == first_special
    tokenizer.chat_template = template
    tokenizer.save_pretrained(folder)


VLM_NEW_TOKENS = 12  # enough decoded tokens to see the image rows matter, few enough for tiny-model tests


def vlm_greedy(max_tokens: int = VLM_NEW_TOKENS, **kw):
    from tokenloom.core.sampling_params import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def vlm_tokens(llm, prompt: str, images, **kw) -> list[int]:
    """tokenloom's greedy tokens for a prompt with images (none: the prompt alone)."""
    request = {"prompt": prompt, "multi_modal_data": {"image": images}} if images else prompt
    out = llm.generate(request, vlm_greedy(**kw), use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def hf_vlm_tokens(hf, inputs: dict, max_tokens: int = VLM_NEW_TOKENS) -> list[int]:
    """transformers' greedy tokens for `inputs` (input_ids, pixel_values and what else the model takes)."""
    import torch
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=max_tokens, do_sample=False, min_new_tokens=max_tokens)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def tiny_image(width: int, height: int, seed: int = 0):
    """A random RGB PIL image."""
    import numpy as np
    from PIL import Image
    data = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(data, "RGB")


def image_data_url(image, fmt: str = "PNG") -> str:
    import base64
    import io
    buf = io.BytesIO()
    image.save(buf, fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


# ---------------------------------------------------------------------------------------------
# Tiny random Qwen2.5-VL: its vision tower (14-pixel patches merged 2 x 2, 56-pixel windows), a tiny Qwen2 text
# model with M-RoPE, a word-level tokenizer with the vision tokens, Qwen2-VL's image processor config and a chat
# template that writes <|vision_start|><|image_pad|><|vision_end|> for each image
# ---------------------------------------------------------------------------------------------
TINY_QWEN_VL_VISION_START, TINY_QWEN_VL_IMAGE_PAD, TINY_QWEN_VL_VISION_END = 509, 510, 511
TINY_QWEN_VL_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
TINY_QWEN_VL_TEMPLATE = TINY_LLAVA_TEMPLATE.replace("<image> ", TINY_QWEN_VL_IMAGE + " ")
TINY_QWEN_VL_MIN_PIXELS, TINY_QWEN_VL_MAX_PIXELS = 28 * 28 * 4, 28 * 28 * 64


def build_tiny_qwen2_5_vl(folder: str, seed: int = 0):
    """A tiny random transformers Qwen2_5_VLForConditionalGeneration saved to `folder` with its tokenizer, image
    processor config and chat template; returns the model (float32, eval mode), the reference."""
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    text = {**TINY_COMMON, "num_key_value_heads": 2,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}}
    vision = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, window_size=56,
                  fullatt_block_indexes=[1])
    config = transformers.Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=TINY_QWEN_VL_IMAGE_PAD,
        vision_start_token_id=TINY_QWEN_VL_VISION_START, vision_end_token_id=TINY_QWEN_VL_VISION_END,
        video_token_id=TINY_QWEN_VL_VISION_START - 1, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.3 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
    model.save_pretrained(folder, safe_serialization=True)
    save_tiny_vlm_tokenizer(folder, TINY_QWEN_VL_VISION_START, ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"],
                            TINY_QWEN_VL_TEMPLATE)
    Qwen2VLImageProcessorPil(min_pixels=TINY_QWEN_VL_MIN_PIXELS,
                             max_pixels=TINY_QWEN_VL_MAX_PIXELS).save_pretrained(folder)
    return model


# ---------------------------------------------------------------------------------------------
# Tiny random Gemma 3 with images: SigLIP on 56-pixel images (7-pixel patches, an 8x8 grid pooled to 16 tokens),
# the tiny Gemma 3 text model's layer kinds and window, a word-level tokenizer with the three image tokens,
# Gemma 3's image processor config and a chat template that writes <start_of_image> for each image. No final-logit
# soft-capping, as in the released multimodal configs (transformers' Gemma3ForConditionalGeneration ignores it).
# ---------------------------------------------------------------------------------------------
TINY_GEMMA3_BOI, TINY_GEMMA3_EOI, TINY_GEMMA3_SOFT = 508, 509, 510
TINY_GEMMA3_MM_TOKENS = 16
TINY_GEMMA3_TEMPLATE = TINY_LLAVA_TEMPLATE.replace("<image> ", "<start_of_image> ")


def build_tiny_gemma3_mm(folder: str, seed: int = 0, text_overrides: dict | None = None):
    """A tiny random transformers Gemma3ForConditionalGeneration saved to `folder` with its tokenizer, image
    processor config and chat template (`text_overrides`: text_config fields to change); returns the model
    (float32, eval mode), the reference."""
    import transformers
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    text = dict(**{**TINY_COMMON, "num_hidden_layers": 3, "num_key_value_heads": 2, "head_dim": 16},
                layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                sliding_window=TINY_GEMMA3_WINDOW, query_pre_attn_scalar=24, final_logit_softcapping=None,
                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                 "full_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    text.update(text_overrides or {})
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, image_size=56,
                  patch_size=7, vision_use_head=False)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision,
                                       mm_tokens_per_image=TINY_GEMMA3_MM_TOKENS, boi_token_index=TINY_GEMMA3_BOI,
                                       eoi_token_index=TINY_GEMMA3_EOI, image_token_index=TINY_GEMMA3_SOFT)
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and "language_model" in name or "mm_soft_emb_norm" in name:
                p.copy_(0.3 * torch.randn_like(p))  # Gemma's (1 + w) norms start at w = 0: make each count
            elif "language_model" not in name:
                p.normal_(0, 0.2)
    model.save_pretrained(folder, safe_serialization=True)
    save_tiny_vlm_tokenizer(folder, TINY_GEMMA3_BOI, ["<start_of_image>", "<end_of_image>", "<image_soft_token>"],
                            TINY_GEMMA3_TEMPLATE)
    Gemma3ImageProcessorPil(size={"height": 56, "width": 56}).save_pretrained(folder)
    return model
