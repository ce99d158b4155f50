"""Command lines copied from vLLM and llama.cpp parse with their meaning, or fail in one line naming the flag.

Parsing only (no model is loaded): `build_parser` is the parser `tokenloom` itself uses.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

import tokenloom
from tokenloom.config import ConfigError, EngineConfig, ModelConfig
from tokenloom.entrypoints.cli import build_parser
from tokenloom.entrypoints.compat import UNSUPPORTED, apply_threads, check_common_args, read_chat_template
from tokenloom.metrics import ServerMetrics, build_1_2_5_buckets


def parse(*args: str):
    return build_parser(args[0]).parse_args(list(args))


@pytest.mark.parametrize("flag", sorted(f for flags in UNSUPPORTED for f in flags if f.startswith("--")))
def test_unsupported_flag_is_refused_naming_it(flag):
    with pytest.raises(ConfigError, match="^" + flag + ": "):
        parse("serve", flag, "x")


def test_unsupported_flag_message_says_what_is_missing():
    with pytest.raises(ConfigError, match="--pipeline-parallel-size: pipeline parallelism is not supported"):
        parse("serve", "--pipeline-parallel-size", "2")


def test_vllm_lora_flags_parse_with_their_meaning():
    ns = parse("serve", "--enable-lora", "--max-loras", "4", "--max-lora-rank", "32", "--max-cpu-loras", "8",
               "--lora-modules", "sql=/a", '{"name": "chat", "path": "/b", "base_model_name": "base"}')
    lora = EngineConfig.from_args(ns).lora
    assert (lora.enable_lora, lora.max_loras, lora.max_lora_rank, lora.max_cpu_loras) == (True, 4, 32, 8)
    assert ns.lora_modules == ["sql=/a", '{"name": "chat", "path": "/b", "base_model_name": "base"}']


def test_unsupported_flag_is_refused_on_generate_too():
    with pytest.raises(ConfigError, match="--speculative-model"):
        parse("generate", "hi", "--speculative-model", "x")


def test_served_model_name_takes_several_names_and_keeps_the_model_positional():
    ns = parse("serve", "my-model.gguf", "--served-model-name", "a", "b")
    assert ns.model == "my-model.gguf"
    assert ns.served_model_name == ["a", "b"]


def test_llama_cpp_alias_flag_names_the_served_model():
    assert parse("serve", "-a", "short").served_model_name == ["short"]


@pytest.mark.parametrize("command", ["serve", "generate", "chat"])
def test_model_option_is_spelled_the_same_on_every_command(command):
    args = [command] + (["hi"] if command == "generate" else []) + ["-m", "x.gguf"]
    ns = parse(*args)
    assert (ns.model_option if command == "serve" else ns.model) == "x.gguf"


@pytest.mark.parametrize("spelling,dtype", [("half", "float16"), ("float16", "float16"), ("fp16", "float16"),
                                            ("bfloat16", "bfloat16"), ("bf16", "bfloat16"), ("float", "float32"),
                                            ("float32", "float32"), ("auto", "auto")])
def test_dtype_spellings_of_vllm_and_llama_cpp(spelling, dtype):
    assert EngineConfig.from_args(parse("serve", "--dtype", spelling)).model.dtype == dtype


def test_unknown_dtype_is_a_config_error():
    with pytest.raises(ConfigError, match="fp17"):
        ModelConfig(dtype="fp17")


def test_llama_cpp_ctx_size_is_max_model_len():
    assert EngineConfig.from_args(parse("generate", "hi", "-c", "777")).model.max_model_len == 777


def test_llama_cpp_parallel_is_max_num_seqs():
    assert EngineConfig.from_args(parse("serve", "-np", "3")).scheduler.max_num_seqs == 3


def test_num_gpu_blocks_override_is_num_blocks():
    assert EngineConfig.from_args(parse("serve", "--num-gpu-blocks-override", "99")).cache.num_blocks == 99


def test_async_scheduling_flag_and_fastdeploys_name_for_it():
    assert EngineConfig.from_args(parse("serve", "--async-scheduling")).scheduler.async_scheduling
    assert EngineConfig.from_args(parse("serve", "--enable-overlap-schedule")).scheduler.async_scheduling
    assert not EngineConfig.from_args(parse("serve")).scheduler.async_scheduling


def test_threads_flag_and_its_short_form():
    assert parse("generate", "hi", "-t", "3").threads == 3
    assert parse("serve", "--threads", "2").threads == 2


def test_threads_sets_this_process_and_the_engines(monkeypatch):
    import torch
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        apply_threads(1)
        assert torch.get_num_threads() == 1
        assert os.environ["OMP_NUM_THREADS"] == "1"
    finally:
        torch.set_num_threads(before)


def test_zero_threads_is_refused():
    with pytest.raises(ConfigError, match="--threads"):
        check_common_args(parse("generate", "hi", "-t", "0"))


@pytest.mark.parametrize("flag", ["--trust-remote-code", "--enable-prefix-caching", "--enable-chunked-prefill",
                                  "--enforce-eager", "--enable-auto-tool-choice", "--disable-log-requests"])
def test_vllm_flags_whose_meaning_tokenloom_has_are_accepted(flag):
    parse("serve", flag)


def test_quantization_gguf_is_accepted_and_others_refused():
    check_common_args(parse("serve", "--quantization", "gguf"))
    with pytest.raises(ConfigError, match="--quantization awq"):
        check_common_args(parse("serve", "--quantization", "awq"))


def test_cors_flags_take_vllms_json_lists_and_allow_no_origin_by_default():
    ns = parse("serve")
    assert (ns.allowed_origins, ns.allowed_methods, ns.allowed_headers, ns.allow_credentials) == (
        [], ["*"], ["*"], False)
    ns = parse("serve", "--allowed-origins", '["http://a.example", "http://b.example"]', "--allow-credentials")
    assert ns.allowed_origins == ["http://a.example", "http://b.example"] and ns.allow_credentials


def test_disable_log_requests_keeps_request_logging_off_and_access_log_default_off():
    ns = parse("serve", "--disable-log-requests")
    assert ns.log_requests == "off" and ns.access_log is False
    assert parse("serve", "--enable-log-requests").log_requests == "lifecycle"


def test_chat_template_is_read_from_a_file_or_given_inline(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert read_chat_template(str(path)) == path.read_text()
    assert read_chat_template("{{ messages }}") == "{{ messages }}"
    with pytest.raises(ConfigError, match="--chat-template"):
        read_chat_template("/no/such/template.jinja")


def test_version_flag_prints_the_version():
    proc = subprocess.run([sys.executable, "-m", "tokenloom.entrypoints.cli", "--version"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"tokenloom {tokenloom.__version__}"


def test_token_count_buckets_are_vllms_1_2_5_series():
    assert build_1_2_5_buckets(100) == (1, 2, 5, 10, 20, 50, 100)


def test_metrics_prefix_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("TOKENLOOM_METRICS_PREFIX", "vllm")
    text = ServerMetrics("m").render().decode()
    assert "vllm:num_requests_running" in text and "tokenloom:" not in text
