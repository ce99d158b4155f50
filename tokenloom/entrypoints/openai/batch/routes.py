"""/v1/files and /v1/batches (OpenAI's Files and Batch APIs), backed by the on-disk store.

`register_batch_routes` opens the store, builds the runner (which resumes unfinished batches as soon as
the event loop runs) and adds the routes; with the web page on, the engine view lists the batches.
Limits: the upload size (413 from the body guard, which lets multipart bodies through on /v1/files
only), requests per batch and line length (400 naming the field), metadata as OpenAI's (16 pairs).
"""
from __future__ import annotations

import asyncio
from typing import Optional

from fastapi import FastAPI, Query, Request
from fastapi.responses import Response
from pydantic import Field, field_validator

from tokenloom.core.json_types import JsonObject
from tokenloom.engine.async_llm import AsyncLLM
from tokenloom.entrypoints.openai.batch.endpoints import EndpointCaller
from tokenloom.entrypoints.openai.batch.lines import split_lines
from tokenloom.entrypoints.openai.batch.multipart_form import MultipartError, parse_form
from tokenloom.entrypoints.openai.batch.objects import (
    ACTIVE_STATUSES,
    COMPLETION_WINDOWS,
    FILE_PURPOSES,
    IN_PROGRESS,
    BatchRecord,
    new_batch_id,
)
from tokenloom.entrypoints.openai.batch.runner import BatchRunner
from tokenloom.entrypoints.openai.batch.settings import BatchSettings
from tokenloom.entrypoints.openai.batch.store import BatchStore
from tokenloom.entrypoints.openai.errors import APIError, BadRequestError, NotFoundError
from tokenloom.entrypoints.openai.protocol import OpenAIBaseModel
from tokenloom.entrypoints.openai.server_state import ServerState

# OpenAI's metadata limits: 16 pairs, keys up to 64 characters, values up to 512.
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
MAX_LIST_LIMIT = 10_000


class CreateBatchRequest(OpenAIBaseModel):
    input_file_id: str = Field(..., min_length=1, max_length=256)
    endpoint: str = Field(..., max_length=256)
    completion_window: str = Field("24h", max_length=16)
    metadata: Optional[dict[str, str]] = Field(None, max_length=MAX_METADATA_PAIRS)

    @field_validator("metadata")
    @classmethod
    def _check_metadata(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        for key, value in (v or {}).items():
            if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
                raise ValueError(f"metadata keys are at most {MAX_METADATA_KEY} characters and values at most "
                                 f"{MAX_METADATA_VALUE}")
        return v


def _page(items: list[JsonObject], limit: int, has_more: bool) -> JsonObject:
    data = items[:limit]
    return {"object": "list", "data": data, "has_more": has_more,
            "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None}


def register_batch_routes(app: FastAPI, engine: AsyncLLM, settings: BatchSettings, state: ServerState,
                          served_model_names: list[str], system_fingerprint: str | None = None) -> BatchRunner:
    store = BatchStore(settings.store_dir)
    caller = EndpointCaller(engine, served_model_names, state, system_fingerprint)
    runner = BatchRunner(store, caller, settings, state)
    app.state.batch_runner = runner
    limits = dict(getattr(app.state, "multipart_limits", None) or {})
    limits["/v1/files"] = settings.max_upload_bytes
    app.state.multipart_limits = limits
    tracker = getattr(app.state, "ui_status", None)
    if tracker is not None:
        tracker.sections["batches"] = runner.summary
    try:
        asyncio.get_running_loop().call_soon(runner.resume)
    except RuntimeError:  # built outside an event loop (tests): resumed on the first batch call
        pass

    def file_or_404(file_id: str):
        record = store.get_file(file_id)
        if record is None:
            raise NotFoundError(f"No such File object: {file_id}", param="file_id", code="file_not_found")
        return record

    def batch_or_404(batch_id: str) -> BatchRecord:
        runner.resume()
        batch = store.get_batch(batch_id)
        if batch is None:
            raise NotFoundError(f"No such Batch object: {batch_id}", param="batch_id", code="batch_not_found")
        return batch

    def batch_api(batch: BatchRecord) -> JsonObject:
        return batch.to_api(*store.result_counts(batch.id))

    # ------------------------------------------------------------------ files

    @app.post("/v1/files")
    async def upload_file(request: Request):
        try:
            form = parse_form(request.headers.get("content-type", ""), await request.body())
        except MultipartError as e:
            raise BadRequestError(f"{e}: send the file as multipart/form-data with fields 'file' and 'purpose'",
                                  param="file", code="invalid_request") from None
        part, purpose = form.get("file"), form.get("purpose")
        if part is None:
            raise BadRequestError("the 'file' field is missing", param="file", code="missing_required_parameter")
        if purpose is None:
            raise BadRequestError("the 'purpose' field is missing", param="purpose",
                                  code="missing_required_parameter")
        purpose_text = purpose.content.decode("utf-8", "replace").strip()
        if purpose_text not in FILE_PURPOSES:
            raise BadRequestError(f"purpose must be one of {', '.join(FILE_PURPOSES)}, got {purpose_text!r}",
                                  param="purpose", code="invalid_value")
        if len(part.content) > settings.max_upload_bytes:
            raise BadRequestError(f"the file has {len(part.content)} bytes; the limit is {settings.max_upload_bytes}",
                                  param="file", code="file_too_large")
        if purpose_text == "batch":
            lines = len(split_lines(part.content))
            if lines > settings.max_requests:
                raise BadRequestError(f"the file has {lines} lines; a batch takes at most {settings.max_requests}",
                                      param="file", code="too_many_requests")
        filename = (part.filename or "upload.jsonl")[:256]
        return store.add_file(purpose_text, filename, part.content).to_api()

    @app.get("/v1/files")
    async def list_files(purpose: Optional[str] = Query(None, max_length=64),
                         limit: int = Query(MAX_LIST_LIMIT, ge=1, le=MAX_LIST_LIMIT),
                         after: Optional[str] = Query(None, max_length=256)):
        files = store.list_files(purpose, limit + 1, after)
        return _page([f.to_api() for f in files], limit, len(files) > limit)

    @app.get("/v1/files/{file_id}")
    async def get_file(file_id: str):
        return file_or_404(file_id).to_api()

    @app.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str):
        record = file_or_404(file_id)
        content = store.file_content(file_id) or b""
        return Response(content, media_type="application/octet-stream",
                        headers={"Content-Disposition": f'attachment; filename="{record.filename}"'})

    @app.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str):
        file_or_404(file_id)
        store.delete_file(file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    # ------------------------------------------------------------------ batches

    @app.post("/v1/batches")
    async def create_batch(request: CreateBatchRequest):
        runner.resume()
        if request.endpoint not in caller.endpoints:
            raise BadRequestError(f"endpoint must be one of {', '.join(caller.endpoints)}, got "
                                  f"{request.endpoint!r}", param="endpoint", code="invalid_value")
        if request.completion_window not in COMPLETION_WINDOWS:
            raise BadRequestError(f"completion_window must be one of {', '.join(COMPLETION_WINDOWS)}",
                                  param="completion_window", code="invalid_value")
        record = store.get_file(request.input_file_id)
        if record is None:
            raise NotFoundError(f"No such File object: {request.input_file_id}", param="input_file_id",
                                code="file_not_found")
        if record.purpose != "batch":
            raise BadRequestError(f"the input file's purpose is {record.purpose!r}, not 'batch'",
                                  param="input_file_id", code="invalid_value")
        lines = len(split_lines(store.file_content(record.id) or b""))
        if lines == 0:
            raise BadRequestError("the input file has no requests", param="input_file_id", code="empty_file")
        if lines > settings.max_requests:
            raise BadRequestError(f"the input file has {lines} lines; a batch takes at most {settings.max_requests}",
                                  param="input_file_id", code="too_many_requests")
        batch = BatchRecord(new_batch_id(), request.endpoint, record.id, request.completion_window,
                            request.metadata, status=IN_PROGRESS, total=lines)
        batch.in_progress_at = batch.created_at
        store.save_batch(batch)
        runner.submit(batch)
        return batch_api(batch)

    @app.get("/v1/batches")
    async def list_batches(limit: int = Query(20, ge=1, le=MAX_LIST_LIMIT),
                           after: Optional[str] = Query(None, max_length=256)):
        runner.resume()
        batches = store.list_batches(limit + 1, after)
        return _page([batch_api(b) for b in batches], limit, len(batches) > limit)

    @app.get("/v1/batches/{batch_id}")
    async def get_batch(batch_id: str):
        return batch_api(batch_or_404(batch_id))

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str):
        batch = batch_or_404(batch_id)
        if batch.status not in ACTIVE_STATUSES:
            raise APIError(f"cannot cancel a batch whose status is {batch.status}", status_code=409,
                           code="batch_not_cancellable")
        return batch_api(runner.cancel(batch))

    return runner
