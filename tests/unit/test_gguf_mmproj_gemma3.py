"""Gemma 3 served as a text GGUF with `--mmproj` (projector type gemma3): greedy output token-identical to
transformers, its image's soft tokens attending both ways as in the safetensors folder, with one image and
with two; the image tokens are the vocabulary's own."""
from __future__ import annotations

import helpers
import mmproj_helpers
import pytest
import torch

from tokenloom import LLM
from tokenloom.model.models.vision_language import pixel_tensor

ONE_IMAGE = "USER: <start_of_image> what is in this picture ? ASSISTANT:"
TWO_IMAGES = "USER: compare <start_of_image> and <start_of_image> please . ASSISTANT:"


@pytest.fixture(scope="module")
def gemma3_gguf(tmp_path_factory):
    """(folder, hf, LLM on the text GGUF and its mmproj)."""
    folder = str(tmp_path_factory.mktemp("gemma3_gguf"))
    hf = helpers.build_tiny_gemma3_mm(folder, text_overrides=mmproj_helpers.GEMMA3_GGUF_TEXT)
    text = mmproj_helpers.write_gemma3_text_gguf(hf, folder, f"{folder}/text.gguf")
    mmproj = mmproj_helpers.write_mmproj(folder, f"{folder}/mmproj.gguf")
    llm = LLM(text, mmproj=mmproj, **mmproj_helpers.ENGINE)
    yield folder, hf, llm
    llm.shutdown()


def _hf_greedy(llm: LLM, hf, ids: list[int], images) -> list[int]:
    expanded, inputs = llm.input_processor.image_processor.prepare(ids, images)
    ids_t = torch.tensor([expanded])
    return helpers.hf_vlm_tokens(hf, {
        "input_ids": ids_t, "attention_mask": torch.ones_like(ids_t),
        "token_type_ids": (ids_t == helpers.TINY_GEMMA3_SOFT).long(),
        "pixel_values": torch.stack([pixel_tensor(i) for i in inputs])})


def test_greedy_output_with_one_image_equals_transformers_and_the_safetensors_folder(gemma3_gguf):
    folder, hf, llm = gemma3_gguf
    ids, image = mmproj_helpers.prompt_ids(folder, ONE_IMAGE), helpers.tiny_image(60, 90, seed=1)
    got = mmproj_helpers.greedy_with_images(llm, ids, image)
    assert got == _hf_greedy(llm, hf, ids, [image])
    folder_llm = LLM(folder, **mmproj_helpers.ENGINE)
    try:
        assert got == mmproj_helpers.greedy_with_images(folder_llm, ids, image)
    finally:
        folder_llm.shutdown()


def test_greedy_output_with_two_images_equals_transformers(gemma3_gguf):
    folder, hf, llm = gemma3_gguf
    ids = mmproj_helpers.prompt_ids(folder, TWO_IMAGES)
    images = [helpers.tiny_image(40, 30, seed=2), helpers.tiny_image(25, 60, seed=3)]
    assert mmproj_helpers.greedy_with_images(llm, ids, images) == _hf_greedy(llm, hf, ids, images)


def test_the_vocabulary_start_of_image_token_marks_the_image_in_a_text_prompt(gemma3_gguf):
    _, hf, llm = gemma3_gguf
    ids = llm.tokenizer.encode(ONE_IMAGE)
    assert ids.count(helpers.TINY_GEMMA3_BOI) == 1
    image = helpers.tiny_image(50, 50, seed=4)
    out = llm.generate({"prompt": ONE_IMAGE, "multi_modal_data": {"image": image}}, helpers.vlm_greedy(),
                       use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == _hf_greedy(llm, hf, ids, [image])
