"""OpenAI's File and Batch objects: what the store keeps of each, and their JSON shape in the API."""
from __future__ import annotations

import time
import uuid
from dataclasses import asdict, dataclass, field, fields

from tokenloom.core.json_types import JsonObject

# Batch statuses, OpenAI's. A batch in one of ACTIVE_STATUSES is resumed when the server starts.
VALIDATING, IN_PROGRESS, FINALIZING, COMPLETED = "validating", "in_progress", "finalizing", "completed"
FAILED, EXPIRED, CANCELLING, CANCELLED = "failed", "expired", "cancelling", "cancelled"
ACTIVE_STATUSES = (VALIDATING, IN_PROGRESS, FINALIZING, CANCELLING)
FILE_PURPOSES = ("batch", "batch_output", "fine-tune", "assistants", "vision", "user_data", "evals")
COMPLETION_WINDOWS = ("24h",)
COMPLETION_WINDOW_S = 24 * 3600


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex[:24]}"


def new_batch_id() -> str:
    return f"batch_{uuid.uuid4().hex[:24]}"


@dataclass
class FileRecord:
    id: str
    purpose: str
    filename: str
    bytes: int
    created_at: int = field(default_factory=lambda: int(time.time()))

    def to_api(self) -> JsonObject:
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed",
                "status_details": None, "expires_at": None}


@dataclass
class BatchRecord:
    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    metadata: dict[str, str] | None = None
    status: str = VALIDATING
    total: int = 0
    created_at: int = field(default_factory=lambda: int(time.time()))
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list[JsonObject] | None = None

    @property
    def expires_at(self) -> int:
        return self.created_at + COMPLETION_WINDOW_S

    def to_json(self) -> JsonObject:
        return asdict(self)

    @classmethod
    def from_json(cls, data: JsonObject) -> BatchRecord:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})  # type: ignore[arg-type]

    def to_api(self, completed: int, failed: int) -> JsonObject:
        body: JsonObject = {k: v for k, v in asdict(self).items() if k not in ("total", "errors")}
        body.update({"object": "batch", "expires_at": self.expires_at, "expired_at": None,
                     "errors": {"object": "list", "data": self.errors} if self.errors else None,
                     "request_counts": {"total": self.total, "completed": completed, "failed": failed}})
        return body
