"""Native CPU kernels, registered as torch ops in the `tokenloom` namespace, with the torch path as fallback.

`load()` builds (or finds cached) the library for the best ISA this CPU has (tokenloom/kernels/build.py),
loads it, then imports every op module here so each registers its fake (meta) implementation.
It runs once per process and answers the same thereafter. When it answers False the engine runs its
plain torch code: `TOKENLOOM_KERNELS=off`, a CPU with neither AVX512-VNNI nor AVX2+FMA, no compiler,
or a failed build (one log line says which; `status()` keeps it). `TOKENLOOM_KERNEL_ISA=avx2` picks the AVX2 build on an
AVX512 machine (the tests use it to check both builds).

Op convention: each csrc/*.cpp declares its schemas with TORCH_LIBRARY_FRAGMENT(tokenloom, m) and its
CPU kernels with TORCH_LIBRARY_IMPL(tokenloom, CPU, m) (a CUDA build adds TORCH_LIBRARY_IMPL(tokenloom,
CUDA, m) beside it). Each op has a Python module here holding its plain-torch reference and its
`torch.library.register_fake("tokenloom::<op>")`, imported by `load()` once the schemas exist.
"""
from __future__ import annotations

import importlib
import logging
import os
import pkgutil
import shutil
from dataclasses import dataclass

import torch

from tokenloom.kernels import cpu_features

logger = logging.getLogger("tokenloom.kernels")

_INFRA = {"build", "cpu_features"}
_state: dict[str, object] = {}


def disabled_by_env() -> bool:
    """`TOKENLOOM_KERNELS=off` (or 0/false/no): build and load nothing, run the torch path."""
    return os.environ.get("TOKENLOOM_KERNELS", "on").strip().lower() in ("off", "0", "false", "no")


@dataclass(frozen=True)
class KernelStatus:
    """What `load()` found. `expected`: this machine can build the kernels (not turned off, a CPU with one
    of the two ISAs, a C++ compiler), so their absence is a fault: the test suite fails on it."""

    loaded: bool
    isa: str | None  # the loaded build's, None on the torch path
    reason: str  # why the torch path runs ("" when loaded)
    expected: bool

    def describe(self) -> str:
        return f"{self.isa} build loaded" if self.loaded else f"not loaded ({self.reason})"


def compiler() -> str | None:
    """The C++ compiler a build would run (torch's cpp_extension reads $CXX, else `c++`), None when absent."""
    return shutil.which(os.environ.get("CXX") or "c++")


def status() -> KernelStatus:
    """Whether the kernels loaded (loading them now if not tried yet), and if not, why and whether they should
    have."""
    loaded = load()
    reason = str(_state.get("reason", ""))
    expected = loaded or (not disabled_by_env() and bool(cpu_features.supported_isas()) and compiler() is not None)
    return KernelStatus(loaded, isa(), reason, expected)


def _unavailable(reason: str) -> bool:
    _state["reason"] = reason
    logger.warning("native kernels unavailable (%s); the torch path runs", reason)
    return False


def load() -> bool:
    """Load the native ops once; True when they are registered (and fakes too), False for the torch path."""
    if "loaded" in _state:
        return bool(_state["loaded"])
    _state["loaded"] = False
    if disabled_by_env():
        _state["reason"] = "off by request: TOKENLOOM_KERNELS=off"
        logger.info("native kernels off (TOKENLOOM_KERNELS=off): the torch path runs")
        return False
    from tokenloom.kernels import build  # lazy: `python -m tokenloom.kernels.build` would otherwise load it twice
    isas = cpu_features.supported_isas()
    isa = os.environ.get("TOKENLOOM_KERNEL_ISA") or (isas[0] if isas else None)
    if isa is None:
        return _unavailable("this CPU has neither AVX512-VNNI nor AVX2+FMA")
    if isa not in isas:
        return _unavailable(f"TOKENLOOM_KERNEL_ISA={isa} but this CPU runs only {', '.join(isas) or 'neither'}")
    try:
        path = build.build(isa)
        torch.ops.load_library(str(path))
    except Exception as exc:  # no compiler, no ninja, a compile error: all mean the torch path
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return _unavailable(f"{isa} build failed: {first[:200]}")
    _state["loaded"] = True
    _state["isa"] = isa
    _register_op_modules()
    logger.debug("native kernels loaded (%s)", isa)
    return True


def enabled() -> bool:
    """Whether the native ops are in use in this process (loads them on first call). Asked a few hundred
    times a decode step, so the answer once known is one dict lookup."""
    loaded = _state.get("loaded")
    return load() if loaded is None else bool(loaded)


def isa() -> str | None:
    """The ISA of the loaded build, None on the torch path."""
    return _state.get("isa") if load() else None


def _register_op_modules() -> None:
    """Import every op module so its register_fake runs now that the schemas exist."""
    for info in pkgutil.iter_modules(__path__):
        if info.name not in _INFRA and not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}")
