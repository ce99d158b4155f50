"""BERT encoder (sentence-transformers' all-MiniLM-L6-v2 and other `BertModel` checkpoints), for embeddings.

An encoder attends both ways within each sequence and keeps no KV cache: the scheduler hands it every
sequence whole in one step (an embedding request is one prefill), so the flat batch splits into sequences
where a position restarts at 0. The sequences are padded into one [batch, longest] block per layer and
attended with one SDPA call under a key-padding mask. Post-layer-norm layers, GELU (erf) MLP, learned
absolute positions and token-type 0 embeddings, as in Hugging Face's BertModel. No tensor parallelism
(a 22M-parameter model does not need it; more than one rank is a ConfigError).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenloom.config import ConfigError
from tokenloom.distributed.parallel_state import tp_group
from tokenloom.model.arch_config import ArchConfig, UnsupportedModelError
from tokenloom.model.layers.attention_backend import AttentionBackend
from tokenloom.model.models.registry import register


class _Batch:
    """Where each flat row sits in the padded [batch, longest] layout, and which padded rows are real."""

    def __init__(self, positions: torch.Tensor):
        starts = torch.nonzero(positions == 0).flatten()
        if positions.numel() == 0 or starts.numel() == 0 or int(starts[0]) != 0:
            raise ValueError("an encoder step must hold whole sequences (each starting at position 0)")
        total = positions.numel()
        lens = torch.diff(starts, append=torch.tensor([total], device=positions.device))
        seq = torch.repeat_interleave(torch.arange(len(lens), device=positions.device), lens)
        if not torch.equal(positions, torch.arange(total, device=positions.device) - starts[seq]):
            raise ValueError("an encoder step must hold whole sequences with consecutive positions")
        self.batch, self.longest = len(lens), int(lens.max())
        self.rows = seq * self.longest + positions  # flat row -> padded row
        mask = torch.zeros(self.batch * self.longest, dtype=torch.bool, device=positions.device)
        mask[self.rows] = True
        self.key_mask = mask.view(self.batch, 1, 1, self.longest)

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros(self.batch * self.longest, *x.shape[1:])
        out[self.rows] = x
        return out.view(self.batch, self.longest, *x.shape[1:])

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(self.batch * self.longest, *x.shape[2:])[self.rows]


class BertSelfAttention(nn.Module):
    def __init__(self, cfg: ArchConfig):
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        width = cfg.num_heads * cfg.head_dim
        self.query = nn.Linear(cfg.hidden_size, width)
        self.key = nn.Linear(cfg.hidden_size, width)
        self.value = nn.Linear(cfg.hidden_size, width)

    def forward(self, x: torch.Tensor, batch: _Batch) -> torch.Tensor:
        def heads(t):  # [T, width] -> [batch, heads, longest, head_dim]
            return batch.pad(t.view(-1, self.num_heads, self.head_dim)).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.query(x)), heads(self.key(x)), heads(self.value(x)),
                                             attn_mask=batch.key_mask)
        return batch.unpad(out.transpose(1, 2)).reshape(x.shape[0], -1)


class _DenseNorm(nn.Module):
    """dense -> + residual -> LayerNorm (BERT's post-norm output block)."""

    def __init__(self, width_in: int, width_out: int, eps: float):
        super().__init__()
        self.dense = nn.Linear(width_in, width_out)
        self.LayerNorm = nn.LayerNorm(width_out, eps=eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, cfg: ArchConfig, eps: float):
        super().__init__()
        self.self = BertSelfAttention(cfg)
        self.output = _DenseNorm(cfg.num_heads * cfg.head_dim, cfg.hidden_size, eps)

    def forward(self, x, batch):
        return self.output(self.self(x, batch), x)


class BertIntermediate(nn.Module):
    def __init__(self, cfg: ArchConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x):
        return F.gelu(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, eps: float):
        super().__init__()
        self.attention = BertAttention(cfg, eps)
        self.intermediate = BertIntermediate(cfg)
        self.output = _DenseNorm(cfg.intermediate_size, cfg.hidden_size, eps)

    def forward(self, x, batch):
        x = self.attention(x, batch)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, cfg: ArchConfig, eps: float):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg, eps) for _ in range(cfg.num_layers))


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: ArchConfig, eps: float, type_vocab_size: int):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=eps)

    def forward(self, input_ids, positions):
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions) + self.token_type_embeddings.weight[0]
        return self.LayerNorm(x)


@register("BertModel")
class BertModel(nn.Module):
    """forward() gives the last hidden state of every row; it has no language-model head."""

    is_encoder = True
    default_pooling = "mean"  # sentence-transformers' default for BERT checkpoints (1_Pooling/config.json)

    def __init__(self, cfg: ArchConfig, attention: AttentionBackend):
        """`attention` is unused: an encoder attends with one SDPA call per layer, no paged cache."""
        super().__init__()
        if tp_group().size > 1:
            raise ConfigError("BERT encoders run on one rank: use --tensor-parallel-size 1")
        self.config = cfg
        eps = cfg.layer_norm_eps
        self.embeddings = BertEmbeddings(cfg, eps, cfg.type_vocab_size)
        self.encoder = BertEncoder(cfg, eps)

    def forward(self, input_ids, positions, kv_caches=None, meta=None) -> torch.Tensor:
        """Hidden states [T, hidden] for a flat batch of whole sequences (the KV caches are not used)."""
        if int(positions.max()) >= self.config.max_position_embeddings:
            raise ValueError(f"position {int(positions.max())} is past the encoder's "
                             f"{self.config.max_position_embeddings} positions")
        batch = _Batch(positions)
        x = self.embeddings(input_ids, positions)
        for layer in self.encoder.layer:
            x = layer(x, batch)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise UnsupportedModelError("a BERT encoder has no language-model head: it only embeds")

    def checkpoint_names(self) -> set[str]:
        return {name for name, _ in self.named_parameters()}

    def load_weight(self, name: str, tensor: torch.Tensor) -> None:
        name = name.removeprefix("bert.")
        if name.startswith(("pooler.", "cls.")) or name == "embeddings.position_ids":
            return  # the [CLS] pooler and the MLM head are not part of a sentence embedding
        try:
            target = self.get_parameter(name)
        except AttributeError:
            raise UnsupportedModelError(f"checkpoint tensor {name!r} has no place in BertModel") from None
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)}, "
                             f"model {tuple(target.shape)}")
        target.data.copy_(tensor)
