"""What the scheduler decides travels in the step contract once, and as decided: an n > 1 fork is one event
the workers apply to match the scheduler's sequences; a grammar trims drafts before their KV slots are
allocated; the EngineCore passes the contract to the executor unchanged."""
from __future__ import annotations

from concurrent.futures import Future

import msgspec
import torch
from helpers import make_request, run_to_completion

from tokenloom.config import SchedulerConfig, SpeculativeConfig
from tokenloom.core.contract import ForkData, ModelRunnerOutput, SampledSequence, SchedulerOutput
from tokenloom.core.request import Request
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.scheduler.kv_cache_manager import KVCacheManager
from tokenloom.scheduler.scheduler import Scheduler
from tokenloom.structured.matcher import StructuredState

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


class ForbidTokenMatcher:
    """An xgrammar GrammarMatcher stand-in whose grammar allows every token but one, forever."""

    def __init__(self, forbidden: int):
        self.forbidden = forbidden
        self.accepted: list[int] = []

    def is_terminated(self) -> bool:
        return False

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        word, bit = divmod(self.forbidden, 32)
        value = int(bitmask[row, word]) & ~(1 << bit)
        bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value
        return True

    def accept_token(self, token: int) -> bool:
        if token == self.forbidden:
            return False
        self.accepted.append(token)
        return True

    def rollback(self, k: int) -> None:
        del self.accepted[len(self.accepted) - k:]


def forbidding(token: int) -> StructuredState:
    ready: Future = Future()
    ready.set_result((None, None, None))
    state = StructuredState(ready, [])
    state._materialized, state.matcher = True, ForbidTokenMatcher(token)
    return state


def _record_steps(core) -> list[SchedulerOutput]:
    """The steps the executor receives, in order."""
    seen = []
    real = core.executor.execute_model

    def execute(step):
        seen.append(step)
        return real(step)
    core.executor.execute_model = execute
    return seen


# ---- forks --------------------------------------------------------------------------------------

def test_a_fork_is_one_event_and_the_workers_then_hold_the_schedulers_sequences(make_core):
    core = make_core(block_size=4)
    runner = core.executor.worker.runner
    steps = _record_steps(core)
    params = SamplingParams(n=3, temperature=0.9, seed=7, max_tokens=6, ignore_eos=True)
    core.add_request(make_request("r", list(range(3, 13)), params))  # 10 prompt tokens: a partial last block
    checked = []

    def after_step(core, _):
        if not steps or not steps[-1].forks:
            return
        sched = core.scheduler.requests
        assert set(runner.requests) == set(sched)
        for key, r in sched.items():
            w = runner.requests[key]
            assert (w.block_ids, w.token_ids, w.index) == (r.block_ids, r.token_ids[:r.sent_tokens], r.index)
            assert w.num_computed_tokens + steps[-1].num_scheduled_tokens.get(key, 0) == r.num_computed_tokens
            assert len(w.generators) == 1
        checked.append(True)
    out = run_to_completion(core, on_step=after_step)

    forks = [f for s in steps for f in s.forks]
    assert forks == [ForkData(parent_key="r", children=forks[0].children)] and checked == [True]
    assert [(c.key, c.index) for c in forks[0].children] == [("r#1", 1), ("r#2", 2)]
    parent_blocks = next(s for s in steps if s.new_requests).new_requests[0].block_ids
    for child in forks[0].children:  # the full blocks shared, the partial last one a copy
        assert child.block_ids[:2] == parent_blocks[:2] and child.block_ids[2] != parent_blocks[2]
    copies = next(s for s in steps if s.forks).block_copies
    assert sorted(dst for _, dst in copies) == sorted(c.block_ids[2] for c in forks[0].children)
    assert sorted(out) == [("r", 0), ("r", 1), ("r", 2)] and all(len(t) == 6 for t in out.values())


def test_children_that_finished_on_their_first_token_are_never_created_on_the_workers(make_core):
    core = make_core()
    runner = core.executor.worker.runner
    steps = _record_steps(core)
    params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=1)
    core.add_request(make_request("r", list(range(3, 13)), params))
    out = run_to_completion(core)
    assert sorted(out) == [("r", 0), ("r", 1), ("r", 2)]
    core.add_request(make_request("next", [3, 4, 5], SamplingParams(max_tokens=2)))
    run_to_completion(core)  # the workers hear of what ended with the next step
    assert not any(s.forks for s in steps)
    assert [key for s in steps for key in s.finished_keys] == ["r"]
    assert set(runner.requests) == {"next"}


# ---- grammars and drafts ---------------------------------------------------------------------------

def test_drafts_a_grammar_forbids_are_trimmed_before_their_slots_are_allocated():
    block_size = 2
    kv = KVCacheManager(64, block_size, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), kv, 256,
                      speculative=SpeculativeConfig(**NGRAM), vocab_size=64)
    req = Request("g", [1, 2, 3, 4, 1, 2, 3], SamplingParams(temperature=0.0, max_tokens=8))
    req.structured = forbidding(2)
    sched.add_request(req)
    prefill = sched.schedule()
    assert "g" in prefill.grammar_bitmask  # it samples after its prompt
    sched.update_from_output(prefill, ModelRunnerOutput(sampled={"g": [SampledSequence([4])]}), 256)

    step = sched.schedule()  # the n-gram drafts [1, 2, 3]: the grammar allows [1] only
    assert step.spec_token_ids == {"g": [1]} and req.spec_token_ids == [1]
    assert step.num_scheduled_tokens == {"g": 2}
    assert len(step.spec_grammar_bitmask["g"]) == 2 and "g" not in step.grammar_bitmask
    # Room for the last token and the kept draft, not for the dropped ones.
    assert len(req.block_ids) == -(-(req.num_computed_tokens + 2) // block_size)
    assert step.cached_requests[0].new_block_ids == req.block_ids[-1:]


def test_the_engine_core_passes_the_schedulers_output_to_the_executor_unchanged(make_core):
    core = make_core(speculative_config=NGRAM, block_size=4)
    returned: list[bytes] = []
    schedule = core.scheduler.schedule

    def snapshot():
        out = schedule()
        returned.append(msgspec.msgpack.encode(out))
        return out
    core.scheduler.schedule = snapshot
    steps = _record_steps(core)
    prompt = [5, 6, 7, 8, 9] * 4
    core.add_request(make_request("s", prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)))
    core.scheduler.requests["s"].structured = forbidding(7)
    core.add_request(make_request("n", prompt[:-1], SamplingParams(n=2, seed=3, temperature=1.0, max_tokens=8,
                                                                     ignore_eos=True)))
    out = run_to_completion(core)
    assert 7 not in out[("s", 0)] and len(out[("s", 0)]) == 16
    assert [msgspec.msgpack.encode(s) for s in steps] == returned
    assert any(s.forks for s in steps) and any(s.spec_token_ids for s in steps)
    assert any("s" in s.spec_grammar_bitmask or "s" in s.grammar_bitmask for s in steps)
