"""Stored responses (``store: true``, OpenAI's default), for ``previous_response_id``, GET and DELETE.

Each entry keeps the response object and the conversation it ends (every input item of the chain
and this response's output items), so a follow-up needs only its own entry: evicting an older
response never breaks a newer one's chain. Memory is bounded two ways, least recently used first:

* `MAX_STORED_BYTES` (64 MiB of JSON): a stored conversation can be as large as the request body
  limit (16 MiB by default), so at least four of the largest fit, and the store stays a small
  part of the API process's memory beside the tokenizer and the model's metadata;
* `MAX_STORED_RESPONSES` (4096): agent loops chain many short turns; the count bounds the
  per-entry overhead when entries are tiny.

An entry larger than the byte limit alone is not stored (its follow-ups get 400, as for an
evicted one). The store lives in the API process: it is gone after a restart, like OpenAI's
responses after their retention.
"""
from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass

from tokenloom.core.json_types import JsonObject

MAX_STORED_BYTES = 64 * 2 ** 20
MAX_STORED_RESPONSES = 4096


@dataclass(frozen=True)
class StoredResponse:
    response: JsonObject
    conversation: list[JsonObject]  # input items of the whole chain, then this response's output items
    size: int


def json_size(value: object) -> int:
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode())


class ResponseStore:
    def __init__(self, max_responses: int = MAX_STORED_RESPONSES, max_bytes: int = MAX_STORED_BYTES) -> None:
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self.total_bytes = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: JsonObject, conversation: list[JsonObject]) -> bool:
        """Keep `response` (False when it alone is over the byte limit), evicting the least recently used."""
        response_id = str(response["id"])
        entry = StoredResponse(response, conversation, json_size(response) + json_size(conversation))
        self.delete(response_id)
        if entry.size > self.max_bytes:
            return False
        self._entries[response_id] = entry
        self.total_bytes += entry.size
        while len(self._entries) > self.max_responses or self.total_bytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.total_bytes -= evicted.size
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self.total_bytes -= entry.size
        return True
