"""POST /v1/responses, GET and DELETE /v1/responses/{id}: a Responses request served by the chat machinery.

The conversation (a stored response's items, then this request's `input` items) becomes chat
messages (input_items.py) and the request a ChatCompletionRequest (to_chat.py); from there it is a
chat completion: the same checks and admission, template, sampling parameters, structured outputs
and tool_choice constraints, engine call and reasoning / tool-call parsing (ChatOutputParser). Its
chat-shaped output becomes output items (output_items.py), streamed as typed events (events.py).
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tokenloom.core.json_types import JsonObject
from tokenloom.engine.async_llm import AsyncLLM
from tokenloom.engine.input_processor import encode_text
from tokenloom.entrypoints.openai.errors import APIError, BadRequestError, NotFoundError, engine_error_to_api_error
from tokenloom.entrypoints.openai.formatting import completion_tokens
from tokenloom.entrypoints.openai.protocol import ChatCompletionRequest
from tokenloom.entrypoints.openai.responses.events import ResponseEvents
from tokenloom.entrypoints.openai.responses.input_items import items_to_messages
from tokenloom.entrypoints.openai.responses.output_items import (
    new_id,
    output_items,
    response_object,
    status_of,
    usage,
)
from tokenloom.entrypoints.openai.responses.protocol import ResponsesRequest, parse_input_items
from tokenloom.entrypoints.openai.responses.store import ResponseStore
from tokenloom.entrypoints.openai.responses.to_chat import in_responses_terms, to_chat_request
from tokenloom.entrypoints.openai.server_state import ServerState
from tokenloom.entrypoints.openai.serving_chat import OpenAIServingChat
from tokenloom.entrypoints.openai.streaming import (
    DisconnectAwareStreamingResponse,
    final_output,
    run_cancellable,
    sse,
)
from tokenloom.entrypoints.openai.structured import ChatOutputParser
from tokenloom.outputs import RequestOutput


@dataclass
class Turn:
    """One request being answered: what the response object and the store need besides the output."""

    request: ResponsesRequest
    chat_request: ChatCompletionRequest
    response_id: str
    created_at: int
    prompt_text: str
    conversation: list[JsonObject]  # the chain's input items and this request's
    model: str  # the name the response reports: the adapter's for an adapter request


def sse_event(event: JsonObject) -> str:
    """An SSE frame as OpenAI sends Responses events: the event's type as the SSE event name."""
    return f"event: {event['type']}\n{sse(event)}"


class OpenAIServingResponses(OpenAIServingChat):

    def __init__(self, engine: AsyncLLM, served_model_names: list[str], state: ServerState | None = None,
                 system_fingerprint: str | None = None, store: ResponseStore | None = None) -> None:
        super().__init__(engine, served_model_names, state, system_fingerprint)
        self.store = store if store is not None else ResponseStore()

    # ------------------------------------------------------------------ stored responses

    def stored(self, response_id: str) -> JsonObject:
        entry = self.store.get(response_id)
        if entry is None:
            raise NotFoundError(f"No response found with id '{response_id}'.", param="response_id",
                                code="response_not_found")
        return entry.response

    def delete(self, response_id: str) -> JsonObject:
        if not self.store.delete(response_id):
            raise NotFoundError(f"No response found with id '{response_id}'.", param="response_id",
                                code="response_not_found")
        return {"id": response_id, "object": "response", "deleted": True}

    def history(self, request: ResponsesRequest) -> list[JsonObject]:
        """The conversation `previous_response_id` ends (its instructions are not carried over, as OpenAI's)."""
        if request.previous_response_id is None:
            return []
        entry = self.store.get(request.previous_response_id)
        if entry is None:
            raise BadRequestError(f"Previous response with id '{request.previous_response_id}' not found.",
                                  param="previous_response_id", code="previous_response_not_found")
        return entry.conversation

    # ------------------------------------------------------------------ create

    async def create_response(self, request: ResponsesRequest, raw_request: Request) -> Response:
        history = self.history(request)
        new_items = request.input_items()
        if not history and not new_items:
            raise BadRequestError("input: give at least one input item (or a previous_response_id)", param="input",
                                  code="missing_required_parameter")
        messages = items_to_messages(parse_input_items(history), request.instructions) \
            + items_to_messages(new_items)
        chat_request = to_chat_request(request, messages)
        response_id = new_id("resp")
        try:
            self.check_request(chat_request)
            text, _, gen = await self.generate_chat(chat_request, response_id)
        except APIError as e:
            raise in_responses_terms(e) from None
        conversation = history + [item.model_dump(exclude_none=True) for item in new_items]
        turn = Turn(request, chat_request, response_id, int(time.time()), text, conversation,
                    self.response_model(chat_request.model))
        if request.stream:
            return DisconnectAwareStreamingResponse(self._stream(turn, gen), media_type="text/event-stream",
                                                    headers={"Cache-Control": "no-cache"},
                                                    write_timeout=self.state.stream_write_timeout)
        result = await run_cancellable(raw_request, self._full(turn, gen))
        if result is None:
            return Response(status_code=499)  # the client went away; nobody reads this
        return JSONResponse(result)

    def _finish(self, turn: Turn, status: str, items: list[JsonObject], final: RequestOutput | None) -> JsonObject:
        """The finished response object, stored when the request asks for it."""
        reasoning_tokens = 0
        for item in items:
            parts = item.get("content") if item["type"] == "reasoning" else None
            for part in parts if isinstance(parts, list) else ():
                assert isinstance(part, dict)
                reasoning_tokens += len(encode_text(self.tokenizer, str(part["text"]), add_special_tokens=False))
        counts = usage(len(final.prompt_token_ids), completion_tokens(final), final.num_cached_tokens,
                       reasoning_tokens) if final is not None else None
        body = response_object(turn.request, turn.response_id, turn.model, turn.created_at, status, items, counts)
        body["completed_at"] = int(time.time())
        if turn.request.store:
            self.store.put(body, turn.conversation + items)
        return body

    async def _full(self, turn: Turn, gen: AsyncIterator[RequestOutput]) -> JsonObject:
        final = await final_output(gen)
        o = final.outputs[0]
        parser = ChatOutputParser(turn.chat_request, self.engine.config, turn.prompt_text)
        message, _ = parser.message(o.text, o.finish_reason)
        status = status_of(o.finish_reason)
        return self._finish(turn, status, output_items(message, status), final)

    async def _stream(self, turn: Turn, gen: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
        events = ResponseEvents()
        for event in events.start(response_object(turn.request, turn.response_id, turn.model, turn.created_at,
                                                  "in_progress", [])):
            yield sse_event(event)
        parser = ChatOutputParser(turn.chat_request, self.engine.config, turn.prompt_text)
        final: RequestOutput | None = None
        sent, finish_reason = 0, None
        try:
            async for out in gen:
                final, o = out, out.outputs[0]
                delta = o.text[sent:]
                if not delta and o.finish_reason is None:
                    continue  # tokens held back by the detokenizer go out with the next text
                for event in events.delta(parser.delta(delta, o.finish_reason is not None)):
                    yield sse_event(event)
                sent, finish_reason = len(o.text), o.finish_reason
        except Exception as e:  # noqa: BLE001 - the stream ends with response.failed
            err = engine_error_to_api_error(e)
            for event in events.finish("incomplete"):
                yield sse_event(event)
            failed = response_object(turn.request, turn.response_id, turn.model, turn.created_at, "failed",
                                     events.items, error={"code": "server_error", "message": err.message})
            for event in events.end(failed):
                yield sse_event(event)
            return
        status = status_of(finish_reason)
        for event in events.finish(status):
            yield sse_event(event)
        for event in events.end(self._finish(turn, status, events.items, final)):
            yield sse_event(event)
