"""What the HTTP app serves and how (`ServerSettings`), apart from the app itself: `tokenloom serve` builds the
settings from its options before the engine process is launched, and imports FastAPI and the routes only
once it is (entrypoints/openai/api_server.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

from tokenloom.entrypoints.openai.batch.settings import BatchSettings
from tokenloom.exposure.connections import ConnectionLimits
from tokenloom.exposure.cors import CorsSettings

DEFAULT_MAX_BODY_BYTES = 16 * 2 ** 20


@dataclass
class ServerSettings:
    served_model_names: list[str] = field(default_factory=list)
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    system_fingerprint: str | None = None
    cors: CorsSettings = field(default_factory=CorsSettings)  # none by default: no cross-origin access
    connections: ConnectionLimits = field(default_factory=ConnectionLimits)  # timeouts and caps (uvicorn's side)
    enable_ui: bool = True  # the web page at / (--no-ui: off)
    allow_runtime_lora_updating: bool = False  # POST /v1/load_lora_adapter and /v1/unload_lora_adapter
    batch: BatchSettings = field(default_factory=BatchSettings)  # /v1/files and /v1/batches
    # Serving inside a training loop (entrypoints/openai/weight_routes.py): off unless asked for.
    enable_weight_updates: bool = False
    enable_sleep_mode: bool = False
