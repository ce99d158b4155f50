"""JSON values: what `json.loads` returns and `json.dumps` takes (request bodies, tool calls, schemas).

Used where a value really is free-form JSON; a value with a known shape gets its own struct."""
from __future__ import annotations

from typing import TypeAlias, Union

JsonValue: TypeAlias = Union[None, bool, int, float, str, list["JsonValue"], dict[str, "JsonValue"]]
JsonObject: TypeAlias = dict[str, JsonValue]
