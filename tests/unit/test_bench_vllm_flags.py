"""`tokenloom bench serve` takes `vllm bench serve`'s flag names and reads ShareGPT-format JSON."""
from __future__ import annotations

import argparse
import json

import pytest

from tokenloom.bench import datasets
from tokenloom.bench.serve import add_serve_bench_args, resolve_vllm_aliases


def parse(*args: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_serve_bench_args(p)
    ns = p.parse_args(list(args))
    resolve_vllm_aliases(ns)
    return ns


@pytest.mark.parametrize("vllm_name,ours", [("random", "random"), ("prefix_repetition", "shared-prefix"),
                                            ("custom", "jsonl"), ("sharegpt", "sharegpt")])
def test_dataset_name_is_an_alias_of_dataset(vllm_name, ours):
    extra = ["--dataset-path", "x.json"] if ours == "sharegpt" else []
    assert parse("--dataset-name", vllm_name, *extra).dataset == ours


def test_random_dataset_flags():
    ns = parse("--random-input-len", "100", "--random-output-len", "20", "--random-range-ratio", "0.5")
    assert (ns.input_len, ns.output_len, ns.range_ratio) == (100, 20, 0.5)


def test_prefix_repetition_flags():
    ns = parse("--prefix-repetition-prefix-len", "64", "--prefix-repetition-num-prefixes", "3",
               "--prefix-repetition-suffix-len", "8", "--prefix-repetition-output-len", "4")
    assert (ns.prefix_len, ns.num_groups, ns.input_len, ns.output_len) == (64, 3, 8, 4)


def test_goodput_becomes_the_slo():
    assert parse("--goodput", "ttft:500", "tpot:50").slo == "ttft=500,tpot=50"


def test_save_result_writes_to_result_dir_and_filename(tmp_path):
    ns = parse("--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json")
    assert ns.json_path == str(tmp_path / "r.json")


def test_save_result_has_a_default_file_name():
    assert parse("--save-result").json_path.startswith("./tokenloom-bench-random-")


@pytest.mark.parametrize("args,endpoint", [(["--backend", "openai-chat"], "chat"), (["--backend", "vllm"],
                                           "completions"), (["--endpoint", "/v1/chat/completions"], "chat"),
                                           (["--endpoint", "/v1/completions"], "completions")])
def test_backend_and_endpoint_paths(args, endpoint):
    assert parse(*args).endpoint == endpoint


def test_host_and_port_make_the_base_url():
    assert parse("--host", "127.0.0.2", "--port", "9001").base_url == "http://127.0.0.2:9001"


def test_host_with_base_url_is_refused():
    with pytest.raises(ValueError, match="--base-url or --host"):
        parse("--base-url", "http://127.0.0.1:1", "--host", "127.0.0.1")


def test_percentile_flags_are_refused_by_name():
    with pytest.raises(ValueError, match="--percentile-metrics"):
        parse("--percentile-metrics", "ttft,tpot")


def _sharegpt(tmp_path, conversations) -> str:
    path = tmp_path / "sg.json"
    path.write_text(json.dumps([{"id": str(i), "conversations": c} for i, c in enumerate(conversations)]))
    return str(path)


def _turns(prompt: str, reply: str) -> list[dict]:
    return [{"from": "human", "value": prompt}, {"from": "gpt", "value": reply}]


def test_sharegpt_prompt_is_the_first_human_turn_and_output_follows_the_reply(tmp_path):
    path = _sharegpt(tmp_path, [_turns("one two three four five six", "a b c d e f g h i j")])
    (p,) = datasets.sharegpt_dataset(path, 1, tokens_per_word=1.0)
    assert p.prompt == "one two three four five six"
    assert p.output_len == 10 and p.input_len == 6


def test_sharegpt_output_len_overrides_the_reply(tmp_path):
    path = _sharegpt(tmp_path, [_turns("one two three four five six", "a b c d e f g h i j")])
    assert datasets.sharegpt_dataset(path, 1, output_len=3)[0].output_len == 3


def test_sharegpt_skips_too_short_and_one_turn_conversations(tmp_path):
    path = _sharegpt(tmp_path, [_turns("hi", "hello there my friend how are you"),
                                [{"from": "human", "value": "only one turn here at all"}],
                                _turns("a long enough prompt of words", "a long enough reply of words")])
    prompts = datasets.sharegpt_dataset(path, 1)
    assert [p.prompt for p in prompts] == ["a long enough prompt of words"]


def test_sharegpt_sample_depends_on_the_seed(tmp_path):
    path = _sharegpt(tmp_path, [_turns(f"prompt number {i} with some words", "reply with several words in it")
                                for i in range(20)])
    a = [p.prompt for p in datasets.sharegpt_dataset(path, 5, seed=0)]
    b = [p.prompt for p in datasets.sharegpt_dataset(path, 5, seed=1)]
    assert a != b and a == [p.prompt for p in datasets.sharegpt_dataset(path, 5, seed=0)]


def test_a_file_that_is_not_sharegpt_is_refused(tmp_path):
    path = tmp_path / "x.json"
    path.write_text('{"prompt": "hi"}')
    with pytest.raises(ValueError, match="ShareGPT"):
        datasets.sharegpt_dataset(str(path), 1)


def test_jsonl_lines_are_taken_from_the_start_line_on(tmp_path):
    """A sweep's later points read the next lines of the file, not the ones an earlier point sent."""
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"prompt {i}"}) + "\n" for i in range(6)))
    first = [p.prompt for p in datasets.jsonl_dataset(str(path), 2, 4)]
    second = [p.prompt for p in datasets.jsonl_dataset(str(path), 2, 4, start=2)]
    assert first == ["prompt 0", "prompt 1"] and second == ["prompt 2", "prompt 3"]
