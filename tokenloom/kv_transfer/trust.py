"""Who may steer a KV transfer: a request's kv_transfer_params decide what a prefill instance pins (its
blocks, under a lease) and where a decode instance connects (any remote_address), so only a trusted sender
may set them.

Trusted means one of:
- the sender proves the shared secret: ``X-KV-Transfer-Secret: <kv_secret>`` (compared in constant time),
  which `tokenloom router --pd --kv-secret` sends to both instances of a pair;
- on a decode instance with ``kv_producers`` set, params that only name producers on that list (the
  allow-list holds with the secret too: a leaked secret still cannot point the decoder elsewhere).

Anything else is refused before the request reaches the engine: the HTTP server answers 400. This module
is plain Python (no torch): the API process imports it.
"""
from __future__ import annotations

import hmac
from urllib.parse import urlsplit

from tokenloom.config import KVTransferConfig

SECRET_HEADER = "x-kv-transfer-secret"
# Sent by a decoder-side request (a prefill instance's answer, passed on by the router).
REMOTE_PREFILL_KEYS = frozenset({"do_remote_prefill", "remote_address", "remote_transfer_id", "remote_num_tokens",
                                 "first_token_id"})


def secret_matches(config: KVTransferConfig | None, sent: str | None) -> bool:
    if config is None or not config.kv_secret or sent is None:
        return False
    return hmac.compare_digest(sent.encode(), config.kv_secret.encode())


def producer_allowed(address: str, allowed: list[str]) -> bool:
    """`address` (tcp://host:port or ipc://path) is on the list: as itself, or by its host (tcp)."""
    if address in allowed:
        return True
    parts = urlsplit(address)
    return parts.scheme == "tcp" and parts.hostname is not None and parts.hostname in allowed


def remote_addresses(params: dict) -> list[str]:
    address = params.get("remote_address")
    if isinstance(address, str):
        return [address]
    return [a for a in address if isinstance(a, str)] if isinstance(address, list) else []


def refusal(params: dict, config: KVTransferConfig | None, secret_ok: bool) -> str | None:
    """Why a request's kv_transfer_params are refused (None: taken)."""
    if config is None:
        return "this server is not part of a prefill/decode pair: it takes no kv_transfer_params"
    if config.kv_producers is not None:
        outside = [a for a in remote_addresses(params) if not producer_allowed(a, config.kv_producers)]
        if outside:
            return f"kv_transfer_params.remote_address {outside[0]!r} is not among this server's kv_producers"
    if secret_ok:
        return None
    if config.kv_producers is not None and params.get("do_remote_prefill") and set(params) <= REMOTE_PREFILL_KEYS:
        return None  # a decode instance's allow-list vouches for where it connects
    return ("kv_transfer_params are taken only from this server's prefill/decode router (the "
            "X-KV-Transfer-Secret header with its kv_secret)")
