"""Model classes register themselves by their HF `architectures` name."""
from __future__ import annotations

from tokenloom.model.arch_config import UnsupportedModelError

_MODELS: dict[str, type] = {}


def register(name: str):
    def wrap(cls):
        _MODELS[name] = cls
        return cls
    return wrap


def model_class(architecture: str) -> type:
    import tokenloom.model.models  # noqa: F401  # lazy: the model files import this registry to register themselves
    if architecture not in _MODELS:
        raise UnsupportedModelError(f"unsupported architecture {architecture!r} "
                                    f"(supported: {', '.join(sorted(_MODELS))})")
    return _MODELS[architecture]
