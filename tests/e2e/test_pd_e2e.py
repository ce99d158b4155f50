"""A prefill/decode pair of real `tokenloom serve` processes on the embedded model, driven by
`tokenloom.router.pd.pd_request` (what `tokenloom router --pd` runs): the answers equal the decode
instance's own greedy answer to the plain request, streamed or not, and the decoder reports the whole
prompt as cached (it computed none of it)."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from server_harness import MODEL, ServerProcess

from tokenloom.router.pd import pd_request

pytestmark = pytest.mark.slow  # two servers on the embedded model: a minute or two to start on 2 cores

PROMPT = "The three primary colours are"
MESSAGES = [{"role": "user", "content": "Name a large city in France."}]


@pytest.fixture(scope="module")
def pair():
    prefill = ServerProcess("--splitwise-role", "prefill")
    try:
        decode = ServerProcess("--kv-transfer-config", '{"kv_role": "kv_consumer", "kv_transfer_timeout_s": 20}')
    except BaseException:
        prefill.terminate()
        raise
    yield prefill, decode
    decode.terminate()
    prefill.terminate()


def through_pair(pair, path: str, body: dict) -> tuple[int, bytes]:
    prefill, decode = pair

    async def go():
        async with httpx.AsyncClient(timeout=120) as client:
            response = await pd_request(client, path, body, prefill.url, decode.url)
            try:
                return response.status_code, await response.aread()
            finally:
                await response.aclose()

    return asyncio.run(go())


def test_a_completion_through_the_pair_equals_the_decoders_own_answer(pair):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    status, raw = through_pair(pair, "/v1/completions", body)
    assert status == 200, raw
    got = json.loads(raw)
    want = pair[1].post("/v1/completions", json=body).json()
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == got["usage"]["prompt_tokens"]


def test_a_streamed_chat_through_the_pair_equals_the_decoders_own_answer(pair):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 24, "temperature": 0, "stream": True}
    status, raw = through_pair(pair, "/v1/chat/completions", body)
    assert status == 200, raw
    chunks = [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: {")]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
    want = pair[1].post("/v1/chat/completions", json=dict(body, stream=False)).json()
    assert text == want["choices"][0]["message"]["content"]


def test_the_prefill_instance_answers_with_the_params_a_decoder_needs(pair):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    params = pair[0].post("/v1/completions", json=body).json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_address"].startswith("tcp://127.0.0.1:")
