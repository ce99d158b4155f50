"""`tokenloom bench vlm`: time to first token for one image and ~100 words through the offline engine, with the
encoder cache on and off, beside transformers' `generate` on the same weights, and images/s through both towers.

The model is built here, random, and saved to a temporary folder: Qwen2.5-VL-3B's vision tower shapes
(`QWEN2_5_VL_3B_VISION`, its output width set to the text width) in front of a two-layer text model of width 256,
so the encoder dominates, as it does on a real 3B model at a short prompt. Every request shows the same image:
with the cache on, the image is encoded once (in the warm-up round) and every timed request reuses its rows; with
`--max-encoder-cache 0` each round encodes it again (the requests of one step share that encoding). Prefix caching
is off in both, or the repeated prompt would skip the encoder through the KV cache instead.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
from PIL import Image
from tqdm import tqdm

from tokenloom.bench.vision_tower import QWEN2_5_VL_3B_VISION
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.entrypoints.llm import LLM
from tokenloom.model.models.vision.qwen2_5_vl_config import Qwen2_5_VLVisionConfig
from tokenloom.model.models.vision.qwen2_5_vl_vision import Qwen2_5_VisionTower

TEXT_MODEL = dict(vocab_size=512, bos_token_id=1, eos_token_id=2, hidden_size=256, intermediate_size=512,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                  rms_norm_eps=1e-6,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [8, 12, 12]})
TINY_VISION = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=14, temporal_patch_size=2,
                   spatial_merge_size=2, window_size=56, fullatt_block_indexes=[1], in_channels=3, hidden_act="silu")
VISION_START, IMAGE_PAD, VISION_END = 509, 510, 511
CACHE_MODES = {"on": None, "off": 0}  # --max-encoder-cache: the default, and no reuse


def add_vlm_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--image-size", default="224x224", metavar="WxH",
                   help="pixels per image; multiples of 28 (default 224x224: 256 patches, 64 tokens)")
    p.add_argument("--words", type=int, default=100, help="prompt words after the image (default 100)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8],
                   help="requests sent at once, each the same image and words (default 1 8)")
    p.add_argument("--repeats", type=int, default=2, help="timed rounds per setting, after one warm-up (default 2)")
    p.add_argument("--tiny", action="store_true", help="a 2-block, 32-wide vision tower instead of the 3B shapes")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no-transformers", action="store_true", help="time tokenloom alone")
    p.add_argument("--transformers-max-batch", type=int, default=8,
                   help="largest concurrency transformers runs as one batch (default 8)")
    p.add_argument("--json", dest="json_path", default=None)
    p.set_defaults(func=run_vlm)


def _build_model(folder: str, vision: dict, width: int, height: int):
    """Save a random Qwen2.5-VL, its word-level tokenizer and its image processor config; returns the model."""
    import transformers  # lazy: transformers builds the reference model (the test extra)
    from tokenizers import Tokenizer, models, pre_tokenizers  # lazy: as above
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (  # lazy: as above
        Qwen2VLImageProcessorPil,
    )
    config = transformers.Qwen2_5_VLConfig(
        text_config=TEXT_MODEL, vision_config={**vision, "out_hidden_size": TEXT_MODEL["hidden_size"]},
        image_token_id=IMAGE_PAD, vision_start_token_id=VISION_START, vision_end_token_id=VISION_END,
        video_token_id=VISION_START - 1, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).eval()
    model.save_pretrained(folder, safe_serialization=True)
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": 2, "do_sample": False}, f)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VISION_START)}}
    inner = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=inner, bos_token="<s>", eos_token="</s>",
                                                     unk_token="<unk>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|vision_start|>", "<|image_pad|>",
                                                                "<|vision_end|>"]})
    tokenizer.save_pretrained(folder)
    processor = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=width * height)
    processor.save_pretrained(folder)
    return model, processor


def _tokenloom_ttft(folder: str, ns, max_encoder_cache: int | None, prompt: dict,
                    first_tokens: set[int]) -> dict[int, float]:
    """Mean seconds from submitting `c` requests at once to each one's first token, median over the rounds;
    adds the greedy first tokens to `first_tokens`."""
    kwargs = {} if max_encoder_cache is None else {"max_encoder_cache": max_encoder_cache}
    llm = LLM(folder, progress=False, dtype=ns.dtype, device=ns.device, log_stats_interval=0, kv_cache_memory=0.05,
              enable_prefix_caching=False, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    results = {}
    try:
        for c in ns.concurrency:
            rounds = []
            for _ in tqdm(range(ns.repeats + 1), desc=f"tokenloom cache {_mode(max_encoder_cache)} c={c}",
                          unit="round"):
                start, first = time.perf_counter(), {}
                for out in llm.generate_stream([prompt] * c, params):
                    first.setdefault(out.request_id, time.perf_counter() - start)
                    first_tokens.update(out.outputs[0].token_ids)
                rounds.append(sum(first.values()) / len(first))
            results[c] = _median(rounds[1:])
    finally:
        llm.shutdown()
    return results


def _transformers_ttft(model, inputs: dict[str, torch.Tensor], ns, first_tokens: set[int]) -> dict[int, float]:
    """Seconds for `generate(max_new_tokens=1)` on a batch of `c` copies: every request's first token arrives at
    the end of the call. Adds the greedy first tokens to `first_tokens`."""
    results = {}
    with torch.inference_mode():
        for c in [c for c in ns.concurrency if c <= ns.transformers_max_batch]:
            batch = {k: torch.cat([v] * c) for k, v in inputs.items()}
            rounds = []
            # Batch 1 warms up both shapes; a larger batch runs one round, the slowest part of the bench.
            for _ in tqdm(range(ns.repeats + 1 if c == 1 else 1), desc=f"transformers batch {c}", unit="round"):
                start = time.perf_counter()
                out = model.generate(**batch, max_new_tokens=1, do_sample=False)
                rounds.append(time.perf_counter() - start)
                first_tokens.update(out[:, -1].tolist())
            results[c] = _median(rounds[1:] if c == 1 else rounds)
    return results


def _encoder_images_per_second(model, pixels: torch.Tensor, grid: list[int], ns) -> dict[str, float]:
    """One image per call through tokenloom's tower (loaded with the saved tower's weights) and transformers'."""
    shape = model.config.vision_config.to_dict()
    ours = Qwen2_5_VisionTower(Qwen2_5_VLVisionConfig.from_hf(shape)).to(getattr(torch, ns.dtype))
    ours.load_state_dict(model.model.visual.state_dict(), assign=True)
    calls = {"tokenloom": lambda: ours.encode(pixels, [grid])}
    if not ns.no_transformers:
        grid_thw = torch.tensor([grid])
        calls["transformers"] = lambda: model.model.visual(pixels, grid_thw=grid_thw)
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    with torch.inference_mode():
        for _ in tqdm(range(ns.repeats), desc="vision towers", unit="round"):
            for name, call in calls.items():
                start = time.perf_counter()
                call()
                seconds[name].append(time.perf_counter() - start)
    return {name: 1 / _median(s) for name, s in seconds.items()}


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def _mode(max_encoder_cache: int | None) -> str:
    return "off" if max_encoder_cache == 0 else "on"


def run_vlm(ns) -> int:
    width, height = (int(v) for v in ns.image_size.lower().split("x"))
    if width % 28 or height % 28 or width <= 0 or height <= 0:
        raise SystemExit(f"--image-size {ns.image_size}: both sides must be positive multiples of 28")
    if ns.repeats < 1 or ns.words < 1 or min(ns.concurrency) < 1:
        raise SystemExit("--repeats, --words and --concurrency must be >= 1")
    vision = TINY_VISION if ns.tiny else QWEN2_5_VL_3B_VISION
    torch.manual_seed(0)
    image = Image.fromarray(torch.randint(0, 256, (height, width, 3), dtype=torch.uint8).numpy(), "RGB")
    words = torch.randint(3, VISION_START, (ns.words,)).tolist()
    prompt = {"prompt_token_ids": [1, VISION_START, IMAGE_PAD, VISION_END, *words],
              "multi_modal_data": {"image": [image]}}
    with tempfile.TemporaryDirectory(prefix="tokenloom-bench-vlm-") as folder:
        print(f"building a random Qwen2.5-VL in {folder} ...", flush=True)
        model, processor = _build_model(folder, vision, width, height)
        model = model.to(getattr(torch, ns.dtype))
        first_tokens: dict[str, set[int]] = {"tokenloom": set(), "transformers": set()}
        ttft = {mode: _tokenloom_ttft(folder, ns, cache, prompt, first_tokens["tokenloom"])
                for mode, cache in CACHE_MODES.items()}
    pixels_out = processor(images=[image], return_tensors="pt")
    pixels, grid = pixels_out["pixel_values"].to(model.dtype), pixels_out["image_grid_thw"][0].tolist()
    image_tokens = grid[0] * grid[1] * grid[2] // 4
    ids = torch.tensor([[1, VISION_START, *[IMAGE_PAD] * image_tokens, VISION_END, *words]])
    if not ns.no_transformers:
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixels,
                  "image_grid_thw": torch.tensor([grid]), "mm_token_type_ids": (ids == IMAGE_PAD).int()}
        ttft["transformers"] = _transformers_ttft(model, inputs, ns, first_tokens["transformers"])
    images_per_second = _encoder_images_per_second(model, pixels, grid, ns)
    results = {"image_size": f"{width}x{height}", "patches": grid[0] * grid[1] * grid[2], "image_tokens": image_tokens,
               "prompt_tokens": ids.shape[1], "vision_depth": vision["depth"], "vision_width": vision["hidden_size"],
               "text_layers": TEXT_MODEL["num_hidden_layers"], "text_width": TEXT_MODEL["hidden_size"],
               "transformers_attention": model.config._attn_implementation, "dtype": ns.dtype,
               "device": ns.device, "threads": torch.get_num_threads(),
               "load_average": os.getloadavg()[0], "ttft_s": ttft,
               "first_tokens": {name: sorted(tokens) for name, tokens in first_tokens.items() if tokens},
               "encoder_images_per_second": images_per_second}
    _print_table(results, ns.concurrency)
    if ns.json_path:
        with open(ns.json_path, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def _print_table(results: dict, concurrency: list[int]) -> None:
    print(f"Qwen2.5-VL, vision {results['vision_depth']} blocks x {results['vision_width']}, text "
          f"{results['text_layers']} layers x {results['text_width']}; one {results['image_size']} image "
          f"({results['patches']} patches, {results['image_tokens']} tokens) in {results['prompt_tokens']} prompt "
          f"tokens; {results['dtype']} on {results['device']}, {results['threads']} threads, "
          f"load average {results['load_average']:.1f}")
    names = {"on": "tokenloom, encoder cache on", "off": "tokenloom, --max-encoder-cache 0",
             "transformers": "transformers generate"}
    print(f"  {'mean TTFT (ms)':<34}" + "".join(f"{f'c={c}':>12}" for c in concurrency))
    for mode, by_c in results["ttft_s"].items():
        cells = "".join(f"{by_c[c] * 1e3:12.1f}" if c in by_c else f"{'-':>12}" for c in concurrency)
        print(f"  {names[mode]:<34}{cells}")
    print(f"  greedy first token(s): {results['first_tokens']}")
    for name, rate in results["encoder_images_per_second"].items():
        print(f"  encoder images/s, {name}: {rate:.3f}")
