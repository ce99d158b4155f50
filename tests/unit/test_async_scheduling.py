"""Async scheduling (--async-scheduling): the next step is scheduled and launched before the outputs of the
step before it are applied. Its outputs must be exactly those of the plain loop; these tests compare the two
engines on a tiny random Llama (real engine, real forward), token for token."""
from __future__ import annotations

import json
import threading

import pytest

from tests.helpers import greedy_params, make_request, random_prompts, run_to_completion
from tokenloom.config import ConfigError, EngineConfig
from tokenloom.core.sampling_params import SamplingParams

LENGTHS = [5, 40, 17, 3, 90, 28, 9, 61]


def _outputs(core, requests) -> dict[tuple[str, int], list[int]]:
    for req in requests:
        core.add_request(req)
    return run_to_completion(core)


def _both(make_core, requests_factory, **engine_args):
    plain = _outputs(make_core(**engine_args), requests_factory())
    overlapped = _outputs(make_core(async_scheduling=True, **engine_args), requests_factory())
    return plain, overlapped


def test_concurrent_requests_of_different_lengths_match_the_plain_loop(make_core):
    prompts = random_prompts(8, LENGTHS, 500, seed=1)

    def requests():
        return [make_request(f"r{i}", p, greedy_params(max_tokens=4 + 5 * i)) for i, p in enumerate(prompts)]

    plain, overlapped = _both(make_core, requests, max_num_batched_tokens=64)
    assert overlapped == plain
    assert [len(overlapped[(f"r{i}", 0)]) for i in range(8)] == [4 + 5 * i for i in range(8)]


def test_stop_tokens_end_requests_where_the_plain_loop_ends_them(make_core):
    prompts = random_prompts(6, LENGTHS, 500, seed=2)
    plain_core = make_core()
    free_run = _outputs(plain_core, [make_request(f"r{i}", p, greedy_params(max_tokens=24))
                                     for i, p in enumerate(prompts)])
    stops = {i: free_run[(f"r{i}", 0)][3 + i] for i in range(6)}  # a token each request samples on its way

    def requests():
        return [make_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stops[i]]))
                for i, p in enumerate(prompts)]

    plain, overlapped = _both(make_core, requests)
    assert overlapped == plain
    for i in range(6):
        assert overlapped[(f"r{i}", 0)][-1] == stops[i]


def test_n_greater_than_one_forks_as_in_the_plain_loop(make_core):
    prompts = random_prompts(3, [7, 33, 12], 500, seed=3)

    def requests():
        return [make_request(f"r{i}", p, SamplingParams(n=3, temperature=0.8, seed=11 + i, max_tokens=9,
                                                        ignore_eos=True)) for i, p in enumerate(prompts)]

    plain, overlapped = _both(make_core, requests)
    assert overlapped == plain
    assert len(overlapped) == 9


def test_seeded_sampling_draws_the_same_tokens(make_core):
    prompts = random_prompts(4, LENGTHS, 500, seed=4)

    def requests():
        return [make_request(f"r{i}", p, SamplingParams(temperature=1.0, top_p=0.9, seed=i, max_tokens=12,
                                                        repetition_penalty=1.2, ignore_eos=True))
                for i, p in enumerate(prompts)]

    plain, overlapped = _both(make_core, requests)
    assert overlapped == plain


def test_preemption_under_a_small_kv_cache_keeps_outputs_exact(make_core):
    prompts = random_prompts(6, [30, 45, 20], 500, seed=5)

    def requests():
        return [make_request(f"r{i}", p, greedy_params(max_tokens=30)) for i, p in enumerate(prompts)]

    plain_core, overlapped_core = make_core(num_blocks=16, block_size=8), make_core(
        num_blocks=16, block_size=8, async_scheduling=True)
    plain, overlapped = _outputs(plain_core, requests()), _outputs(overlapped_core, requests())
    assert overlapped_core.stats()["num_preemptions"] > 0
    assert overlapped == plain


def test_prefix_cache_hits_after_overlapped_steps_give_the_same_tokens(make_core):
    shared = random_prompts(1, [48], 500, seed=6)[0]
    tails = random_prompts(4, [5, 9, 13, 2], 500, seed=7)

    def requests():
        return [make_request(f"r{i}", shared + t, greedy_params(max_tokens=10)) for i, t in enumerate(tails)]

    core = make_core(async_scheduling=True)
    first = _outputs(core, requests())
    again = _outputs(core, requests())  # the shared prompt's blocks now come from the prefix cache
    assert core.stats()["prefix_cache_hits"] > 0
    assert again == first == _outputs(make_core(), requests())


def test_the_next_step_is_launched_before_the_outputs_of_the_last_are_applied(make_core):
    """What the option is for: step() returns with a step still running on the workers."""
    core = make_core(async_scheduling=True)
    core.add_request(make_request("r", [5, 6, 7, 8], greedy_params(max_tokens=5)))
    first = core.step()  # the prefill is launched; nothing of it is known yet
    assert first == [] and core.has_unfinished_requests()
    tokens = run_to_completion(core)[("r", 0)]
    assert len(tokens) == 5


def test_the_forward_runs_on_its_own_thread_while_the_engine_schedules(make_core):
    core = make_core(async_scheduling=True)
    threads: set[str] = set()
    run = core.executor.worker.execute_model

    def recording(step):
        threads.add(threading.current_thread().name)
        return run(step)

    core.executor.worker.execute_model = recording
    _outputs(core, [make_request("r", [5, 6, 7], greedy_params(max_tokens=3))])
    assert threads and threading.current_thread().name not in threads


def test_a_weight_update_between_steps_waits_for_the_step_in_flight(make_core):
    prompts = random_prompts(3, LENGTHS, 500, seed=8)

    def requests():
        return [make_request(f"r{i}", p, greedy_params(max_tokens=8)) for i, p in enumerate(prompts)]

    want = _outputs(make_core(), requests())
    core = make_core(async_scheduling=True)
    for req in requests():
        core.add_request(req)
    got: dict[tuple[str, int], list[int]] = {}
    for _ in range(3):
        for o in core.step():
            got.setdefault((o.request_id, o.index), []).extend(o.new_token_ids)
    assert core._in_flight  # noqa: SLF001 - the state this test is about
    core.update_weights_from_disk(core.info.model_path)  # the same weights: the tokens must not change
    for key, tokens in run_to_completion(core).items():
        got.setdefault(key, []).extend(tokens)
    assert got == want


def test_a_step_that_fails_in_the_worker_voids_the_step_after_it_and_its_requests_run_plainly(make_core, caplog):
    """The next step was launched on samples the failed one never produced: both are void, their requests
    compute again without overlap, the culprit fails alone and the others end as in the plain loop."""
    prompts = random_prompts(3, LENGTHS, 500, seed=9)

    def requests():
        return [make_request(f"r{i}", p, greedy_params(max_tokens=6)) for i, p in enumerate(prompts)]

    want = _outputs(make_core(), requests())
    core = make_core(async_scheduling=True)
    bad = make_request("bad", [3, core.info.vocab_size + 5, 4], greedy_params(max_tokens=6))
    got = _outputs(core, requests() + [bad])
    assert "compute again without overlap" in caplog.text
    assert got.pop(("bad", 0)) == []
    assert got == want
    assert core.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("extra, words", [
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}, "speculative decoding"),
    ({"splitwise_role": "prefill"}, "KV connector"),
    ({"kv_offloading_backend": "native"}, "KV connector"),
    ({"tensor_parallel_size": 2}, "tensor_parallel_size 1"),
])
def test_combinations_it_cannot_run_are_refused_at_start(extra, words):
    with pytest.raises(ConfigError, match=words):
        EngineConfig.from_kwargs(async_scheduling=True, **extra)


# ---- the embedded model, through the offline LLM (detokenizer, stop strings, structured outputs) ------------
CHATS = ["Name three colours.", "Write a haiku about the sea.", "What is 12 times 7?",
         "List the days of the week.", "Say hello in French."]
CITY = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
        "required": ["city", "population"]}


def _texts(llm, params) -> list[list[str]]:
    outputs = llm.chat([[{"role": "user", "content": c}] for c in CHATS], params, use_tqdm=False)
    return [[o.text for o in out.outputs] for out in outputs]


@pytest.fixture(scope="module")
def llms(make_llm):
    return make_llm(num_blocks=256, max_model_len=512), make_llm(num_blocks=256, max_model_len=512,
                                                                async_scheduling=True)


def test_embedded_model_greedy_text_is_the_same_with_stop_strings_and_max_tokens(llms):
    plain, overlapped = llms
    params = [SamplingParams(temperature=0.0, max_tokens=8 + 6 * i, stop=[".", "\n\n"][i % 2:]) for i in range(5)]
    want = _texts(plain, params)
    assert _texts(overlapped, params) == want
    assert any(len(t[0]) > 0 for t in want)


def test_embedded_model_n_best_of_sequences_are_the_same(llms):
    plain, overlapped = llms
    params = SamplingParams(n=3, temperature=0.7, seed=5, max_tokens=16)
    assert _texts(overlapped, params) == _texts(plain, params)


def test_embedded_model_structured_output_is_the_same_and_valid_json(llms):
    plain, overlapped = llms
    params = SamplingParams(temperature=0.0, max_tokens=48, structured_outputs={"json": CITY})
    want = _texts(plain, params)
    got = _texts(overlapped, params)
    assert got == want
    complete = [json.loads(t[0]) for t in got if t[0].rstrip().endswith("}")]
    assert complete and all(set(c) >= {"city", "population"} for c in complete)


def test_the_process_executor_gives_the_same_tokens(make_core):
    """Rank 0 in its own process: the next step waits in its socket while the one before runs."""
    prompts = random_prompts(4, LENGTHS, 500, seed=10)

    def requests():
        return [make_request(f"r{i}", p, greedy_params(max_tokens=5 + 3 * i)) for i, p in enumerate(prompts)]

    want = _outputs(make_core(), requests())
    core = make_core(async_scheduling=True, distributed_executor_backend="mp")
    try:
        assert _outputs(core, requests()) == want
    finally:
        core.shutdown()
