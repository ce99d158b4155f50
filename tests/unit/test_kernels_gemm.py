"""The many-row quantized matmuls on the column-interleaved weight form (csrc/quant_gemm.cpp) against the
plain-torch references, batch invariance bit for bit, and the interleaved form inside QuantizedWeight.

Tolerances as test_kernels_quant.py's: the exact op differs from float32 `x @ W.T` only by summation order,
the W4A8 op from its float64 integer-block reference only by float32 scaling and accumulation.
"""
from __future__ import annotations

import pytest
import torch
from skip_policy import require_kernels
from test_kernels_quant import A8_TOL, EXACT_TOL, FORMATS, _random_weight, _rel

from tokenloom.kernels.quant import interleave, panel_rows, quant_matmul_a8_reference, quant_matmul_reference, unpacked

ROWS = [1, 2, 5, 16, 33, 128, 300]
COLUMNS = 37  # not a multiple of the 16-column panel nor of the 32-column tile


def _ops():
    require_kernels()
    from tokenloom.kernels import quant
    return quant


def _interleaved(n, k, bits, block, seed=0):
    w = _random_weight(n, k, bits, block, seed)
    return w, interleave(w.qweight, w.scales, w.mins, bits, block)


# ---- the layout ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits,block", FORMATS)
def test_rows_read_back_from_the_interleaved_form_are_the_row_major_ones(bits, block):
    w, panels = _interleaved(COLUMNS, 128, bits, block)
    rows = torch.tensor([0, 15, 16, 36, 3, 3])
    q, scales, mins = panel_rows(*panels, bits, rows)
    assert torch.equal(q, unpacked(w.qweight, bits)[rows])
    assert torch.equal(scales, w.scales[rows]) and torch.equal(mins, w.mins[rows])


def test_the_interleaved_form_pads_columns_to_a_whole_tile_with_zero_weights():
    _, (qpacked, scales, mins) = _interleaved(COLUMNS, 64, 4, 32)
    assert qpacked.shape == (4, 2, 256) and scales.shape == mins.shape == (4, 2, 16)
    assert not qpacked[2:].reshape(2, 2, 4, 16, 4)[:, :, :, 5:].any()  # panels 2-3 hold columns 32..36 only
    assert not scales[3].any() and not mins[3].any()


# ---- the ops against their references ------------------------------------------------------------------
@pytest.mark.kernels
@pytest.mark.parametrize("bits,block", FORMATS)
@pytest.mark.parametrize("rows", ROWS)
def test_exact_gemm_matches_float32_over_the_dequantized_weight(bits, block, rows):
    quant = _ops()
    w, panels = _interleaved(COLUMNS, 576, bits, block, seed=rows)
    x = torch.randn(rows, 576)
    got = quant.quant_gemm(x, *panels, COLUMNS, bits, block)
    assert got.shape == (rows, COLUMNS)
    assert _rel(got, quant_matmul_reference(x, w.qweight, w.scales, w.mins, bits, block)) < EXACT_TOL


@pytest.mark.kernels
@pytest.mark.parametrize("bits,block", FORMATS)
@pytest.mark.parametrize("rows", ROWS)
def test_w4a8_gemm_matches_its_integer_block_reference(bits, block, rows):
    quant = _ops()
    w, panels = _interleaved(COLUMNS, 576, bits, block, seed=rows)
    x = torch.randn(rows, 576)
    got = quant.quant_gemm_a8(x, *panels, COLUMNS, bits, block)
    assert _rel(got, quant_matmul_a8_reference(x, w.qweight, w.scales, w.mins, bits, block)) < A8_TOL


@pytest.mark.kernels
@pytest.mark.parametrize("op", ["quant_gemm", "quant_gemm_a8"])
@pytest.mark.parametrize("bits,block", FORMATS)
def test_a_rows_result_is_bit_identical_whatever_the_number_of_rows(op, bits, block):
    """1 and 2 rows decode into registers, up to 8 use one row tile, more a decoded buffer: same bits."""
    quant = _ops()
    _, panels = _interleaved(100, 256, bits, block, seed=3)
    x = torch.randn(257, 256)
    fn = getattr(quant, op)
    full = fn(x, *panels, 100, bits, block)
    for rows in (1, 2, 3, 32):
        for first in (0, 7, 257 - rows):
            got = fn(x[first:first + rows], *panels, 100, bits, block)
            assert torch.equal(got, full[first:first + rows]), (rows, first)


@pytest.mark.kernels
def test_gemm_ops_have_fake_implementations_for_compiled_graphs():
    _ops()
    from torch._subclasses.fake_tensor import FakeTensorMode
    _, panels = _interleaved(8, 64, 4, 32)
    with FakeTensorMode() as mode:
        args = [mode.from_tensor(t) for t in (torch.randn(3, 64), *panels)]
        for op in (torch.ops.tokenloom.quant_gemm, torch.ops.tokenloom.quant_gemm_a8):
            assert op(*args, 8, 4, 32).shape == (3, 8)


@pytest.mark.kernels
def test_a_packed_weight_of_the_wrong_width_is_refused():
    quant = _ops()
    _, panels = _interleaved(COLUMNS, 64, 4, 32)
    with pytest.raises(RuntimeError, match="does not fit"):
        quant.quant_gemm(torch.randn(2, 64), *panels, 70, 4, 32)


# ---- float16 block scales --------------------------------------------------------------------------------
def _gguf_like(n, k, bits, block, seed=0):
    """Scales that are float16 values and mins a scale times -8, as GGUF's Q4_0 stores them."""
    w = _random_weight(n, k, bits, block, seed)
    w.scales = w.scales.half().float()
    w.mins = w.scales * -8.0
    return w


def test_scales_that_are_float16_values_are_interleaved_as_float16():
    w = _gguf_like(COLUMNS, 64, 4, 32)
    _, scales, mins = interleave(w.qweight, w.scales, w.mins, 4, 32)
    assert scales.dtype == mins.dtype == torch.float16


def test_scales_a_float16_would_round_stay_float32():
    w = _random_weight(COLUMNS, 64, 4, 32)  # float32 draws: most are not float16 values
    _, scales, mins = interleave(w.qweight, w.scales, w.mins, 4, 32)
    assert scales.dtype == mins.dtype == torch.float32


def test_rows_read_back_from_float16_panels_are_the_float32_row_major_ones():
    w = _gguf_like(COLUMNS, 128, 4, 32)
    q, scales, mins = panel_rows(*interleave(w.qweight, w.scales, w.mins, 4, 32), 4, torch.arange(COLUMNS))
    assert scales.dtype == torch.float32
    assert torch.equal(scales, w.scales) and torch.equal(mins, w.mins)


@pytest.mark.kernels
@pytest.mark.parametrize("op", ["quant_gemm", "quant_gemm_a8"])
@pytest.mark.parametrize("bits,block", FORMATS)
def test_float16_scales_give_the_float32_scales_products_bit_for_bit(op, bits, block):
    quant = _ops()
    w = _gguf_like(100, 256, bits, block, seed=5)
    qpacked, scales, mins = interleave(w.qweight, w.scales, w.mins, bits, block)
    assert scales.dtype == torch.float16
    fn = getattr(quant, op)
    for rows in (1, 2, 5, 40):
        x = torch.randn(rows, 256)
        assert torch.equal(fn(x, qpacked, scales, mins, 100, bits, block),
                           fn(x, qpacked, scales.float(), mins.float(), 100, bits, block)), rows


@pytest.mark.kernels
def test_scales_and_mins_of_different_dtypes_are_refused():
    quant = _ops()
    w = _gguf_like(COLUMNS, 64, 4, 32)
    qpacked, scales, mins = interleave(w.qweight, w.scales, w.mins, 4, 32)
    with pytest.raises(RuntimeError, match="both float32 or both float16"):
        quant.quant_gemm(torch.randn(2, 64), qpacked, scales, mins.float(), COLUMNS, 4, 32)


# ---- QuantizedWeight in the interleaved form -------------------------------------------------------------
@pytest.mark.parametrize("bits,block", FORMATS)
def test_an_interleaved_weight_keeps_its_values_and_shards_as_before(bits, block):
    w = _random_weight(COLUMNS, 128, bits, block, seed=5)
    packed = w.interleaved()
    assert packed.qweight is None and packed.shape == w.shape
    assert torch.equal(packed.dequantize(), w.dequantize())
    assert torch.equal(packed.rows(3, 20).dequantize(), w.rows(3, 20).dequantize())
    assert torch.equal(packed.narrow(1, 32, 64).dequantize(), w.narrow(1, 32, 64).dequantize())
    ids = torch.tensor([[4, 36], [0, 4]])
    assert torch.equal(packed.embedding(ids), w.embedding(ids))


@pytest.mark.kernels
@pytest.mark.parametrize("int8", [False, True])
def test_an_interleaved_weight_multiplies_like_the_row_major_one(int8):
    _ops()
    w = _random_weight(COLUMNS, 128, 4, 32, seed=6)
    w.activations_int8 = int8
    x = torch.randn(9, 128)
    tol = A8_TOL if int8 else EXACT_TOL
    assert _rel(w.interleaved().linear(x), w.linear(x)) < tol
