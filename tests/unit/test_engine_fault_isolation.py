"""A request whose processing raises inside EngineCore.step fails alone; the batch goes on.

Real engine (tiny random Llama), real fault: a prompt token id outside the vocabulary that
slipped past the frontend's validation makes preparing the step's inputs raise.
"""
from __future__ import annotations

import time

import pytest

from tokenloom.core.messages import EngineCoreRequest
from tokenloom.core.sampling_params import SamplingParams


def _req(rid, prompt, max_tokens=6, n=1):
    return EngineCoreRequest(request_id=rid, prompt_token_ids=list(prompt), arrival_time=time.time(),
                             sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                                            n=n))


def _run(core, max_steps=200):
    tokens: dict[tuple[str, int], list[int]] = {}
    finished: dict[tuple[str, int], tuple[str, str | None]] = {}
    for _ in range(max_steps):
        if not core.has_unfinished_requests():
            break
        for o in core.step():
            tokens.setdefault((o.request_id, o.index), []).extend(o.new_token_ids)
            if o.finish_reason:
                finished[(o.request_id, o.index)] = (o.finish_reason, o.error)
    assert not core.has_unfinished_requests()
    return tokens, finished


# Each test runs with the plain step loop and with async scheduling, where the step after a failed one is
# already running when the failure is read (tokenloom/engine/faults.py: requeue_lost_steps).
overlap = pytest.mark.parametrize("async_scheduling", [False, True], ids=["plain", "async"])

GOOD = {"a": [1, 2, 3, 4, 5], "b": [7, 8, 9], "c": [11, 12, 13, 14, 15, 16, 17, 18, 19]}


@overlap
def test_bad_request_fails_alone_batch_goes_on(make_core, async_scheduling):
    core = make_core(async_scheduling=async_scheduling)
    vocab = core.info.vocab_size
    ref = make_core()
    for rid, p in GOOD.items():
        ref.add_request(_req(rid, p))
    want, _ = _run(ref)

    for rid, p in GOOD.items():
        core.add_request(_req(rid, p))
    core.add_request(_req("bad", [3, vocab + 17, 4]))  # as if validation had a bug
    core.add_request(_req("fork", [21, 22, 23], n=2))
    got, finished = _run(core)
    assert finished[("bad", 0)][0] == "error" and "TokenOutOfVocabulary" in finished[("bad", 0)][1]
    for rid in GOOD:
        assert finished[(rid, 0)] == ("length", None)
        assert got[(rid, 0)] == want[(rid, 0)], rid  # same tokens as without the bad neighbour
    assert finished[("fork", 0)][0] == finished[("fork", 1)][0] == "length"
    assert core.stats()["kv_blocks_used"] == 0  # nothing leaked
    # the engine still serves
    core.add_request(_req("after", GOOD["a"]))
    got, finished = _run(core)
    assert got[("after", 0)] == want[("a", 0)]


@overlap
def test_bad_decode_step_fails_only_that_request(make_core, async_scheduling):
    """A fault that hits a running request mid-generation (injected, as a buggy logits processor would)."""
    from tokenloom.engine.faults import FaultInjector, InjectedFault

    core = make_core(async_scheduling=async_scheduling)
    for rid, p in GOOD.items():
        core.add_request(_req(rid, p, max_tokens=8))
    core.add_request(_req("victim", [99, 5, 6], max_tokens=8))
    for _ in range(3):  # everyone is decoding now
        core.step()
    core.faults = FaultInjector(step_error=99)
    got, finished = _run(core)
    assert finished[("victim", 0)][0] == "error" and InjectedFault.__name__ in finished[("victim", 0)][1]
    assert all(finished[(rid, 0)] == ("length", None) for rid in GOOD)
    assert core.stats()["kv_blocks_used"] == 0


@overlap
def test_engine_wide_fault_is_raised(make_core, async_scheduling):
    """When every request of the batch fails on its own, it is not the requests' fault: step raises (with
    async scheduling, the step() that reads the failed step's result)."""
    core = make_core(async_scheduling=async_scheduling)
    vocab = core.info.vocab_size
    core.add_request(_req("x", [vocab + 1]))
    core.add_request(_req("y", [vocab + 2]))
    with pytest.raises(IndexError):
        for _ in range(3):
            core.step()
