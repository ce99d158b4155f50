"""Write a GGUF file with a real model's exact shapes and random quantized blocks, for benchmarks.

Decode speed, load time and memory depend on a model's shapes and quantization types, not on what its
weights say, so a file with Llama-3.2-1B's shapes and random blocks is a fair benchmark for any engine
that loads it (llama.cpp and tokenloom both do). The tokenizer is the embedded model's (SmolLM2's GGUF
tokenizer metadata) padded with reserved control tokens to the shape's 128,256-token vocabulary.

Types follow llama-quantize: `q4_0` and `q8_0` put every 2-D weight in that type, except that q4_0's output
head (or the token embedding, when the head is tied to it) is Q6_K; `q4_k_m` is Q4_K with Q6_K for the
head and for attn_v and ffn_down on the layers llama.cpp's Q4_K_M gives more bits (`use_more_bits`: the
first and last eighth, and every third layer between).

Blocks are random bytes with finite float16 scales chosen so a weight's standard deviation is ~0.02 and
its mean ~0 (the residual stream stays finite through every layer). They are generated and written a
chunk at a time (no float copy, at most CHUNK_BLOCKS blocks in memory), reproducibly from `--seed`:

    python scripts/shaped_gguf.py --shape llama-3.2-1b --quant q4_k_m --out /work/models/llama-3.2-1b-q4_k_m.gguf
"""
from __future__ import annotations

import argparse
import functools
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES

from tokenloom.core.json_types import JsonValue
from tokenloom.model.model_path import embedded_model_path
from tokenloom.tokenizer.gguf_metadata import read_gguf_metadata

WEIGHT_STD = 0.02  # the usual initializer's spread; keeps activations through random layers finite
CHUNK_BLOCKS = 1 << 18  # blocks generated at once: <= 55 MiB of Q6_K, whatever the tensor's size
VOCAB = 128_256  # Llama 3's vocabulary


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied_head: bool
    rope_theta: float = 500_000.0
    context: int = 131_072

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


# From each model's config.json (hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
# intermediate_size, vocab_size, tie_word_embeddings).
SHAPES = {
    "llama-3.2-1b": ModelShape("Llama-3.2-1B", 2048, 16, 32, 8, 8192, VOCAB, tied_head=True),
    "llama-3.2-3b": ModelShape("Llama-3.2-3B", 3072, 28, 24, 8, 8192, VOCAB, tied_head=True),
    "llama-3.1-8b": ModelShape("Llama-3.1-8B", 4096, 32, 32, 8, 14336, VOCAB, tied_head=False),
}

Q = GGMLQuantizationType
FILE_TYPES = {"q4_0": 2, "q8_0": 7, "q4_k_m": 15}  # llama_ftype


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's rule for the layers whose attn_v and ffn_down Q4_K_M stores as Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_types(shape: ModelShape, quant: str) -> list[tuple[str, tuple[int, int] | tuple[int], Q]]:
    """(GGUF name, (rows, columns) or (length,), type) of every tensor, in llama.cpp's converter order."""
    base = {"q4_0": Q.Q4_0, "q8_0": Q.Q8_0, "q4_k_m": Q.Q4_K}[quant]
    head = Q.Q8_0 if quant == "q8_0" else Q.Q6_K
    h, kv = shape.hidden, shape.kv_heads * shape.head_dim
    out: list[tuple[str, tuple[int, int] | tuple[int], Q]] = [
        ("token_embd.weight", (shape.vocab, h), head if shape.tied_head else base)]
    for i in range(shape.layers):
        more = quant == "q4_k_m" and use_more_bits(i, shape.layers)
        out += [
            (f"blk.{i}.attn_norm.weight", (h,), Q.F32),
            (f"blk.{i}.attn_q.weight", (h, h), base),
            (f"blk.{i}.attn_k.weight", (kv, h), base),
            (f"blk.{i}.attn_v.weight", (kv, h), Q.Q6_K if more else base),
            (f"blk.{i}.attn_output.weight", (h, h), base),
            (f"blk.{i}.ffn_norm.weight", (h,), Q.F32),
            (f"blk.{i}.ffn_gate.weight", (shape.ffn, h), base),
            (f"blk.{i}.ffn_up.weight", (shape.ffn, h), base),
            (f"blk.{i}.ffn_down.weight", (h, shape.ffn), Q.Q6_K if more else base),
        ]
    out.append(("output_norm.weight", (h,), Q.F32))
    if not shape.tied_head:
        out.append(("output.weight", (shape.vocab, h), head))
    return out


def _f16(rng: np.random.Generator, n: int, value: float) -> np.ndarray:
    """n float16 scales within 25% of `value`, as their raw bytes [n, 2]."""
    return (value * rng.uniform(0.75, 1.25, n)).astype(np.float16).view(np.uint8).reshape(n, 2)


def random_blocks(kind: Q, n: int, rng: np.random.Generator) -> np.ndarray:
    """n random blocks of `kind` as raw bytes [n, block bytes], with zero-mean weights of std ~WEIGHT_STD."""
    size = GGML_QUANT_SIZES[kind][1]
    blocks = rng.integers(0, 256, (n, size), dtype=np.uint8)
    if kind == Q.Q4_0:  # w = d * (q - 8), q uniform 0..15 (std 4.6)
        blocks[:, 0:2] = _f16(rng, n, WEIGHT_STD / 4.6)
    elif kind == Q.Q8_0:  # w = d * q, q uniform int8 (std 74)
        blocks[:, 0:2] = _f16(rng, n, WEIGHT_STD / 74)
    elif kind == Q.Q4_K:  # w = d*sc*q - dmin*m per sub-block of 32; m = sc and dmin = 7.5 d centre it
        d = (WEIGHT_STD / 4.6 / 40 * rng.uniform(0.75, 1.25, n)).astype(np.float16)
        blocks[:, 0:2] = d.view(np.uint8).reshape(n, 2)
        blocks[:, 2:4] = (d.astype(np.float32) * 7.5).astype(np.float16).view(np.uint8).reshape(n, 2)
        sc = rng.integers(16, 64, (n, 8), dtype=np.uint8)
        blocks[:, 4:16] = pack_k_scales(sc, sc)
    elif kind == Q.Q6_K:  # w = d * sc * (q - 32), q uniform 0..63 (std 18.5), int8 sub-scales 4..15
        blocks[:, 192:208] = rng.integers(4, 16, (n, 16), dtype=np.uint8)
        blocks[:, 208:210] = _f16(rng, n, WEIGHT_STD / 18.5 / 9.5)
    else:
        raise ValueError(f"no random blocks for {kind.name}")
    return blocks


def pack_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 12 bytes of eight 6-bit scales and mins [n, 8] each (ggml's get_scale_min_k4, inverted)."""
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (m[:, 0:4] & 63) | ((m[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 15) | ((m[:, 4:8] & 15) << 4)
    return out


def _value_type(value: object) -> tuple[GGUFValueType, GGUFValueType | None]:
    """The GGUF type each tokenizer.* value of the embedded file has (strings, ids, flags and their lists)."""
    if isinstance(value, list):
        return GGUFValueType.ARRAY, GGUFValueType.STRING if value and isinstance(value[0], str) else GGUFValueType.INT32
    if isinstance(value, bool):
        return GGUFValueType.BOOL, None
    return (GGUFValueType.STRING, None) if isinstance(value, str) else (GGUFValueType.UINT32, None)


@functools.cache
def _tokenizer_fields() -> dict[str, JsonValue]:
    """The embedded model's tokenizer.* metadata (tokenloom's plain reader: gguf's takes seconds on it)."""
    return read_gguf_metadata(embedded_model_path(), prefix="tokenizer.")


def _add_tokenizer(writer: GGUFWriter, vocab: int) -> None:
    fields = dict(_tokenizer_fields())
    tokens = list(fields["tokenizer.ggml.tokens"])
    if vocab < len(tokens):
        raise ValueError(f"a {vocab}-token vocabulary is smaller than the tokenizer's {len(tokens)} tokens")
    pad = vocab - len(tokens)
    fields["tokenizer.ggml.tokens"] = tokens + [f"<|reserved_special_token_{i}|>" for i in range(pad)]
    fields["tokenizer.ggml.token_type"] = list(fields["tokenizer.ggml.token_type"]) + [3] * pad  # CONTROL
    for key, value in fields.items():
        vtype, sub = _value_type(value)
        writer.add_key_value(key, value, vtype, sub_type=sub)


def write_shaped_gguf(shape: ModelShape, quant: str, out: Path, seed: int = 0, progress: bool = False) -> int:
    """Write the file; returns its size in bytes."""
    rng = np.random.default_rng(seed)
    tensors = tensor_types(shape, quant)
    writer = GGUFWriter(out, "llama")
    writer.add_name(f"{shape.name} (shaped, random {quant.upper()} blocks)")
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(FILE_TYPES[quant])
    writer.add_vocab_size(shape.vocab)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_quantization_version(2)
    _add_tokenizer(writer, shape.vocab)
    for name, dims, kind in tensors:
        if kind == Q.F32:
            writer.add_tensor_info(name, dims, np.dtype(np.float32), dims[0] * 4)
            continue
        block, size = GGML_QUANT_SIZES[kind]
        rows, cols = dims
        if cols % block:
            raise ValueError(f"{name}: {cols} columns is not a multiple of {kind.name}'s {block}-value block")
        writer.add_tensor_info(name, (rows, cols // block * size), np.dtype(np.uint8), rows * cols // block * size,
                               raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    fout = writer.fout[0]
    for i, (name, dims, kind) in enumerate(tensors):
        writer.write_padding(fout, fout.tell())
        if kind == Q.F32:
            data = np.ones(dims, dtype=np.float32)
            data.tofile(fout)
            nbytes = data.nbytes
        else:
            blocks_total = dims[0] * dims[1] // GGML_QUANT_SIZES[kind][0]
            nbytes = 0
            for start in range(0, blocks_total, CHUNK_BLOCKS):
                chunk = random_blocks(kind, min(CHUNK_BLOCKS, blocks_total - start), rng)
                chunk.tofile(fout)
                nbytes += chunk.nbytes
        writer.write_padding(fout, nbytes)
        if progress:
            print(f"\r{i + 1}/{len(tensors)} tensors", end="", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    writer.close()
    return out.stat().st_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--quant", choices=sorted(FILE_TYPES), default="q4_k_m")
    parser.add_argument("--out", type=Path, required=True, help="the file to write (keep it out of the repository)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    size = write_shaped_gguf(SHAPES[args.shape], args.quant, args.out, args.seed, progress=True)
    print(f"{args.out}: {size / 2**20:,.0f} MiB in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
