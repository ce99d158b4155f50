"""Reading one typed field out of a HF `vision_config` dict, with a `ConfigError` that names it."""
from __future__ import annotations

from collections.abc import Mapping

from tokenloom.config import ConfigError
from tokenloom.core.json_types import JsonValue


def int_field(config: Mapping[str, JsonValue], name: str, default: int | None = None) -> int:
    value = config.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"vision_config.{name} must be an integer, got {value!r}")
    if value <= 0:
        raise ConfigError(f"vision_config.{name} must be positive, got {value}")
    return value


def float_field(config: Mapping[str, JsonValue], name: str, default: float) -> float:
    value = config.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"vision_config.{name} must be a number, got {value!r}")
    return float(value)


def str_field(config: Mapping[str, JsonValue], name: str, default: str) -> str:
    value = config.get(name, default)
    if not isinstance(value, str):
        raise ConfigError(f"vision_config.{name} must be a string, got {value!r}")
    return value


def int_list_field(config: Mapping[str, JsonValue], name: str, default: tuple[int, ...]) -> tuple[int, ...]:
    value = config.get(name, list(default))
    if not isinstance(value, (list, tuple)) or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
        raise ConfigError(f"vision_config.{name} must be a list of integers, got {value!r}")
    return tuple(value)
