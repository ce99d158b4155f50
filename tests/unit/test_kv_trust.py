"""Who may set kv_transfer_params (tokenloom/kv_transfer/trust.py, entrypoints/openai/kv_trust.py): only the
sender of the pair's shared secret, or, on a decode instance with kv_producers, params naming only producers on
that list; anything else is a 400 in OpenAI's shape. The HTTP checks run on a real ASGI stack (the middleware
and the check as the server wires them); the start-up check as `tokenloom serve` runs it."""
from __future__ import annotations

import asyncio

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from tokenloom.config import ConfigError, EngineConfig, KVTransferConfig
from tokenloom.entrypoints.openai.api_server import StartupError, _check_kv_trust
from tokenloom.entrypoints.openai.errors import APIError
from tokenloom.entrypoints.openai.kv_trust import KVTrustMiddleware, check_kv_transfer_params
from tokenloom.kv_transfer.trust import SECRET_HEADER, producer_allowed, refusal

SECRET = "0123456789abcdef0123"
DECODE = {"do_remote_decode": True}


def remote_prefill(address: str | list[str] = "tcp://10.0.0.5:5600") -> dict:
    return {"do_remote_prefill": True, "remote_address": address, "remote_transfer_id": "t" * 32,
            "remote_num_tokens": 7, "first_token_id": 3}


def producer(**kw) -> KVTransferConfig:
    return KVTransferConfig(kv_role="kv_producer", **kw)


def consumer(**kw) -> KVTransferConfig:
    return KVTransferConfig(kv_role="kv_consumer", **kw)


def test_a_server_outside_a_pd_pair_takes_no_params():
    assert "not part of a prefill/decode pair" in refusal(DECODE, None, secret_ok=True)


def test_a_producer_takes_remote_decode_only_with_the_secret():
    config = producer(kv_secret=SECRET)
    assert refusal(DECODE, config, secret_ok=True) is None
    assert "only from this server's prefill/decode router" in refusal(DECODE, config, secret_ok=False)


def test_a_decoder_takes_remote_prefill_only_with_the_secret_when_it_has_no_producer_list():
    config = consumer(kv_secret=SECRET)
    assert refusal(remote_prefill("tcp://203.0.113.9:1"), config, secret_ok=True) is None
    assert refusal(remote_prefill(), config, secret_ok=False) is not None


def test_a_decoders_producer_list_vouches_for_params_that_name_only_listed_producers():
    config = consumer(kv_producers=["10.0.0.5"])
    assert refusal(remote_prefill("tcp://10.0.0.5:5600"), config, secret_ok=False) is None
    assert refusal(remote_prefill(["tcp://10.0.0.5:5600", "tcp://10.0.0.5:5601"]), config, secret_ok=False) is None
    assert "not among this server's kv_producers" in refusal(remote_prefill("tcp://10.0.0.6:5600"), config, False)
    assert refusal(dict(remote_prefill(), do_remote_decode=True), config, secret_ok=False) is not None


def test_the_producer_list_holds_even_for_the_secrets_sender():
    config = consumer(kv_secret=SECRET, kv_producers=["10.0.0.5"])
    assert "kv_producers" in refusal(remote_prefill("tcp://198.51.100.1:80"), config, secret_ok=True)


@pytest.mark.parametrize("address, allowed, ok", [
    ("tcp://10.0.0.5:5600", ["10.0.0.5"], True),  # a host: any port
    ("tcp://10.0.0.5:5600", ["tcp://10.0.0.5:5600"], True),
    ("tcp://10.0.0.5:5601", ["tcp://10.0.0.5:5600"], False),
    ("tcp://10.0.0.5.evil.example:1", ["10.0.0.5"], False),
    ("tcp://user@10.0.0.6:1", ["10.0.0.5"], False),
    ("ipc:///tmp/tokenloom-kv-1-0.sock", ["ipc:///tmp/tokenloom-kv-1-0.sock"], True),
    ("ipc:///tmp/other.sock", ["ipc:///tmp/tokenloom-kv-1-0.sock"], False),
])
def test_producer_addresses_match_by_address_or_by_host(address, allowed, ok):
    assert producer_allowed(address, allowed) is ok


@pytest.mark.parametrize("kw, message", [({"kv_secret": "short"}, "at least 16 characters"),
                                         ({"kv_producers": []}, "non-empty list"),
                                         ({"kv_producers": "10.0.0.5"}, "non-empty list")])
def test_a_bad_trust_setting_is_a_config_error(kw, message):
    with pytest.raises(ConfigError, match=message):
        KVTransferConfig(**kw)


def test_the_secret_defaults_to_the_environment_variable(monkeypatch):
    monkeypatch.setenv("TOKENLOOM_KV_SECRET", SECRET)
    assert KVTransferConfig().kv_secret == SECRET


# ---------------------------------------------------------------- over HTTP

def http_status(config: KVTransferConfig | None, params: dict, headers: dict[str, str]) -> tuple[int, dict]:
    async def endpoint(request: Request) -> JSONResponse:
        try:
            check_kv_transfer_params(params, config)
        except APIError as e:
            return e.response()
        return JSONResponse({})

    app = KVTrustMiddleware(Starlette(routes=[Route("/", endpoint, methods=["POST"])]), config)

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            r = await client.post("/", headers=headers)
            return r.status_code, r.json()

    return asyncio.run(main())


def test_over_http_the_secret_header_is_what_makes_a_sender_trusted():
    config = producer(kv_secret=SECRET)
    assert http_status(config, DECODE, {SECRET_HEADER: SECRET})[0] == 200
    status, body = http_status(config, DECODE, {SECRET_HEADER: SECRET[:-1] + "x"})
    assert status == 400
    assert body["error"]["param"] == "kv_transfer_params" and body["error"]["code"] == "untrusted_kv_transfer"
    assert http_status(config, DECODE, {})[0] == 400


def test_outside_an_http_request_nobody_is_trusted():
    with pytest.raises(APIError):
        check_kv_transfer_params(DECODE, producer(kv_secret=SECRET))


# ---------------------------------------------------------------- start-up

@pytest.mark.parametrize("kv", [{"kv_role": "kv_producer"}, {"kv_role": "kv_consumer"}, {"kv_role": "kv_both"},
                                {"kv_role": "kv_both", "kv_producers": ["10.0.0.5"]}])
def test_a_pd_server_without_a_way_to_trust_its_router_does_not_start(kv, monkeypatch):
    monkeypatch.delenv("TOKENLOOM_KV_SECRET", raising=False)
    with pytest.raises(StartupError, match="kv_secret"):
        _check_kv_trust(EngineConfig(kv_transfer_config=kv))


@pytest.mark.parametrize("kv", [{"kv_role": "kv_producer", "kv_secret": SECRET},
                                {"kv_role": "kv_consumer", "kv_producers": ["10.0.0.5"]}])
def test_a_secret_or_a_decoders_producer_list_lets_a_pd_server_start(kv, monkeypatch):
    monkeypatch.delenv("TOKENLOOM_KV_SECRET", raising=False)
    _check_kv_trust(EngineConfig(kv_transfer_config=kv))
