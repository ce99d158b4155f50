"""What users of Ollama, llama.cpp and vLLM type from habit gets the tokenloom answer: Ollama's commands name
the tokenloom way, a misspelt flag names the nearest one, `-ngl` over every layer means the GPU, a
speculative config names its unsupported method first, a base model points to --raw, the terminal chat
takes several lines and survives an empty one, and the start-up lines say what the engine holds.

The CLI cases run `main` or the parser (no model); the chat and chat-template cases drive a real LLM on
the embedded model, sharing the session's loaded weights."""
from __future__ import annotations

import io

import pytest

from tokenloom.config import ConfigError, EngineConfig, SpeculativeConfig
from tokenloom.core.engine_info import EngineInfo, KVCacheInfo
from tokenloom.core.pooling import PoolingConfig
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.engine.async_llm import AsyncLLM
from tokenloom.entrypoints.chat_session import ChatSession, read_message
from tokenloom.entrypoints.cli import build_parser, main
from tokenloom.entrypoints.compat import check_common_args
from tokenloom.entrypoints.habits import model_layers
from tokenloom.entrypoints.openai.api_server import ready_line
from tokenloom.entrypoints.terminal import require_chat_template


def run_main(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


# --- Ollama's commands ------------------------------------------------------------------------------------

def test_ollama_run_names_chat_generate_and_serve(capsys):
    code, out, err = run_main(capsys, "run", "my-model.gguf")
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and err.startswith("tokenloom: error:")
    for way in ("tokenloom chat -m my-model.gguf", "tokenloom generate -m my-model.gguf", "tokenloom serve"):
        assert way in err


def test_ollama_pull_says_models_are_never_downloaded(capsys):
    code, _, err = run_main(capsys, "pull", "llama3.2")
    assert code == 1
    assert "never downloads" in err and "smollm2-135m-instruct" in err


def test_ollama_list_lists_the_installed_models_and_their_files(capsys, embedded_path):
    code, out, _ = run_main(capsys, "list")
    assert code == 0
    assert any(line.startswith("smollm2-135m-instruct") and line.endswith(embedded_path)
               for line in out.splitlines())


# --- flags ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("command, typed, meant", [("serve", "--max-model-length", "--max-model-len"),
                                                   ("generate", "--temprature", "--temperature"),
                                                   ("chat", "--sytem", "--system")])
def test_a_misspelt_flag_names_the_nearest_one(command, typed, meant):
    args = [command] + (["hi"] if command == "generate" else []) + [typed, "1"]
    with pytest.raises(ConfigError, match=f"unrecognized arguments: {typed}.*did you mean {meant}\\?"):
        build_parser(command).parse_args(args)


def test_a_flag_like_none_gets_no_guess():
    with pytest.raises(ConfigError) as exc:
        build_parser("serve").parse_args(["serve", "--zzz"])
    assert "did you mean" not in str(exc.value)


def ngl(*args: str):
    ns = build_parser("generate").parse_args(["generate", "hi", *args])
    check_common_args(ns)
    return ns.device


def test_the_embedded_model_has_30_layers():
    """The -ngl cases below count on it (read from the GGUF header, as -ngl does)."""
    assert model_layers(None) == 30


@pytest.mark.parametrize("value", ["30", "99", "-1"])
def test_ngl_covering_every_layer_means_the_gpu(value):
    assert ngl("-ngl", value) == "cuda"


def test_ngl_keeps_a_chosen_cuda_device():
    assert ngl("-ngl", "99", "--device", "cuda:1") == "cuda:1"


def test_ngl_zero_means_the_cpu():
    assert ngl("--n-gpu-layers", "0") == "cpu"


def test_a_partial_offload_is_refused_naming_the_layer_count():
    with pytest.raises(ConfigError, match=r"-ngl 12: partial GPU offload \(12 of the model's 30 layers\)"):
        ngl("-ngl", "12")


def test_every_layer_on_the_gpu_with_device_cpu_is_a_contradiction():
    with pytest.raises(ConfigError, match="--device is cpu"):
        ngl("-ngl", "99", "--device", "cpu")


def test_an_unsupported_speculative_method_is_named_before_an_unknown_key():
    """EAGLE's config carries keys of its own: the method is the error, not its keys."""
    with pytest.raises(ConfigError, match="speculative method 'eagle' is not supported"):
        SpeculativeConfig.parse('{"method": "eagle", "model": "x", "draft_tensor_parallel_size": 1}')


# --- start-up lines ---------------------------------------------------------------------------------------

def engine_with(pooling: PoolingConfig | None = None, tp: int = 1) -> AsyncLLM:
    """An AsyncLLM that is not started, given the info a started engine would have sent."""
    engine = AsyncLLM(EngineConfig(), served_model_name="m")
    engine.info = EngineInfo(model_path="m.gguf", architecture="LlamaForCausalLM", vocab_size=32,
                             max_position_embeddings=512, max_model_len=512, eos_token_ids=[2], device="cpu",
                             dtype="float32", tensor_parallel_size=tp, pooling=pooling,
                             kv_cache=KVCacheInfo(num_blocks=64, block_size=16, dtype="float32",
                                                  full_length_requests=2))
    return engine


def test_the_serve_ready_line_states_tensor_parallel_and_the_kv_capacity():
    line = ready_line("http://127.0.0.1:8000", engine_with(tp=2))
    assert "| tensor parallel 2 |" in line
    assert "64 blocks x 16 tokens | 2 full-length (512-token) requests fit" in line


def test_an_embedding_engines_ready_line_states_no_kv_capacity():
    pooling = PoolingConfig(method="mean", normalize=True, dimensions=8)
    line = ready_line("http://127.0.0.1:8000", engine_with(pooling=pooling))
    assert "KV cache" not in line and "requests fit" not in line
    assert "embeddings of up to 512 tokens" in line


# --- chat -------------------------------------------------------------------------------------------------

def test_a_message_between_triple_quotes_spans_lines():
    lines = iter(["second line", "", 'last line"""'])
    assert read_message('"""first line', lambda prompt: next(lines)) == "first line\nsecond line\n\nlast line"


def test_a_one_line_message_may_sit_between_triple_quotes():
    assert read_message('"""just this"""', lambda prompt: pytest.fail("read past the closing marks")) == "just this"


@pytest.fixture(scope="module")
def llm(make_llm):
    return make_llm(num_blocks=64, max_model_len=256)


def chat(llm, *lines: str) -> ChatSession:
    feed = iter(lines)

    def read(prompt: str) -> str:
        try:
            return next(feed)
        except StopIteration:
            raise EOFError from None

    session = ChatSession(llm, SamplingParams(max_tokens=2), out=io.StringIO(), err=io.StringIO(), read=read)
    assert session.run() == 0
    return session


def test_an_empty_line_does_not_end_the_chat(llm):
    session = chat(llm, "", "Hello")
    assert [t["role"] for t in session.turns] == ["user", "assistant"]


def test_a_multi_line_message_is_one_user_turn(llm):
    session = chat(llm, '"""Line one', 'line two"""', "/quit")
    assert session.turns[0] == {"role": "user", "content": "Line one\nline two"}
    assert len(session.turns) == 2


def test_a_model_without_a_chat_template_points_to_raw_and_chat_template(llm, monkeypatch):
    monkeypatch.setattr(llm.tokenizer, "chat_template", None)  # as a base model's tokenizer has it
    with pytest.raises(ConfigError, match="has no chat template .*--raw.*--chat-template"):
        require_chat_template(llm, "generate")
