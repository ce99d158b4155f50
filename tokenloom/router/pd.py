"""One request through a prefill/decode pair: prefill on one instance, decode (and stream) on another.

The flow of vLLM's disaggregated-serving proxy: the prefill instance (started with
``--kv-transfer-config '{"kv_connector": "ZmqConnector", "kv_role": "kv_producer"}'`` or
``--splitwise-role prefill``) runs the prompt with ``max_tokens=1`` and
``kv_transfer_params={"do_remote_decode": true}``; it keeps the prompt's KV blocks under a lease
and answers with the ``kv_transfer_params`` a decoder needs (its KV address, the transfer id, the
first token). The decode instance (``kv_consumer`` / ``--splitwise-role decode``) gets the original
body plus those params, pulls the KV over ZMQ, computes no prompt token and streams the answer.
Both instances take kv_transfer_params only with the pair's secret in the headers (the caller adds it;
tokenloom/kv_transfer/trust.py).
"""
from __future__ import annotations

import httpx

DO_REMOTE_DECODE = {"do_remote_decode": True}


class PrefillFailed(Exception):
    """The prefill instance refused or failed the request; `status` and `body` are what to answer with."""

    def __init__(self, status: int, body: bytes):
        super().__init__(f"prefill instance answered {status}: {body[:200]!r}")
        self.status = status
        self.body = body


def prefill_body(body: dict) -> dict:
    """The request as the prefill instance runs it: one token, no stream, and a request for remote decode."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    out.update(max_tokens=1, stream=False, kv_transfer_params=DO_REMOTE_DECODE)
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    if out.get("min_tokens"):  # the first token still may not be an end of sequence; more cannot fit
        out["min_tokens"] = 1
    return out


async def pd_request(client: httpx.AsyncClient, path: str, body: dict, prefill_url: str, decode_url: str,
                     headers: dict[str, str] | None = None) -> httpx.Response:
    """Run one OpenAI request (``path`` is ``/v1/completions`` or ``/v1/chat/completions``) on a PD pair.

    ``body`` is the client's JSON body; ``prefill_url`` and ``decode_url`` are base URLs
    (``http://host:port``). Sends the prefill request, waits for its answer, then opens the decode
    request and returns its response unread (``client.send(..., stream=True)``): the caller passes
    status, headers and ``aiter_raw()`` through unchanged, streaming or not, and must ``aclose()`` it.

    Raises `PrefillFailed` when the prefill instance answers with an error (pass its status and body on)
    or without ``kv_transfer_params`` (502: it is not a producer); httpx errors propagate (the prefill
    instance is down: the request has not started, so the caller may retry it elsewhere).
    """
    answer = await client.post(prefill_url.rstrip("/") + path, json=prefill_body(body), headers=headers)
    if answer.status_code != 200:
        raise PrefillFailed(answer.status_code, answer.content)
    params = answer.json().get("kv_transfer_params")
    if not params:
        raise PrefillFailed(502, b'{"error": {"message": "the prefill instance returned no kv_transfer_params '
                                 b'(start it with --splitwise-role prefill)", "type": "bad_gateway"}}')
    request = client.build_request("POST", decode_url.rstrip("/") + path, json=dict(body, kv_transfer_params=params),
                                   headers=headers)
    return await client.send(request, stream=True)
