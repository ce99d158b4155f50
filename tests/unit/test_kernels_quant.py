"""The kernel layer and the quantized matmuls: each native op against its plain-torch reference, the GGUF
repack against the `gguf` package's dequantization, sharding of quantized weights, and the fallback.

Tolerances: the exact op differs from float32 `x @ W.T` over the dequantized weight only by summation
order (measured <= 5e-7 of the output's magnitude); the W4A8 op from its float64 reference (exact integer
block sums) by float32 scaling and accumulation (measured <= 2e-7).
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from skip_policy import require_kernels

from tokenloom.kernels import cpu_features
from tokenloom.model.layers.quantized_weight import QuantizedSlot, QuantizedWeight, cat_rows
from tokenloom.model.loader.gguf_repack import repack

EXACT_TOL = 2e-6
A8_TOL = 2e-6
FORMATS = [(4, 32), (8, 32), (8, 16)]  # (bits, block): Q4_0/Q4_1/Q4_K; Q8_0/Q5_K; Q6_K


def _native():
    require_kernels()
    from tokenloom.kernels import quant
    return quant


def _random_weight(n: int, k: int, bits: int, block: int, seed: int = 0) -> QuantizedWeight:
    from tokenloom.kernels.quant import pack_nibbles
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16 if bits == 4 else 256, (n, k), dtype=torch.uint8, generator=g)
    scales = torch.rand(n, k // block, generator=g) * 0.02
    mins = -torch.rand(n, k // block, generator=g) * 0.1
    return QuantizedWeight(pack_nibbles(q) if bits == 4 else q, scales, mins, bits, block)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


# ---- the kernel layer ----------------------------------------------------------------------------------
def test_isa_is_chosen_from_the_cpu_flags():
    avx512 = frozenset("avx2 fma f16c avx512f avx512bw avx512vl avx512_vnni avx512_bf16".split())
    assert cpu_features.supported_isas(avx512) == ["avx512", "avx2"]
    assert cpu_features.supported_isas(frozenset("avx2 fma f16c".split())) == ["avx2"]
    assert cpu_features.supported_isas(avx512 - {"avx512_vnni"}) == ["avx2"]
    assert cpu_features.supported_isas(frozenset("sse4_2 avx".split())) == []


def _load_in_subprocess(env: dict) -> subprocess.CompletedProcess:
    code = "import logging; logging.basicConfig(); from tokenloom import kernels; print(kernels.load())"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


def test_kernels_off_forces_the_torch_path():
    proc = _load_in_subprocess({"TOKENLOOM_KERNELS": "off"})
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stderr


@pytest.mark.kernels
def test_a_failed_build_is_one_log_line_and_the_torch_path(tmp_path):
    # kernels on in the child even when this run forces them off (make test-fallback)
    proc = _load_in_subprocess({"TOKENLOOM_KERNEL_CACHE": str(tmp_path), "CXX": "/nonexistent/c++",
                                "TOKENLOOM_KERNELS": "on"})
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if "native kernels unavailable" in line]
    assert len(warnings) == 1, proc.stderr


# ---- the ops against their references ------------------------------------------------------------------
@pytest.mark.kernels
@pytest.mark.parametrize("bits,block", FORMATS)
@pytest.mark.parametrize("rows", [1, 3, 7, 33])
def test_exact_matmul_matches_float32_over_the_dequantized_weight(bits, block, rows):
    quant = _native()
    w = _random_weight(37, 576, bits, block)
    x = torch.randn(rows, 576)
    got = quant.quant_matmul(x, w.qweight, w.scales, w.mins, bits, block)
    want = quant.quant_matmul_reference(x, w.qweight, w.scales, w.mins, bits, block)
    assert got.shape == (rows, 37)
    assert _rel(got, want) < EXACT_TOL


@pytest.mark.kernels
@pytest.mark.parametrize("bits,block", FORMATS)
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_w4a8_matmul_matches_its_integer_block_reference(bits, block, rows):
    quant = _native()
    w = _random_weight(37, 576, bits, block, seed=1)
    x = torch.randn(rows, 576)
    got = quant.quant_matmul_a8(x, w.qweight, w.scales, w.mins, bits, block)
    want = quant.quant_matmul_a8_reference(x, w.qweight, w.scales, w.mins, bits, block)
    assert _rel(got, want) < A8_TOL


@pytest.mark.kernels
@pytest.mark.parametrize("op", ["quant_matmul", "quant_matmul_a8"])
def test_a_rows_result_does_not_depend_on_the_rest_of_the_batch(op):
    quant = _native()
    w = _random_weight(45, 256, 4, 32, seed=2)
    x = torch.randn(11, 256)
    fn = getattr(quant, op)
    batch = fn(x, w.qweight, w.scales, w.mins, 4, 32)
    for i in (0, 5, 10):
        assert torch.equal(fn(x[i:i + 1], w.qweight, w.scales, w.mins, 4, 32)[0], batch[i])


@pytest.mark.kernels
def test_ops_have_fake_implementations_for_compiled_graphs():
    _native()
    from torch._subclasses.fake_tensor import FakeTensorMode
    w = _random_weight(8, 64, 4, 32)
    with FakeTensorMode() as mode:
        args = [mode.from_tensor(t) for t in (torch.randn(3, 64), w.qweight, w.scales, w.mins)]
        for op in (torch.ops.tokenloom.quant_matmul, torch.ops.tokenloom.quant_matmul_a8):
            assert op(*args, 4, 32).shape == (3, 8)


# ---- GGUF blocks -> QuantizedWeight ------------------------------------------------------------------
def _gguf_blocks(type_name: str, rows: int, cols: int) -> np.ndarray:
    """Real quantized blocks (gguf's quantizer) or, for the K-quants it cannot make, random blocks with
    sane fp16 super-block scales."""
    from gguf import GGMLQuantizationType, quants
    rng = np.random.default_rng(0)
    if type_name in ("Q4_0", "Q4_1", "Q5_0", "Q8_0"):
        return quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), GGMLQuantizationType[type_name])
    size, d_at = {"Q4_K": (144, (0, 2)), "Q5_K": (176, (0, 2)), "Q6_K": (210, (208,))}[type_name]
    blocks = rng.integers(0, 256, (rows * cols // 256, size), dtype=np.uint8)
    for at in d_at:
        d = rng.uniform(1e-3, 1e-2, blocks.shape[0]).astype(np.float16)
        blocks[:, at:at + 2] = d.view(np.uint8).reshape(-1, 2)
    return blocks


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_repacked_blocks_hold_exactly_the_gguf_weights(type_name):
    from gguf import GGMLQuantizationType, quants
    blocks = _gguf_blocks(type_name, 6, 512)
    w = repack(type_name, blocks, 6, 512)
    want = torch.from_numpy(quants.dequantize(blocks, GGMLQuantizationType[type_name])).reshape(6, 512)
    assert w.shape == (6, 512)
    assert torch.equal(w.dequantize(), want)


# ---- sharding and assembling ----------------------------------------------------------------------------
@pytest.mark.parametrize("bits,block", FORMATS)
def test_a_block_aligned_column_shard_stays_quantized(bits, block):
    w = _random_weight(4, 256, bits, block)
    part = w.narrow(1, 64, 96)
    assert isinstance(part, QuantizedWeight)
    assert torch.equal(part.dequantize(), w.dequantize()[:, 64:160])


def test_a_column_shard_inside_a_block_falls_back_to_the_dense_slice():
    w = _random_weight(4, 256, 4, 32)
    part = w.narrow(1, 40, 50)
    assert isinstance(part, torch.Tensor)
    assert torch.equal(part, w.dequantize()[:, 40:90])


def test_merged_pieces_of_different_forms_assemble_losslessly():
    """A Q4_K_M file merges 4-bit q/k with Q6_K v into one QKV weight: the slot widens all to one form."""
    pieces = [_random_weight(8, 64, 4, 32, seed=3), _random_weight(4, 64, 8, 16, seed=4),
              _random_weight(4, 64, 8, 32, seed=5)]
    slot = QuantizedSlot((16, 64))
    slot.narrow(0, 0, 8).copy_(pieces[0])
    slot.narrow(0, 12, 4).copy_(pieces[2])
    slot.narrow(0, 8, 4).copy_(pieces[1])
    merged = slot.finalize("qkv")
    assert (merged.bits, merged.block_size) == (8, 16)
    assert torch.equal(merged.dequantize(), torch.cat([p.dequantize() for p in pieces]))
    assert torch.equal(cat_rows(pieces).dequantize(), merged.dequantize())


def test_a_slot_with_rows_never_loaded_is_an_error():
    slot = QuantizedSlot((8, 64))
    slot.narrow(0, 0, 4).copy_(_random_weight(4, 64, 4, 32))
    with pytest.raises(ValueError, match="not loaded"):
        slot.finalize("w")


def test_a_dense_piece_makes_the_weight_dense():
    slot = QuantizedSlot((8, 64))
    q = _random_weight(4, 64, 4, 32)
    dense = torch.randn(4, 64)
    slot.narrow(0, 0, 4).copy_(q)
    slot.narrow(0, 4, 4).copy_(dense)
    out = slot.finalize("w")
    assert isinstance(out, torch.Tensor) and torch.equal(out, torch.cat([q.dequantize(), dense]))


@pytest.mark.kernels
@pytest.mark.slow
@pytest.mark.skipif("avx2" not in cpu_features.supported_isas() or cpu_features.best_isa() == "avx2",
                    reason="kernels: the AVX2 build is the default here (or this CPU has no AVX2)")
def test_the_avx2_build_matches_the_references_too(tmp_path):
    """The AVX2 build (maddubs instead of vpdpbusd, 8-lane FMAs; the interleaved kernels read one 16-column
    panel as two 8-lane vectors) in a process of its own: both builds register the same op names, so one
    process holds one."""
    code = (
        "import torch; from tokenloom import kernels; assert kernels.load() and kernels.isa() == 'avx2'\n"
        "from tokenloom.kernels import quant\n"
        "import test_kernels_quant as t\n"
        "for bits, block in t.FORMATS:\n"
        "    w = t._random_weight(37, 576, bits, block); x = torch.randn(7, 576)\n"
        "    args = (w.qweight, w.scales, w.mins, bits, block)\n"
        "    assert t._rel(quant.quant_matmul(x, *args), quant.quant_matmul_reference(x, *args)) < t.EXACT_TOL\n"
        "    assert t._rel(quant.quant_matmul_a8(x, *args), quant.quant_matmul_a8_reference(x, *args)) < t.A8_TOL\n"
        "    panels = quant.interleave(*args)\n"
        "    for rows in (1, 2, 5, 33):\n"
        "        x = torch.randn(rows, 576)\n"
        "        exact = quant.quant_gemm(x, *panels, 37, bits, block)\n"
        "        assert t._rel(exact, quant.quant_matmul_reference(x, *args)) < t.EXACT_TOL\n"
        "        assert torch.equal(quant.quant_gemm(x[:1], *panels, 37, bits, block)[0], exact[0])\n"
        "        a8 = quant.quant_gemm_a8(x, *panels, 37, bits, block)\n"
        "        assert t._rel(a8, quant.quant_matmul_a8_reference(x, *args)) < t.A8_TOL\n"
        "print('ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900,
                          cwd=os.path.dirname(__file__), env={**os.environ, "TOKENLOOM_KERNEL_ISA": "avx2"})
    assert proc.stdout.strip() == "ok", proc.stderr[-3000:]
