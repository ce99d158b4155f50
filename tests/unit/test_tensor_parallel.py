"""Tensor parallelism on tiny random models (4 heads, 2 or 4 KV heads): TP=2 against TP=1.

Every rank is a real worker process on gloo; the summation order of the all-reduces differs from
one process, so logprobs agree within float tolerance and greedy tokens are identical.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import helpers
import pytest
from helpers import greedy_params, make_request

from tokenloom.config import ConfigError, EngineConfig
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.engine.core import EngineCore
from tokenloom.executor.base import ExecutorFault

pytestmark = pytest.mark.tp

KINDS = ["llama", "llama_tied_gqa", "qwen2", "qwen3"]
PROMPTS = helpers.random_prompts(4, [5, 9, 23, 3], 512, seed=1)
LOGPROB_TOLERANCE = 1e-4  # float32, two partial sums instead of one


def _core(folder: str, **kwargs) -> EngineCore:
    args = dict(model=folder, dtype="float32", device="cpu", log_stats_interval=0, kv_cache_memory=0.05)
    return EngineCore(EngineConfig.from_kwargs(**{**args, **kwargs}), progress=False)


@pytest.fixture(scope="module")
def cores(tiny_models):
    """cores(kind, tp): one engine per (kind, size) for the module; the TP=2 ones are shut down at the end."""
    built = {}

    def get(kind: str, tp: int) -> EngineCore:
        if (kind, tp) not in built:
            built[kind, tp] = _core(tiny_models(kind)[0], tensor_parallel_size=tp)
        return built[kind, tp]

    yield get
    for core in built.values():
        core.shutdown()


def _prompt_logprobs(core: EngineCore, prompt: list[int]) -> list[float]:
    core.add_request(make_request("p", prompt, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)))
    first = None
    while core.has_unfinished_requests():
        for out in core.step():
            first = first or out.prompt_logprobs
    return [entry[0][1] for entry in first[1:]]


@pytest.mark.parametrize("kind", KINDS)
def test_tp2_prompt_logprobs_match_tp1_within_float_tolerance(cores, kind):
    for prompt in PROMPTS[:3]:
        one, two = _prompt_logprobs(cores(kind, 1), prompt), _prompt_logprobs(cores(kind, 2), prompt)
        assert len(one) == len(two) == len(prompt) - 1
        assert max(abs(a - b) for a, b in zip(one, two)) < LOGPROB_TOLERANCE


@pytest.mark.parametrize("kind", KINDS)
def test_tp2_greedy_output_is_identical_to_tp1(cores, kind):
    params = greedy_params(12)
    assert helpers.generate_tokens(cores(kind, 2), PROMPTS, params) == helpers.generate_tokens(
        cores(kind, 1), PROMPTS, params)


def test_tp2_seeded_sampling_and_n_forks_match_tp1(cores):
    """Generators live on rank 0 and the siblings of n > 1 fork there as they do in one process."""
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)

    def run(core):
        core.add_request(make_request("s", PROMPTS[1], params))
        return helpers.run_to_completion(core)

    assert run(cores("llama", 2)) == run(cores("llama", 1))


def test_a_size_that_does_not_divide_the_heads_is_a_one_line_config_error(tiny_models):
    with pytest.raises(ConfigError, match=r"^tensor_parallel_size 3 does not divide its 4 attention heads"):
        _core(tiny_models("llama")[0], tensor_parallel_size=3)


def test_the_uni_executor_runs_one_rank_only():
    with pytest.raises(ConfigError, match="needs 'mp'"):
        EngineConfig.from_kwargs(tensor_parallel_size=2, distributed_executor_backend="uni")


def test_the_mp_executor_at_size_one_matches_uni(cores, tiny_models):
    core = _core(tiny_models("llama")[0], distributed_executor_backend="mp")
    try:
        assert helpers.generate_tokens(core, PROMPTS, greedy_params(6)) == helpers.generate_tokens(
            cores("llama", 1), PROMPTS, greedy_params(6))
    finally:
        core.shutdown()


def test_a_killed_worker_fails_the_step_at_once(tiny_models):
    core = _core(tiny_models("llama")[0], tensor_parallel_size=2)
    try:
        core.add_request(make_request("k", PROMPTS[2], greedy_params(10_000)))
        core.step()
        os.kill(core.executor.procs[1].pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(ExecutorFault, match=r"worker rank 1 \(pid \d+\) exited with code -9"):
            for _ in range(1000):
                core.step()
        assert time.monotonic() - start < 5
    finally:
        core.shutdown()
    assert all(p.poll() is not None for p in core.executor.procs.values())  # no rank outlives the engine


def test_two_nodes_launched_apart_form_one_group_with_the_output_of_one(cores, tiny_models):
    folder = tiny_models("llama")[0]
    port = helpers.free_port()
    node1 = subprocess.Popen([sys.executable, "-m", "tokenloom.entrypoints.cli", "serve", folder,
                              "--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "1",
                              "--master-addr", "127.0.0.1", "--master-port", str(port), "--dtype", "float32",
                              "--device", "cpu", "--kv-cache-memory", "0.05"])
    try:
        core = _core(folder, tensor_parallel_size=2, nnodes=2, node_rank=0, master_addr="127.0.0.1",
                     master_port=port)
        try:
            got = helpers.generate_tokens(core, PROMPTS, greedy_params(8))
        finally:
            core.shutdown()
        assert node1.wait(30) == 0  # node 0's shutdown reached the other node's rank
    finally:
        node1.kill()
    assert got == helpers.generate_tokens(cores("llama", 1), PROMPTS, greedy_params(8))


def test_tp2_with_speculative_decoding_matches_tp1_without(cores, tiny_models):
    """Every rank verifies the same drafts (they travel in the step contract); rank 0 alone samples."""
    core = _core(tiny_models("llama")[0], tensor_parallel_size=2,
                 speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    try:
        prompts = [[5, 6, 7, 8] * 5, [11, 12, 13] * 6]
        params = greedy_params(16)
        assert helpers.generate_tokens(core, prompts, params) == helpers.generate_tokens(cores("llama", 1), prompts,
                                                                                        params)
        assert core.stats()["spec_num_drafts"] > 0
    finally:
        core.shutdown()
