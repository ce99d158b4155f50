"""POST /v1/chat/completions: chat template -> token ids -> engine -> chat.completion(.chunk)."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from PIL import Image

from tokenloom.core.json_types import JsonObject
from tokenloom.engine.input_processor import encode_text
from tokenloom.entrypoints.openai.errors import BadRequestError
from tokenloom.entrypoints.openai.formatting import chat_logprobs, completion_tokens, prompt_logprobs, usage_body
from tokenloom.entrypoints.openai.protocol import ChatCompletionRequest, TokenizeRequest
from tokenloom.entrypoints.openai.serving_engine import OpenAIServing
from tokenloom.entrypoints.openai.streaming import (
    SSE_DONE,
    DisconnectAwareStreamingResponse,
    final_output,
    run_cancellable,
    sse,
    stream_error_chunk,
)
from tokenloom.entrypoints.openai.structured import ChatOutputParser, apply_constraints, template_tools
from tokenloom.multimodal.chat_parts import ImageRef, split_image_parts
from tokenloom.multimodal.errors import ImageInputError
from tokenloom.multimodal.image_source import image_bytes
from tokenloom.outputs import RequestOutput
from tokenloom.tokenizer.chat_template import ChatTemplateError
from tokenloom.tokenizer.template_process import render_untrusted

# Names the renderer takes itself: chat_template_kwargs may not override them.
_RESERVED_TEMPLATE_KWARGS = {"messages", "add_generation_prompt", "tools", "documents", "continue_final_message",
                             "chat_template", "template", "special_tokens"}


class OpenAIServingChat(OpenAIServing):

    def render_prompt(self, request: ChatCompletionRequest | TokenizeRequest) -> tuple[str, list[int]]:
        """Apply the chat template; returns (prompt text, token ids). Template errors are 400s.

        Blocking (template rendering and tokenization): the handlers call it via `render_prompt_async`.
        A template sent with the request is refused unless the server trusts request templates
        (--trust-request-chat-template, vLLM's flag); trusted, it renders in a separate process with
        memory and time limits (tokenizer/template_process.py)."""
        custom = request.chat_template
        if custom is None and not self.tokenizer.chat_template:
            raise BadRequestError("this model has no chat template (a base model): use /v1/completions, or start "
                                  "the server with --chat-template FILE", param="messages",
                                  code="no_chat_template")
        if custom is not None and custom != self.tokenizer.chat_template \
                and not self.state.trust_request_chat_template:
            raise BadRequestError("a chat_template sent with the request is refused: the server does not trust "
                                  "request chat templates (start it with --trust-request-chat-template)",
                                  param="chat_template", code="untrusted_chat_template")
        messages = []
        for m in request.messages:
            d = m.model_dump(exclude_none=True)
            if not m.has_images:
                d["content"] = m.text_content() if m.content is not None else ""
            messages.append(d)
        inputs = self.engine.input_processor
        processor = inputs.image_processor if inputs is not None else None
        # image parts as the template's {"type": "image"}, or the image token's text for a GGUF's template
        messages, _ = split_image_parts(messages, processor.image_text if processor is not None else None)
        kwargs = dict(request.chat_template_kwargs or {})
        clash = _RESERVED_TEMPLATE_KWARGS & kwargs.keys()
        if clash:
            raise BadRequestError(f"chat_template_kwargs may not set {', '.join(sorted(clash))}",
                                  param="chat_template_kwargs", code="invalid_value")
        for name in ("documents", "reasoning_effort"):  # vLLM's chat fields the template reads (not /tokenize's)
            value = getattr(request, name, None)
            if value is not None:
                kwargs[name] = value
        try:
            if custom is not None and custom != self.tokenizer.chat_template:
                tok = self.tokenizer
                special = {k: getattr(tok, k, None) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
                documents = kwargs.pop("documents", None)
                text = render_untrusted(custom, messages, add_generation_prompt=request.add_generation_prompt,
                                        continue_final_message=request.continue_final_message,
                                        tools=template_tools(request), documents=documents,
                                        special_tokens={k: v for k, v in special.items() if v is not None},
                                        **kwargs)
            else:
                text = self.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=request.add_generation_prompt,
                    tools=template_tools(request), continue_final_message=request.continue_final_message,
                    **kwargs)
        except ChatTemplateError as e:
            param = "chat_template" if custom else "messages"
            message = str(e) if str(e).startswith("chat template") else f"chat template failed: {e}"
            raise BadRequestError(message, param=param, code="invalid_value") from None
        return text, encode_text(self.tokenizer, text, add_special_tokens=False)

    def image_refs(self, request: ChatCompletionRequest) -> list[ImageRef]:
        """The request's images in order, checked against the model and --limit-mm-per-prompt before any is
        fetched or decoded."""
        with_images = [i for i, m in enumerate(request.messages) if m.has_images]
        try:
            _, refs = split_image_parts([request.messages[i].model_dump(exclude_none=True) for i in with_images])
            self.engine.input_processor.check_image_count(len(refs))
        except ImageInputError as e:
            raise BadRequestError(e.message, param=f"messages[{with_images[0]}].content", code=e.code) from None
        return refs

    def load_images(self, refs: list[ImageRef]) -> list[Image.Image]:
        """The images decoded (a blocking call: fetches and decodes)."""
        processor = self.engine.input_processor.image_processor
        config = self.engine.config.multimodal
        try:
            return [processor.decode(image_bytes(ref, config)) for ref in refs]
        except ImageInputError as e:
            raise BadRequestError(e.message, param="messages", code=e.code) from None

    async def render_prompt_async(self, request: ChatCompletionRequest | TokenizeRequest) -> tuple[str, list[int]]:
        """`render_prompt` off the event loop: a slow render never holds up other requests."""
        return await asyncio.to_thread(self.render_prompt, request)

    async def generate_chat(self, request: ChatCompletionRequest, request_id: str, logprobs: int | None = None
                            ) -> tuple[str, list[int], AsyncIterator[RequestOutput]]:
        """A checked chat request's prompt (text and ids) and its generation: the template, the sampling
        parameters, the structured-output constraints and the engine request. Every API that translates onto
        chat (Responses, Anthropic Messages) starts its generation here."""
        refs = self.image_refs(request)
        text, prompt_ids = await self.render_prompt_async(request)
        params = self.sampling_params(request, max_tokens=request.effective_max_tokens, logprobs=logprobs,
                                      default_max_tokens=None)
        params = await apply_constraints(self, request, params, chat=True)
        args = (request_id, prompt_ids, params, request.priority, request.cache_salt)
        kwargs = dict(prompt_param="messages", data_parallel_rank=request.data_parallel_rank, model=request.model)
        if refs:  # fetching, decoding and preprocessing block: never on the event loop
            images = await asyncio.to_thread(self.load_images, refs)
            engine_request = await asyncio.to_thread(self.process_inputs, *args, images=images, **kwargs)
        else:
            engine_request = self.process_inputs(*args, **kwargs)
        gen = self.engine.generate(prompt_ids, engine_request.sampling_params, request_id,
                                   engine_request=engine_request, prompt_text=text, priority=request.priority,
                                   timeout=self.timeout_for(request), reservation=self.reservation())
        return text, prompt_ids, gen

    async def create(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        self.check_request(request)
        request_id = self.request_id(request, "chatcmpl")
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        _, _, gen = await self.generate_chat(request, request_id, logprobs)
        created = int(time.time())
        if request.stream:
            return DisconnectAwareStreamingResponse(self._stream(request, gen, request_id, created),
                                                    media_type="text/event-stream",
                                                    headers={"Cache-Control": "no-cache"},
                                                    write_timeout=self.state.stream_write_timeout)
        result = await run_cancellable(raw_request, self._full(request, gen, request_id, created))
        if result is None:
            return Response(status_code=499)  # the client went away; nobody reads this
        return JSONResponse(result)

    # ------------------------------------------------------------------ non-streamed

    async def _full(self, request: ChatCompletionRequest, gen: AsyncIterator[RequestOutput], request_id: str,
                    created: int) -> JsonObject:
        final = await final_output(gen)
        choices = []
        for o in final.outputs:
            message, finish_reason = ChatOutputParser(request, self.engine.config, final.prompt or "").message(
                o.text, o.finish_reason)
            choice: JsonObject = {
                "index": o.index,
                "message": message,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": o.stop_reason,
            }
            if request.logprobs and o.logprobs is not None:
                choice["logprobs"] = {"content": chat_logprobs(self.tokenizer, o.token_ids, o.logprobs,
                                                                    request.top_logprobs or 0)}
            if request.return_token_ids:
                choice["token_ids"] = list(o.token_ids)
            choices.append(choice)
        body: JsonObject = {
            "id": request_id, "object": "chat.completion", "created": created,
            "model": self.response_model(request.model), "system_fingerprint": self.system_fingerprint,
            "choices": choices,
            "usage": usage_body(len(final.prompt_token_ids), completion_tokens(final), final.num_cached_tokens),
        }
        if request.return_token_ids:
            body["prompt_token_ids"] = list(final.prompt_token_ids)
        if request.prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs(final)
        if final.kv_transfer_params is not None:  # a prefill instance's answer (PD)
            body["kv_transfer_params"] = final.kv_transfer_params
        return body

    # ------------------------------------------------------------------ streamed

    def _chunk(self, request_id: str, model: str, created: int, choices: list[JsonObject],
               usage: JsonObject | None = None, with_usage_key: bool = False) -> str:
        body: JsonObject = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                                "model": model, "system_fingerprint": self.system_fingerprint,
                                "choices": choices}
        if usage is not None or with_usage_key:
            body["usage"] = usage
        return sse(body)

    async def _stream(self, request: ChatCompletionRequest, gen: AsyncIterator[RequestOutput], request_id: str,
                      created: int) -> AsyncIterator[str]:
        n = request.n or 1
        model = self.response_model(request.model)
        sent_text = [0] * n
        sent_tokens = [0] * n
        done = [False] * n
        parsers: dict[int, ChatOutputParser] = {}
        include_usage = request.include_usage
        continuous = include_usage and request.continuous_usage
        prompt_tokens = 0
        cached = 0
        generated = 0
        try:
            first = True
            async for out in gen:
                prompt_tokens = len(out.prompt_token_ids)
                cached = out.num_cached_tokens
                generated = completion_tokens(out)
                usage = usage_body(prompt_tokens, generated, cached) if continuous else None
                if first:
                    first = False
                    for i in range(n):
                        choice: JsonObject = {"index": i, "delta": {"role": "assistant", "content": ""},
                                                  "logprobs": None, "finish_reason": None}
                        if request.return_token_ids and i == 0:
                            choice["prompt_token_ids"] = list(out.prompt_token_ids)
                        yield self._chunk(request_id, model, created, [choice],
                                          usage_body(prompt_tokens, 0, cached) if continuous else None,
                                          include_usage)
                for o in out.outputs:
                    i = o.index
                    if i >= n or done[i]:
                        continue
                    delta_text = o.text[sent_text[i]:]
                    if not delta_text and o.finish_reason is None:
                        continue  # tokens held back by the detokenizer go out with the next text
                    new_ids = o.token_ids[sent_tokens[i]:]
                    parser = parsers.setdefault(i, ChatOutputParser(request, self.engine.config, out.prompt or ""))
                    choice = {"index": i, "delta": parser.delta(delta_text, o.finish_reason is not None),
                              "logprobs": None, "finish_reason": parser.finish_reason(o.finish_reason)}
                    if o.finish_reason is not None:
                        choice["stop_reason"] = o.stop_reason
                    if request.logprobs and o.logprobs is not None:
                        choice["logprobs"] = {"content": chat_logprobs(self.tokenizer,
                            new_ids, o.logprobs[sent_tokens[i]:], request.top_logprobs or 0)}
                    if request.return_token_ids:
                        choice["token_ids"] = list(new_ids)
                    sent_text[i] = len(o.text)
                    sent_tokens[i] = len(o.token_ids)
                    done[i] = o.finish_reason is not None
                    yield self._chunk(request_id, model, created, [choice], usage, include_usage)
            if include_usage:
                yield self._chunk(request_id, model, created, [], usage_body(prompt_tokens, generated, cached))
        except Exception as e:  # noqa: BLE001 - the stream ends with an error chunk, then [DONE]
            yield stream_error_chunk(e)
        yield SSE_DONE
