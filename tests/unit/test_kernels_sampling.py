"""The greedy sampler's native argmax against torch.argmax: the same index for every row, ties, masked
(-inf) logits and NaNs included, on the AVX512 and the AVX2 build."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tokenloom.kernels import sampling_ops

pytestmark = pytest.mark.kernels

VOCAB = 49152  # SmolLM2's


def special_rows() -> torch.Tensor:
    """Rows whose argmax a careless kernel gets wrong: ties, -inf masks, NaNs, the max in the scalar tail."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(10, VOCAB + 5, generator=g)
    rows[1, [7, 900, 40000]] = 50.0  # a three-way tie: the first wins
    rows[2] = float("-inf")  # everything masked: index 0, as torch answers
    rows[3, :-3] = float("-inf")  # only the tail (past the last full vector) is finite
    rows[4, 123] = float("nan")  # a NaN counts as the maximum
    rows[5, [17, 30000]] = float("nan")  # the first NaN
    rows[5, 5] = 1e30
    rows[6, VOCAB + 4] = 99.0  # the max is the last element
    rows[7, 0] = 99.0  # the first
    rows[8, 11] = -0.0  # -0.0 and 0.0 tie as maxima
    rows[8, 12] = 0.0
    rows[8, :11] = -1.0
    rows[8, 13:] = -1.0
    rows[9, ::2] = float("-inf")  # half masked, as allowed_token_ids leaves a row
    return rows


def test_argmax_matches_torch_on_random_rows():
    logits = torch.randn(33, VOCAB, generator=torch.Generator().manual_seed(1))
    assert torch.equal(torch.ops.tokenloom.argmax_rows(logits), logits.argmax(dim=-1))


def test_argmax_matches_torch_on_ties_masks_nans_and_tails():
    rows = special_rows()
    assert torch.equal(torch.ops.tokenloom.argmax_rows(rows), rows.argmax(dim=-1))


@pytest.mark.parametrize("vocab", [1, 7, 16, 17, 100])
def test_argmax_matches_torch_on_short_rows(vocab):
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(vocab))
    assert torch.equal(torch.ops.tokenloom.argmax_rows(logits), logits.argmax(dim=-1))


def test_argmax_reads_rows_of_a_strided_view():
    wide = torch.randn(4, 2 * VOCAB, generator=torch.Generator().manual_seed(2))
    view = wide[:, :VOCAB]
    assert torch.equal(torch.ops.tokenloom.argmax_rows(view), view.argmax(dim=-1))


def test_argmax_rows_falls_back_to_torch_off_the_native_path():
    logits = torch.randn(3, 50, dtype=torch.float64)
    assert torch.equal(sampling_ops.argmax_rows(logits), logits.argmax(dim=-1))


def test_argmax_schema_and_fake():
    torch.library.opcheck(torch.ops.tokenloom.argmax_rows.default, (torch.randn(2, 100),),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.slow
def test_the_avx2_build_answers_the_same():
    code = ("import torch\n"
            "import test_kernels_sampling as t\n"
            "from tokenloom import kernels\n"
            "assert kernels.isa() == 'avx2'\n"
            "rows = t.special_rows()\n"
            "assert torch.equal(torch.ops.tokenloom.argmax_rows(rows), rows.argmax(dim=-1))\n"
            "for vocab in (1, 7, 8, 9, 100):\n"
            "    x = torch.randn(3, vocab)\n"
            "    assert torch.equal(torch.ops.tokenloom.argmax_rows(x), x.argmax(dim=-1))\n"
            "print('ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900,
                          cwd=os.path.dirname(__file__), env={**os.environ, "TOKENLOOM_KERNEL_ISA": "avx2"})
    assert proc.stdout.strip() == "ok", proc.stderr[-3000:]
