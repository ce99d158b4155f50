"""LoRA adapters on the embedded model (SmolLM2-135M-Instruct, quantized GGUF): offline against transformers +
PEFT on the same dequantized weights, at one rank and split over three (its 9 heads and 3 KV heads shard at
TP=3), and served by `tokenloom serve` (names, listing, errors, run-time loads).

Tolerance: as test_reference_embedded.py (both sides dequantize the same file and run float32 math): greedy
tokens identical, prompt logprobs within 3e-4.
"""
from __future__ import annotations

import json
import shutil

import helpers
import pytest
from server_harness import ServerProcess

from tokenloom import LLM, LoRARequest, SamplingParams

LOGPROB_TOL = 3e-4
NEW_TOKENS = 8
TEXTS = ["The capital of France is", "def fibonacci(n):\n    "]


@pytest.fixture(scope="module")
def adapter(hf_embedded, tmp_path_factory):
    """(folder, PEFT model): a random rank-16 adapter on every projection."""
    return helpers.make_peft_adapter(hf_embedded, str(tmp_path_factory.mktemp("smol_lora")), r=16, alpha=32, seed=1)


@pytest.fixture(scope="module")
def llm(make_llm):
    return make_llm(num_blocks=128, enable_lora=True)


@pytest.fixture(scope="module")
def prompts(llm):
    return [llm.tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]


@pytest.fixture(scope="module")
def mixed(llm, prompts, adapter):
    """One run: each prompt with the adapter and without it, all in the same batch."""
    lora = LoRARequest("smol-ft", 1, adapter[0])
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, prompt_logprobs=0)
    return llm.generate(prompts + prompts, params, use_tqdm=False, lora_request=[lora] * len(prompts) +
                        [None] * len(prompts))


@pytest.fixture(scope="module")
def peft_greedy(adapter, prompts):
    """transformers + PEFT's greedy tokens for each prompt."""
    return helpers.hf_greedy_batch(adapter[1], prompts, NEW_TOKENS)


def test_adapter_greedy_output_and_prompt_logprobs_match_transformers_with_peft(adapter, prompts, mixed,
                                                                              peft_greedy):
    _, reference = adapter
    want = peft_greedy
    worst = 0.0
    for prompt, out, tokens in zip(prompts, mixed, want):
        assert out.outputs[0].token_ids == tokens, helpers.describe_divergence(reference, prompt,
                                                                                out.outputs[0].token_ids, tokens)
        ref = helpers.hf_log_softmax(reference, prompt)
        for pos in range(1, len(prompt)):
            worst = max(worst, abs(out.prompt_logprobs[pos][prompt[pos]].logprob - ref[pos - 1, prompt[pos]].item()))
    print(f"max abs prompt logprob diff {worst:.2e}")
    assert worst < LOGPROB_TOL


def test_base_requests_beside_adapter_requests_match_the_base_model_alone(llm, prompts, mixed):
    """The mixed batch runs layer by layer; alone, the base requests take the engine's fast path."""
    alone = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
                         use_tqdm=False)
    base_in_mix = mixed[len(prompts):]
    assert [o.outputs[0].token_ids for o in base_in_mix] == [o.outputs[0].token_ids for o in alone]
    assert base_in_mix[0].outputs[0].token_ids != mixed[0].outputs[0].token_ids


@pytest.mark.tp
@pytest.mark.slow  # three worker processes loading the model and the adapter, ~18 s (make soak-ci)
def test_tp3_adapter_and_base_rows_in_one_batch_equal_tp1_and_peft(adapter, prompts, mixed, peft_greedy):
    """Three ranks: q, k, v, gate and up hold their rows of B, o and down their columns of A, the deltas summed
    by the all-reduce with the partial sums; the base rows beside them keep the base model's output."""
    lora = LoRARequest("smol-ft", 1, adapter[0])
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with LLM(progress=False, tensor_parallel_size=3, dtype="float32", device="cpu", num_blocks=128,
             log_stats_interval=0, enable_lora=True) as tp3:
        got = tp3.generate(prompts + prompts, params, use_tqdm=False,
                           lora_request=[lora] * len(prompts) + [None] * len(prompts))
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in mixed]
    assert [o.outputs[0].token_ids for o in got[:len(prompts)]] == peft_greedy


@pytest.fixture(scope="module")
def server(adapter):
    s = ServerProcess("--enable-lora", "--max-loras", "2", "--lora-modules", f"smol-ft={adapter[0]}",
                      env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    yield s
    s.kill()


def _complete(server, model: str) -> dict:
    r = server.post("/v1/completions", json={"model": model, "prompt": TEXTS[0], "max_tokens": NEW_TOKENS,
                                             "temperature": 0, "ignore_eos": True})
    return r.json() if r.status_code == 200 else {"status": r.status_code, **r.json()}


def test_the_model_field_picks_the_adapter_and_models_lists_it_with_its_parent(server, mixed, llm):
    cards = {c["id"]: c for c in server.get("/v1/models").json()["data"]}
    assert cards["smol-ft"]["parent"] == server.model and cards[server.model]["parent"] is None
    got = _complete(server, "smol-ft")["choices"][0]["text"]
    assert got == llm.tokenizer.decode(mixed[0].outputs[0].token_ids)
    assert _complete(server, server.model)["choices"][0]["text"] != got


def _reported_models(server, path: str, body: dict) -> list[str]:
    """The `model` of the answer, or of every streamed chunk or Responses event that carries one."""
    r = server.post(path, json=body)
    assert r.status_code == 200, r.text
    if not body.get("stream"):
        return [r.json()["model"]]
    events = [json.loads(line[len("data: "):]) for line in r.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    return [e["model"] if "model" in e else e["response"]["model"] for e in events
            if "model" in e or "model" in e.get("response", {})]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("api", ["completions", "chat", "responses"])
def test_responses_to_adapter_requests_report_the_adapters_name_as_their_model(server, api, stream):
    """As vLLM answers: the adapter's name in the body and in every chunk; the base model's own name otherwise."""
    content = {"completions": ("/v1/completions", {"prompt": TEXTS[0], "max_tokens": 3}),
               "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}),
               "responses": ("/v1/responses", {"input": "Hi", "max_output_tokens": 3})}
    path, body = content[api]
    for model in ("smol-ft", server.model):
        reported = _reported_models(server, path, {**body, "model": model, "stream": stream})
        assert reported and set(reported) == {model}, (model, reported)


def test_chat_responses_and_anthropic_messages_answer_with_the_adapter_they_name(server):
    """Every API that names a model picks the adapter by it: the same greedy answer from each, not the base
    model's."""
    question = [{"role": "user", "content": "Name a color."}]
    common = {"max_tokens": NEW_TOKENS, "temperature": 0}

    def chat(model: str) -> str:
        r = server.post("/v1/chat/completions", json={"model": model, "messages": question, **common})
        return r.json()["choices"][0]["message"]["content"]

    adapter_text = chat("smol-ft")
    r = server.post("/v1/messages", json={"model": "smol-ft", "messages": question, **common})
    assert r.status_code == 200, r.text
    assert "".join(b["text"] for b in r.json()["content"] if b["type"] == "text") == adapter_text
    r = server.post("/v1/responses", json={"model": "smol-ft", "input": "Name a color.", "temperature": 0,
                                           "max_output_tokens": NEW_TOKENS})
    assert r.status_code == 200, r.text
    assert r.json()["output"][-1]["content"][0]["text"] == adapter_text
    assert chat(server.model) != adapter_text


def test_an_unknown_model_is_a_404_in_openais_shape(server):
    out = _complete(server, "no-such-adapter")
    assert out["status"] == 404 and out["error"]["code"] == "model_not_found"
    assert "smol-ft" in out["error"]["message"]


def test_adapters_load_and_unload_at_run_time_and_bad_ones_are_400s(server, adapter, tmp_path, llm, mixed):
    bad = tmp_path / "bad"
    shutil.copytree(adapter[0], bad)
    (bad / "adapter_model.safetensors").write_bytes(b"\x00" * 8)
    r = server.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(bad)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path", r.text
    r = server.post("/v1/load_lora_adapter", json={"lora_name": "again", "lora_path": adapter[0]})
    assert r.status_code == 200, r.text
    assert _complete(server, "again")["choices"][0]["text"] == llm.tokenizer.decode(mixed[0].outputs[0].token_ids)
    assert server.post("/v1/unload_lora_adapter", json={"lora_name": "again"}).status_code == 200
    assert _complete(server, "again")["status"] == 404
    assert "again" not in {c["id"] for c in server.get("/v1/models").json()["data"]}
    assert server.get("/health").status_code == 200
