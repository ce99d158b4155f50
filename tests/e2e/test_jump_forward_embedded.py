"""Jump-forward decoding on the embedded model (offline LLM, greedy unless said): text a grammar forces is
emitted in the tokenizer's own tokens, in one step, and what the model writes after it is what it writes
with that text in its prompt. A forced tool call's scaffold no longer eats the token budget."""
from __future__ import annotations

import json

import pytest

from tokenloom import SamplingParams
from tokenloom.structured.jump_forward import canonical_tokens
from tokenloom.structured.spec import close_objects
from tokenloom.structured.tool_parsers import HermesToolParser

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CHAT = [{"role": "user", "content": "What is the weather like in Paris today?"}]
SCAFFOLD = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "'
REQUIRED = {"structural_tag": HermesToolParser().structural_tag([{"name": "get_weather",
                                                                  "parameters": close_objects(WEATHER)}])}


@pytest.fixture(scope="module")
def llm(make_llm):
    return make_llm(num_blocks=256, max_model_len=1024)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=kw.pop("max_tokens", 40), **kw)


def prompt_ids(llm) -> list[int]:
    text = llm.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
    return llm.tokenizer.encode(text, add_special_tokens=False)


def the_call(text: str) -> dict:
    assert text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>"), text
    return json.loads(text[len("<tool_call>\n"):-len("\n</tool_call>")])


def test_a_required_call_completes_within_40_tokens_with_its_scaffold_in_canonical_tokens(llm):
    out = llm.generate([prompt_ids(llm)], greedy(structured_outputs=REQUIRED), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop", out.text
    call = the_call(out.text)
    assert call["name"] == "get_weather" and isinstance(call["arguments"]["city"], str)
    scaffold = llm.tokenizer.encode(SCAFFOLD, add_special_tokens=False)
    assert out.token_ids[:len(scaffold)] == scaffold
    closing = llm.tokenizer.encode("}}\n</tool_call>", add_special_tokens=False)
    free = len(out.token_ids) - len(scaffold) - len(closing) - 1  # the value, and the end-of-turn token
    assert free <= 4, [llm.tokenizer.decode([t]) for t in out.token_ids]


def test_what_follows_a_forced_stretch_is_what_the_model_writes_with_the_stretch_in_its_prompt(llm):
    """The forced tokens' KV, computed as a chunk in the step after them, is the KV a prefill computes."""
    forced, choices = "The city is ", ["Paris", "London", "Rome", "Berlin"]
    options = " | ".join(json.dumps(c) for c in choices)
    prompt = prompt_ids(llm)
    jumped = llm.generate([prompt], greedy(logprobs=1, structured_outputs={
        "grammar": f'root ::= "{forced}" ({options})'}), use_tqdm=False)[0].outputs[0]
    stretch = canonical_tokens(llm.tokenizer, forced, prompt[-1])
    assert jumped.token_ids[:len(stretch)] == stretch
    reference = llm.generate([prompt + stretch], greedy(logprobs=1, structured_outputs={
        "grammar": f"root ::= ({options})"}), use_tqdm=False)[0].outputs[0]
    assert jumped.token_ids[len(stretch):] == reference.token_ids
    for got, want in zip(jumped.logprobs[len(stretch):], reference.logprobs):
        (token, lp), = [(t, p.logprob) for t, p in got.items() if p.rank == 1]
        assert want[token].logprob == pytest.approx(lp, abs=1e-3)


def test_forced_text_arrives_in_one_streamed_delta(llm):
    texts = [o.outputs[0].text for o in llm.generate_stream([prompt_ids(llm)], greedy(structured_outputs={
        "json": WEATHER}))]
    assert texts[0] == '{"city": "'


def test_forced_tokens_count_as_output_tokens_and_carry_logprob_zero(llm):
    out = llm.generate([prompt_ids(llm)], greedy(logprobs=2, structured_outputs=REQUIRED),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids)
    scaffold = llm.tokenizer.encode(SCAFFOLD, add_special_tokens=False)
    for token, entry in zip(scaffold, out.logprobs):
        assert entry[token].logprob == 0.0 and entry[token].rank == 1


def test_a_stop_string_inside_forced_text_cuts_the_output_there(llm):
    out = llm.generate([prompt_ids(llm)], greedy(stop=["arguments"], structured_outputs=REQUIRED),
                       use_tqdm=False)[0].outputs[0]
    assert (out.text, out.finish_reason) == ('<tool_call>\n{"name": "get_weather", "', "stop")


@pytest.mark.slow  # ~18 s on 2 loaded cores
def test_each_of_n_sampled_sequences_gets_the_forced_text(llm):
    outs = llm.generate([prompt_ids(llm)], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=40,
                                                          structured_outputs=REQUIRED), use_tqdm=False)[0].outputs
    assert len(outs) == 3
    for out in outs:
        assert out.text.startswith(SCAFFOLD)
        if out.finish_reason == "stop":
            assert the_call(out.text)["name"] == "get_weather"


@pytest.mark.slow  # ~60 s on 2 loaded cores
def test_a_preempted_sequence_recomputes_its_forced_tokens_and_answers_the_same(llm, make_llm):
    """Six calls at once in 12 blocks of 16 tokens: some are preempted while they write their calls, and their
    forced tokens are recomputed with the rest."""
    prompts = [prompt_ids(llm)] * 6
    small = make_llm(num_blocks=12, block_size=16, enable_prefix_caching=False, max_model_len=1024)
    got = small.generate(prompts, greedy(structured_outputs=REQUIRED), use_tqdm=False)
    assert small.engine.stats()["num_preemptions"] > 0
    want = llm.generate(prompts[:1], greedy(structured_outputs=REQUIRED), use_tqdm=False)[0].outputs[0]
    assert all(o.outputs[0].token_ids == want.token_ids for o in got)
