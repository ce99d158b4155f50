"""LLaVA through the engine: greedy output token-identical to transformers with images anywhere in the prompt,
prompt logprobs within tolerance, chunked prefill across an image, the encoder cache, and the prefix cache keyed
by image content."""
from __future__ import annotations

import helpers
import pytest
import torch
from helpers import vlm_greedy, vlm_tokens

from tokenloom import LLM
from tokenloom.model.models.vision_language import pixel_tensor
from tokenloom.multimodal.errors import ImageInputError

ONE_IMAGE = "USER: <image> what is in this picture ? ASSISTANT:"
TWO_IMAGES = "USER: compare <image> and <image> please . ASSISTANT:"
IMAGE_LAST = "USER: describe the image <image>"


@pytest.fixture(scope="module")
def llava(tiny_llava):
    folder, hf = tiny_llava
    llm = LLM(folder, progress=False, dtype="float32", device="cpu", log_stats_interval=0, kv_cache_memory=0.05)
    yield llm, hf
    llm.shutdown()


def _engine_inputs(llm: LLM, prompt: str, images):
    ids, inputs = llm.input_processor.image_processor.prepare(llm.tokenizer.encode(prompt), images)
    pixels = torch.stack([pixel_tensor(i) for i in inputs])
    return ids, pixels


def _hf_greedy(llm: LLM, hf, prompt: str, images, max_tokens: int = helpers.VLM_NEW_TOKENS) -> list[int]:
    ids, pixels = _engine_inputs(llm, prompt, images)
    inputs = {"input_ids": torch.tensor([ids]), "pixel_values": pixels, "attention_mask": torch.ones(1, len(ids))}
    return helpers.hf_vlm_tokens(hf, inputs, max_tokens)


def test_greedy_output_with_one_image_equals_transformers(llava):
    llm, hf = llava
    image = helpers.tiny_image(40, 30, seed=1)
    assert vlm_tokens(llm, ONE_IMAGE, image) == _hf_greedy(llm, hf, ONE_IMAGE, [image])


def test_greedy_output_with_two_images_equals_transformers(llava):
    llm, hf = llava
    images = [helpers.tiny_image(40, 30, seed=2), helpers.tiny_image(25, 60, seed=3)]
    assert vlm_tokens(llm, TWO_IMAGES, images) == _hf_greedy(llm, hf, TWO_IMAGES, images)


def test_an_image_at_the_end_of_the_prompt_equals_transformers(llava):
    llm, hf = llava
    image = helpers.tiny_image(33, 33, seed=4)
    assert vlm_tokens(llm, IMAGE_LAST, image) == _hf_greedy(llm, hf, IMAGE_LAST, [image])


def test_prompt_logprobs_over_image_placeholders_match_transformers(llava):
    llm, hf = llava
    image = helpers.tiny_image(40, 30, seed=5)
    out = llm.generate({"prompt": ONE_IMAGE, "multi_modal_data": {"image": image}},
                       vlm_greedy(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    ids, pixels = _engine_inputs(llm, ONE_IMAGE, [image])
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor([ids]), pixel_values=pixels).logits[0]
    want = torch.log_softmax(logits.float(), -1)
    for pos in range(1, len(ids)):
        got = out.prompt_logprobs[pos][ids[pos]].logprob
        assert got == pytest.approx(want[pos - 1, ids[pos]].item(), abs=1e-4), pos


def test_chunked_prefill_that_splits_an_image_equals_transformers_and_encodes_it_once(tiny_llava):
    folder, hf = tiny_llava
    llm = LLM(folder, progress=False, dtype="float32", device="cpu", log_stats_interval=0, kv_cache_memory=0.05,
              long_prefill_token_threshold=5, max_num_batched_tokens=64)
    calls = []
    model = llm.engine.executor.worker.runner.model
    real = model.encode
    model.encode = lambda pixels: calls.append(pixels.shape[0]) or real(pixels)
    try:
        image = helpers.tiny_image(40, 30, seed=6)
        assert vlm_tokens(llm, ONE_IMAGE, image) == _hf_greedy(llm, hf, ONE_IMAGE, [image])
        assert calls == [1]  # 16 placeholders over 4 chunks, one encoder run
    finally:
        llm.shutdown()


def test_the_same_image_and_text_hit_the_prefix_cache(llava):
    llm, _ = llava
    llm.engine.reset_prefix_cache()
    prompt = {"prompt": ONE_IMAGE + " tell me more about it please .", "multi_modal_data":
              {"image": helpers.tiny_image(40, 30, seed=7)}}
    first = llm.generate(prompt, vlm_greedy(), use_tqdm=False)[0]
    again = llm.generate(prompt, vlm_greedy(), use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens >= 16
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_a_different_image_gives_different_output_and_no_prefix_cache_hit(llava):
    llm, _ = llava
    llm.engine.reset_prefix_cache()
    text = "USER: <image> tell me more about it please . ASSISTANT:"  # the image's block is the first
    first = llm.generate({"prompt": text, "multi_modal_data": {"image": helpers.tiny_image(40, 30, seed=8)}},
                         vlm_greedy(), use_tqdm=False)[0]
    other = llm.generate({"prompt": text, "multi_modal_data": {"image": helpers.tiny_image(40, 30, seed=9)}},
                         vlm_greedy(), use_tqdm=False)[0]
    assert other.num_cached_tokens == 0
    assert other.outputs[0].token_ids != first.outputs[0].token_ids


def test_n_greater_than_one_with_an_image_samples_every_sequence(llava):
    llm, hf = llava
    image = helpers.tiny_image(40, 30, seed=10)
    out = llm.generate({"prompt": ONE_IMAGE, "multi_modal_data": {"image": image}},
                       vlm_greedy(n=3), use_tqdm=False)[0]
    want = _hf_greedy(llm, hf, ONE_IMAGE, [image])
    assert [list(o.token_ids) for o in out.outputs] == [want] * 3


def test_preempted_image_requests_recompute_to_the_same_output(tiny_llava):
    folder, hf = tiny_llava
    llm = LLM(folder, progress=False, dtype="float32", device="cpu", log_stats_interval=0, num_blocks=8,
              block_size=8, max_encoder_cache=32)
    try:
        images = [helpers.tiny_image(40, 30, seed=20 + i) for i in range(3)]
        outs = llm.generate([{"prompt": ONE_IMAGE, "multi_modal_data": {"image": im}} for im in images],
                            vlm_greedy(max_tokens=16), use_tqdm=False)
        assert llm.engine.scheduler.num_preemptions > 0
        for out, image in zip(outs, images):
            assert list(out.outputs[0].token_ids) == _hf_greedy(llm, hf, ONE_IMAGE, [image], max_tokens=16)
    finally:
        llm.shutdown()


def test_offline_chat_takes_image_parts(llava):
    llm, hf = llava
    image = helpers.tiny_image(40, 30, seed=11)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": helpers.image_data_url(image)}},
                                             {"type": "text", "text": "what is in this picture ?"}]}]
    out = llm.chat(messages, vlm_greedy(), use_tqdm=False)[0]
    prompt = "USER: <image> what is in this picture ? ASSISTANT:"
    assert out.prompt.startswith("USER: <image>")
    assert list(out.outputs[0].token_ids) == _hf_greedy(llm, hf, prompt, [image])


def test_a_prompt_whose_placeholders_do_not_match_its_images_is_refused(llava):
    llm, _ = llava
    with pytest.raises(ImageInputError, match="placeholder"):
        llm.generate({"prompt": ONE_IMAGE, "multi_modal_data": {"image": []}}, vlm_greedy(), use_tqdm=False)


def test_an_encoder_cache_of_one_image_serves_a_two_image_prompt_one_image_at_a_time(tiny_llava):
    folder, hf = tiny_llava
    llm = LLM(folder, progress=False, dtype="float32", device="cpu", log_stats_interval=0, kv_cache_memory=0.05,
              max_encoder_cache=16)
    try:
        images = [helpers.tiny_image(40, 30, seed=30), helpers.tiny_image(30, 40, seed=31)]
        assert vlm_tokens(llm, TWO_IMAGES, images) == _hf_greedy(llm, hf, TWO_IMAGES, images)
        assert set(llm.engine.executor.worker.runner.encoder_cache.rows) == set(llm.engine.scheduler.encoder.entries)
        assert len(llm.engine.scheduler.encoder.entries) == 1
    finally:
        llm.shutdown()


def test_an_image_larger_than_the_encoder_cache_is_refused(tiny_llava):
    llm = LLM(tiny_llava[0], progress=False, dtype="float32", device="cpu", log_stats_interval=0,
              kv_cache_memory=0.05, max_encoder_cache=8)
    try:
        with pytest.raises(ImageInputError, match="--max-encoder-cache"):
            llm.generate({"prompt": ONE_IMAGE, "multi_modal_data": {"image": helpers.tiny_image(9, 9)}}, vlm_greedy(),
                         use_tqdm=False)
    finally:
        llm.shutdown()


@pytest.mark.tp
def test_tensor_parallel_over_two_ranks_gives_the_same_greedy_output(tiny_llava):
    folder, hf = tiny_llava
    llm = LLM(folder, progress=False, dtype="float32", device="cpu", log_stats_interval=0, kv_cache_memory=0.05,
              tensor_parallel_size=2)
    try:
        images = [helpers.tiny_image(40, 30, seed=40), helpers.tiny_image(28, 28, seed=41)]
        assert vlm_tokens(llm, TWO_IMAGES, images) == _hf_greedy(llm, hf, TWO_IMAGES, images)
    finally:
        llm.shutdown()
