"""The draft-model proposer: a smaller model with the target's vocabulary drafts K tokens per sequence, in
the worker, right after the target's step sampled; the scheduler has the target verify them next step.

KV cache. The draft keeps KV tensors of its own (its layers, its heads) with one block for each target
block, addressed through the target's block tables. Allocation, freeing, preemption, n > 1 forks (their
block copies are mirrored here) and prefix-cache hits then stay in step with the target's sequences by
construction, and one pool sizes both (a block costs the target's bytes plus the draft's). Drafting
writes a few positions past the sequence's tokens: the scheduler reserves K lookahead slots when it can
(vLLM's num_lookahead_tokens), and a sequence never drafts past its block table.

What the draft has computed. Per sequence, positions below `computed` hold the draft's KV of the
sequence's own tokens. A proposal first catches up in one chunk (tokens [computed, N): usually the token
just sampled, the whole prompt after its prefill, or the prompt past a prefix-cache hit), then decodes
one token a row K-1 times. The drafts it fed at positions N.. stay valid for as many as turn out to be
the sequence's next tokens (matched by content next step), so an accepting step costs no catch-up. A
replaced table (preemption, a fork's own table) keeps only what it still addresses. A prefix-cache hit
trusts the draft KV in the shared blocks, written when the sequence that cached them drafted past them;
should a block be cached before its sequence drafted (speculation paused, or a long prompt's earlier
chunks still fresh), the draft reads stale KV there and only the acceptance rate suffers: verification
is exact for any draft distribution.

Sampling. Each draft is drawn from the draft's distribution after the same processing the target's
sampler applies (penalties over the tokens so far and the drafts before, min_tokens, bad words, logit
bias, temperature, top-k/p, min-p; not the grammar mask, which lives in the scheduler and is applied to
the target's side), with a per-request generator seeded from the request's seed, so seeded requests
reproduce. Greedy requests draft the argmax and verify by the deterministic rule; the others keep q for
the rejection sampler.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from tokenloom.config import ConfigError
from tokenloom.core.contract import CachedRequestData, NewRequestData, SchedulerOutput
from tokenloom.kernels.kv_int8 import row_width
from tokenloom.model.arch_config import ArchConfig
from tokenloom.model.layers.attention_backend import AttentionBackend
from tokenloom.model.sampler import Sampler, SamplingRow
from tokenloom.spec_decode.proposer import WorkerProposer
from tokenloom.worker.batch_layout import BatchLayout, SequenceChunk
from tokenloom.worker.request_state import CHILD_SEED_STRIDE, RequestState
from tokenloom.worker.sampling_plan import sampling_row, seeded_generator
from tokenloom.worker.step_states import follow_step

# A seeded request's draft generator starts at seed + DRAFT_SEED_OFFSET (+ the child stride), so the draft
# never draws the numbers the target's verification draws.
DRAFT_SEED_OFFSET = 7_919


@dataclass
class DraftState:
    computed: int  # positions below hold the draft's KV of the sequence's tokens
    table: list[int]  # the block table those positions were written through
    generator: torch.Generator | None
    fed_at: int = 0  # the last proposal fed `fed` at positions fed_at, fed_at + 1, ...
    fed: list[int] = field(default_factory=list)
    drafts: list[int] = field(default_factory=list)
    probs: torch.Tensor | None = None  # [len(drafts), V] the distribution each draft was drawn from


class DraftModelProposer(WorkerProposer):
    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], block_size: int,
                 device: torch.device, attention: AttentionBackend, num_tokens: int, max_model_len: int):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.attention = attention
        self.num_tokens = num_tokens
        self.max_model_len = max_model_len
        self.sampler = Sampler()
        self.states: dict[str, DraftState] = {}

    # ---- following the target's sequences --------------------------------------------------
    def update_states(self, step: SchedulerOutput) -> None:
        """The runner's rule (step_states.follow_step) over the draft's caches and states; a fork's sibling
        has none until its first proposal."""
        follow_step(step, self.kv_caches, self.states, self._new_state, _follow_delta, every_sequence_known=False)

    def _new_state(self, new: NewRequestData) -> DraftState:
        return DraftState(new.num_computed_tokens, list(new.block_ids), _generator(new.sampling_params.seed, 0,
                                                                                   self.device))

    def _state(self, r: RequestState) -> DraftState:
        st = self.states.get(r.key)
        if st is None:  # a fork's sibling: it catches up from the start (its shared blocks get the same KV)
            st = self.states[r.key] = DraftState(0, list(r.block_ids), _generator(r.params.seed, r.index, self.device))
        return st

    def _advance(self, st: DraftState, tokens: list[int], table: list[int]) -> None:
        """What of the draft's KV still holds the sequence's tokens, now that they are `tokens`."""
        same = 0
        while same < min(len(table), len(st.table)) and table[same] == st.table[same]:
            same += 1
        st.computed = min(st.computed, same * self.block_size)
        if st.computed == st.fed_at:
            matched = 0
            for token, fed in zip(tokens[st.fed_at:], st.fed):
                if token != fed:
                    break
                matched += 1
            st.computed += matched
        st.computed = min(st.computed, len(tokens) - 1)  # the last token is always fed: its logits draft
        st.fed, st.table = [], list(table)

    # ---- proposing ------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, sampled: list[tuple[RequestState, list[int]]]) -> dict[str, list[int]]:
        bs = self.block_size
        rows: list[tuple[RequestState, DraftState, list[int], int]] = []  # (sequence, state, tokens, drafts)
        for r, new in sampled:
            st = self._state(r)
            tokens = r.token_ids + new
            self._advance(st, tokens, r.block_ids)
            n = len(tokens)
            k = min(self.num_tokens, self.max_model_len - n - 1, len(r.block_ids) * bs - n + 1)
            st.drafts, st.probs = [], None
            if k > 0:
                rows.append((r, st, tokens, k))
        if not rows:
            return {}
        drafts: list[list[int]] = [[] for _ in rows]
        probs: list[list[torch.Tensor]] = [[] for _ in rows]
        for j in range(max(k for *_, k in rows)):
            active = [i for i, row in enumerate(rows) if row[3] > j]
            if j == 0:  # catch up: each sequence's tokens the draft has not seen, the last one included
                spans = [(rows[i][2][rows[i][1].computed:], rows[i][1].computed) for i in active]
            else:
                spans = [([drafts[i][-1]], len(rows[i][2]) + j - 1) for i in active]
            logits = self._forward([rows[i][0].block_ids for i in active], spans)
            sampling = [self._sampling_row(rows[i][0], rows[i][1], rows[i][2], drafts[i]) for i in active]
            tokens, q = self._draw(logits, sampling)
            for a, i in enumerate(active):
                drafts[i].append(tokens[a])
                if q is not None and q[a] is not None:
                    probs[i].append(q[a])
        out = {}
        for (r, st, tokens, k), d, p in zip(rows, drafts, probs):
            st.computed = st.fed_at = len(tokens)
            st.fed, st.drafts = d[:-1], d
            st.probs = torch.stack(p) if p else None
            out[r.key] = d
        return out

    def draft_probs(self, key: str, drafts: list[int]) -> torch.Tensor | None:
        st = self.states[key]
        if st.drafts[:len(drafts)] != drafts:
            raise RuntimeError(f"sequence {key!r} verifies drafts {drafts} its draft model did not propose "
                               f"({st.drafts})")
        return None if st.probs is None else st.probs[:len(drafts)]

    def _sampling_row(self, r: RequestState, st: DraftState, tokens: list[int], drafts: list[int]) -> SamplingRow:
        return sampling_row(r, tokens[r.num_prompt_tokens:] + drafts, st.generator, replace(r.params, logprobs=None))

    def _draw(self, logits: torch.Tensor, rows: list[SamplingRow]):
        """One token per row from the processed distribution; for random rows also that distribution."""
        processed = self.sampler.process(logits, rows)
        tokens = processed.logits.argmax(dim=-1).tolist()
        if not processed.random_idx:
            return tokens, None
        q: list[torch.Tensor | None] = [None] * len(rows)
        probs = processed.logits[processed.random_idx].softmax(dim=-1)
        unseeded = [j for j, i in enumerate(processed.random_idx) if rows[i].generator is None]
        if unseeded:
            drawn = torch.multinomial(probs[unseeded], 1).view(-1).tolist()
            for j, token in zip(unseeded, drawn):
                tokens[processed.random_idx[j]] = token
        for j, i in enumerate(processed.random_idx):
            if rows[i].generator is not None:
                tokens[i] = int(torch.multinomial(probs[j], 1, generator=rows[i].generator))
            q[i] = probs[j]
        return tokens, q

    def _forward(self, tables: list[list[int]], spans: list[tuple[list[int], int]]) -> torch.Tensor:
        """The draft's logits after the last token of each span (tokens, start position), one flat batch."""
        layout = self.layout(tables, spans)
        hidden = self.model(*layout.tensors(self.device), self.kv_caches, layout.metadata(self.attention, self.device))
        return self.model.compute_logits(hidden[torch.tensor(layout.last_rows(), device=self.device)])

    def layout(self, tables: list[list[int]], spans: list[tuple[list[int], int]]) -> BatchLayout:
        """The flat batch of `spans` (tokens, start position) through `tables`: the runner's layout rule."""
        return BatchLayout.build([SequenceChunk(tokens, start, table) for (tokens, start), table in zip(spans, tables)],
                                 self.block_size)


def _follow_delta(st: DraftState, delta: CachedRequestData) -> None:
    if delta.replace_block_ids:
        # A new table (preemption; released draft blocks): only what the target has computed through it
        # (after a preemption, the prefix-cache hit it resumes from) is surely the draft's too.
        st.computed = min(st.computed, delta.num_computed_tokens)


def _generator(seed: int | None, child: int, device: torch.device) -> torch.Generator | None:
    return seeded_generator(seed, DRAFT_SEED_OFFSET + CHILD_SEED_STRIDE * child, device)


def check_draft_vocabulary(draft: ArchConfig, target: ArchConfig, path: str) -> None:
    if draft.vocab_size != target.vocab_size:
        raise ConfigError(f"draft model {path} has a vocabulary of {draft.vocab_size} tokens and the target "
                          f"{target.vocab_size}: speculative decoding needs the same vocabulary")


def build_drafter(draft: torch.nn.Module, arch: ArchConfig, num_blocks: int, block_size: int, kv_dtype: torch.dtype,
                  device: torch.device, attention: AttentionBackend, num_tokens: int,
                  max_model_len: int) -> DraftModelProposer:
    """The draft's KV cache (one block per target block, see the module docstring) and its proposer;
    `attention`: an unbound instance of the engine's backend (the target's is bound to the target's caches)."""
    shape = attention.kv_cache_shape(num_blocks, block_size, arch.num_kv_heads, row_width(arch.head_dim, kv_dtype))
    kv_caches = [torch.zeros(shape, dtype=kv_dtype, device=device) for _ in range(arch.num_layers)]
    attention.bind(kv_caches[0])
    return DraftModelProposer(draft, kv_caches, block_size, device, attention, num_tokens,
                              min(max_model_len, arch.max_position_embeddings))
