"""JSON data as the type checker sees it: what the API reads from request bodies and writes into responses."""
from __future__ import annotations

from typing import Union

JsonScalar = Union[None, bool, int, float, str]
JsonValue = Union[JsonScalar, list["JsonValue"], dict[str, "JsonValue"]]
JsonObject = dict[str, JsonValue]
