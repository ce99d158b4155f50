"""Qwen2.5-VL through the engine: greedy output token-identical to transformers with images anywhere in the
prompt (M-RoPE positions in the prompt, `index + delta` while decoding), prompt logprobs within tolerance,
chunked prefill across an image, text-only prompts on the plain path, and both checkpoint layouts."""
from __future__ import annotations

import json
import os
import shutil

import helpers
import pytest
import torch
from helpers import vlm_greedy, vlm_tokens
from safetensors.torch import load_file, save_file

from tokenloom import LLM
from tokenloom.model.models.vision_language import pixel_tensor
from tokenloom.multimodal.errors import ImageInputError

IMAGE = helpers.TINY_QWEN_VL_IMAGE
ONE_IMAGE = f"USER: {IMAGE} what is in this picture ? ASSISTANT:"
TWO_IMAGES = f"USER: compare {IMAGE} and {IMAGE} please . ASSISTANT:"
IMAGE_MID_PROMPT = f"USER: tell me more about {IMAGE} the red one please . ASSISTANT:"
IMAGE_LAST = f"USER: describe the image {IMAGE}"
TEXT_ONLY = "USER: tell me more about the red cat please . ASSISTANT:"


@pytest.fixture(scope="module")
def qwen_vl(tiny_qwen2_5_vl):
    folder, hf = tiny_qwen2_5_vl
    llm = LLM(folder, progress=False, dtype="float32", device="cpu", log_stats_interval=0, kv_cache_memory=0.05)
    yield llm, hf
    llm.shutdown()


def _hf_inputs(llm: LLM, prompt: str, images) -> dict[str, torch.Tensor]:
    """What transformers' processor gives for the prompt: the expanded ids, the patches, the grids and the
    token types its M-RoPE positions need."""
    ids, inputs = llm.input_processor.image_processor.prepare(llm.tokenizer.encode(prompt), images)
    ids_t = torch.tensor([ids])
    out = {"input_ids": ids_t, "attention_mask": torch.ones_like(ids_t),
           "mm_token_type_ids": (ids_t == helpers.TINY_QWEN_VL_IMAGE_PAD).int()}
    if inputs:
        out["pixel_values"] = torch.cat([pixel_tensor(i) for i in inputs])
        out["image_grid_thw"] = torch.tensor([i.grid_thw for i in inputs])
    return out


def _hf_greedy(llm: LLM, hf, prompt: str, images, max_tokens: int = helpers.VLM_NEW_TOKENS) -> list[int]:
    inputs = _hf_inputs(llm, prompt, images)
    return helpers.hf_vlm_tokens(hf, inputs, max_tokens)


def test_greedy_output_with_one_image_equals_transformers(qwen_vl):
    llm, hf = qwen_vl
    image = helpers.tiny_image(60, 90, seed=1)
    assert vlm_tokens(llm, ONE_IMAGE, [image]) == _hf_greedy(llm, hf, ONE_IMAGE, [image])


def test_greedy_output_with_two_images_of_different_sizes_equals_transformers(qwen_vl):
    llm, hf = qwen_vl
    images = [helpers.tiny_image(60, 90, seed=2), helpers.tiny_image(120, 64, seed=3)]
    _, inputs = llm.input_processor.image_processor.prepare(llm.tokenizer.encode(TWO_IMAGES), images)
    assert [i.grid_thw for i in inputs] == [[1, 6, 4], [1, 4, 8]]
    assert vlm_tokens(llm, TWO_IMAGES, images) == _hf_greedy(llm, hf, TWO_IMAGES, images)


def test_an_image_mid_prompt_equals_transformers(qwen_vl):
    llm, hf = qwen_vl
    image = helpers.tiny_image(84, 84, seed=4)
    assert vlm_tokens(llm, IMAGE_MID_PROMPT, [image]) == _hf_greedy(llm, hf, IMAGE_MID_PROMPT, [image])


def test_decoding_after_a_tall_image_continues_its_positions_with_the_delta(qwen_vl):
    llm, hf = qwen_vl
    image = helpers.tiny_image(56, 224, seed=5)  # 8 x 2 merged tokens: the text after it resumes 8 on, not 16
    assert vlm_tokens(llm, IMAGE_LAST, [image], max_tokens=20) == _hf_greedy(llm, hf, IMAGE_LAST, [image], 20)


def test_a_text_only_prompt_equals_transformers(qwen_vl):
    llm, hf = qwen_vl
    assert vlm_tokens(llm, TEXT_ONLY, None) == _hf_greedy(llm, hf, TEXT_ONLY, [])


def test_text_and_image_prompts_in_one_batch_each_equal_transformers(qwen_vl):
    llm, hf = qwen_vl
    image = helpers.tiny_image(60, 90, seed=6)
    outs = llm.generate([TEXT_ONLY, {"prompt": ONE_IMAGE, "multi_modal_data": {"image": [image]}}], vlm_greedy(),
                        use_tqdm=False)
    assert list(outs[0].outputs[0].token_ids) == _hf_greedy(llm, hf, TEXT_ONLY, [])
    assert list(outs[1].outputs[0].token_ids) == _hf_greedy(llm, hf, ONE_IMAGE, [image])


def test_prompt_logprobs_over_image_placeholders_match_transformers(qwen_vl):
    llm, hf = qwen_vl
    images = [helpers.tiny_image(60, 90, seed=7), helpers.tiny_image(120, 64, seed=8)]
    out = llm.generate({"prompt": TWO_IMAGES, "multi_modal_data": {"image": images}},
                       vlm_greedy(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    inputs = _hf_inputs(llm, TWO_IMAGES, images)
    ids = inputs["input_ids"][0].tolist()
    with torch.no_grad():
        want = torch.log_softmax(hf(**inputs).logits[0].float(), -1)
    for pos in range(1, len(ids)):
        got = out.prompt_logprobs[pos][ids[pos]].logprob
        assert got == pytest.approx(want[pos - 1, ids[pos]].item(), abs=1e-4), pos


def test_chunked_prefill_that_splits_an_image_equals_transformers_and_encodes_it_once(tiny_qwen2_5_vl):
    folder, hf = tiny_qwen2_5_vl
    llm = LLM(folder, progress=False, dtype="float32", device="cpu", log_stats_interval=0, kv_cache_memory=0.05,
              long_prefill_token_threshold=5, max_num_batched_tokens=64)
    calls = []
    model = llm.engine.executor.worker.runner.model
    real = model.encode_images
    model.encode_images = lambda images, device: calls.append(len(images)) or real(images, device)
    try:
        image = helpers.tiny_image(56, 224, seed=9)  # 16 placeholders over 4 chunks
        assert vlm_tokens(llm, ONE_IMAGE, [image]) == _hf_greedy(llm, hf, ONE_IMAGE, [image])
        assert calls == [1]
    finally:
        llm.shutdown()


def test_with_no_encoder_cache_each_chunk_and_each_request_encodes_the_image_again(tiny_qwen2_5_vl):
    folder, hf = tiny_qwen2_5_vl
    llm = LLM(folder, progress=False, dtype="float32", device="cpu", log_stats_interval=0, kv_cache_memory=0.05,
              long_prefill_token_threshold=5, max_num_batched_tokens=64, max_encoder_cache=0,
              enable_prefix_caching=False)
    calls = []
    model = llm.engine.executor.worker.runner.model
    real = model.encode_images
    model.encode_images = lambda images, device: calls.append(len(images)) or real(images, device)
    try:
        image = helpers.tiny_image(56, 224, seed=9)  # 16 placeholders over 4 chunks
        assert vlm_tokens(llm, ONE_IMAGE, [image]) == _hf_greedy(llm, hf, ONE_IMAGE, [image])
        assert calls == [1, 1, 1, 1]
        vlm_tokens(llm, ONE_IMAGE, [image])
        assert calls == [1] * 8
    finally:
        llm.shutdown()


def test_the_earlier_checkpoint_layout_loads_the_same_model(tiny_qwen2_5_vl, tmp_path):
    folder, hf = tiny_qwen2_5_vl
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    renamed = {("model.language_model." + n.removeprefix("model.") if n.startswith("model.") else
                "model." + n if n.startswith("visual.") else n): t for n, t in tensors.items()}
    assert any(n.startswith("model.visual.") for n in renamed)
    save_file(renamed, os.path.join(tmp_path, "model.safetensors"), metadata={"format": "pt"})
    llm = LLM(str(tmp_path), progress=False, dtype="float32", device="cpu", log_stats_interval=0,
              kv_cache_memory=0.05)
    try:
        image = helpers.tiny_image(60, 90, seed=10)
        assert vlm_tokens(llm, ONE_IMAGE, [image]) == _hf_greedy(llm, hf, ONE_IMAGE, [image])
    finally:
        llm.shutdown()


def test_more_images_than_placeholders_is_refused(qwen_vl):
    llm, _ = qwen_vl
    images = [helpers.tiny_image(60, 90, seed=11)] * 2
    with pytest.raises(ImageInputError, match="1 image placeholder"):
        llm.generate({"prompt": ONE_IMAGE, "multi_modal_data": {"image": images}}, vlm_greedy(), use_tqdm=False)


@pytest.mark.tp
def test_tensor_parallel_over_two_ranks_gives_the_same_greedy_output(tiny_qwen2_5_vl):
    folder, hf = tiny_qwen2_5_vl
    llm = LLM(folder, progress=False, dtype="float32", device="cpu", log_stats_interval=0, kv_cache_memory=0.05,
              tensor_parallel_size=2)
    try:
        images = [helpers.tiny_image(60, 90, seed=12), helpers.tiny_image(120, 64, seed=13)]
        assert vlm_tokens(llm, TWO_IMAGES, images) == _hf_greedy(llm, hf, TWO_IMAGES, images)
    finally:
        llm.shutdown()


def test_ngram_speculative_decoding_after_an_image_equals_transformers(tiny_qwen2_5_vl):
    folder, hf = tiny_qwen2_5_vl
    llm = LLM(folder, progress=False, dtype="float32", device="cpu", log_stats_interval=0, kv_cache_memory=0.05,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    try:
        image = helpers.tiny_image(56, 224, seed=14)
        assert vlm_tokens(llm, IMAGE_LAST, [image], max_tokens=20) == _hf_greedy(llm, hf, IMAGE_LAST, [image], 20)
    finally:
        llm.shutdown()


def test_an_image_larger_than_the_encoder_cache_is_refused_naming_its_rows(tiny_qwen2_5_vl):
    folder, _ = tiny_qwen2_5_vl
    llm = LLM(folder, progress=False, dtype="float32", device="cpu", log_stats_interval=0, kv_cache_memory=0.05,
              max_encoder_cache=10)
    try:
        images = [helpers.tiny_image(60, 90, seed=15), helpers.tiny_image(112, 112, seed=16)]  # 6 and 16 rows
        with pytest.raises(ImageInputError, match="takes 16 encoder rows; the encoder cache holds 10"):
            llm.generate({"prompt": TWO_IMAGES, "multi_modal_data": {"image": images}}, vlm_greedy(), use_tqdm=False)
    finally:
        llm.shutdown()


def test_the_released_config_layout_loads_the_same_model(tiny_qwen2_5_vl, tmp_path):
    """The released config.json states the text model's fields at the top level, M-RoPE as
    rope_scaling {"type": "mrope"} and the tower's channels as in_chans."""
    folder, hf = tiny_qwen2_5_vl
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    with open(os.path.join(folder, "config.json")) as f:
        saved = json.load(f)
    text = saved.pop("text_config")
    rope = text.pop("rope_parameters")
    vision = saved["vision_config"]
    vision["in_chans"] = vision.pop("in_channels")
    released = {**saved, **text, "model_type": "qwen2_5_vl", "rope_theta": rope["rope_theta"],
                "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]}}
    with open(os.path.join(tmp_path, "config.json"), "w") as f:
        json.dump(released, f)
    llm = LLM(str(tmp_path), progress=False, dtype="float32", device="cpu", log_stats_interval=0,
              kv_cache_memory=0.05)
    try:
        image = helpers.tiny_image(60, 90, seed=17)
        assert vlm_tokens(llm, ONE_IMAGE, [image]) == _hf_greedy(llm, hf, ONE_IMAGE, [image])
    finally:
        llm.shutdown()


def test_a_prefix_cache_hit_past_an_image_keeps_transformers_greedy_output(qwen_vl):
    llm, hf = qwen_vl
    llm.engine.reset_prefix_cache()
    prompt = ONE_IMAGE + " tell me more about it please ."
    image = helpers.tiny_image(56, 224, seed=18)
    first = llm.generate({"prompt": prompt, "multi_modal_data": {"image": [image]}}, vlm_greedy(), use_tqdm=False)[0]
    again = llm.generate({"prompt": prompt, "multi_modal_data": {"image": [image]}}, vlm_greedy(), use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens >= 16
    assert list(again.outputs[0].token_ids) == _hf_greedy(llm, hf, prompt, [image])
