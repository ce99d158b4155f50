"""M-RoPE: the three position streams of a prompt with images equal transformers' `get_rope_index`, decoding
continues them with the same delta, and the rotary embedding that mixes the streams by `mrope_section` rotates
queries and keys as transformers' Qwen2_5_VLRotaryEmbedding + apply_rotary_pos_emb do."""
from __future__ import annotations

import pytest
import torch
from transformers import Qwen2_5_VLConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
    Qwen2_5_VLModel,
    Qwen2_5_VLRotaryEmbedding,
    apply_rotary_pos_emb,
)

from tokenloom.config import ConfigError
from tokenloom.model.models.vision.mrope import (
    ImagePlaceholderError,
    MRotaryEmbedding,
    mrope_decode_positions,
    mrope_positions,
)

IMAGE, VISION_START, VISION_END = 151655, 151652, 151653
MERGE = 2
HEAD_DIM, MROPE_SECTION = 16, [2, 3, 3]


@pytest.fixture(scope="module")
def reference():
    config = Qwen2_5_VLConfig(
        text_config=dict(hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=152000,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                          "mrope_section": MROPE_SECTION}),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64,
                           spatial_merge_size=MERGE),
        image_token_id=IMAGE, vision_start_token_id=VISION_START, vision_end_token_id=VISION_END)
    return Qwen2_5_VLModel(config).eval()


def _prompt(grids: list[tuple[int, int, int]], text_runs: list[int]) -> list[int]:
    """text, then per image <vision_start> placeholders <vision_end> text."""
    tokens = list(range(100, 100 + text_runs[0]))
    for (t, h, w), run in zip(grids, text_runs[1:]):
        tokens += [VISION_START] + [IMAGE] * (t * h * w // MERGE**2) + [VISION_END] + list(range(200, 200 + run))
    return tokens


def _reference_positions(model, tokens, grids):
    ids = torch.tensor([tokens])
    types = (ids == IMAGE).int()
    positions, delta = model.get_rope_index(ids, mm_token_type_ids=types,
                                            image_grid_thw=torch.tensor(grids) if grids else None)
    return positions[:, 0], int(delta)


@pytest.mark.parametrize("grids,text_runs", [
    ([], [9]),
    ([(1, 6, 10)], [4, 5]),
    ([(1, 10, 4), (1, 4, 4)], [3, 2, 6]),
    ([(1, 8, 6)], [0, 0]),
], ids=["no-image", "one-wide-image", "two-images", "image-first-and-last"])
def test_prompt_positions_and_delta_equal_transformers(reference, grids, text_runs):
    tokens = _prompt(grids, text_runs)
    want, want_delta = _reference_positions(reference, tokens, grids)
    got, delta = mrope_positions(tokens, IMAGE, grids, MERGE)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert delta == want_delta


def test_decode_positions_continue_the_prompt_with_its_delta(reference):
    grids = [(1, 6, 10)]
    prompt = _prompt(grids, [4, 5])
    _, delta = mrope_positions(prompt, IMAGE, grids, MERGE)
    extended = prompt + [300, 301, 302]
    want, _ = _reference_positions(reference, extended, grids)
    torch.testing.assert_close(mrope_decode_positions(len(prompt), 3, delta), want[:, len(prompt):], rtol=0, atol=0)


def test_a_prompt_with_fewer_placeholders_than_images_is_refused():
    with pytest.raises(ImagePlaceholderError, match="2 image"):
        mrope_positions(_prompt([(1, 4, 4)], [2, 2]), IMAGE, [(1, 4, 4), (1, 4, 4)], MERGE)


def test_a_cut_placeholder_run_is_refused():
    tokens = _prompt([(1, 4, 4)], [2, 2])
    tokens.remove(IMAGE)
    with pytest.raises(ImagePlaceholderError, match="4 consecutive"):
        mrope_positions(tokens, IMAGE, [(1, 4, 4)], MERGE)


def test_rotation_equals_transformers_for_image_positions(reference):
    grids = [(1, 10, 4), (1, 4, 4)]
    tokens = _prompt(grids, [3, 2, 6])
    positions, _ = mrope_positions(tokens, IMAGE, grids, MERGE)
    hf_rotary = Qwen2_5_VLRotaryEmbedding(reference.config.text_config)
    torch.manual_seed(0)
    q, k = torch.randn(len(tokens), 4, HEAD_DIM), torch.randn(len(tokens), 2, HEAD_DIM)
    cos, sin = hf_rotary(q, positions[:, None, :])
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    got_q, got_k = MRotaryEmbedding(HEAD_DIM, 1000000.0, MROPE_SECTION)(positions, q, k)
    torch.testing.assert_close(got_q, want_q[0].transpose(0, 1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_k, want_k[0].transpose(0, 1), rtol=1e-5, atol=1e-6)


def test_text_positions_rotate_as_a_plain_rope():
    rotary = MRotaryEmbedding(HEAD_DIM, 10000.0, MROPE_SECTION)
    positions = torch.arange(7)
    cos3, sin3 = rotary.cos_sin(positions.expand(3, -1))
    cos1, sin1 = rotary.cos_sin(positions)
    angles = torch.outer(positions.float(), rotary.inv_freq)
    torch.testing.assert_close(cos1, angles.cos())
    torch.testing.assert_close((cos3, sin3), (cos1, sin1))


def test_each_forward_rotates_by_its_own_positions():
    rotary = MRotaryEmbedding(HEAD_DIM, 10000.0, MROPE_SECTION)
    q, k = torch.randn(5, 2, HEAD_DIM), torch.randn(5, 1, HEAD_DIM)
    first = rotary(torch.arange(5).expand(3, -1), q, k)
    later = torch.arange(5).expand(3, -1) + torch.tensor([[0], [7], [3]])
    second = rotary(later, q, k)
    fresh = MRotaryEmbedding(HEAD_DIM, 10000.0, MROPE_SECTION)(later, q, k)
    torch.testing.assert_close(second, fresh, rtol=0, atol=0)
    assert not torch.equal(first[0], second[0])


def test_sections_that_do_not_cover_half_the_head_are_a_config_error():
    with pytest.raises(ConfigError, match="mrope_section"):
        MRotaryEmbedding(HEAD_DIM, 10000.0, [2, 2, 2])
