"""On-disk cache of a GGUF model's dequantized weights (or, with the native kernels, its weights repacked
into their quantized form), so a warm start skips parsing, dequantizing and repacking.

Entries live in `$TOKENLOOM_CACHE_DIR/weights` (default `~/.cache/tokenloom/weights`);
`TOKENLOOM_WEIGHT_CACHE=0` turns it off. An entry is keyed by the file's content (its size and a
sample of its bytes) and the runtime dtype, not by its path or time, so a reinstalled or moved copy
of the same model reuses it. The folder is bounded: after each store the least recently used
entries go until the total is under `TOKENLOOM_WEIGHT_CACHE_MAX_GB` (default 2 GiB; the newest
entry always stays). `tokenloom cache` lists what it holds; `tokenloom cache --clear` empties it.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tokenloom.config import ConfigError
from tokenloom.model.arch_config import ArchConfig
from tokenloom.model.layers.quantized_weight import QuantizedWeight

_FORMAT = 3  # 3: Q5_0 weights kept quantized (a format-2 entry holds them dense)
_SAMPLES = 16  # blocks read across the file for its fingerprint
_SAMPLE_BYTES = 64 * 1024
DEFAULT_MAX_GB = 2.0


def enabled() -> bool:
    return os.environ.get("TOKENLOOM_WEIGHT_CACHE", "1") != "0"


def folder() -> Path:
    return Path(os.environ.get("TOKENLOOM_CACHE_DIR") or Path.home() / ".cache" / "tokenloom") / "weights"


def max_bytes() -> int:
    raw = os.environ.get("TOKENLOOM_WEIGHT_CACHE_MAX_GB")
    try:
        gb = float(raw) if raw else DEFAULT_MAX_GB
    except ValueError:
        raise ConfigError(f"TOKENLOOM_WEIGHT_CACHE_MAX_GB={raw!r} is not a number") from None
    return int(gb * 2 ** 30)


def fingerprint(path: str) -> str:
    """Size plus evenly spaced blocks (the first and last included): cheap, and the same for any copy."""
    size = os.path.getsize(path)
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        for i in range(_SAMPLES):
            f.seek(max(0, (size - _SAMPLE_BYTES) * i // (_SAMPLES - 1)))
            h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()


def entry_stem(path: str, dtype: torch.dtype) -> Path:
    raw = f"{fingerprint(path)}|{dtype}|{_FORMAT}"
    return folder() / hashlib.sha256(raw.encode()).hexdigest()[:32]


@dataclass
class Entry:
    """One cached model, as `tokenloom cache` reports it."""

    stem: Path
    source: str
    dtype: str
    bytes: int
    last_used: float


class CachedWeights:
    """A cache hit: the architecture and the tensors, memory-mapped from safetensors."""

    def __init__(self, stem: Path):
        self.stem = stem
        with open(f"{stem}.json") as f:
            meta = json.load(f)
        self.arch_config = ArchConfig(**meta["arch"])
        with safe_open(f"{stem}.safetensors", framework="pt") as f:
            self.num_tensors = len(f.keys())

    @staticmethod
    def lookup(path: str, dtype: torch.dtype) -> "CachedWeights | None":
        if not enabled():
            return None
        stem = entry_stem(path, dtype)
        if os.path.isfile(f"{stem}.json") and os.path.isfile(f"{stem}.safetensors"):
            try:
                hit = CachedWeights(stem)
            except (OSError, ValueError, TypeError, KeyError):
                return None
            _touch(stem)
            return hit
        return None

    def tensors(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        with safe_open(f"{self.stem}.safetensors", framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


PANELS = ".panels"  # a quantized model's loaded form (tokenloom/model/loader/panel_cache.py)
QUANTIZED = "quantized"  # the entry key (in place of a dtype) of a model whose weights stay in blocks
_PART = "#"  # a quantized weight is stored as <name>#<bits>.<block>.<qweight|scales|mins>


def flatten_quantized(tensors: dict) -> dict[str, torch.Tensor]:
    """Tensors and QuantizedWeights by name -> plain tensors by name, for safetensors."""
    flat = {}
    for name, t in tensors.items():
        if isinstance(t, QuantizedWeight):
            for part in ("qweight", "scales", "mins"):
                flat[f"{name}{_PART}{t.bits}.{t.block_size}.{part}"] = getattr(t, part)
        else:
            flat[name] = t
    return flat


def unflatten_quantized(flat: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, object]]:
    """The inverse of flatten_quantized, over a cache entry's tensors."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in flat:
        if _PART not in key:
            yield key, t
            continue
        name, _, rest = key.partition(_PART)
        bits, block, part = rest.split(".")
        got = parts.setdefault(f"{name}{_PART}{bits}.{block}", {})
        got[part] = t
        if len(got) == 3:
            del parts[f"{name}{_PART}{bits}.{block}"]
            yield name, QuantizedWeight(got["qweight"], got["scales"], got["mins"], int(bits), int(block))
    if parts:
        raise ValueError(f"incomplete quantized weights in the cache entry: {sorted(parts)[:3]}")


def _touch(stem: Path) -> None:
    try:
        os.utime(f"{stem}.json")
    except OSError:
        pass


def store(path: str, dtype: torch.dtype | str, arch: ArchConfig, tensors: dict[str, torch.Tensor]) -> None:
    """Write an entry atomically, then trim the folder to its bound; a failure (read-only home, full
    disk) only costs the next start time. `dtype` QUANTIZED: `tensors` may hold QuantizedWeights."""
    if not enabled():
        return
    tensors = flatten_quantized(tensors)
    stem = entry_stem(path, dtype)
    try:
        stem.parent.mkdir(parents=True, exist_ok=True)
        tmp = f"{stem}.{os.getpid()}.tmp"
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp)
        os.replace(tmp, f"{stem}.safetensors")
        with open(f"{tmp}.json", "w") as f:
            json.dump({"arch": asdict(arch), "source": os.path.abspath(path), "dtype": str(dtype).replace(
                "torch.", "")}, f)
        os.replace(f"{tmp}.json", f"{stem}.json")
        trim(keep=stem)
    except OSError:
        pass


def entries() -> list[Entry]:
    """Every entry in the folder, most recently used first (entries of older formats included)."""
    out = []
    for tensors in [*folder().glob("*.safetensors"), *folder().glob(f"*{PANELS}")]:  # PANELS: panel_cache.py
        stem = tensors.with_suffix("")
        meta_path = Path(f"{stem}.json")
        try:
            with open(meta_path) as f:
                meta = json.load(f)
            used = meta_path.stat().st_mtime
        except (OSError, ValueError):
            meta, used = {}, tensors.stat().st_mtime
        size = tensors.stat().st_size + (meta_path.stat().st_size if meta_path.exists() else 0)
        out.append(Entry(stem, meta.get("source", "?") if isinstance(meta, dict) else "?",
                         meta.get("dtype", "?") if isinstance(meta, dict) else "?", size, used))
    return sorted(out, key=lambda e: e.last_used, reverse=True)


def remove(entry: Entry) -> None:
    for suffix in (".safetensors", PANELS, ".json"):
        try:
            os.unlink(f"{entry.stem}{suffix}")
        except FileNotFoundError:
            pass


def trim(keep: Path | None = None, limit: int | None = None) -> list[Entry]:
    """Remove least recently used entries until the folder fits `limit` bytes; returns those removed.
    Leftover temporary files of interrupted stores older than an hour go too."""
    limit = max_bytes() if limit is None else limit
    for tmp in folder().glob("*.tmp*"):
        try:
            if time.time() - tmp.stat().st_mtime > 3600:
                tmp.unlink()
        except OSError:
            pass
    removed = []
    current = entries()
    total = sum(e.bytes for e in current)
    for entry in reversed(current):  # oldest first
        if total <= limit:
            break
        if keep is not None and entry.stem == keep:
            continue
        remove(entry)
        removed.append(entry)
        total -= entry.bytes
    return removed
