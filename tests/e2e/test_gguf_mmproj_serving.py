"""`tokenloom serve text.gguf --mmproj mmproj.gguf`: a chat image through the server, its image part written as the
vocabulary's `<image>` in the GGUF's text-only template, answered as transformers answers the same prompt."""
from __future__ import annotations

import base64
import io

import helpers
import mmproj_helpers
import numpy as np
import pytest
import torch
from server_harness import ServerProcess

from tokenloom.config import MultiModalConfig
from tokenloom.multimodal.processor import ImageProcessor
from tokenloom.tokenizer import Tokenizer

LIGHT = ["--max-model-len", "256", "--num-blocks", "64", "--log-level", "warning", "--max-expected-latency", "0"]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def gguf_server(tiny_llava, tmp_path_factory):
    folder, hf = tiny_llava
    tmp = tmp_path_factory.mktemp("gguf_mmproj_serving")
    text = mmproj_helpers.write_llava_text_gguf(hf, folder, str(tmp / "text.gguf"))
    mmproj = mmproj_helpers.write_mmproj(folder, str(tmp / "mmproj.gguf"))
    s = ServerProcess("--mmproj", mmproj, model=text, base_args=LIGHT)
    yield s, text, mmproj, hf
    s.kill()


def test_a_chat_image_is_answered_as_transformers_answers_the_rendered_prompt(gguf_server):
    server, text, mmproj, hf = gguf_server
    image = helpers.tiny_image(40, 30, seed=1)
    buf = io.BytesIO()
    image.save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    r = server.post("/v1/chat/completions", json={
        "model": server.model, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "what is in this picture ?"}]}]})
    assert r.status_code == 200, r.text
    body = r.json()
    ids = body["prompt_token_ids"]
    assert ids.count(helpers.TINY_LLAVA_IMAGE_TOKEN) == 16  # the <image> the template got, expanded
    processor = ImageProcessor.for_gguf(text, mmproj, MultiModalConfig(), Tokenizer.from_gguf(text))
    _, inputs = processor.prepare([helpers.TINY_LLAVA_IMAGE_TOKEN], [image])
    pixels = torch.from_numpy(np.frombuffer(inputs[0].pixel_values, np.float32).reshape(inputs[0].shape).copy())
    with torch.no_grad():
        want = hf.generate(input_ids=torch.tensor([ids]), pixel_values=pixels[None],
                           attention_mask=torch.ones(1, len(ids)), max_new_tokens=NEW_TOKENS,
                           min_new_tokens=NEW_TOKENS, do_sample=False)[0, len(ids):].tolist()
    assert body["choices"][0]["token_ids"] == want
