"""Gemma 3 with images through the engine: greedy output token-identical to transformers with images anywhere in
the prompt, prompt logprobs within tolerance, an image's tokens attending to each other both ways in prefill
(and a chunk never splitting them), text-only prompts through the same model, both checkpoint layouts."""
from __future__ import annotations

import os
import shutil

import helpers
import numpy as np
import pytest
import torch
from helpers import vlm_greedy, vlm_tokens
from safetensors.torch import load_file, save_file

from tokenloom import LLM
from tokenloom.model.models.vision_language import pixel_tensor

IMAGE = "<start_of_image>"
ONE_IMAGE = f"USER: {IMAGE} what is in this picture ? ASSISTANT:"
TWO_IMAGES = f"USER: compare {IMAGE} and {IMAGE} please . ASSISTANT:"
IMAGE_MID_PROMPT = f"USER: tell me more about {IMAGE} the red one please . ASSISTANT:"
TEXT_ONLY = "USER: tell me more about the red cat please . ASSISTANT:"


def _llm(folder: str, **kw) -> LLM:
    return LLM(folder, progress=False, dtype="float32", device="cpu", log_stats_interval=0, kv_cache_memory=0.05,
               **kw)


@pytest.fixture(scope="module")
def gemma(tiny_gemma3_mm):
    folder, hf = tiny_gemma3_mm
    llm = _llm(folder)
    yield llm, hf
    llm.shutdown()


def _hf_inputs(llm: LLM, prompt: str, images, bidirectional: bool = True) -> dict[str, torch.Tensor]:
    """What transformers' processor gives for the prompt: the expanded ids, the pixels and the token types that
    mark the image tokens (without them transformers attends causally everywhere)."""
    ids, inputs = llm.input_processor.image_processor.prepare(llm.tokenizer.encode(prompt), images)
    ids_t = torch.tensor([ids])
    out = {"input_ids": ids_t, "attention_mask": torch.ones_like(ids_t)}
    if bidirectional:
        out["token_type_ids"] = (ids_t == helpers.TINY_GEMMA3_SOFT).long()
    if inputs:
        out["pixel_values"] = torch.stack([pixel_tensor(i) for i in inputs])
    return out


def _hf_greedy(llm: LLM, hf, prompt: str, images, max_tokens: int = helpers.VLM_NEW_TOKENS) -> list[int]:
    inputs = _hf_inputs(llm, prompt, images)
    return helpers.hf_vlm_tokens(hf, inputs, max_tokens)


def _prompt_logprobs(llm: LLM, prompt: str, images) -> list[float]:
    """Our logprob of each prompt token after the first."""
    out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": images}},
                       vlm_greedy(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    ids = out.prompt_token_ids
    return [out.prompt_logprobs[pos][ids[pos]].logprob for pos in range(1, len(ids))]


def _hf_prompt_logprobs(llm: LLM, hf, prompt: str, images, bidirectional: bool = True) -> list[float]:
    inputs = _hf_inputs(llm, prompt, images, bidirectional)
    ids = inputs["input_ids"][0].tolist()
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(**inputs).logits[0].float(), -1)
    return [logprobs[pos - 1, ids[pos]].item() for pos in range(1, len(ids))]


def test_each_image_becomes_start_soft_tokens_and_end_as_gemma3_processor_writes_it(gemma):
    llm, _ = gemma
    ids, inputs = llm.input_processor.image_processor.prepare(llm.tokenizer.encode(ONE_IMAGE),
                                                              [helpers.tiny_image(60, 90, seed=1)])
    n = helpers.TINY_GEMMA3_MM_TOKENS
    start = ids.index(helpers.TINY_GEMMA3_BOI)
    assert ids[start + 1:start + 2 + n] == [helpers.TINY_GEMMA3_SOFT] * n + [helpers.TINY_GEMMA3_EOI]
    assert (inputs[0].offset, inputs[0].length, inputs[0].attend_whole) == (start + 1, n, True)


def test_greedy_output_with_one_image_equals_transformers(gemma):
    llm, hf = gemma
    image = helpers.tiny_image(60, 90, seed=1)
    assert vlm_tokens(llm, ONE_IMAGE, [image]) == _hf_greedy(llm, hf, ONE_IMAGE, [image])


def test_greedy_output_with_two_images_equals_transformers(gemma):
    llm, hf = gemma
    images = [helpers.tiny_image(60, 90, seed=2), helpers.tiny_image(120, 64, seed=3)]
    assert vlm_tokens(llm, TWO_IMAGES, images) == _hf_greedy(llm, hf, TWO_IMAGES, images)


def test_an_image_mid_prompt_equals_transformers(gemma):
    llm, hf = gemma
    image = helpers.tiny_image(80, 80, seed=4)
    assert vlm_tokens(llm, IMAGE_MID_PROMPT, [image]) == _hf_greedy(llm, hf, IMAGE_MID_PROMPT, [image])


def test_a_text_only_prompt_through_the_same_model_equals_transformers(gemma):
    llm, hf = gemma
    assert vlm_tokens(llm, TEXT_ONLY, []) == _hf_greedy(llm, hf, TEXT_ONLY, [])


def test_prompt_logprobs_over_two_images_match_transformers(gemma):
    llm, hf = gemma
    images = [helpers.tiny_image(60, 90, seed=5), helpers.tiny_image(120, 64, seed=6)]
    got = _prompt_logprobs(llm, TWO_IMAGES, images)
    want = _hf_prompt_logprobs(llm, hf, TWO_IMAGES, images)
    assert got == pytest.approx(want, abs=1e-4)


def test_an_images_tokens_attend_to_each_other_both_ways_not_causally(gemma):
    """Causal attention over the image's tokens gives transformers' logprobs without token types, which differ
    from ours by far more than the tolerance above: the both-ways mask is what makes the outputs equal."""
    llm, hf = gemma
    image = helpers.tiny_image(60, 90, seed=7)
    got = np.array(_prompt_logprobs(llm, ONE_IMAGE, [image]))
    causal = np.array(_hf_prompt_logprobs(llm, hf, ONE_IMAGE, [image], bidirectional=False))
    assert np.abs(got - causal).max() > 1e-2


def test_chunked_prefill_never_splits_an_image_and_equals_transformers(tiny_gemma3_mm):
    folder, hf = tiny_gemma3_mm
    llm = _llm(folder, long_prefill_token_threshold=5, max_num_batched_tokens=helpers.TINY_GEMMA3_MM_TOKENS + 2)
    chunks = []
    runner = llm.engine.executor.worker.runner
    real = runner.execute_model
    runner.execute_model = lambda step, *a: chunks.append(dict(step.num_scheduled_tokens)) or real(step, *a)
    try:
        image = helpers.tiny_image(60, 90, seed=8)
        assert vlm_tokens(llm, IMAGE_MID_PROMPT, [image]) == _hf_greedy(llm, hf, IMAGE_MID_PROMPT, [image])
        _, (placed,) = llm.input_processor.image_processor.prepare(llm.tokenizer.encode(IMAGE_MID_PROMPT), [image])
        ends = np.cumsum([n for step in chunks for n in step.values()])
        assert ends[0] < placed.offset  # chunked ahead of the image: the threshold of 5 applied
        assert not any(placed.offset < end < placed.end for end in ends)
    finally:
        llm.shutdown()


def test_an_image_longer_than_a_steps_token_budget_is_refused(tiny_gemma3_mm):
    folder, _ = tiny_gemma3_mm
    llm = _llm(folder, max_num_batched_tokens=helpers.TINY_GEMMA3_MM_TOKENS - 1)
    try:
        with pytest.raises(ValueError, match="must be prefilled in one step"):
            vlm_tokens(llm, ONE_IMAGE, [helpers.tiny_image(60, 90, seed=9)])
    finally:
        llm.shutdown()


def _transformers_5_module_names(name: str) -> str:
    if name.startswith("language_model.model."):
        return "model.language_model." + name.removeprefix("language_model.model.")
    return "model." + name


def _released_names(name: str) -> str:
    return name.replace("vision_tower.", "vision_tower.vision_model.", 1)


@pytest.mark.parametrize("rename", [_transformers_5_module_names, _released_names])
def test_each_checkpoint_layout_loads_the_same_model(tiny_gemma3_mm, tmp_path, rename):
    folder, hf = tiny_gemma3_mm
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    renamed = {rename(n): t for n, t in tensors.items()}
    save_file(renamed, os.path.join(tmp_path, "model.safetensors"), metadata={"format": "pt"})
    llm = _llm(str(tmp_path))
    try:
        image = helpers.tiny_image(60, 90, seed=10)
        assert vlm_tokens(llm, ONE_IMAGE, [image]) == _hf_greedy(llm, hf, ONE_IMAGE, [image])
    finally:
        llm.shutdown()


def test_the_torch_attention_backend_gives_the_same_greedy_output(tiny_gemma3_mm):
    folder, hf = tiny_gemma3_mm
    llm = _llm(folder, attention_backend="torch")
    try:
        images = [helpers.tiny_image(60, 90, seed=11), helpers.tiny_image(120, 64, seed=12)]
        assert vlm_tokens(llm, TWO_IMAGES, images) == _hf_greedy(llm, hf, TWO_IMAGES, images)
    finally:
        llm.shutdown()


@pytest.mark.tp
def test_tensor_parallel_over_two_ranks_gives_the_same_greedy_output(tiny_gemma3_mm):
    folder, hf = tiny_gemma3_mm
    llm = _llm(folder, tensor_parallel_size=2)
    try:
        images = [helpers.tiny_image(60, 90, seed=13), helpers.tiny_image(120, 64, seed=14)]
        assert vlm_tokens(llm, TWO_IMAGES, images) == _hf_greedy(llm, hf, TWO_IMAGES, images)
    finally:
        llm.shutdown()
