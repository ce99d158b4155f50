"""`--lora-modules` (serve) and `--lora` (generate, chat): adapters named on the command line, as vLLM spells
them: `name=path`, or a JSON object `{"name": ..., "path": ..., "base_model_name": ...}`."""
from __future__ import annotations

import json
from dataclasses import dataclass

from tokenloom.config import ConfigError
from tokenloom.env_vars import env_flag

# vLLM's opt-in for POST /v1/load_lora_adapter and /v1/unload_lora_adapter; tokenloom's own is the
# --allow-runtime-lora-updating flag (TOKENLOOM_ALLOW_RUNTIME_LORA_UPDATING).
VLLM_RUNTIME_UPDATES_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


@dataclass(frozen=True)
class LoRAModule:
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(value: str, flag: str = "--lora-modules") -> LoRAModule:
    value = value.strip()
    if value.startswith("{"):
        try:
            obj = json.loads(value)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{flag}: {value!r} is not valid JSON: {e}") from None
        unknown = sorted(set(obj) - {"name", "path", "base_model_name"}) if isinstance(obj, dict) else []
        if not isinstance(obj, dict) or unknown or not isinstance(obj.get("name"), str) \
                or not isinstance(obj.get("path"), str):
            raise ConfigError(f"{flag}: a JSON adapter is {{\"name\": ..., \"path\": ..., \"base_model_name\": ...}} "
                              f"(got {value!r})")
        module = LoRAModule(obj["name"], obj["path"], obj.get("base_model_name"))
    else:
        name, sep, path = value.partition("=")
        if not sep:
            raise ConfigError(f"{flag}: {value!r} is not name=path (nor a JSON object)")
        module = LoRAModule(name.strip(), path.strip())
    if not module.name or not module.path:
        raise ConfigError(f"{flag}: {value!r} needs both a name and a path")
    return module


def parse_lora_modules(values: list[str] | None, flag: str = "--lora-modules") -> list[LoRAModule]:
    modules = [parse_lora_module(v, flag) for v in values or []]
    names = [m.name for m in modules]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise ConfigError(f"{flag}: adapter name {duplicate!r} is given twice")
    return modules


def runtime_updates_from_env() -> bool:
    return env_flag(VLLM_RUNTIME_UPDATES_ENV)
