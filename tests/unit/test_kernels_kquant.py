"""K-quant weights (Q4_K, Q5_K, Q6_K) in the interleaved form with their scales as the file has them: an
integer per sub-block times a float per 256 values (tokenloom/kernels/quant.py `super_block_scales`).

The claim is exactness: the products d*sc and dm*m are the float32 scales and mins the plain form stores,
so the kernels' results are the plain form's bit for bit, at fewer bytes. Blocks are random bytes with
random float16 d and dmin, which is every Q4_K/Q5_K/Q6_K block a file can hold.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from skip_policy import require_kernels
from test_kernels_quant import A8_TOL, EXACT_TOL, _rel

from tokenloom.kernels.quant import (
    interleave,
    panel_rows,
    quant_matmul_a8_reference,
    quant_matmul_reference,
    super_block_scales,
    unpacked,
)
from tokenloom.model.layers.quantized_weight import cat_rows
from tokenloom.model.loader.gguf_repack import repack

BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
FLOAT16_AT = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}  # d (and dmin) in each block
COLUMNS = 37  # not a multiple of the 16-column panel nor of the 32-column tile
K = 512


def _k_weight(type_name: str, rows: int = COLUMNS, cols: int = K, seed: int = 0):
    rng = np.random.default_rng(seed)
    n = rows * cols // 256
    raw = rng.integers(0, 256, (n, BLOCK_BYTES[type_name]), dtype=np.uint8)
    for at in FLOAT16_AT[type_name]:  # finite float16 factors of a realistic size, either sign
        raw[:, at:at + 2] = (rng.uniform(-1e-3, 1e-3, (n, 1)).astype(np.float16)).view(np.uint8)
    return repack(type_name, raw, rows, cols)


def _plain_panels(w):
    return interleave(w.qweight, w.scales, w.mins, w.bits, w.block_size)


def _k_panels(w, bits=None):
    return interleave(w.qweight, w.scales, w.mins, bits or w.bits, w.block_size, w.super_blocks.sub,
                      w.super_blocks.factors)


def _ops():
    require_kernels()
    from tokenloom.kernels import quant
    return quant


# ---- the format ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("type_name", sorted(BLOCK_BYTES))
def test_k_quant_scales_are_the_float32_products_bit_for_bit(type_name):
    w = _k_weight(type_name)
    scales, mins = super_block_scales(w.super_blocks.sub, w.super_blocks.factors)
    assert torch.equal(scales.view(torch.int32), w.scales.view(torch.int32))
    assert torch.equal(mins.view(torch.int32), w.mins.view(torch.int32))


@pytest.mark.parametrize("type_name,shared", [("Q4_K", False), ("Q5_K", False), ("Q6_K", True)])
def test_k_quant_panels_hold_int8_sub_block_scales_and_float32_super_block_factors(type_name, shared):
    w = _k_weight(type_name)
    qpacked, scales, mins = _k_panels(w)
    panels = 4  # 37 columns padded to 64
    assert torch.equal(qpacked, _plain_panels(w)[0])
    assert scales.dtype == torch.int8 and scales.shape == (panels, K // w.block_size, 1 if shared else 2, 16)
    assert mins.dtype == torch.float32 and mins.shape == (panels, K // 256, 2, 16)


def test_a_q4_k_weight_takes_under_five_bits_a_value_in_panels():
    w = _k_weight("Q4_K", rows=64, cols=4096)
    bits = sum(t.numel() * t.element_size() for t in _k_panels(w)) * 8 / (64 * 4096)
    plain = sum(t.numel() * t.element_size() for t in _plain_panels(w)) * 8 / (64 * 4096)
    assert bits == 4.75 and plain == 6.0


def test_a_q6_k_weight_takes_under_seven_bits_a_value_in_its_panels():
    w = _k_weight("Q6_K", rows=64, cols=4096).interleaved()
    assert w.bits == 6
    assert w.nbytes * 8 / (64 * 4096) == 6.75


@pytest.mark.parametrize("type_name,bits", [("Q4_K", 4), ("Q5_K", 6), ("Q6_K", 6)])
def test_panels_take_six_bits_where_every_value_fits_them(type_name, bits):
    assert _k_weight(type_name).interleaved().bits == bits


def test_eight_bit_values_of_64_and_over_stay_bytes():
    w = _k_weight("Q6_K")
    w.qweight[5, 7] = 64
    assert w.interleaved().bits == 8


@pytest.mark.parametrize("type_name", ["Q5_K", "Q6_K"])
def test_rows_read_back_from_six_bit_panels_are_the_row_major_bytes(type_name):
    w = _k_weight(type_name)
    rows = torch.tensor([0, 15, 16, 36, 3, 3])
    q, scales, mins = panel_rows(*_k_panels(w, 6), 6, rows)
    assert torch.equal(q, w.qweight[rows])
    assert torch.equal(scales, w.scales[rows]) and torch.equal(mins, w.mins[rows])


def test_scales_the_factors_do_not_give_exactly_keep_the_plain_form():
    w = _k_weight("Q4_K")
    wrong = w.super_blocks.factors.clone()
    wrong[0, 0, 0] = torch.nextafter(wrong[0, 0, 0], torch.tensor(1.0))
    _, scales, _ = interleave(w.qweight, w.scales, w.mins, 4, 32, w.super_blocks.sub, wrong)
    assert scales.dtype == torch.float32 and scales.dim() == 3


@pytest.mark.parametrize("type_name", sorted(BLOCK_BYTES))
def test_rows_read_back_from_k_quant_panels_are_the_row_major_ones(type_name):
    w = _k_weight(type_name)
    rows = torch.tensor([0, 15, 16, 36, 3, 3])
    q, scales, mins = panel_rows(*_k_panels(w), w.bits, rows)
    assert torch.equal(q, unpacked(w.qweight, w.bits)[rows])
    assert torch.equal(scales, w.scales[rows]) and torch.equal(mins, w.mins[rows])


# ---- QuantizedWeight carries the factors -----------------------------------------------------------------
def test_a_merged_q4_k_and_q6_k_weight_keeps_the_k_quant_form():
    q, v = _k_weight("Q4_K", rows=64, seed=1), _k_weight("Q6_K", rows=32, seed=2)
    merged = cat_rows([q, v])
    assert (merged.bits, merged.block_size) == (8, 16)
    packed = merged.interleaved()
    assert packed.bits == 6 and packed.panels.scales.dtype == torch.int8 and packed.panels.scales.shape[2] == 2
    assert torch.equal(packed.dequantize(), merged.dequantize())


def test_a_k_quant_weight_sharded_on_super_block_edges_keeps_its_factors():
    w = _k_weight("Q4_K").interleaved()
    assert w.panels.scales.dtype == torch.int8
    assert w.rows(3, 20).interleaved().panels.scales.dtype == torch.int8
    assert w.narrow(1, 256, 256).interleaved().panels.scales.dtype == torch.int8
    assert w.narrow(1, 32, 64).interleaved().panels.scales.dtype == torch.float32
    assert torch.equal(w.rows(3, 20).dequantize(), w.row_major().rows(3, 20).dequantize())


def test_a_six_bit_panel_weight_shards_and_reads_back_as_bytes():
    w = _k_weight("Q6_K")
    packed = w.interleaved()
    assert packed.row_major().bits == 8 and torch.equal(packed.row_major().qweight, w.qweight)
    assert torch.equal(packed.rows(3, 20).dequantize(), w.rows(3, 20).dequantize())
    assert torch.equal(packed.narrow(1, 256, 256).dequantize(), w.narrow(1, 256, 256).dequantize())
    ids = torch.tensor([[4, 36], [0, 4]])
    assert torch.equal(packed.embedding(ids), w.embedding(ids))


# ---- the kernels ---------------------------------------------------------------------------------------
@pytest.mark.kernels
@pytest.mark.parametrize("op", ["quant_gemm", "quant_gemm_a8"])
@pytest.mark.parametrize("type_name", sorted(BLOCK_BYTES))
def test_k_quant_panels_give_the_plain_panels_products_bit_for_bit(op, type_name):
    fn = getattr(_ops(), op)
    w = _k_weight(type_name, seed=3)
    k_form, plain = _k_panels(w), _plain_panels(w)
    for rows in (1, 2, 3, 5, 16, 130):
        x = torch.randn(rows, K)
        assert torch.equal(fn(x, *k_form, COLUMNS, w.bits, w.block_size),
                           fn(x, *plain, COLUMNS, w.bits, w.block_size)), rows


@pytest.mark.kernels
@pytest.mark.parametrize("op", ["quant_gemm", "quant_gemm_a8"])
@pytest.mark.parametrize("type_name", ["Q5_K", "Q6_K"])
def test_six_bit_panels_give_the_byte_panels_products_bit_for_bit(op, type_name):
    fn = getattr(_ops(), op)
    w = _k_weight(type_name, seed=4)
    six, plain = _k_panels(w, 6), _plain_panels(w)
    for rows in (1, 2, 3, 5, 16, 130):
        x = torch.randn(rows, K)
        assert torch.equal(fn(x, *six, COLUMNS, 6, w.block_size), fn(x, *plain, COLUMNS, 8, w.block_size)), rows


@pytest.mark.kernels
@pytest.mark.parametrize("int8", [False, True])
def test_a_merged_q4_k_and_q6_k_weight_multiplies_as_its_row_major_blocks(int8):
    _ops()
    merged = cat_rows([_k_weight("Q4_K", rows=64, seed=1), _k_weight("Q6_K", rows=32, seed=2)])
    merged.activations_int8 = int8
    x = torch.randn(3, K)
    assert _rel(merged.interleaved().linear(x), merged.linear(x)) < (A8_TOL if int8 else EXACT_TOL)


@pytest.mark.kernels
@pytest.mark.parametrize("type_name", sorted(BLOCK_BYTES))
@pytest.mark.parametrize("rows", [1, 16, 130])
def test_k_quant_panels_match_the_torch_references(type_name, rows):
    quant = _ops()
    w = _k_weight(type_name, seed=rows)
    x = torch.randn(rows, K)
    args = (w.qweight, *super_block_scales(w.super_blocks.sub, w.super_blocks.factors), w.bits, w.block_size)
    exact = quant.quant_gemm(x, *_k_panels(w), COLUMNS, w.bits, w.block_size)
    a8 = quant.quant_gemm_a8(x, *_k_panels(w), COLUMNS, w.bits, w.block_size)
    assert _rel(exact, quant_matmul_reference(x, *args)) < EXACT_TOL
    assert _rel(a8, quant_matmul_a8_reference(x, *args)) < A8_TOL


@pytest.mark.kernels
def test_int8_scales_with_mins_that_are_not_super_block_factors_are_refused():
    quant = _ops()
    w = _k_weight("Q4_K")
    qpacked, scales, mins = _k_panels(w)
    with pytest.raises(RuntimeError, match="super-block factors"):
        quant.quant_gemm(torch.randn(2, K), qpacked, scales, mins.half(), COLUMNS, 4, 32)
