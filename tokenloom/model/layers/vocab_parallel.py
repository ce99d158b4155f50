"""The embedding table and the output head split by vocabulary rows across tensor-parallel ranks.

Each rank holds ceil(V/p) rows (the last rank's tail is zero padding). The lookup zeroes the
rows of ids outside this rank's range and all-reduces, so every rank ends with the full
embedding. The head multiplies by the local rows and gathers the partial logits to rank 0,
which alone samples; the padding columns are cut off there.
"""
from __future__ import annotations

import torch
from torch import nn

from tokenloom.distributed.parallel_state import all_reduce, gather_to_first, tp_group
from tokenloom.model.layers.linear import Linear
from tokenloom.model.layers.module import InferenceModule
from tokenloom.model.layers.quantized_weight import embedding_lookup


def _rows_per_rank(vocab_size: int, size: int) -> int:
    return -(-vocab_size // size)


def _load_rows(dst: torch.Tensor, tensor: torch.Tensor, rank: int, what: str) -> None:
    rows = dst.shape[0]
    start = rank * rows
    piece = tensor[start:start + rows]
    if tuple(piece.shape[1:]) != tuple(dst.shape[1:]) or tensor.shape[0] > rows * tp_group().size:
        raise ValueError(f"shape mismatch for {what}: checkpoint {tuple(tensor.shape)}, model shard "
                         f"{tuple(dst.shape)}")
    dst.zero_()
    dst[:piece.shape[0]].copy_(piece)


class VocabParallelEmbedding(InferenceModule):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.tp = tp_group()
        self.vocab_size = vocab_size
        rows = _rows_per_rank(vocab_size, self.tp.size)
        self.start = self.tp.rank * rows
        self.weight = nn.Parameter(torch.empty(rows, hidden_size), requires_grad=False)

    def load(self, name: str, tensor: torch.Tensor, shard: str | None = None) -> None:
        _load_rows(self.weight.data, tensor, self.tp.rank, f"embedding {name}")

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return embedding_lookup(input_ids, self.weight)
        if input_ids.numel() and int(input_ids.max()) >= self.vocab_size:  # as F.embedding would at size 1
            raise IndexError(f"token id {int(input_ids.max())} is out of the vocabulary ({self.vocab_size})")
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = embedding_lookup(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return all_reduce(out)


class ParallelLMHead(Linear):
    """The output projection over this rank's vocabulary rows (its own weight, or the tied embedding's)."""

    def __init__(self, hidden_size: int, vocab_size: int):
        self.tp = tp_group()
        self.vocab_size = vocab_size
        super().__init__(hidden_size, _rows_per_rank(vocab_size, self.tp.size))

    def load(self, name, tensor, shard=None):
        _load_rows(self.weight.data, tensor, self.tp.rank, f"lm_head {name}")


def gather_logits(local_logits: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
    """The full [T, V] logits on rank 0 from every rank's [T, V/p] slice; None on the other ranks."""
    if tp_group().size == 1:
        return local_logits
    logits = gather_to_first(local_logits)
    return None if logits is None else logits[:, :vocab_size]
