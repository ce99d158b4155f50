"""Printing a reply at the terminal as it is generated (`tokenloom generate` and `tokenloom chat`)."""
from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, TextIO

from tokenloom.core.lora_request import LoRARequest
from tokenloom.core.sampling_params import SamplingParams

if TYPE_CHECKING:  # the LLM imports torch; these helpers only call it
    from tokenloom.entrypoints.llm import LLM


def chat_prompt_ids(llm: LLM, messages: list[dict[str, str]]) -> list[int]:
    text = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return llm.tokenizer.encode(text, add_special_tokens=False)


def stream_reply(llm: LLM, prompt: str | list[int], params: SamplingParams, out: TextIO = sys.stdout,
                 stop: Callable[[], bool] | None = None, lora_request: LoRARequest | None = None) -> tuple[str, bool]:
    """Print the reply's new text as it comes; returns (text, stopped). `stop()` true ends it early.
    `lora_request`: the LoRA adapter to answer with (`--lora`)."""
    text, request_id = "", None
    for o in llm.generate_stream(prompt, params, lora_request=lora_request):
        request_id = o.request_id
        new = o.outputs[0].text
        out.write(new[len(text):])
        out.flush()
        text = new
        if stop is not None and stop() and not o.finished:
            llm.abort(request_id)
            return text, True
    return text, False
