"""POST /v1/messages and /v1/messages/count_tokens on the chat machinery.

The request is translated to a chat request (translate.py) and goes the chat path's way: the same
checks and admission, template rendering, sampling params, tool_choice and output constraints, engine
call, cancellation on disconnect; the output is parsed by the chat output parser and written back as
content blocks (blocks.py) or Anthropic's events (stream_events.py).
"""
from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tokenloom.core.json_types import JsonObject
from tokenloom.entrypoints.anthropic.blocks import content_blocks, message_body, message_id, stop_reason, usage
from tokenloom.entrypoints.anthropic.errors import error_event, to_api_error
from tokenloom.entrypoints.anthropic.protocol import MessagesCountRequest, MessagesRequest
from tokenloom.entrypoints.anthropic.stream_events import MessageEventStream, sse_event
from tokenloom.entrypoints.anthropic.translate import to_chat_request
from tokenloom.entrypoints.openai.formatting import completion_tokens
from tokenloom.entrypoints.openai.limits import check_request_limits, check_text
from tokenloom.entrypoints.openai.protocol import ChatCompletionRequest
from tokenloom.entrypoints.openai.serving_chat import OpenAIServingChat
from tokenloom.entrypoints.openai.streaming import DisconnectAwareStreamingResponse, final_output, run_cancellable
from tokenloom.entrypoints.openai.structured import ChatOutputParser
from tokenloom.outputs import RequestOutput


class AnthropicServingMessages(OpenAIServingChat):

    def chat_request(self, request: MessagesCountRequest) -> ChatCompletionRequest:
        return to_chat_request(request, reasoning_parser=bool(getattr(self.engine.config, "reasoning_parser", None)))

    async def count_tokens(self, request: MessagesCountRequest) -> JsonObject:
        """The prompt's token count: the chat template rendered with the system prompt, turns and tools."""
        self.check_model(request.model)
        chat_request = self.chat_request(request)
        check_text(chat_request)
        check_request_limits(chat_request, self.engine.max_model_len)
        _, prompt_ids = await self.render_prompt_async(chat_request)
        return {"input_tokens": len(prompt_ids)}

    async def create_message(self, request: MessagesRequest, raw_request: Request) -> Response:
        chat_request = self.chat_request(request)
        self.check_request(chat_request)
        msg_id = message_id()
        _, prompt_ids, gen = await self.generate_chat(chat_request, msg_id)
        if request.stream:
            events = self._events(request, chat_request, gen, msg_id, len(prompt_ids))
            return DisconnectAwareStreamingResponse(events, media_type="text/event-stream",
                                                    headers={"Cache-Control": "no-cache"},
                                                    write_timeout=self.state.stream_write_timeout)
        body = await run_cancellable(raw_request, self._message(request, chat_request, gen, msg_id))
        if body is None:
            return Response(status_code=499)  # the client went away; nobody reads this
        return JSONResponse(body)

    async def _message(self, request: MessagesRequest, chat_request: ChatCompletionRequest,
                       gen: AsyncIterator[RequestOutput], msg_id: str) -> JsonObject:
        final = await final_output(gen, to_api_error)
        o = final.outputs[0]
        message, _ = ChatOutputParser(chat_request, self.engine.config, final.prompt or "").message(
            o.text, o.finish_reason)
        blocks = content_blocks(message)
        used_tools = any(isinstance(b, dict) and b.get("type") == "tool_use" for b in blocks)
        reason, sequence = stop_reason(o.finish_reason, o.stop_reason, used_tools, request.stop_sequences)
        return message_body(msg_id, request.model, blocks, reason, sequence,
                            usage(len(final.prompt_token_ids), completion_tokens(final), final.num_cached_tokens))

    async def _events(self, request: MessagesRequest, chat_request: ChatCompletionRequest,
                      gen: AsyncIterator[RequestOutput], msg_id: str, prompt_tokens: int) -> AsyncIterator[str]:
        stream = MessageEventStream(msg_id, request.model)
        for event in stream.start(prompt_tokens):
            yield sse_event(event)
        parser: ChatOutputParser | None = None
        sent = 0
        try:
            async for out in gen:
                o = out.outputs[0]
                delta_text = o.text[sent:]
                if not delta_text and o.finish_reason is None:
                    continue  # tokens held back by the detokenizer go out with the next text
                sent = len(o.text)
                parser = parser or ChatOutputParser(chat_request, self.engine.config, out.prompt or "")
                for event in stream.feed(parser.delta(delta_text, o.finish_reason is not None)):
                    yield sse_event(event)
                if o.finish_reason is not None:
                    reason, sequence = stop_reason(o.finish_reason, o.stop_reason, stream.used_tools,
                                                   request.stop_sequences)
                    counts = usage(len(out.prompt_token_ids), completion_tokens(out), out.num_cached_tokens)
                    for event in stream.finish(reason, sequence, counts):
                        yield sse_event(event)
                    return
        except Exception as e:  # noqa: BLE001 - the stream ends with an error event
            yield error_event(e)
