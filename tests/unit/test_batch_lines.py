"""The batch JSONL format without a server: checking input lines, the URL table, output lines."""
from __future__ import annotations

import json

import pytest

from tokenloom.entrypoints.openai.batch.endpoints import BATCH_ENDPOINTS, HandlerAnswer
from tokenloom.entrypoints.openai.batch.lines import (
    BatchLine,
    LineError,
    answer_line,
    error_line,
    line_succeeded,
    parse_line,
    parse_lines,
    split_lines,
)
from tokenloom.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from tokenloom.entrypoints.openai.serving_chat import OpenAIServingChat
from tokenloom.entrypoints.openai.serving_engine import OpenAIServing

URLS = set(BATCH_ENDPOINTS)
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def line(**fields) -> bytes:
    base = {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": CHAT}
    base.update(fields)
    return json.dumps({k: v for k, v in base.items() if v is not None}).encode()


def parse(raw: bytes, **kw) -> BatchLine | LineError:
    return parse_line(raw, 0, urls=URLS, max_line_bytes=kw.pop("max_line_bytes", 10_000), **kw)


def test_the_url_table_names_each_endpoint_once_with_its_body_model_and_handler():
    assert set(BATCH_ENDPOINTS) == {"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses",
                                    "/v1/messages"}
    assert BATCH_ENDPOINTS["/v1/chat/completions"].request_model is ChatCompletionRequest
    assert BATCH_ENDPOINTS["/v1/completions"].request_model is CompletionRequest
    assert BATCH_ENDPOINTS["/v1/chat/completions"].serving is OpenAIServingChat
    for endpoint in BATCH_ENDPOINTS.values():
        assert issubclass(endpoint.serving, OpenAIServing) and callable(getattr(endpoint.serving, endpoint.method))


def test_a_good_line_parses():
    item = parse(line())
    assert item == BatchLine(0, "r1", "/v1/chat/completions", CHAT)


def test_method_defaults_to_post():
    assert isinstance(parse(line(method=None)), BatchLine)


@pytest.mark.parametrize("raw, code", [
    (b"not json", "invalid_json"),
    (b"[1, 2]", "invalid_json"),
    (line(custom_id=None), "missing_custom_id"),
    (line(custom_id=""), "missing_custom_id"),
    (line(custom_id=5), "missing_custom_id"),
    (line(custom_id="x" * 600), "invalid_custom_id"),
    (line(method="GET"), "invalid_method"),
    (line(url="/v1/models"), "invalid_url"),
    (line(body=None), "invalid_body"),
    (line(body="text"), "invalid_body"),
])
def test_bad_lines_become_errors_naming_the_line(raw, code):
    item = parse(raw)
    assert isinstance(item, LineError) and item.code == code and item.message.startswith("line 1:")


def test_a_line_over_the_length_limit_is_an_error():
    item = parse(line(), max_line_bytes=20)
    assert isinstance(item, LineError) and item.code == "line_too_long" and "20" in item.message


def test_a_line_for_another_endpoint_than_the_batch_is_an_error():
    item = parse(line(url="/v1/completions"), endpoint="/v1/chat/completions")
    assert isinstance(item, LineError) and item.code == "mismatched_url" and item.custom_id == "r1"


def test_blank_lines_are_skipped_and_crlf_accepted():
    content = line(custom_id="a") + b"\r\n\n  \n" + line(custom_id="b") + b"\n"
    items = parse_lines(split_lines(content), urls=URLS, max_line_bytes=10_000)
    assert [i.custom_id for i in items] == ["a", "b"] and all(isinstance(i, BatchLine) for i in items)


def test_a_repeated_custom_id_is_an_error_on_the_later_line():
    items = parse_lines([line(), line(), b"{"], urls=URLS, max_line_bytes=10_000)
    assert isinstance(items[0], BatchLine)
    assert isinstance(items[1], LineError) and items[1].code == "duplicate_custom_id"
    assert [i.index for i in items] == [0, 1, 2]


def test_an_answered_line_carries_the_response():
    ok = answer_line(BatchLine(0, "r1", "/v1/chat/completions", CHAT),
                     HandlerAnswer(200, {"id": "chatcmpl-1", "choices": []}))
    assert ok["custom_id"] == "r1" and ok["error"] is None and ok["id"].startswith("batch_req_")
    assert ok["response"] == {"status_code": 200, "request_id": "chatcmpl-1", "body": {"id": "chatcmpl-1",
                                                                                          "choices": []}}
    assert line_succeeded(ok)
    rejected = answer_line(BatchLine(1, "r2", "/v1/completions", {}),
                           HandlerAnswer(400, {"error": {"message": "bad", "type": "invalid_request_error",
                                                         "param": "prompt", "code": None}}))
    assert rejected["response"]["status_code"] == 400 and not line_succeeded(rejected)


def test_an_unsendable_line_has_an_error_and_no_response():
    out = error_line(LineError(3, None, "invalid_json", "line 4: not valid JSON"))
    assert out["response"] is None and out["custom_id"] is None
    assert out["error"] == {"code": "invalid_json", "message": "line 4: not valid JSON"}
    assert not line_succeeded(out)
