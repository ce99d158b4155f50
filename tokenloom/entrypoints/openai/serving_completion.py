"""POST /v1/completions: one or more prompts (text or token ids) -> text_completion(s).

Each prompt becomes its own engine request; choice index = prompt index * n + sequence
index, as in OpenAI's API. `echo` prepends the prompt (and its logprobs when asked).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tokenloom.core.json_types import JsonObject, JsonValue
from tokenloom.entrypoints.openai.errors import engine_error_to_api_error
from tokenloom.entrypoints.openai.formatting import completion_logprobs, completion_tokens, prompt_logprobs, usage_body
from tokenloom.entrypoints.openai.protocol import CompletionRequest
from tokenloom.entrypoints.openai.serving_engine import OpenAIServing
from tokenloom.entrypoints.openai.streaming import (
    SSE_DONE,
    DisconnectAwareStreamingResponse,
    merge_generators,
    run_cancellable,
    sse,
    stream_error_chunk,
)
from tokenloom.entrypoints.openai.structured import apply_constraints
from tokenloom.outputs import CompletionOutput, RequestOutput


class OpenAIServingCompletion(OpenAIServing):

    async def create(self, request: CompletionRequest, raw_request: Request) -> Response:
        self.check_request(request)
        prompts = request.prompts()
        base_id = self.request_id(request, "cmpl", len(prompts))
        echo_logprobs = request.echo and request.logprobs is not None
        params = self.sampling_params(request, max_tokens=request.max_tokens, logprobs=request.logprobs,
                                      default_max_tokens=16, best_of=request.best_of, echo_logprobs=echo_logprobs)
        params = await apply_constraints(self, request, params)
        engine_requests = []
        prompt_texts: list[str] = []
        for i, prompt in enumerate(prompts):
            rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
            param = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            if isinstance(prompt, str) and len(prompt) > 4096:  # tokenize long prompts off the event loop
                er = await asyncio.to_thread(self.process_inputs, rid, prompt, params.clone(), request.priority,
                                             request.cache_salt, param, request.data_parallel_rank, request.model)
            else:
                er = self.process_inputs(rid, prompt, params.clone(), request.priority, request.cache_salt,
                                         prompt_param=param, data_parallel_rank=request.data_parallel_rank,
                                         model=request.model)
            engine_requests.append(er)
            prompt_texts.append(prompt if isinstance(prompt, str)
                                else self.tokenizer.decode(list(prompt), skip_special_tokens=False))
        reservation = self.reservation()
        gens = [self.engine.generate(prompt, er.sampling_params, er.request_id, engine_request=er,
                                     prompt_text=text, priority=request.priority, timeout=self.timeout_for(request),
                                     reservation=reservation)
                for prompt, er, text in zip(prompts, engine_requests, prompt_texts)]
        created = int(time.time())
        if request.stream:
            return DisconnectAwareStreamingResponse(
                self._stream(request, gens, prompt_texts, base_id, created), media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"}, write_timeout=self.state.stream_write_timeout)
        result = await run_cancellable(raw_request, self._full(request, gens, prompt_texts, base_id, created))
        if result is None:
            return Response(status_code=499)
        return JSONResponse(result)

    # ------------------------------------------------------------------ shared

    def _logprobs(self, request: CompletionRequest, ro: RequestOutput, o: CompletionOutput, echo_text: str | None,
                  start: int = 0, text_offset: int = 0) -> dict[str, list] | None:
        if request.logprobs is None or o.logprobs is None:
            return None
        top = request.logprobs
        if echo_text is not None:
            prompt_lps = ro.prompt_logprobs or [None] * len(ro.prompt_token_ids)
            lp = completion_logprobs(self.tokenizer, ro.prompt_token_ids + o.token_ids[start:],
                                          list(prompt_lps) + list(o.logprobs[start:]), top, text_offset)
        else:
            lp = completion_logprobs(self.tokenizer, o.token_ids[start:], o.logprobs[start:], top, text_offset)
        return lp

    def _choice(self, request: CompletionRequest, index: int, text: str, o: CompletionOutput,
                logprobs: JsonValue, finish: bool) -> JsonObject:
        choice: JsonObject = {"index": index, "text": text, "logprobs": logprobs,
                                  "finish_reason": o.finish_reason if finish else None}
        if finish:
            choice["stop_reason"] = o.stop_reason
        return choice

    # ------------------------------------------------------------------ non-streamed

    async def _full(self, request: CompletionRequest, gens: list[AsyncIterator[RequestOutput]],
                    prompt_texts: list[str], request_id: str, created: int) -> JsonObject:
        finals: list[RequestOutput | None] = [None] * len(gens)
        try:
            async for i, out in merge_generators(gens):
                finals[i] = out
        except Exception as e:  # noqa: BLE001
            raise engine_error_to_api_error(e) from None
        n = request.n or 1
        choices = []
        prompt_tokens = generated = cached = 0
        for p, ro in enumerate(finals):
            assert ro is not None
            prompt_tokens += len(ro.prompt_token_ids)
            generated += completion_tokens(ro)
            cached += ro.num_cached_tokens
            for k, o in enumerate(ro.outputs):
                echo = prompt_texts[p] if request.echo else None
                text = (echo or "") + o.text
                choice = self._choice(request, p * n + k, text, o, self._logprobs(request, ro, o, echo), True)
                if request.return_token_ids:
                    choice["prompt_token_ids"] = list(ro.prompt_token_ids)
                    choice["token_ids"] = list(o.token_ids)
                if request.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = prompt_logprobs(ro)
                choices.append(choice)
        body = {"id": request_id, "object": "text_completion", "created": created,
                "model": self.response_model(request.model), "system_fingerprint": self.system_fingerprint,
                "choices": choices, "usage": usage_body(prompt_tokens, generated, cached)}
        if finals and finals[0].kv_transfer_params is not None:  # a prefill instance's answer (PD)
            body["kv_transfer_params"] = finals[0].kv_transfer_params
        return body

    # ------------------------------------------------------------------ streamed

    def _chunk(self, request_id: str, model: str, created: int, choices: list[JsonObject],
               usage: JsonObject | None, with_usage_key: bool) -> str:
        body: JsonObject = {"id": request_id, "object": "text_completion", "created": created,
                                "model": model, "system_fingerprint": self.system_fingerprint,
                                "choices": choices}
        if usage is not None or with_usage_key:
            body["usage"] = usage
        return sse(body)

    async def _stream(self, request: CompletionRequest, gens: list[AsyncIterator[RequestOutput]],
                      prompt_texts: list[str], request_id: str, created: int) -> AsyncIterator[str]:
        n = request.n or 1
        model = self.response_model(request.model)
        total = n * len(gens)
        sent_text = [0] * total
        sent_tokens = [0] * total
        done = [False] * total
        echoed = [False] * total
        include_usage = request.include_usage
        continuous = include_usage and request.continuous_usage
        latest: list[RequestOutput | None] = [None] * len(gens)

        def usage_now() -> JsonObject:
            outs = [ro for ro in latest if ro is not None]
            return usage_body(sum(len(ro.prompt_token_ids) for ro in outs), sum(completion_tokens(ro) for ro in outs),
                              sum(ro.num_cached_tokens for ro in outs))

        try:
            async for p, ro in merge_generators(gens):
                latest[p] = ro
                for o in ro.outputs:
                    k = p * n + o.index
                    if o.index >= n or done[k]:
                        continue
                    delta = o.text[sent_text[k]:]
                    echo = None
                    if request.echo and not echoed[k]:
                        echo = prompt_texts[p]
                    if not delta and echo is None and o.finish_reason is None:
                        continue
                    logprobs = None
                    if request.logprobs is not None and o.logprobs is not None:
                        logprobs = self._logprobs(request, ro, o, echo, start=sent_tokens[k])
                    choice = self._choice(request, k, (echo or "") + delta, o, logprobs, o.finish_reason is not None)
                    if request.return_token_ids:
                        if echo is not None or sent_tokens[k] == 0:
                            choice["prompt_token_ids"] = list(ro.prompt_token_ids)
                        choice["token_ids"] = list(o.token_ids[sent_tokens[k]:])
                    echoed[k] = True
                    sent_text[k] = len(o.text)
                    sent_tokens[k] = len(o.token_ids)
                    done[k] = o.finish_reason is not None
                    yield self._chunk(request_id, model, created, [choice], usage_now() if continuous else None,
                                      include_usage)
            if include_usage:
                yield self._chunk(request_id, model, created, [], usage_now(), True)
        except Exception as e:  # noqa: BLE001
            yield stream_error_chunk(e)
        yield SSE_DONE
