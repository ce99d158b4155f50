"""Images through the server: chat image_url parts and Responses input_image on a tiny random LLaVA, output
token-identical to transformers, and every bad image a 400 in OpenAI's shape that leaves the requests beside it
untouched."""
from __future__ import annotations

import base64
import concurrent.futures
import io

import helpers
import numpy as np
import pytest
import torch
from PIL import Image
from server_harness import ServerProcess

from tokenloom.config import MultiModalConfig
from tokenloom.multimodal.processor import ImageProcessor
from tokenloom.tokenizer import Tokenizer

LIGHT = ["--max-model-len", "256", "--num-blocks", "64", "--log-level", "warning", "--max-expected-latency", "0"]
MAX_IMAGE_BYTES = 20_000
MAX_IMAGE_PIXELS = 10_000
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("media")
    helpers.tiny_image(40, 30, seed=3).save(folder / "cat.png")
    return folder


@pytest.fixture(scope="module")
def server(tiny_llava, media_dir):
    s = ServerProcess("--limit-mm-per-prompt", '{"image": 2}', "--max-image-bytes", str(MAX_IMAGE_BYTES),
                      "--max-image-pixels", str(MAX_IMAGE_PIXELS), "--allowed-local-media-path", str(media_dir),
                      model=tiny_llava[0], base_args=LIGHT)
    yield s
    s.kill()


def _data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


def _chat(server, urls: list[str], text: str = "what is in this picture ?") -> dict:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls] + [{"type": "text", "text": text}]
    r = server.post("/v1/chat/completions", json={
        "model": server.model, "messages": [{"role": "user", "content": parts}], "max_tokens": NEW_TOKENS,
        "temperature": 0, "ignore_eos": True, "return_token_ids": True})
    return {"status": r.status_code, **r.json()}


def _want(tiny_llava, images: list[Image.Image], text: str = "what is in this picture ?") -> list[int]:
    folder, hf = tiny_llava
    prompt = "USER: " + "<image> " * len(images) + text + " ASSISTANT:"
    processor = ImageProcessor.for_model(folder, MultiModalConfig())
    ids, inputs = processor.prepare(Tokenizer.from_model_path(folder).encode(prompt, add_special_tokens=False), images)
    pixels = torch.stack([torch.from_numpy(np.frombuffer(i.pixel_values, np.float32).reshape(i.shape).copy())
                          for i in inputs])
    with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor([ids]), pixel_values=pixels, attention_mask=torch.ones(1, len(ids)),
                          max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, len(ids):].tolist()


def _assert_400(out: dict, match: str) -> None:
    assert out["status"] == 400, out
    assert set(out["error"]) >= {"message", "type", "param", "code"}
    assert match in out["error"]["message"], out["error"]["message"]


def test_a_chat_image_as_a_data_url_gives_transformers_greedy_output(server, tiny_llava):
    image = helpers.tiny_image(40, 30, seed=1)
    out = _chat(server, [_data_url(_png(image))])
    assert out["choices"][0]["token_ids"] == _want(tiny_llava, [image])


def test_two_images_in_one_message_give_transformers_greedy_output(server, tiny_llava):
    images = [helpers.tiny_image(40, 30, seed=4), helpers.tiny_image(30, 45, seed=5)]
    out = _chat(server, [_data_url(_png(im)) for im in images])
    assert out["choices"][0]["token_ids"] == _want(tiny_llava, images)


def test_a_file_url_under_the_allowed_path_is_read(server, tiny_llava, media_dir):
    out = _chat(server, [f"file://{media_dir}/cat.png"])
    assert out["choices"][0]["token_ids"] == _want(tiny_llava, [Image.open(media_dir / "cat.png")])


def test_responses_input_image_gives_the_chat_output(server, tiny_llava):
    image = helpers.tiny_image(40, 30, seed=1)
    r = server.post("/v1/responses", json={
        "model": server.model, "max_output_tokens": NEW_TOKENS, "temperature": 0,
        "input": [{"role": "user", "content": [{"type": "input_image", "image_url": _data_url(_png(image))},
                                               {"type": "input_text", "text": "what is in this picture ?"}]}]})
    assert r.status_code == 200, r.text
    text = r.json()["output"][-1]["content"][0]["text"]
    want = Tokenizer.from_model_path(tiny_llava[0]).decode(_want(tiny_llava, [image]))
    assert text.strip() and want.strip().startswith(text.strip())  # it may stop early at an end-of-sequence token


BAD_IMAGES = {
    "undecodable": (lambda: _data_url(b"\x89PNG\r\n\x1a\n" + b"\x00" * 64), "not a decodable image"),
    "truncated": (lambda: _data_url(_png(helpers.tiny_image(40, 30))[:300]), "not a decodable image"),
    "not an image": (lambda: _data_url(b"%PDF-1.4 a document", "application/pdf"), "not a decodable image"),
    "too many bytes": (lambda: _data_url(_png(helpers.tiny_image(100, 100))), "bytes"),
    "too many pixels": (lambda: _data_url(_png(Image.new("RGB", (120, 90)))), "pixels"),
    "not base64": (lambda: "data:image/png;base64,!!!", "base64"),
    "http without allowed domains": (lambda: "http://example.com/cat.png", "--allowed-media-domains"),
    "a file outside the allowed path": (lambda: "file:///etc/passwd", "outside --allowed-local-media-path"),
    "an unknown scheme": (lambda: "ftp://example.com/cat.png", "scheme"),
}


@pytest.mark.parametrize("kind", list(BAD_IMAGES))
def test_a_bad_image_is_a_400_in_openais_shape(server, kind):
    url, match = BAD_IMAGES[kind]
    _assert_400(_chat(server, [url()]), match)


def test_more_images_than_the_limit_is_a_400(server):
    url = _data_url(_png(helpers.tiny_image(40, 30)))
    _assert_400(_chat(server, [url, url, url]), "at most 2")


def test_requests_beside_bad_images_are_unaffected(server, tiny_llava):
    image = helpers.tiny_image(40, 30, seed=6)
    good = _data_url(_png(image))
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(_chat, server, [good])] + [pool.submit(_chat, server, [make()])
                                                         for make, _ in BAD_IMAGES.values()]
        results = [f.result() for f in futures]
    assert results[0]["choices"][0]["token_ids"] == _want(tiny_llava, [image])
    assert all(r["status"] == 400 for r in results[1:])


def test_an_image_for_a_text_only_model_is_a_400():
    s = ServerProcess(base_args=LIGHT)
    try:
        _assert_400(_chat(s, [_data_url(_png(helpers.tiny_image(40, 30)))]), "text-only")
    finally:
        s.kill()


def test_qwen2_5_vl_serves_two_images_of_different_sizes_with_transformers_greedy_output(tiny_qwen2_5_vl):
    folder, hf = tiny_qwen2_5_vl
    images = [helpers.tiny_image(60, 90, seed=7), helpers.tiny_image(120, 64, seed=8)]
    prompt = "USER: " + f"{helpers.TINY_QWEN_VL_IMAGE} " * 2 + "what is in this picture ? ASSISTANT:"
    processor = ImageProcessor.for_model(folder, MultiModalConfig())
    ids, inputs = processor.prepare(Tokenizer.from_model_path(folder).encode(prompt, add_special_tokens=False), images)
    ids_t = torch.tensor([ids])
    with torch.no_grad():
        want = hf.generate(input_ids=ids_t, attention_mask=torch.ones_like(ids_t),
                           mm_token_type_ids=(ids_t == helpers.TINY_QWEN_VL_IMAGE_PAD).int(),
                           pixel_values=torch.cat([torch.from_numpy(np.frombuffer(i.pixel_values, np.float32)
                                                                    .reshape(i.shape).copy()) for i in inputs]),
                           image_grid_thw=torch.tensor([i.grid_thw for i in inputs]),
                           max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    s = ServerProcess(model=folder, base_args=LIGHT)
    try:
        out = _chat(s, [_data_url(_png(im)) for im in images])
    finally:
        s.kill()
    assert out["choices"][0]["token_ids"] == want[0, len(ids):].tolist()
