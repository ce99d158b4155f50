"""Native CPU kernels, registered as torch ops in the `tokenloom` namespace, with the torch path as fallback.

`load()` builds (or finds cached) the library for the best ISA this CPU has (tokenloom/kernels/build.py),
loads it, then imports every op module here so each registers its fake (meta) implementation.
It runs once per process and answers the same thereafter. When it answers False the engine runs its
plain torch code: `TOKENLOOM_KERNELS=off`, a CPU with neither AVX512-VNNI nor AVX2+FMA, no compiler,
or a failed build (one log line says which). `TOKENLOOM_KERNEL_ISA=avx2` picks the AVX2 build on an
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

import torch

from tokenloom.kernels import cpu_features

logger = logging.getLogger("tokenloom.kernels")

_INFRA = {"build", "cpu_features"}
_state: dict[str, object] = {}


def disabled_by_env() -> bool:
    """`TOKENLOOM_KERNELS=off` (or 0/false/no): build and load nothing, run the torch path."""
    return os.environ.get("TOKENLOOM_KERNELS", "on").strip().lower() in ("off", "0", "false", "no")


def load() -> bool:
    """Load the native ops once; True when they are registered (and fakes too), False for the torch path."""
    if "loaded" in _state:
        return bool(_state["loaded"])
    _state["loaded"] = False
    if disabled_by_env():
        logger.info("native kernels off (TOKENLOOM_KERNELS=off): the torch path runs")
        return False
    from tokenloom.kernels import build  # lazy: `python -m tokenloom.kernels.build` would otherwise load it twice
    isas = cpu_features.supported_isas()
    isa = os.environ.get("TOKENLOOM_KERNEL_ISA") or (isas[0] if isas else None)
    if isa is None:
        logger.warning("native kernels unavailable: this CPU has neither AVX512-VNNI nor AVX2+FMA; "
                       "the torch path runs")
        return False
    if isa not in isas:
        logger.warning("native kernels unavailable: TOKENLOOM_KERNEL_ISA=%s but this CPU runs only %s; "
                       "the torch path runs", isa, ", ".join(isas) or "neither")
        return False
    try:
        path = build.build(isa)
        torch.ops.load_library(str(path))
    except Exception as exc:  # no compiler, no ninja, a compile error: all mean the torch path
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        logger.warning("native kernels unavailable (%s build failed: %s); the torch path runs", isa, first[:200])
        return False
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
