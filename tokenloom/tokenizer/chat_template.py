"""Render Hugging Face style Jinja chat templates in a sandbox.

The sandbox refuses unsafe attributes (no dunders, no module globals, no imports or file
access: there is no loader). A template may come with a request, so its cost is bounded
too, here and where it runs:

* in the sandbox: `*`, `**`, `+` and `%` that would build a string or list over
  `MAX_RENDER_CHARS` or an integer over `MAX_INT_BITS` bits raise before computing it
  (Python's big-integer arithmetic is C code that holds the GIL: `(7**1024)**1024` froze
  the whole API process for 30 s), as do padding arguments (`center`, `ljust`, `indent`,
  `"%300000000s"`) over `MAX_RENDER_CHARS`; the output is capped at `MAX_RENDER_CHARS`;
* the model's own template renders in a worker thread, interrupted past
  `MAX_RENDER_SECONDS`;
* a template sent with a request renders in a separate process (`render_untrusted`, see
  template_process.py) with an address-space limit and a wall-clock limit after which it
  is killed, so no template can stall or bloat the server whatever it computes.

All of these are ChatTemplateErrors.
"""
from __future__ import annotations

import ctypes
import json
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
import jinja2.filters
import jinja2.nodes
import jinja2.runtime
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tokenloom.core.json_types import JsonValue

_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
MAX_RENDER_SECONDS = 2.0
MAX_RENDER_CHARS = 4 * 2 ** 20
_MAX_POWER_EXPONENT = 1024
# Integers a template may build: far beyond any index or count a real template uses (they
# stay below 2**64), far below what makes arithmetic or str() slow (milliseconds at 4,096 bits).
MAX_INT_BITS = 4096
# str methods whose int arguments are output widths.
_PADDING_METHODS = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs"})
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """A chat template failed to compile or render, or rejected its input."""


class _GenerationTag(jinja2.ext.Extension):
    """Accept `{% generation %}...{% endgeneration %}` and render its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Callable[[], str]) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore-prefixed attributes."""

    def __init__(*args: object, **kwargs: object) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: object) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


class _TemplateDict:
    """`dict()` for templates, without exposing the `dict` type itself."""

    def __call__(self, *args: object, **kwargs: object) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: object, **kwargs: object) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(x: JsonValue, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _refuse(message: str) -> None:
    raise jinja2.exceptions.SecurityError(message)


def _check_int_bits(bits: int) -> None:
    if bits > MAX_INT_BITS:
        _refuse(f"the template builds an integer of about {bits} bits; the limit is {MAX_INT_BITS}")


def _check_width(width: object) -> None:
    if isinstance(width, int) and not isinstance(width, bool) and width > MAX_RENDER_CHARS:
        _refuse(f"the template asks for a width of {width} characters; the limit is {MAX_RENDER_CHARS}")


_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")


def _check_percent_format(fmt: str) -> None:
    """`"%300000000s" % x` would allocate its padding before any size check could see it."""
    if "%" not in fmt:
        return
    for m in _PERCENT_SPEC.finditer(fmt):
        for group in m.groups():
            if group == "*":
                _refuse("'*' widths in %-formatting are not allowed in chat templates")
            if group is not None and len(group) > 7 or (group and int(group) > MAX_RENDER_CHARS):
                _refuse(f"a %-format width of {group} characters; the limit is {MAX_RENDER_CHARS}")


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """Sandbox that raises on unsafe attribute access instead of yielding an undefined value,
    and on operators and methods that would build oversized values (checked before the work)."""

    intercepted_binops = frozenset(["*", "**", "+", "%"])

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: object, right: object) -> object:
        ints = isinstance(left, int) and isinstance(right, int)
        if operator == "*":
            if ints:
                _check_int_bits(left.bit_length() + right.bit_length())
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(times, int) and \
                        len(seq) * max(times, 0) > MAX_RENDER_CHARS:
                    _refuse(f"the template builds a value of {len(seq) * times} items; the limit is "
                            f"{MAX_RENDER_CHARS}")
        elif operator == "**":
            if isinstance(right, (int, float)) and abs(right) > _MAX_POWER_EXPONENT:
                _refuse(f"exponent {right} is too large")
            if ints and right > 0 and abs(left) > 1:
                _check_int_bits(left.bit_length() * right)
        elif operator == "+":
            if ints:
                _check_int_bits(max(left.bit_length(), right.bit_length()) + 1)
            elif isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)) and \
                    len(left) + len(right) > MAX_RENDER_CHARS:
                _refuse(f"the template builds a value of {len(left) + len(right)} items; the limit is "
                        f"{MAX_RENDER_CHARS}")
        elif operator == "%" and isinstance(left, str):
            _check_percent_format(left)
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: jinja2.runtime.Context, __obj: object, *args: object,  # noqa: N805
             **kwargs: object) -> object:
        """Method calls from templates: refuse str padding / replacement that would be oversized."""
        owner = getattr(__obj, "__self__", None)
        name = getattr(__obj, "__name__", "")
        if isinstance(owner, str):
            if name in _PADDING_METHODS:
                for a in (*args, *kwargs.values()):
                    _check_width(a)
                if name == "expandtabs" and owner.count("\t") * max([a for a in args if isinstance(a, int)] or [8]) \
                        > MAX_RENDER_CHARS:
                    _refuse("expandtabs would build an oversized string")
            elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
                grows = len(args[1]) - len(args[0])
                if grows > 0 and len(owner) + (owner.count(args[0]) if args[0] else len(owner) + 1) * grows \
                        > MAX_RENDER_CHARS:
                    _refuse("replace would build a string over the size limit")
            elif name == "format":
                for a in (*args, *kwargs.values()):
                    if isinstance(a, str) and len(a) > MAX_RENDER_CHARS:
                        _refuse("format argument over the size limit")
        return super().call(__context, __obj, *args, **kwargs)

    def unsafe_undefined(self, obj: object, attribute: str) -> jinja2.Undefined:
        raise jinja2.exceptions.SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe"
        )


def _checked_filter(name: str, width_args: tuple[str, ...]) -> Callable[..., object]:
    """A jinja2 built-in filter whose width-like arguments are capped (filters bypass `call`)."""
    real = jinja2.filters.FILTERS[name]

    def run(*args: object, **kwargs: object) -> object:
        for a in (*args[1:], *(kwargs.get(k) for k in width_args)):
            _check_width(a)
        if name == "format" and args and isinstance(args[0], str):
            _check_percent_format(args[0])
        return real(*args, **kwargs)

    run.__name__ = name
    if hasattr(real, "jinja_pass_arg"):  # pass_environment / pass_eval_context filters keep that
        run.jinja_pass_arg = real.jinja_pass_arg  # type: ignore[attr-defined]
    return run


@lru_cache(maxsize=32)
def compile_chat_template(template: str) -> jinja2.Template:
    """Compile `template` once; later calls with the same string reuse it."""
    env = _StrictSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    for name, kw in (("center", ("width",)), ("indent", ("width",)), ("wordwrap", ("width",)),
                     ("format", ())):
        env.filters[name] = _checked_filter(name, kw)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    try:
        return env.from_string(template)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"invalid chat template: {e}") from e


def _plain(value: object) -> JsonValue:
    """Rebuild `value` from plain JSON types so a template sees no rich objects."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _normalize_messages(messages: Sequence[object]) -> list[dict[str, JsonValue]]:
    out = []
    for message in _plain(messages):
        if not isinstance(message, dict):
            raise ChatTemplateError(f"chat messages must be dicts, got {message!r}")
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _tag_final_message(messages: list[dict[str, JsonValue]], template: str) -> str:
    """Append a marker to the final message's text; return that text."""
    if not messages:
        raise ChatTemplateError("continue_final_message is set but the conversation is empty")
    final = messages[-1]
    content = final.get("content")
    if content is None:
        raise ChatTemplateError("continue_final_message is set but the final message has no content")
    if "content" not in template:
        raise ChatTemplateError("continue_final_message is set but the template never reads 'content'")
    if isinstance(content, list):
        for block in reversed(content):
            if isinstance(block, dict) and "text" in block:
                text = block["text"]
                block["text"] = text + _CONTINUE_TAG
                return text
        raise ChatTemplateError("continue_final_message is set but the final message has no text block")
    final["content"] = content + _CONTINUE_TAG
    return content


def _cut_at_tag(rendered: str, final_text: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final_text.strip() not in rendered or tag not in rendered:
        raise ChatTemplateError("continue_final_message is set but the template drops the final message")
    loc = rendered.rindex(tag)
    if rendered[loc:loc + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:loc]
    return rendered[:loc].rstrip()


def render_chat_template(
    template: str,
    messages: Sequence[object],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: Sequence[Mapping[str, object]] | None = None,
    documents: Sequence[Mapping[str, object]] | None = None,
    special_tokens: Mapping[str, str | None] | None = None,
    **chat_template_kwargs: object,
) -> str:
    """Render `messages` with `template` the way `transformers` does (tokenize=False).

    `special_tokens` (e.g. bos_token, eos_token) become template variables; `chat_template_kwargs`
    are passed through and override them. With `continue_final_message` the output ends right
    after the final message's text (no end-of-turn, no generation prompt).
    """
    compiled = compile_chat_template(template)
    chat = _normalize_messages(messages)
    final_text = _tag_final_message(chat, template) if continue_final_message else None
    variables = {**dict(special_tokens or {}), **_plain(chat_template_kwargs)}
    try:
        rendered = _bounded_render(compiled, dict(
            messages=chat,
            tools=_plain(tools),
            documents=_plain(documents),
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            **variables,
        ))
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template failed: {e}") from e
    except Exception as e:
        raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from e
    if final_text is not None:
        rendered = _cut_at_tag(rendered, final_text)
    return rendered


class _RenderInterrupted(Exception):
    """Raised inside a render thread that ran out of time."""


def _bounded_render(compiled: jinja2.Template, variables: dict[str, object]) -> str:
    """Render in a worker thread: output capped at MAX_RENDER_CHARS, time at MAX_RENDER_SECONDS
    (an overdue render gets an exception raised inside its thread, which stops any pure-Python
    loop the template compiled to)."""
    result: dict[str, str | BaseException] = {}

    def work() -> None:
        try:
            parts: list[str] = []
            size = 0
            for chunk in compiled.generate(**variables):
                size += len(chunk)
                if size > MAX_RENDER_CHARS:
                    raise ChatTemplateError(f"chat template output exceeds {MAX_RENDER_CHARS} characters")
                parts.append(chunk)
            result["text"] = "".join(parts)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            result["error"] = e

    worker = threading.Thread(target=work, name="chat-template", daemon=True)
    worker.start()
    worker.join(MAX_RENDER_SECONDS)
    if worker.is_alive():
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(worker.ident),
                                                   ctypes.py_object(_RenderInterrupted))
        worker.join(0.5)
        raise ChatTemplateError(f"chat template rendering took longer than {MAX_RENDER_SECONDS:g} s")
    error = result.get("error")
    if error is not None:
        if isinstance(error, _RenderInterrupted):
            raise ChatTemplateError(f"chat template rendering took longer than {MAX_RENDER_SECONDS:g} s")
        raise error
    return result["text"]
