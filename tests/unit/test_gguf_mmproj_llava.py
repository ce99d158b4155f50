"""A LLaVA served as llama.cpp users have it, a text GGUF with `--mmproj`: greedy output token-identical to
transformers and to the same model's safetensors folder, with one image, two images, images placed by the
vocabulary's `<image>`, by llama.cpp's `<__media__>` marker, and through chat; the mmproj's tensors read in
either of llama.cpp's fc1/fc2 spellings and dequantized from Q8_0."""
from __future__ import annotations

import subprocess
import sys

import helpers
import mmproj_helpers
import pytest
import torch

from tokenloom import LLM
from tokenloom.model.models.vision_language import pixel_tensor

ONE_IMAGE = "USER: <image> what is in this picture ? ASSISTANT:"
TWO_IMAGES = "USER: compare <image> and <image> please . ASSISTANT:"


@pytest.fixture(scope="module")
def llava_gguf(tiny_llava, tmp_path_factory):
    """(folder, hf, text GGUF, F32 mmproj, tmp dir)."""
    folder, hf = tiny_llava
    tmp = tmp_path_factory.mktemp("llava_gguf")
    text = mmproj_helpers.write_llava_text_gguf(hf, folder, str(tmp / "text.gguf"))
    mmproj = mmproj_helpers.write_mmproj(folder, str(tmp / "mmproj-f32.gguf"))
    return folder, hf, text, mmproj, tmp


@pytest.fixture(scope="module")
def gguf_llm(llava_gguf):
    _, hf, text, mmproj, _ = llava_gguf
    llm = LLM(text, mmproj=mmproj, **mmproj_helpers.ENGINE)
    yield llm, hf
    llm.shutdown()


def _hf_greedy(llm: LLM, hf, ids: list[int], images, image_token: int = helpers.TINY_LLAVA_IMAGE_TOKEN):
    """transformers on the engine's expanded prompt, its placeholder runs written as LLaVA's image token."""
    expanded, inputs = llm.input_processor.image_processor.prepare(ids, images)
    for im in inputs:
        expanded[im.offset:im.offset + im.length] = [image_token] * im.length
    pixels = torch.stack([pixel_tensor(i) for i in inputs])
    return mmproj_helpers.hf_greedy_with_pixels(hf, expanded, pixels)


def test_greedy_output_with_one_image_equals_transformers_and_the_safetensors_folder(llava_gguf, gguf_llm):
    folder = llava_gguf[0]
    llm, hf = gguf_llm
    ids, image = mmproj_helpers.prompt_ids(folder, ONE_IMAGE), helpers.tiny_image(40, 30, seed=1)
    got = mmproj_helpers.greedy_with_images(llm, ids, image)
    assert got == _hf_greedy(llm, hf, ids, [image])
    folder_llm = LLM(folder, **mmproj_helpers.ENGINE)
    try:
        assert got == mmproj_helpers.greedy_with_images(folder_llm, ids, image)
    finally:
        folder_llm.shutdown()


def test_greedy_output_with_two_images_equals_transformers(llava_gguf, gguf_llm):
    llm, hf = gguf_llm
    ids = mmproj_helpers.prompt_ids(llava_gguf[0], TWO_IMAGES)
    images = [helpers.tiny_image(40, 30, seed=2), helpers.tiny_image(25, 60, seed=3)]
    assert mmproj_helpers.greedy_with_images(llm, ids, images) == _hf_greedy(llm, hf, ids, images)


def test_the_text_gguf_vocabulary_image_token_marks_the_image_in_a_text_prompt(gguf_llm):
    llm, hf = gguf_llm
    image = helpers.tiny_image(33, 33, seed=4)
    ids = llm.tokenizer.encode(ONE_IMAGE)
    assert ids.count(helpers.TINY_LLAVA_IMAGE_TOKEN) == 1
    out = llm.generate({"prompt": ONE_IMAGE, "multi_modal_data": {"image": image}}, helpers.vlm_greedy(),
                       use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == _hf_greedy(llm, hf, ids, [image])


def test_a_chat_image_part_is_written_as_the_image_token_in_a_text_only_template(gguf_llm):
    llm, hf = gguf_llm
    image = helpers.tiny_image(30, 40, seed=5)
    out = llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                                 {"type": "text", "text": "what is in this picture ?"}]}],
                   helpers.vlm_greedy(), use_tqdm=False)
    assert out[0].prompt == "USER: <image>\nwhat is in this picture ? ASSISTANT:"
    ids = llm.tokenizer.encode(out[0].prompt, add_special_tokens=False)
    assert list(out[0].outputs[0].token_ids) == _hf_greedy(llm, hf, ids, [image])


def test_a_vocabulary_without_an_image_token_places_images_at_llama_cpp_media_marker(llava_gguf):
    folder, hf, _, mmproj, tmp = llava_gguf
    text = mmproj_helpers.write_llava_text_gguf(hf, folder, str(tmp / "text-no-image.gguf"), image_token=False)
    llm = LLM(text, mmproj=mmproj, **mmproj_helpers.ENGINE)
    try:
        prompt, image = "USER: <__media__> what ASSISTANT:", helpers.tiny_image(40, 30, seed=6)
        ids = llm.tokenizer.encode(prompt)
        out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": image}}, helpers.vlm_greedy(),
                           use_tqdm=False)
        assert max(out[0].prompt_token_ids) < hf.config.text_config.vocab_size
        assert list(out[0].outputs[0].token_ids) == _hf_greedy(llm, hf, ids, [image])
    finally:
        llm.shutdown()


def test_older_converters_fc1_named_ffn_down_reads_the_same(llava_gguf, gguf_llm):
    folder, hf, text, _, tmp = llava_gguf
    legacy = mmproj_helpers.write_mmproj(folder, str(tmp / "mmproj-legacy.gguf"), legacy_ffn_names=True)
    ids, image = mmproj_helpers.prompt_ids(folder, ONE_IMAGE), helpers.tiny_image(40, 30, seed=7)
    llm = LLM(text, mmproj=legacy, **mmproj_helpers.ENGINE)
    try:
        expected = mmproj_helpers.greedy_with_images(gguf_llm[0], ids, image)
        assert mmproj_helpers.greedy_with_images(llm, ids, image) == expected
    finally:
        llm.shutdown()


def test_a_q8_0_mmproj_dequantizes_to_image_rows_near_the_f32_ones(llava_gguf):
    from tokenloom.model.loader.mmproj_tensors import MmprojTensors
    folder, _, _, f32, tmp = llava_gguf
    q8 = mmproj_helpers.write_mmproj(folder, str(tmp / "mmproj-q8_0.gguf"), outtype="q8_0")
    exact = dict(MmprojTensors(f32, "mlp", 32).tensors())
    quantized = dict(MmprojTensors(q8, "mlp", 32).tensors())
    assert exact.keys() == quantized.keys()
    weight = "multi_modal_projector.linear_1.weight"
    assert not torch.equal(exact[weight], quantized[weight])
    for name, tensor in exact.items():
        torch.testing.assert_close(quantized[name], tensor, atol=0.01, rtol=0.01, msg=name)


def test_a_text_gguf_without_mmproj_stays_a_text_model(llava_gguf):
    text = llava_gguf[2]
    llm = LLM(text, **mmproj_helpers.ENGINE)
    try:
        assert llm.input_processor.image_processor is None
        with pytest.raises(ValueError, match="reads no images"):
            llm.generate({"prompt": "USER: what", "multi_modal_data": {"image": helpers.tiny_image(8, 8)}},
                         helpers.vlm_greedy(), use_tqdm=False)
    finally:
        llm.shutdown()


def test_a_quantized_text_gguf_keeps_its_blocks_beside_the_mmproj_with_logits_near_the_dense_load(llava_gguf):
    from tokenloom import kernels
    from tokenloom.model.layers.quantized_linear import quantized_weights
    from tokenloom.model.loader import load_model
    if not kernels.load():
        pytest.skip("kernels: blocks stay quantized only on the native CPU kernels")
    folder, hf, _, mmproj, tmp = llava_gguf
    text = mmproj_helpers.write_llava_text_gguf(hf, folder, str(tmp / "text-q8_0.gguf"), weights="Q8_0")
    cpu = torch.device("cpu")
    kept = load_model(text, torch.float32, cpu, progress=False, mmproj=mmproj)
    dense = load_model(text, torch.float32, cpu, progress=False, mmproj=mmproj, quantized=False)
    assert len(quantized_weights(kept.model)) == 2 * 4  # each layer's fused qkv, o, fused gate-up, down
    assert not quantized_weights(dense.model)
    ids = torch.tensor(mmproj_helpers.prompt_ids(folder, "USER: what is in this picture ? ASSISTANT:"))
    logits = [helpers.sequence_logits(m.model, ids.tolist()) for m in (kept, dense)]
    torch.testing.assert_close(logits[0], logits[1], atol=1e-3, rtol=1e-3)
    pixels = torch.randn(1, 3, 28, 28)
    torch.testing.assert_close(kept.model.encode(pixels), dense.model.encode(pixels))


@pytest.mark.tp
def test_tensor_parallel_over_two_ranks_gives_transformers_greedy_output(llava_gguf, gguf_llm):
    folder, hf, text, mmproj, _ = llava_gguf
    ids = mmproj_helpers.prompt_ids(folder, TWO_IMAGES)
    images = [helpers.tiny_image(40, 30, seed=8), helpers.tiny_image(28, 28, seed=9)]
    llm = LLM(text, mmproj=mmproj, tensor_parallel_size=2, **mmproj_helpers.ENGINE)
    try:
        assert mmproj_helpers.greedy_with_images(llm, ids, images) == _hf_greedy(gguf_llm[0], hf, ids, images)
    finally:
        llm.shutdown()


FRONTEND_THEN_REPORT = """
import sys
from tokenloom.config import MultiModalConfig
from tokenloom.multimodal.processor import ImageProcessor
from tokenloom.tokenizer import Tokenizer
processor = ImageProcessor.for_gguf(sys.argv[1], sys.argv[2], MultiModalConfig(), Tokenizer.from_gguf(sys.argv[1]))
print(processor.image_text, "torch imported:", "torch" in sys.modules)
"""


def test_the_api_process_reads_the_pair_without_importing_torch(llava_gguf):
    _, _, text, mmproj, _ = llava_gguf
    result = subprocess.run([sys.executable, "-c", FRONTEND_THEN_REPORT, text, mmproj], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "<image> torch imported: False"
