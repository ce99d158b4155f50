"""Response pieces the chat and completion APIs share: ids, usage, logprobs in OpenAI's shapes."""
from __future__ import annotations

import uuid

from tokenloom.core.json_types import JsonObject, JsonValue
from tokenloom.outputs import Logprob, PositionLogprobs, RequestOutput
from tokenloom.tokenizer import Tokenizer


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> JsonObject:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_tokens(ro: RequestOutput) -> int:
    return sum(len(o.token_ids) for o in ro.outputs)


def finite(x: float) -> float:
    # JSON has no -inf: clamp like other OpenAI-compatible servers do.
    return max(x, -9999.0) if x == x else -9999.0


def token_str(tokenizer: Tokenizer, token_id: int, lp: Logprob | None = None) -> str:
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _by_rank(pos: PositionLogprobs) -> list[tuple[int, Logprob]]:
    return sorted(pos.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None else 1 << 30))


def prompt_logprobs(ro: RequestOutput) -> list[JsonValue] | None:
    """vLLM's shape: per prompt position None (the first) or {token_id: {logprob, rank, decoded_token}}."""
    if ro.prompt_logprobs is None:
        return None
    return [None if pos is None else
            {str(tid): {"logprob": finite(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
             for tid, lp in pos.items()} for pos in ro.prompt_logprobs]


def chat_logprobs(tokenizer: Tokenizer, token_ids: list[int], logprobs: list[PositionLogprobs],
                  top: int) -> list[JsonValue]:
    content: list[JsonValue] = []
    for tid, pos in zip(token_ids, logprobs):
        chosen = pos.get(tid)
        tok = token_str(tokenizer, tid, chosen)
        top_logprobs: list[JsonValue] = []
        for alt_id, alt in _by_rank(pos)[:top]:
            alt_tok = token_str(tokenizer, alt_id, alt)
            top_logprobs.append({"token": alt_tok, "logprob": finite(alt.logprob),
                                 "bytes": list(alt_tok.encode("utf-8"))})
        content.append({"token": tok, "logprob": finite(chosen.logprob if chosen else float("-inf")),
                        "bytes": list(tok.encode("utf-8")), "top_logprobs": top_logprobs})
    return content


def completion_logprobs(tokenizer: Tokenizer, token_ids: list[int], logprobs: list[PositionLogprobs | None],
                        top: int, text_offset: int = 0) -> dict[str, list[JsonValue]]:
    out: dict[str, list[JsonValue]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = text_offset
    for tid, pos in zip(token_ids, logprobs):
        if pos is None:  # first prompt position: no logprob
            tok = token_str(tokenizer, tid)
            out["tokens"].append(tok)
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
        else:
            chosen = pos.get(tid)
            tok = token_str(tokenizer, tid, chosen)
            out["tokens"].append(tok)
            out["token_logprobs"].append(finite(chosen.logprob if chosen else float("-inf")))
            out["top_logprobs"].append({token_str(tokenizer, i, lp): finite(lp.logprob)
                                        for i, lp in _by_rank(pos)[:top]})
        out["text_offset"].append(offset)
        offset += len(tok)
    return out
