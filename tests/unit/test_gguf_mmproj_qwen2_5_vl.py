"""Qwen2.5-VL served as a text GGUF (architecture qwen2vl, its M-RoPE sections in the metadata) with `--mmproj`
(projector type qwen2.5vl_merger): the tower's split qkv and patch frames joined back, greedy output
token-identical to transformers and to the safetensors folder with one image and with two of different sizes."""
from __future__ import annotations

import helpers
import mmproj_helpers
import pytest
import torch

from tokenloom import LLM
from tokenloom.model.models.vision_language import pixel_tensor

IMAGE = helpers.TINY_QWEN_VL_IMAGE
ONE_IMAGE = f"USER: {IMAGE} what is in this picture ? ASSISTANT:"
TWO_IMAGES = f"USER: compare {IMAGE} and {IMAGE} please . ASSISTANT:"


@pytest.fixture(scope="module")
def qwen_gguf(tiny_qwen2_5_vl, tmp_path_factory):
    """(folder, hf, LLM on the text GGUF and its mmproj)."""
    folder, hf = tiny_qwen2_5_vl
    tmp = tmp_path_factory.mktemp("qwen2_5_vl_gguf")
    text = mmproj_helpers.write_qwen2_5_vl_text_gguf(hf, folder, str(tmp / "text.gguf"))
    mmproj = mmproj_helpers.write_mmproj(folder, str(tmp / "mmproj.gguf"))
    llm = LLM(text, mmproj=mmproj, **mmproj_helpers.ENGINE)
    yield folder, hf, llm
    llm.shutdown()


def _hf_greedy(llm: LLM, hf, ids: list[int], images) -> list[int]:
    expanded, inputs = llm.input_processor.image_processor.prepare(ids, images)
    ids_t = torch.tensor([expanded])
    return helpers.hf_vlm_tokens(hf, {
        "input_ids": ids_t, "attention_mask": torch.ones_like(ids_t),
        "mm_token_type_ids": (ids_t == helpers.TINY_QWEN_VL_IMAGE_PAD).int(),
        "pixel_values": torch.cat([pixel_tensor(i) for i in inputs]),
        "image_grid_thw": torch.tensor([i.grid_thw for i in inputs])})


def test_greedy_output_with_one_image_equals_transformers_and_the_safetensors_folder(qwen_gguf):
    folder, hf, llm = qwen_gguf
    ids, image = mmproj_helpers.prompt_ids(folder, ONE_IMAGE), helpers.tiny_image(60, 40, seed=1)
    got = mmproj_helpers.greedy_with_images(llm, ids, image)
    assert got == _hf_greedy(llm, hf, ids, [image])
    folder_llm = LLM(folder, **mmproj_helpers.ENGINE)
    try:
        assert got == mmproj_helpers.greedy_with_images(folder_llm, ids, image)
    finally:
        folder_llm.shutdown()


def test_greedy_output_with_two_images_of_different_sizes_equals_transformers(qwen_gguf):
    folder, hf, llm = qwen_gguf
    ids = mmproj_helpers.prompt_ids(folder, TWO_IMAGES)
    images = [helpers.tiny_image(56, 84, seed=2), helpers.tiny_image(112, 56, seed=3)]
    expanded, _ = llm.input_processor.image_processor.prepare(ids, images)
    assert expanded.count(helpers.TINY_QWEN_VL_IMAGE_PAD) > 2 * 4  # not the smallest grid twice
    assert mmproj_helpers.greedy_with_images(llm, ids, images) == _hf_greedy(llm, hf, ids, images)


def test_a_chat_image_part_is_written_as_the_vision_tokens_in_a_text_only_template(qwen_gguf):
    _, hf, llm = qwen_gguf
    image = helpers.tiny_image(50, 70, seed=4)
    out = llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                                 {"type": "text", "text": "what is in this picture ?"}]}],
                   helpers.vlm_greedy(), use_tqdm=False)
    assert out[0].prompt == f"USER: {IMAGE}\nwhat is in this picture ? ASSISTANT:"
    ids = llm.tokenizer.encode(out[0].prompt, add_special_tokens=False)
    assert list(out[0].outputs[0].token_ids) == _hf_greedy(llm, hf, ids, [image])
