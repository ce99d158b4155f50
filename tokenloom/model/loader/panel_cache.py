"""A quantized model's loaded form in one file that later starts memory-map instead of repacking.

The native kernels cannot multiply GGUF blocks in the file's layout: every quantized weight is repacked
once into the column-interleaved panels they read (tokenloom/kernels/quant.py `interleave`), which took
most of a 1B model's load. This file holds exactly that loaded form (each weight's panels with their
float16-compacted, K-quant or float32 scales, and every other parameter), page-aligned, so a warm start maps it
and hands the kernels views of the mapping: nothing is parsed, repacked or copied, the pages are the page
cache's (shared by every process that maps the file), and the start touches no more memory than the
weights. With huge pages on (tokenloom/model/huge_pages.py) the loader then copies the panels into one
huge-page region once, for the faster decode step; `TOKENLOOM_HUGE_PAGES=off` keeps them in the mapping.

The file lives next to the weight cache's entries (`$TOKENLOOM_CACHE_DIR/weights/<key>.panels`, counted
in its size bound and listed by `tokenloom cache`); its key is the GGUF's content fingerprint, the
tensor-parallel rank and size, and LAYOUT. Layout: 8-byte magic, u64 header length, the msgspec JSON
header, then each tensor at a page-aligned offset.
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import mmap
import os
import struct
import time
from dataclasses import asdict
from pathlib import Path
from typing import BinaryIO

import msgspec
import torch
from torch import nn

from tokenloom.model.arch_config import ArchConfig
from tokenloom.model.layers.quantized_linear import QUANTIZED, set_quantized_matmul
from tokenloom.model.layers.quantized_weight import Panels, QuantizedWeight
from tokenloom.model.loader import weight_cache

LAYOUT = 2  # bump when the panel layout (kernels/quant.py interleave) or this file's format changes
# 2: K-quants' scales as int8 sub-block integers and float32 super-block factors
MAGIC = b"TLPANEL1"
PAGE = 4096
HEADER_ROOM = 1 << 20  # before the first tensor; a 3B model's header takes 40 KiB
# Below this share of the mapping on 2 MiB pages the loader copies the weights into anonymous huge pages:
# on a 1B model's panels (1,204 MiB, one thread) a pass took 0.90x the time on huge pages as on 4 KiB ones.
HUGE_IN_PLACE = 0.9
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.uint8, torch.int8, torch.float16, torch.bfloat16,
                                                       torch.float32, torch.int32, torch.int64)}


class StoredTensor(msgspec.Struct, frozen=True):
    dtype: str
    shape: list[int]
    offset: int  # from the start of the file, a multiple of PAGE


class StoredWeight(msgspec.Struct, frozen=True):
    """A module's quantized weight in panels; `alias` names the module whose weight it shares (a tied head)."""
    module: str
    bits: int = 0
    block_size: int = 0
    columns: int = 0
    qpacked: StoredTensor | None = None
    scales: StoredTensor | None = None
    mins: StoredTensor | None = None
    alias: str = ""


class Header(msgspec.Struct, frozen=True):
    arch: msgspec.Raw  # ArchConfig's fields as JSON (the dataclass's annotations are not all msgspec types)
    weights: list[StoredWeight]
    parameters: dict[str, StoredTensor]


def entry_path(path: str, rank: int, world: int) -> Path:
    raw = f"{weight_cache.fingerprint(path)}|panels|tp{rank}/{world}|{LAYOUT}"
    return weight_cache.folder() / f"{hashlib.sha256(raw.encode()).hexdigest()[:32]}{weight_cache.PANELS}"


def quantized_modules(model: nn.Module) -> list[tuple[str, nn.Module, QuantizedWeight]]:
    return [(name, m, m.weight) for name, m in model.named_modules()
            if isinstance(getattr(m, "weight", None), QuantizedWeight)]


class _Writer:
    def __init__(self, f: BinaryIO, offset: int):
        self.f, self.offset = f, offset

    def tensor(self, t: torch.Tensor) -> StoredTensor:
        t = t.contiguous()
        self.offset = (self.offset + PAGE - 1) // PAGE * PAGE
        self.f.seek(self.offset)
        self.f.write(t.view(torch.uint8).reshape(-1).numpy().data)  # the tensor's own bytes, no copy
        stored = StoredTensor(str(t.dtype).removeprefix("torch."), list(t.shape), self.offset)
        self.offset += t.numel() * t.element_size()
        return stored


def store(path: str, rank: int, world: int, arch: ArchConfig, model: nn.Module) -> None:
    """Write `model`'s loaded form (after finalize_quantized, before huge pages) atomically, then trim the
    cache folder; a failure (read-only home, full disk) only costs the next start its repacking."""
    if not weight_cache.enabled():
        return
    target = entry_path(path, rank, world)
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            writer = _Writer(f, HEADER_ROOM)
            weights, seen = [], {}
            for name, _, w in quantized_modules(model):
                if id(w) in seen:
                    weights.append(StoredWeight(name, alias=seen[id(w)]))
                    continue
                seen[id(w)] = name
                p = w.interleaved().panels
                weights.append(StoredWeight(name, w.bits, w.block_size, p.columns, writer.tensor(p.qpacked),
                                            writer.tensor(p.scales), writer.tensor(p.mins)))
            parameters = {name: writer.tensor(p.detach()) for name, p in model.named_parameters()}
            header = msgspec.json.encode(Header(msgspec.Raw(json.dumps(asdict(arch)).encode()), weights, parameters))
            if len(header) + 16 > HEADER_ROOM:
                raise OSError(f"panel cache header of {len(header)} bytes")
            f.seek(0)
            f.write(MAGIC + struct.pack("<Q", len(header)) + header)
        os.replace(tmp, target)
        _drop_from_page_cache(target)  # the next start reads it afresh, into huge folios (on_huge_pages)
        with open(target.with_suffix(".json"), "w") as f:  # what `tokenloom cache` lists
            json.dump({"source": os.path.abspath(path), "dtype": f"quantized panels, tp {rank}/{world}"}, f)
        weight_cache.trim(keep=target.with_suffix(""))
    except OSError:
        tmp.unlink(missing_ok=True)


class MappedPanels:
    """A cache hit: the header, and tensors that are views of the file's private (copy-on-write) mapping."""

    def __init__(self, target: Path):
        with open(target, "rb") as f:
            if f.read(8) != MAGIC:
                raise ValueError(f"{target}: not a panel cache file")
            (length,) = struct.unpack("<Q", f.read(8))
            self.header = msgspec.json.decode(f.read(length), type=Header)
            # Copy-on-write: torch.frombuffer wants a writable buffer; the pages stay the page cache's.
            self.map = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.arch_config = ArchConfig(**json.loads(bytes(self.header.arch)))
        self.bytes = os.path.getsize(target)

    @staticmethod
    def lookup(path: str, rank: int, world: int) -> "MappedPanels | None":
        target = entry_path(path, rank, world)
        if not weight_cache.enabled() or not target.is_file():
            return None
        try:
            hit = MappedPanels(target)
        except (OSError, ValueError, TypeError, msgspec.DecodeError):
            return None
        # Its place in the folder's least-recently-used order. The precise clock, not the file system's
        # coarse one (a tick of a few ms), which gives an entry written a moment earlier the same time.
        now = time.time_ns()
        for used in (target, target.with_suffix(".json")):
            try:
                os.utime(used, ns=(now, now))
            except OSError:
                pass
        return hit

    def tensor(self, stored: StoredTensor) -> torch.Tensor:
        dtype = _DTYPES[stored.dtype]
        count = 1
        for d in stored.shape:
            count *= d
        if count == 0:
            return torch.empty(stored.shape, dtype=dtype)
        return torch.frombuffer(self.map, dtype=dtype, count=count, offset=stored.offset).view(stored.shape)

    def _base(self) -> int:
        return ctypes.addressof(ctypes.c_char.from_buffer(self.map))

    def on_huge_pages(self) -> bool:
        """Ask for the mapping on huge pages, read it in, and say whether the kernel mapped (nearly) all of it
        so: where the filesystem's page cache holds the file in 2 MiB folios (ext4 and XFS on recent Linux,
        read after the advice), the weights get the huge-page decode step in place, without a copy. A file
        whose pages were cached in small folios (just written) maps on 4 KiB pages: False."""
        if not hasattr(mmap, "MADV_HUGEPAGE"):
            return False
        self.map.madvise(mmap.MADV_HUGEPAGE)
        self.map.madvise(getattr(mmap, "MADV_POPULATE_READ", 22))  # Linux 5.14+: fault every page in now
        start, end = self._base(), self._base() + len(self.map)
        rss = pmd = 0
        try:
            with open("/proc/self/smaps") as f:
                inside = False
                for line in f:
                    head = line.split(maxsplit=1)[0]
                    if "-" in head and not head.endswith(":"):
                        low, high = (int(x, 16) for x in head.split("-"))
                        inside = start <= low and high <= end
                    elif inside and head == "Rss:":
                        rss += int(line.split()[1])
                    elif inside and head == "FilePmdMapped:":
                        pmd += int(line.split()[1])
        except OSError:
            return False
        return rss > 0 and pmd >= HUGE_IN_PLACE * rss

    def release(self, t: torch.Tensor) -> None:
        """Drop this process's pages of a tensor of the mapping once it has been copied elsewhere (huge
        pages): the warm start's peak then stays at one copy of the weights. The page cache keeps them."""
        base = self._base()
        start = (t.data_ptr() - base) // PAGE * PAGE
        end = t.data_ptr() - base + t.numel() * t.element_size()
        if 0 <= start < end <= len(self.map):
            self.map.madvise(mmap.MADV_DONTNEED, start, end - start)

    def fill(self, model: nn.Module) -> bool:
        """Put every weight and parameter of the file into `model` (its slots not installed); False when the
        file does not describe this model (then nothing usable was changed: the caller loads the GGUF)."""
        weights = {w.module: w for w in self.header.weights}
        names = {name for name, m in model.named_modules() if isinstance(getattr(m, "weight", None), torch.Tensor)
                 and name in weights}
        params = dict(model.named_parameters())
        if len(names) != len(weights) or set(params) - {f"{n}.weight" for n in names} - set(self.header.parameters):
            return False
        modules = dict(model.named_modules())
        built: dict[str, QuantizedWeight] = {}
        for w in self.header.weights:
            if not w.alias:
                built[w.module] = QuantizedWeight(None, None, None, w.bits, w.block_size, panels=Panels(
                    self.tensor(w.qpacked), self.tensor(w.scales), self.tensor(w.mins), w.columns))
        for name, p in params.items():
            if name in self.header.parameters:
                p.data.copy_(self.tensor(self.header.parameters[name]))
        for w in self.header.weights:
            module = modules[w.module]
            del module._parameters["weight"]
            module.weight = built[w.alias or w.module]
            if hasattr(module, "method"):
                module.method = QUANTIZED
        set_quantized_matmul(model, "exact")
        return True


def _drop_from_page_cache(target: Path) -> None:
    """Written pages sit in the page cache in small folios, which map on 4 KiB pages; dropped, the file is
    read back in 2 MiB folios where the filesystem can."""
    if hasattr(os, "posix_fadvise"):
        fd = os.open(target, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
