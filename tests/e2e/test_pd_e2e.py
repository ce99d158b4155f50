"""A prefill/decode pair of real `tokenloom serve` processes on the embedded model, driven by
`tokenloom.router.pd.pd_request` and by a real `tokenloom router --pd` process in front of the pair: the
answers equal the decode instance's own greedy answer to the plain request, streamed or not, and the
decoder reports the whole prompt as cached (it computed none of it). Both take kv_transfer_params only with
the pair's secret: a client without it gets a 400 at once, from either instance."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from router_harness import RouterProcess
from server_harness import MODEL, ServerProcess

from tokenloom.kv_transfer.trust import SECRET_HEADER
from tokenloom.router.pd import pd_request

pytestmark = pytest.mark.slow  # two servers on the embedded model: a minute or two to start on 2 cores

PROMPT = "The three primary colours are"
MESSAGES = [{"role": "user", "content": "Name a large city in France."}]
SECRET = "pd-e2e-secret-0123456789"
TRUSTED = {SECRET_HEADER: SECRET}


@pytest.fixture(scope="module")
def pair():
    prefill = ServerProcess("--splitwise-role", "prefill", env={"TOKENLOOM_KV_SECRET": SECRET})
    try:
        config = {"kv_role": "kv_consumer", "kv_transfer_timeout_s": 20, "kv_secret": SECRET}
        decode = ServerProcess("--kv-transfer-config", json.dumps(config))
    except BaseException:
        prefill.terminate()
        raise
    yield prefill, decode
    decode.terminate()
    prefill.terminate()


@pytest.fixture(scope="module")
def pd_router(pair):
    prefill, decode = pair
    with RouterProcess("--pd", "--prefill", prefill.url, "--decode", decode.url, "--kv-secret", SECRET) as router:
        yield router


def through_pair(pair, path: str, body: dict) -> tuple[int, bytes]:
    prefill, decode = pair

    async def go():
        async with httpx.AsyncClient(timeout=120) as client:
            response = await pd_request(client, path, body, prefill.url, decode.url, headers=TRUSTED)
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
    params = pair[0].post("/v1/completions", json=body, headers=TRUSTED).json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_address"].startswith("tcp://127.0.0.1:")


def test_a_client_without_the_secret_cannot_pin_the_prefill_instances_blocks(pair):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    r = pair[0].post("/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["code"] == "untrusted_kv_transfer"


def test_a_client_cannot_point_the_decoder_at_a_host_of_its_choosing(pair):
    params = {"do_remote_prefill": True, "remote_address": "tcp://192.0.2.1:80", "remote_transfer_id": "x" * 32,
              "remote_num_tokens": 6, "first_token_id": 1}
    t0 = time.monotonic()
    r = pair[1].post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4,
                                              "kv_transfer_params": params})
    assert r.status_code == 400 and r.json()["error"]["code"] == "untrusted_kv_transfer"
    assert time.monotonic() - t0 < 5  # refused at the door: no connection attempt, no transfer timeout
def _streamed_text(raw: str) -> str:
    chunks = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))


def test_a_completion_through_the_router_in_pd_mode_equals_the_decoders_own_answer(pair, pd_router):
    body = {"model": MODEL, "prompt": PROMPT + " red,", "max_tokens": 24, "temperature": 0}
    r = httpx.post(pd_router.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    want = pair[1].post("/v1/completions", json=body).json()
    assert r.json()["choices"][0]["text"] == want["choices"][0]["text"]
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == r.json()["usage"]["prompt_tokens"]


def test_a_streamed_chat_through_the_router_in_pd_mode_equals_the_decoders_own_answer(pair, pd_router):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Name a large city in Italy."}],
            "max_tokens": 24, "temperature": 0, "stream": True}
    with httpx.stream("POST", pd_router.url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        raw = "".join(r.iter_text())
    assert raw.rstrip().endswith("data: [DONE]"), raw[-300:]
    want = pair[1].post("/v1/chat/completions", json=dict(body, stream=False)).json()
    assert _streamed_text(raw) == want["choices"][0]["message"]["content"]
