"""Structured outputs, reasoning and tools on the OpenAI server (kept out of the serving files).

* `apply_constraints`: response_format / guided_* / structural_tag / structured_outputs / tool_choice /
  thinking budget -> `SamplingParams.structured_outputs` (at most one constraint, else 400), validated
  and compiled off the event loop so a bad one is a 400 naming the field before anything is queued;
* `template_tools`: the tools the chat template sees (none for ``tool_choice: "none"``);
* `ChatOutputParser`: the choice's text -> reasoning_content / content / tool_calls, whole or streamed.
"""
from __future__ import annotations

import asyncio
from dataclasses import replace

from tokenloom.config import EngineConfig
from tokenloom.core.json_types import JsonObject, JsonValue
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.entrypoints.openai.errors import BadRequestError
from tokenloom.entrypoints.openai.protocol import ChatCompletionRequest, SamplingFields
from tokenloom.entrypoints.openai.serving_engine import OpenAIServing
from tokenloom.structured.backend import get_backend
from tokenloom.structured.errors import StructuredOutputError
from tokenloom.structured.reasoning import get_reasoning_parser
from tokenloom.structured.spec import OPTION_KEYS, check_schema, close_objects, normalize_structured_outputs
from tokenloom.structured.tool_parsers import ToolCall, get_tool_parser

_RESPONSE_FORMATS = ("text", "json_object", "json_schema", "structural_tag")
_GUIDED = (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
           ("guided_grammar", "grammar"), ("structural_tag", "structural_tag"),
           ("grammar", "grammar"), ("json_schema", "json"))  # the last two: llama.cpp's spellings


def _bad(message: str, param: str | None) -> BadRequestError:
    return BadRequestError(message, param=param, code="invalid_value")


def _constraints(request: SamplingFields) -> list[tuple[str, JsonObject, str | None]]:
    """(field name, structured_outputs dict, where) for each constraint the request sets."""
    found = []
    rf = getattr(request, "response_format", None)
    if rf:
        kind = rf.get("type")
        if kind not in _RESPONSE_FORMATS:
            raise _bad(f"response_format.type must be one of {', '.join(_RESPONSE_FORMATS)}, got {kind!r}",
                       "response_format.type")
        if kind == "json_object":
            found.append(("response_format", {"json_object": True}, "response_format"))
        elif kind == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict):
                raise _bad("response_format.json_schema must be an object with a 'schema'",
                           "response_format.json_schema")
            schema = js.get("schema", js.get("json_schema"))
            if schema is None:
                raise _bad("response_format.json_schema.schema is required", "response_format.json_schema.schema")
            found.append(("response_format", {"json": schema, "strict": bool(js.get("strict"))},
                          "response_format.json_schema.schema"))
        elif kind == "structural_tag":
            tag = {k: v for k, v in rf.items() if k != "type"} if "structures" in rf else rf
            found.append(("response_format", {"structural_tag": tag}, "response_format"))
    for field, key in _GUIDED:
        value = getattr(request, field, None)
        if value is not None:
            if field == "json_schema" and isinstance(value, dict) and isinstance(value.get("schema"), dict) \
                    and "name" in value:  # response_format's {"name", "schema"} sent at the top level
                found.append((field, {key: value["schema"]}, "json_schema.schema"))
                continue
            found.append((field, {key: value}, field))
    so = getattr(request, "structured_outputs", None)
    if so:
        if any(k not in OPTION_KEYS for k in so):
            found.append(("structured_outputs", dict(so), None))
        else:  # options only (e.g. any_whitespace): they apply to the JSON constraint given elsewhere
            found = [(f, {**c, **so} if ("json" in c or "json_object" in c) else c, w) for f, c, w in found]
    return found


def _functions(request: ChatCompletionRequest) -> list[JsonObject]:
    out = []
    for i, tool in enumerate(getattr(request, "tools", None) or ()):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _bad(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}",
                       f"tools[{i}]")
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise _bad(f"tools[{i}].function.parameters must be a JSON schema object",
                       f"tools[{i}].function.parameters")
        out.append({"name": fn["name"], "parameters": params, "where": f"tools[{i}].function.parameters"})
    return out


def tool_mode(request: ChatCompletionRequest) -> str:
    """none | auto | required | the named function's name."""
    tools = getattr(request, "tools", None)
    choice = getattr(request, "tool_choice", None)
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type", "function") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise _bad("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                       "{'name': ...}}", "tool_choice")
        return "named:" + name
    if choice not in ("none", "auto", "required"):
        raise _bad(f"tool_choice must be 'none', 'auto', 'required' or a named function, got {choice!r}",
                   "tool_choice")
    if choice != "none" and not tools:
        raise _bad(f"tool_choice {choice!r} needs tools", "tool_choice")
    return choice


def template_tools(request: ChatCompletionRequest) -> list[dict[str, JsonValue]] | None:
    tools = getattr(request, "tools", None)
    return None if not tools or getattr(request, "tool_choice", None) == "none" else tools


def _any_whitespace(request: SamplingFields) -> bool:
    """The request's ``structured_outputs.any_whitespace`` option (free JSON whitespace; default compact)."""
    so = getattr(request, "structured_outputs", None)
    return isinstance(so, dict) and so.get("any_whitespace") is True


def _tool_constraint(request: ChatCompletionRequest, parser_name: str | None) -> JsonObject | None:
    """The constraint tool_choice puts on the output: for a named function, its arguments as JSON
    (the server writes the call around them: the model spends no tokens on the wrapper or the name
    it was given); for ``required``, one or more complete calls in the parser's format (exactly one
    with ``parallel_tool_calls: false``), then the end of the output."""
    mode = tool_mode(request)
    if mode in ("none", "auto"):
        return None
    functions = _functions(request)
    if mode.startswith("named:"):
        name = mode[len("named:"):]
        functions = [f for f in functions if f["name"] == name]
        if not functions:
            raise _bad(f"tool_choice names function {name!r}, which is not in tools", "tool_choice.function.name")
    for fn in functions:
        try:
            check_schema(fn["parameters"], fn["where"])
        except StructuredOutputError as e:
            raise _bad(e.message, e.param) from None
    if mode.startswith("named:"):
        return {"json": close_objects(functions[0]["parameters"]),
                **({"any_whitespace": True} if _any_whitespace(request) else {})}
    if parser_name is None:
        raise _bad(f"tool_choice {getattr(request, 'tool_choice')!r} needs a tool-call parser (the server runs "
                   "with --tool-call-parser none)", "tool_choice")
    parallel = getattr(request, "parallel_tool_calls", None) is not False
    specs = [{"name": f["name"], "parameters": close_objects(f["parameters"])} for f in functions]
    return {"structural_tag": get_tool_parser(parser_name)().structural_tag(specs, parallel,
                                                                            _any_whitespace(request))}


async def apply_constraints(serving: OpenAIServing, request: SamplingFields, params: SamplingParams,
                            chat: bool = False) -> SamplingParams:
    """The request's constraint and thinking budget on `params`; 400 on anything invalid."""
    config = serving.engine.config
    found = _constraints(request)
    if chat:
        assert isinstance(request, ChatCompletionRequest)
        tool = _tool_constraint(request, getattr(config, "tool_call_parser", None))
        if tool is not None:
            found.append(("tool_choice", tool, "tool_choice"))
    if len(found) > 1:
        names = ", ".join(f for f, _, _ in found)
        raise _bad(f"give at most one output constraint; this request sets {len(found)}: {names}", found[1][0])
    budget = getattr(request, "thinking_token_budget", None)
    if budget is None:
        budget = getattr(request, "reasoning_max_tokens", None)
    if budget is not None and not getattr(config, "reasoning_parser", None):
        raise _bad("thinking_token_budget needs a reasoning parser (start the server with --reasoning-parser)",
                   "thinking_token_budget")
    if not found and budget is None:
        return params
    so = None
    if found:
        field, so, where = found[0]
        try:
            spec = normalize_structured_outputs(so, field, where)
            if spec is not None:
                ip = serving.engine.input_processor
                assert ip is not None
                backend = get_backend(serving.tokenizer, ip.vocab_size)
                await asyncio.to_thread(backend.compile, spec, where or field)
        except StructuredOutputError as e:
            raise _bad(e.message, e.param) from None
        so = {k: v for k, v in so.items() if v is not None}
    return replace(params, structured_outputs=so, thinking_token_budget=budget)


class ChatOutputParser:
    """One choice's text -> message fields, with the server's reasoning parser and tool parser.

    With a named tool_choice the (constrained) text is the call's arguments: the parser wraps it in
    the call, whole or streamed, and the finish reason stays OpenAI's for a forced function ("stop").
    Otherwise calls the model wrote make a "stop" finish "tool_calls" (auto and required)."""

    def __init__(self, request: ChatCompletionRequest, config: EngineConfig, prompt_text: str) -> None:
        name = getattr(config, "reasoning_parser", None)
        self.reasoning = get_reasoning_parser(name)(prompt_text) if name else None
        mode = tool_mode(request)
        self.named = mode[len("named:"):] if mode.startswith("named:") else None
        self.named_call = ToolCall(self.named, "") if self.named else None
        self.named_started = False
        tool_name = getattr(config, "tool_call_parser", None)
        self.tools = get_tool_parser(tool_name)() if tool_name and mode != "none" and not self.named else None
        self.single = getattr(request, "parallel_tool_calls", None) is False
        self.num_calls = 0

    # ---- whole
    def message(self, text: str, finish_reason: str | None) -> tuple[JsonObject, str | None]:
        msg: JsonObject = {"role": "assistant"}
        content: str | None = text
        if self.reasoning is not None:
            msg["reasoning_content"], content = self.reasoning.extract(text)
        if self.named_call is not None:
            self.named_call.arguments = content or ""
            msg["content"] = None
            msg["tool_calls"] = [self.named_call.to_dict()]
            return msg, finish_reason
        calls = []
        if self.tools is not None and content:
            content, calls = self.tools.extract(content)
            if self.single:
                calls = calls[:1]
        msg["content"] = content if (content or not calls) else None
        if calls:
            msg["tool_calls"] = [c.to_dict() for c in calls]
            if finish_reason == "stop":
                finish_reason = "tool_calls"
        return msg, finish_reason

    # ---- streamed
    def delta(self, text_delta: str, final: bool) -> JsonObject:
        """Delta fields for new text (final=True flushes whatever was held back)."""
        out: JsonObject = {}
        reasoning, content = "", text_delta
        if self.reasoning is not None:
            r1, c1 = self.reasoning.feed(text_delta)
            r2, c2 = self.reasoning.finish() if final else ("", "")
            reasoning, content = r1 + r2, c1 + c2
        if reasoning:
            out["reasoning_content"] = reasoning
        if self.named_call is not None:
            if content or (final and not self.named_started):
                call: JsonObject = {"index": 0, "function": {"arguments": content}}
                if not self.named_started:
                    self.named_started = True
                    call = {"index": 0, "id": self.named_call.id, "type": "function",
                            "function": {"name": self.named, "arguments": content}}
                out["tool_calls"] = [call]
            return out
        calls: list[JsonObject] = []
        if self.tools is not None:
            c1, calls = self.tools.feed(content)
            if final:
                c2, more = self.tools.finish()
                c1, calls = c1 + c2, calls + more
            content = c1
            if self.single:
                calls = [c for c in calls if c["index"] == 0]
        if content:
            out["content"] = content
        if calls:
            self.num_calls = max(self.num_calls, 1 + max(c["index"] for c in calls))
            out["tool_calls"] = calls
        return out

    def finish_reason(self, finish_reason: str | None) -> str | None:
        if self.named_call is not None:
            return finish_reason
        return "tool_calls" if finish_reason == "stop" and self.num_calls else finish_reason
