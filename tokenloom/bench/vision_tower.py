"""`tokenloom bench vision`: images per second through the Qwen2.5-VL vision tower, tokenloom's against
transformers' `Qwen2_5_VisionTransformerPretrainedModel` on the same random weights (shared, not copied).

The defaults are Qwen2.5-VL-3B's vision shapes (32 blocks of width 1280, 16 heads, 14-pixel patches merged 2x2,
112-pixel windows, full attention in blocks 7/15/23/31, output width 2048). The two towers run alternately, so
a machine whose speed drifts (shared cores, clocks) moves both; the reported figure is the median.
"""
from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

from tokenloom.model.models.vision.qwen2_5_vl_config import Qwen2_5_VLVisionConfig
from tokenloom.model.models.vision.qwen2_5_vl_vision import Qwen2_5_VisionTower

QWEN2_5_VL_3B_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                            patch_size=14, temporal_patch_size=2, spatial_merge_size=2, window_size=112,
                            fullatt_block_indexes=[7, 15, 23, 31], in_channels=3, hidden_act="silu")


def add_vision_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--image-size", default="448x448", metavar="WxH",
                   help="pixels per image after resizing; multiples of 28 (default 448x448: 1024 patches, 256 tokens)")
    p.add_argument("--images", type=int, default=1, help="images per call (default 1)")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per tower (median reported; default 3)")
    p.add_argument("--depth", type=int, default=QWEN2_5_VL_3B_VISION["depth"], help="vision blocks (default 32)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no-transformers", action="store_true", help="time tokenloom's tower alone")
    p.add_argument("--json", dest="json_path", default=None)
    p.set_defaults(func=run_vision)


def _median_seconds(fns: dict[str, Callable[[], torch.Tensor]], repeats: int, device: torch.device) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def run_vision(ns) -> int:
    width, height = (int(v) for v in ns.image_size.lower().split("x"))
    if width % 28 or height % 28 or width <= 0 or height <= 0:
        raise SystemExit(f"--image-size {ns.image_size}: both sides must be positive multiples of 28")
    device, dtype = torch.device(ns.device), getattr(torch, ns.dtype)
    shape = {**QWEN2_5_VL_3B_VISION, "depth": ns.depth,
             "fullatt_block_indexes": [i for i in QWEN2_5_VL_3B_VISION["fullatt_block_indexes"] if i < ns.depth]}
    grids = [(1, height // 14, width // 14)] * ns.images
    patches = sum(t * h * w for t, h, w in grids)
    torch.manual_seed(0)
    pixels = torch.randn(patches, 3 * 2 * 14 * 14, device=device, dtype=dtype)
    with torch.device(device):
        ours = Qwen2_5_VisionTower(Qwen2_5_VLVisionConfig.from_hf(shape)).to(dtype)
    fns: dict[str, Callable[[], torch.Tensor]] = {"tokenloom": lambda: torch.cat(ours.encode(pixels, grids))}
    if not ns.no_transformers:
        import transformers  # lazy: transformers is optional (the test extra)
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (  # lazy: as above
            Qwen2_5_VisionTransformerPretrainedModel,
        )
        hf_config = transformers.Qwen2_5_VLConfig(vision_config=shape).vision_config
        hf_config._attn_implementation = "sdpa"
        with torch.device(device):
            reference = Qwen2_5_VisionTransformerPretrainedModel(hf_config).to(dtype).eval()
        ours.load_state_dict(reference.state_dict(), assign=True)
        grid_thw = torch.tensor(grids, device=device)

        def hf_encode() -> torch.Tensor:
            with torch.inference_mode():
                return reference(pixels, grid_thw=grid_thw).pooler_output
        fns["transformers"] = hf_encode
        difference = (fns["tokenloom"]() - hf_encode()).abs().max().item()  # also the warm-up call of each
    else:
        fns["tokenloom"]()
        difference = None
    seconds = _median_seconds(fns, ns.repeats, device)
    results = {"image_size": f"{width}x{height}", "images_per_call": ns.images, "patches_per_call": patches,
               "depth": ns.depth, "dtype": ns.dtype, "device": str(device), "threads": torch.get_num_threads(),
               "seconds_per_call": seconds,
               "images_per_second": {name: ns.images / s for name, s in seconds.items()},
               "max_abs_difference": difference}
    print(f"Qwen2.5-VL vision tower, {ns.depth} blocks, {ns.images} image(s) of {width}x{height} ({patches} patches) "
          f"per call, {ns.dtype} on {device}, {torch.get_num_threads()} threads, median of {ns.repeats}")
    for name, s in seconds.items():
        print(f"  {name:>12}: {s * 1e3:9.1f} ms/call  {ns.images / s:8.3f} images/s")
    if difference is not None:
        print(f"  max |tokenloom - transformers| = {difference:.3g}")
    if ns.json_path:
        with open(ns.json_path, "w") as f:
            json.dump(results, f, indent=2)
    return 0
