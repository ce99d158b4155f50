"""Read the key/value metadata of a GGUF file without touching its tensors."""
from __future__ import annotations

import struct
from typing import BinaryIO

import numpy as np

from tokenloom.core.json_types import JsonValue

_GGUF_MAGIC = b"GGUF"
_STRING = 8
_ARRAY = 9
_SCALARS: dict[int, str] = {
    0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d",
}


class GGUFMetadataError(ValueError):
    """The file is not a readable GGUF file."""


def read_gguf_metadata(path: str, prefix: str = "") -> dict[str, JsonValue]:
    """Return the metadata entries of the GGUF at `path` whose keys start with `prefix`.

    Numeric arrays come back as lists of Python numbers, strings as `str`.
    """
    try:
        with open(path, "rb") as f:
            return _read(f, prefix)
    except (struct.error, UnicodeDecodeError, ValueError, MemoryError) as e:
        if isinstance(e, GGUFMetadataError):
            raise
        raise GGUFMetadataError(f"corrupt GGUF metadata ({e})") from e


def _read(f: BinaryIO, prefix: str) -> dict[str, JsonValue]:
    if f.read(4) != _GGUF_MAGIC:
        raise GGUFMetadataError("not a GGUF file (bad magic)")
    (version,) = struct.unpack("<I", _exact(f, 4))
    if version not in (2, 3):
        raise GGUFMetadataError(f"unsupported GGUF version {version}")
    _tensor_count, kv_count = struct.unpack("<QQ", _exact(f, 16))
    out: dict[str, JsonValue] = {}
    for _ in range(kv_count):
        key = _string(f)
        (vtype,) = struct.unpack("<I", _exact(f, 4))
        value = _value(f, vtype)
        if key.startswith(prefix):
            out[key] = value
    return out


def _exact(f: BinaryIO, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise GGUFMetadataError("truncated GGUF metadata")
    return data


def _string(f: BinaryIO) -> str:
    (n,) = struct.unpack("<Q", _exact(f, 8))
    return _exact(f, n).decode("utf-8")


def _value(f: BinaryIO, vtype: int) -> JsonValue:
    if vtype == _STRING:
        return _string(f)
    if vtype in _SCALARS:
        fmt = "<" + _SCALARS[vtype]
        return struct.unpack(fmt, _exact(f, struct.calcsize(fmt)))[0]
    if vtype == _ARRAY:
        itype, n = struct.unpack("<IQ", _exact(f, 12))
        if itype == _STRING:
            return [_string(f) for _ in range(n)]
        if itype in _SCALARS:
            dtype = np.dtype("<" + _SCALARS[itype])
            return np.frombuffer(_exact(f, dtype.itemsize * n), dtype=dtype).tolist()
        return [_value(f, itype) for _ in range(n)]
    raise GGUFMetadataError(f"unknown GGUF value type {vtype}")
