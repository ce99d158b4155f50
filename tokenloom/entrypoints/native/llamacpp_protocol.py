"""The request body of llama-server's /completion (pydantic), with the OpenAI bodies' size caps.

Fields the engine has are typed; llama-server's others (``cache_prompt``, ``n_probs``, ``samplers``,
``id_slot``, ``n_keep``...) are ignored, as unknown fields are everywhere in this server.
"""
from __future__ import annotations

from typing import Optional, Union

from pydantic import BaseModel, ConfigDict, Field, JsonValue, field_validator

from tokenloom.entrypoints.openai.limits import MAX_GRAMMAR_CHARS
from tokenloom.entrypoints.openai.protocol import MAX_STOP, MAX_TOKEN_LIST


class LlamaCppCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())

    prompt: Union[str, list[int]]
    n_predict: int = Field(-1, ge=-2)  # -1: until the context is full (-2 likewise)
    temperature: Optional[float] = Field(None, ge=0.0)
    top_k: Optional[int] = Field(None, ge=-1)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    min_p: Optional[float] = Field(None, ge=0.0, le=1.0)
    repeat_penalty: Optional[float] = Field(None, gt=0.0)
    presence_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    stop: Optional[list[str]] = Field(None, max_length=MAX_STOP)
    seed: Optional[int] = Field(None, ge=-1, le=2**64 - 1)  # -1: random
    ignore_eos: bool = False
    grammar: Optional[str] = Field(None, max_length=MAX_GRAMMAR_CHARS)
    json_schema: Optional[dict[str, JsonValue]] = None
    stream: bool = False
    model: Optional[str] = Field(None, max_length=1024)  # llama-server serves one model: ignored

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, v):
        if isinstance(v, list) and (len(v) > MAX_TOKEN_LIST or any(t < 0 for t in v)):
            raise ValueError(f"a token prompt is a list of at most {MAX_TOKEN_LIST} token ids >= 0")
        return v
