"""Speculative decoding (n-gram, and the model as its own draft) on the embedded model, against the same model
with speculation off."""
from __future__ import annotations

import json
import math

import pytest

from tokenloom import SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
CODE = "def total(xs):\n    s = 0\n    for x in xs:\n        s += x * x\n    return s\n"
CHATS = [
    [{"role": "user", "content": "Repeat this code exactly:\n" + CODE}],
    [{"role": "user", "content": "Write the numbers from 1 to 30, separated by commas."}],
    [{"role": "user", "content": "What is the capital of France?"}],
]


def chi2_critical(df: int, z: float = 3.090) -> float:
    """Upper quantile of chi-square(df) by the Wilson-Hilferty approximation; z = 3.090 is alpha = 0.001."""
    c = 2 / (9 * df)
    return df * (1 - c + z * math.sqrt(c)) ** 3


@pytest.fixture(scope="module")
def pair(make_llm):
    return make_llm(), make_llm(speculative_config=NGRAM)


def test_greedy_chat_output_identical(pair):
    off, on = pair
    params = SamplingParams(temperature=0.0, max_tokens=48)
    want = [o.outputs[0].token_ids for o in off.chat(CHATS, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in on.chat(CHATS, params, use_tqdm=False)]
    assert got == want
    assert on.engine.stats()["spec_num_accepted_tokens"] > 0


def test_stop_string_with_speculation(pair):
    off, on = pair
    full = off.chat(CHATS[:1], SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)[0].outputs[0].text
    stop = full[24:28]  # a stop string inside what the model writes
    params = SamplingParams(temperature=0.0, max_tokens=32, stop=[stop])
    want = off.chat(CHATS[:1], params, use_tqdm=False)[0].outputs[0]
    got = on.chat(CHATS[:1], params, use_tqdm=False)[0].outputs[0]
    assert (got.text, got.finish_reason) == (want.text, want.finish_reason)
    assert want.finish_reason == "stop" and stop not in got.text


def test_structured_output_with_speculation(pair):
    """The grammar masks every verified position and the matcher rolls back over the drafts it tried."""
    off, on = pair
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "admin": {"type": "boolean"}}, "required": ["name", "admin"]}
    chat = [{"role": "user", "content": 'Repeat this JSON: {"name": "alice", "admin": true}'}]
    params = SamplingParams(temperature=0.0, max_tokens=32, structured_outputs={"json": schema})
    before = on.engine.stats()["spec_num_drafts"]
    want = off.chat([chat], params, use_tqdm=False)[0].outputs[0]
    got = on.chat([chat], params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason == "stop"
    assert on.engine.stats()["spec_num_drafts"] > before


@pytest.mark.slow
def test_unseeded_sampling_has_the_same_distribution(pair):
    """Chi-square test of homogeneity, speculation off vs on: 200 unseeded draws each of output tokens 2..5
    (as one category; categories expected < 5 times pooled), alpha = 0.001 (critical value by Wilson-Hilferty,
    slightly conservative at df 1: 11.2 against 10.8). On this counting prompt the n-gram proposer drafts
    almost every step and the model leaves the count in ~14% of draws, so accepted and rejected drafts both
    shape the outputs. Measured power: a runner that emits every draft as accepted fails it (chi-square 13.8,
    table [[172, 28], [193, 7]]), by a small margin; ~3 minutes on 2 shared cores, hence slow."""
    off, on = pair
    prompt = "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2,"
    params = SamplingParams(temperature=1.5, top_k=4, max_tokens=5)
    draws = 200
    a = [tuple(o.outputs[0].token_ids[1:]) for o in off.generate([prompt] * draws, params, use_tqdm=False)]
    before = on.engine.stats()["spec_num_accepted_tokens"]
    b = [tuple(o.outputs[0].token_ids[1:]) for o in on.generate([prompt] * draws, params, use_tqdm=False)]
    assert on.engine.stats()["spec_num_accepted_tokens"] - before > 100
    cats = sorted(set(a) | set(b))
    big = [c for c in cats if (a.count(c) + b.count(c)) / 2 >= 5]
    table = [[x.count(c) for c in big] + [draws - sum(x.count(c) for c in big)] for x in (a, b)]
    if table[0][-1] + table[1][-1] == 0:
        table = [row[:-1] for row in table]
    cols = [table[0][j] + table[1][j] for j in range(len(table[0]))]
    chi2 = sum((table[i][j] - cols[j] / 2) ** 2 / (cols[j] / 2) for i in range(2) for j in range(len(cols)))
    df = len(cols) - 1
    assert df >= 1, table
    assert chi2 < chi2_critical(df), (chi2, df, table)


# ---- draft model: the embedded model as its own draft ----------------------------------------------------------
@pytest.fixture(scope="module")
def draft_pair(make_llm, embedded_path):
    """Speculation off, and on with the embedded model as its own draft (small KV caches: ~0.25 GiB each)."""
    return make_llm(kv_cache_memory=0.25), make_llm(
        kv_cache_memory=0.25, speculative_config={"method": "draft_model", "model": embedded_path,
                                                  "num_speculative_tokens": 4})


def test_draft_model_greedy_chat_output_identical(draft_pair):
    off, draft_on = draft_pair
    params = SamplingParams(temperature=0.0, max_tokens=32)
    want = [o.outputs[0].token_ids for o in off.chat(CHATS[:2], params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in draft_on.chat(CHATS[:2], params, use_tqdm=False)]
    assert got == want
    s = draft_on.engine.stats()
    assert s["spec_num_accepted_tokens"] >= 0.9 * s["spec_num_draft_tokens"] > 0


@pytest.mark.slow
def test_draft_model_stop_string_and_structured_output(draft_pair):
    """A stop string inside what the model writes; a JSON schema whose grammar masks every verified position and
    rolls back over the drafts it tried. Slow (~3.5 minutes on 2 busy cores); the n-gram tests above check the
    same scheduler paths in make test, and the tiny-model tests stop ids with a draft model."""
    off, draft_on = draft_pair
    full = off.chat(CHATS[:1], SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)[0].outputs[0].text
    params = SamplingParams(temperature=0.0, max_tokens=32, stop=[full[24:28]])
    want = off.chat(CHATS[:1], params, use_tqdm=False)[0].outputs[0]
    got = draft_on.chat(CHATS[:1], params, use_tqdm=False)[0].outputs[0]
    assert (got.text, got.finish_reason) == (want.text, want.finish_reason) and want.finish_reason == "stop"
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "admin": {"type": "boolean"}}, "required": ["name", "admin"]}
    chat = [{"role": "user", "content": 'Repeat this JSON: {"name": "alice", "admin": true}'}]
    params = SamplingParams(temperature=0.0, max_tokens=32, structured_outputs={"json": schema})
    before = draft_on.engine.stats()["spec_num_drafts"]
    want = off.chat([chat], params, use_tqdm=False)[0].outputs[0]
    got = draft_on.chat([chat], params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason == "stop"
    assert draft_on.engine.stats()["spec_num_drafts"] > before


def test_draft_model_sampled_structured_output_is_valid_json(draft_pair):
    """Sampled drafts (rejection sampling) under a grammar: every output still parses and fits the schema. The
    draft samples without the grammar (it lives in the scheduler), so the prompt asks for text the model would
    write anyway, or the grammar would drop most drafts before the forward. The schema has a free string: text
    the grammar forces (keys, punctuation) is appended without drafting (jump-forward decoding)."""
    _, draft_on = draft_pair
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "note": {"type": "string", "maxLength": 24}},
              "required": ["ok", "note"], "additionalProperties": False}
    chat = [{"role": "user", "content": 'Repeat this JSON: {"ok": true, "note": "all good, thank you"}'}]
    params = SamplingParams(temperature=0.7, seed=3, max_tokens=48, structured_outputs={"json": schema})
    before = draft_on.engine.stats()["spec_num_drafts"]
    for o in draft_on.chat([chat] * 3, params, use_tqdm=False):
        assert o.outputs[0].finish_reason == "stop", o.outputs[0].text
        answer = json.loads(o.outputs[0].text)
        assert isinstance(answer["ok"], bool) and isinstance(answer["note"], str)
    assert draft_on.engine.stats()["spec_num_drafts"] > before
