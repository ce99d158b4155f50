"""Compile every C++ source under csrc/ into one shared library per instruction set, cached.

One library holds all ops (each source registers its own into the `tokenloom` op namespace),
so a build is one ninja run. The same sources build for both ISAs: the code picks its
intrinsics with `#ifdef __AVX512VNNI__` and friends, set by the flags below.

Cache: `$TOKENLOOM_KERNEL_CACHE` (default ~/.cache/tokenloom/kernels)/<isa>-torch<version>-<hash>,
the hash over every source and header plus the flags, so a changed source or a new torch
builds afresh and an unchanged one loads at once. Sources include ATen and torch/library.h
only: torch/extension.h pulls in pybind11 and costs ~26 s a file against ~10 s (measured).
"""
from __future__ import annotations

import hashlib
import os
import sys
import time
from pathlib import Path

import torch

from tokenloom.kernels import disabled_by_env
from tokenloom.kernels.cpu_features import best_isa

CSRC = Path(__file__).parent / "csrc"

FLAGS = {
    "avx512": ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx512bf16", "-mavx2",
               "-mfma", "-mf16c"],
    "avx2": ["-O3", "-mavx2", "-mfma", "-mf16c"],
}
COMMON_FLAGS = ["-fopenmp", "-DNDEBUG", "-Wno-unused-function"]


def cache_root() -> Path:
    return Path(os.environ.get("TOKENLOOM_KERNEL_CACHE") or Path.home() / ".cache" / "tokenloom" / "kernels")


def sources() -> list[Path]:
    return sorted(CSRC.glob("*.cpp"))


def source_hash(isa: str) -> str:
    h = hashlib.sha256(" ".join(FLAGS[isa] + COMMON_FLAGS).encode())
    for path in sorted(CSRC.glob("*.cpp")) + sorted(CSRC.glob("*.h")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def library_name(isa: str) -> str:
    return f"tokenloom_kernels_{isa}_{source_hash(isa)}"


def build_dir(isa: str) -> Path:
    version = torch.__version__.replace("+", "_")
    return cache_root() / f"{isa}-torch{version}-{source_hash(isa)}"


def library_path(isa: str) -> Path:
    return build_dir(isa) / f"{library_name(isa)}.so"


def build(isa: str, verbose: bool = False) -> Path:
    """The built library for ``isa`` (compiled now unless cached); raises on a failed build."""
    if isa not in FLAGS:
        raise ValueError(f"unknown ISA {isa!r} (one of {', '.join(FLAGS)})")
    path = library_path(isa)
    if path.exists():
        return path
    srcs = sources()
    if not srcs:
        raise FileNotFoundError(f"no kernel sources in {CSRC}")
    from torch.utils.cpp_extension import load  # lazy: the C++ extension toolchain, only for a build
    put_venv_ninja_on_path()
    os.environ.setdefault("MAX_JOBS", str(max(1, min(4, os.cpu_count() or 1))))  # ninja's default oversubscribes
    directory = build_dir(isa)
    directory.mkdir(parents=True, exist_ok=True)
    _drop_stale_lock(directory)
    load(name=library_name(isa), sources=[str(s) for s in srcs], extra_cflags=FLAGS[isa] + COMMON_FLAGS,
         extra_ldflags=["-fopenmp"], extra_include_paths=[str(CSRC)], build_directory=str(directory),
         is_python_module=False, verbose=verbose)
    return path


STALE_LOCK_SECONDS = 900  # a cold build takes ~40 s alone, a few minutes on a loaded 2-core machine


def _drop_stale_lock(directory: Path) -> None:
    """torch waits forever on the lock file of a build that was killed: drop one far older than any build."""
    lock = directory / "lock"
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_SECONDS:
            lock.unlink()
    except FileNotFoundError:
        pass


def put_venv_ninja_on_path() -> None:
    """pip's `ninja` lands beside the interpreter, which is not on PATH when .venv/bin/python runs unactivated."""
    bindir = os.path.dirname(sys.executable)
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")


def main() -> int:
    """`python -m tokenloom.kernels.build [isa]`: build (or find cached) the library for this CPU."""
    if disabled_by_env():
        print("tokenloom kernels: TOKENLOOM_KERNELS=off, nothing built")
        return 0
    args = [a for a in sys.argv[1:] if not a.startswith("-")]
    isa = args[0] if args else best_isa()
    if isa is None:
        print("tokenloom kernels: this CPU has neither AVX512-VNNI nor AVX2+FMA; the torch path runs")
        return 0
    print(build(isa, verbose="-v" in sys.argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
