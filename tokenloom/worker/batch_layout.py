"""A forward's flat batch: which token sits in which row, at which position, in which KV slot.

The runner's step and the draft model's proposals lay their batches out the same way: each sequence
contributes a chunk of tokens at consecutive positions through its block table; decodes (one token) come
first, shortest context first, so each attention group pads only to its own longest (the backends rely
on it). `BatchLayout.build` is that rule, once; `step_layout` adds what only a target step has (the rows
whose logits are needed, the rows an embedding pools).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from tokenloom.model.host_copy import tensor_on
from tokenloom.model.layers.attention_backend import AttentionBackend, ScheduledSpan
from tokenloom.worker.request_state import RequestState


@dataclass(frozen=True)
class SequenceChunk:
    """One sequence's tokens in a forward: `tokens` at indices start, start + 1, ... through `block_ids`, at
    those positions unless `positions` ([3, tokens], an M-RoPE prompt with images) gives them."""

    tokens: list[int]
    start: int
    block_ids: list[int]
    positions: torch.Tensor | None = None


def attention_order(chunks: list[SequenceChunk]) -> list[int]:
    """The chunks' indices in flat-batch order: decodes first, then by context (a stable sort)."""
    return sorted(range(len(chunks)), key=lambda i: (len(chunks[i].tokens) > 1, chunks[i].start))


@dataclass
class BatchLayout:
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slot_mapping: list[int] = field(default_factory=list)
    spans: list[ScheduledSpan] = field(default_factory=list)  # one per chunk, in flat order
    order: list[int] = field(default_factory=list)  # spans[k] is chunk order[k]
    # M-RoPE rows whose three position streams differ (image tokens): (first row, [3, rows] positions).
    stream_rows: list[tuple[int, torch.Tensor]] = field(default_factory=list)

    @classmethod
    def build(cls, chunks: list[SequenceChunk], block_size: int) -> BatchLayout:
        layout = cls()
        for i in attention_order(chunks):
            layout.append(chunks[i], block_size)
            layout.order.append(i)
        return layout

    def append(self, chunk: SequenceChunk, block_size: int) -> None:
        start, table = chunk.start, chunk.block_ids
        end = start + len(chunk.tokens)
        self.spans.append(ScheduledSpan(len(self.input_ids), start, len(chunk.tokens), table))
        if chunk.positions is None:
            self.positions.extend(range(start, end))
        else:
            self.positions.extend(chunk.positions[0].tolist())
            if not bool((chunk.positions == chunk.positions[0]).all()):
                self.stream_rows.append((len(self.input_ids), chunk.positions))
        self.input_ids.extend(chunk.tokens)
        self.slot_mapping.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))

    def last_rows(self) -> list[int]:
        """Each chunk's last flat row, in the chunks' own order."""
        rows = [0] * len(self.spans)
        for i, span in zip(self.order, self.spans):
            rows[i] = span.first_row + span.num_tokens - 1
        return rows

    def metadata(self, attention: AttentionBackend, device: torch.device):
        return attention.build_metadata(self.spans, tensor_on(self.slot_mapping, torch.long, device))

    def row_values(self, per_chunk: list[int]) -> list[int]:
        """A per-chunk value (in the chunks' own order) repeated over each chunk's rows, in flat order: how
        each row learns its sequence's LoRA adapter."""
        rows: list[int] = []
        for i, span in zip(self.order, self.spans):
            rows.extend([per_chunk[i]] * span.num_tokens)
        return rows

    def tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The input ids and positions on the device: positions [T], or [3, T] when some rows' three M-RoPE
        streams differ (a forward over image tokens)."""
        positions = tensor_on(self.positions, torch.long, device)
        if self.stream_rows:
            positions = positions.expand(3, -1).clone()
            for first, streams in self.stream_rows:
                positions[:, first:first + streams.shape[1]] = streams.to(device)
        return tensor_on(self.input_ids, torch.long, device), positions


class LogitRow(NamedTuple):
    state: RequestState
    row: int  # flat row whose hidden state gives the logits
    samples: bool  # a token is sampled from it (else a prompt logprob is read)


@dataclass
class StepLayout:
    batch: BatchLayout
    logit_rows: list[LogitRow]
    pool_spans: list[tuple[str, int, int]]  # embedding requests: (key, first row, rows), whole prompts


def step_layout(scheduled: list[tuple[RequestState, int]], spec_token_ids: dict[str, list[int]],
                block_size: int) -> StepLayout:
    """The target step's layout: each scheduled sequence's next `n` tokens (its last token and its drafts
    on a verify span), and which rows' logits the step needs."""
    chunks = []
    for r, n in scheduled:
        start = r.num_computed_tokens
        drafts = spec_token_ids.get(r.key)
        # A verify span: the last token and the drafts, causal like a short prefill chunk.
        tokens = r.token_ids[start:] + drafts if drafts else r.token_ids[start:start + n]
        positions = None if r.rope is None else r.rope.streams(start, start + len(tokens))
        chunks.append(SequenceChunk(tokens, start, r.block_ids, positions))
    batch = BatchLayout.build(chunks, block_size)
    logit_rows: list[LogitRow] = []
    pool_spans: list[tuple[str, int, int]] = []
    for i, span in zip(batch.order, batch.spans):
        r, n = scheduled[i]
        first, start = span.first_row, span.start
        end = start + n
        if r.params.embed:  # the scheduler gives it its whole prompt in one step
            pool_spans.append((r.key, first, n))
            continue
        if r.params.prompt_logprobs is not None and r.num_output_tokens == 0 and start < r.num_prompt_tokens - 1:
            upto = min(end, r.num_prompt_tokens - 1)
            logit_rows.extend(LogitRow(r, first + p - start, False) for p in range(start, upto))
        if spec_token_ids.get(r.key):  # sample after the last token and after each draft
            logit_rows.extend(LogitRow(r, first + j, True) for j in range(n))
        elif end == len(r.token_ids):  # every known token's KV is computed: sample the next one
            logit_rows.append(LogitRow(r, first + span.num_tokens - 1, True))
    return StepLayout(batch, logit_rows, pool_spans)
