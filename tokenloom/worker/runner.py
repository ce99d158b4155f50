"""ModelRunner: one step of the contract -> flat input tensors -> one forward -> sampled tokens.

It keeps each sequence's device-side state between steps (`RequestState`), so the scheduler
sends deltas only. Every tensor-parallel rank runs the same forward; the logits are gathered
to rank 0, which alone samples and answers.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from tokenloom.core.contract import ModelRunnerOutput, SampledSequence, SchedulerOutput, TokenLogprobs
from tokenloom.distributed.parallel_state import tp_group
from tokenloom.model.host_copy import tensor_on
from tokenloom.model.layers.attention_backend import AttentionBackend, ScheduledSpan
from tokenloom.model.pooler import pool
from tokenloom.model.pooling_config import PoolingConfig
from tokenloom.model.sampler import Sampler, SamplingRow, compute_prompt_logprobs
from tokenloom.profiler import PROFILER
from tokenloom.spec_decode.proposer import WorkerProposer
from tokenloom.spec_decode.rejection_sampler import accept_deterministic, verify_sampled_drafts
from tokenloom.structured.matcher import apply_token_bitmask
from tokenloom.worker.request_state import RequestState, apply_forks


class TokenOutOfVocabulary(IndexError):
    """A step input no rank can embed. Raised while preparing inputs, before any collective, and alike on
    every rank, so the ranks stay in step and the EngineCore isolates the request as in one process."""

    before_collectives = True


class ModelRunner:
    pooling: PoolingConfig | None = None  # set by the worker's setup on an embedding engine (model/pooler.py)
    # For one step, the caches with a KV connector's per-layer hooks (tokenloom.kv_transfer.layerwise); else None.
    kv_layers = None

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], block_size: int,
                 device: torch.device, attention: AttentionBackend):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.attention = attention
        self.sampler = Sampler()
        self.requests: dict[str, RequestState] = {}
        self.last_step_id = -1
        self.graphs = None  # DecodeGraphs on CUDA unless --enforce-eager (tokenloom.worker.cuda_graphs)
        self.native_stack = None  # NativeStack on CPU unless --enforce-eager (tokenloom.model.native_stack)
        self.drafter: WorkerProposer | None = None  # a proposer that runs here (draft model), set by the setup

    # ---- state --------------------------------------------------------------
    def update_states(self, step: SchedulerOutput) -> None:
        """Apply the step's deltas and block copies, once per step id."""
        if step.step_id == self.last_step_id:
            return
        self.last_step_id = step.step_id
        if self.drafter is not None:
            self.drafter.update_states(step)
        for src, dst in step.block_copies:
            for cache in self.kv_caches:
                cache[:, dst].copy_(cache[:, src])
        apply_forks(self.requests, step.forks)
        for key in step.finished_keys:
            self.requests.pop(key, None)
        for new in step.new_requests:
            self.requests[new.key] = RequestState.from_new(new, self.device)
        for delta in step.cached_requests:
            self.requests[delta.key].apply(delta)

    # ---- one step -------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, step: SchedulerOutput) -> ModelRunnerOutput | None:
        """The step's samples on the first tensor-parallel rank; None on the others."""
        if not step.num_scheduled_tokens:
            return ModelRunnerOutput() if tp_group().is_first else None
        scheduled = [(self.requests[k], n) for k, n in step.num_scheduled_tokens.items()]
        # Decodes first, shortest context first, so each attention group pads only to its own longest.
        scheduled.sort(key=lambda item: (item[1] > 1, item[0].num_computed_tokens))
        with PROFILER.section("prepare_inputs"):
            ids, pos, slots, spans, logit_rows, pool_spans = self._prepare(scheduled, step.spec_token_ids)
        with PROFILER.section("forward"):
            hidden = self._forward(ids, pos, slots, spans)
            pooled = {key: pool(hidden[first:first + n], self.pooling).tolist() for key, first, n in pool_spans}
            if not logit_rows:
                return ModelRunnerOutput(pooled=pooled) if tp_group().is_first else None
            with PROFILER.section("matmul"):
                logits = self.model.compute_logits(self._rows(hidden, [row for _, row, _ in logit_rows]))
        out = None
        if logits is not None:  # the first rank; the others only contributed their share of the vocabulary
            with PROFILER.section("sampling"):
                out = self._sample(logit_rows, logits, step)
                out.pooled = pooled
        forking = {r.key for r, _, samples in logit_rows if samples and r.forks}  # they fork next step
        if out is not None and self.drafter is not None and step.propose_drafts:
            with PROFILER.section("draft"):
                out.draft_token_ids = self.drafter.propose([(self.requests[key], seqs[0].token_ids)
                                                            for key, seqs in out.sampled.items() if key not in forking])
        return out

    def _prepare(self, scheduled: list[tuple[RequestState, int]], spec_token_ids: dict[str, list[int]]):
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        spans: list[ScheduledSpan] = []
        logit_rows: list[tuple[RequestState, int, bool]] = []  # (sequence, flat row, samples?)
        pool_spans: list[tuple[str, int, int]] = []  # embedding requests: (key, first row, rows), whole prompts
        for r, n in scheduled:
            start = r.num_computed_tokens
            end = start + n
            first = len(ids)
            drafts = spec_token_ids.get(r.key)
            if drafts:  # a verify span: the last token and the drafts, causal like a short prefill chunk
                ids.extend(r.token_ids[start:] + drafts)
            else:
                ids.extend(r.token_ids[start:end])
            pos.extend(range(start, end))
            table = r.block_ids
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            spans.append(ScheduledSpan(first, start, n, table))
            if r.params.embed:  # the scheduler gives it its whole prompt in one step
                pool_spans.append((r.key, first, n))
                continue
            if r.params.prompt_logprobs is not None and r.num_output_tokens == 0 and start < r.num_prompt_tokens - 1:
                upto = min(end, r.num_prompt_tokens - 1)
                logit_rows.extend((r, first + p - start, False) for p in range(start, upto))
            if drafts:  # sample after the last token and after each draft
                logit_rows.extend((r, first + j, True) for j in range(n))
            elif end == len(r.token_ids):  # every known token's KV is computed: sample the next one
                logit_rows.append((r, len(ids) - 1, True))
        vocab_size = self.model.config.vocab_size
        if ids and not 0 <= min(ids) <= max(ids) < vocab_size:
            bad = next(t for t in ids if not 0 <= t < vocab_size)
            raise TokenOutOfVocabulary(f"token id {bad} is outside the vocabulary (0..{vocab_size - 1})")
        return ids, pos, slots, spans, logit_rows, pool_spans

    def _forward(self, ids: list[int], pos: list[int], slots: list[int], spans: list[ScheduledSpan]) -> torch.Tensor:
        """Hidden states of the flat batch: a captured CUDA graph for a decode-only step that fits one, the
        native decoder stack on the CPU, else the layer-by-layer forward."""
        if self.graphs is not None and self.kv_layers is None and self.graphs.can_run(spans):
            return self.graphs.run(ids, pos, slots, spans)
        dev = self.device
        meta = self.attention.build_metadata(spans, tensor_on(slots, torch.long, dev))
        ids_t, pos_t = tensor_on(ids, torch.long, dev), tensor_on(pos, torch.long, dev)
        if self.native_stack is not None and self.kv_layers is None and self.native_stack.can_run():
            return self.native_stack.run(ids_t, pos_t, self.kv_caches, meta)
        caches = self.kv_caches if self.kv_layers is None else self.kv_layers
        return self.model(ids_t, pos_t, caches, meta)

    def _rows(self, t: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """t[rows], without the copy when rows is every row in order (a decode-only step)."""
        if rows == list(range(t.shape[0])):
            return t
        return t[torch.tensor(rows, device=self.device)]

    def _sample(self, logit_rows, logits: torch.Tensor, step: SchedulerOutput) -> ModelRunnerOutput:
        out = ModelRunnerOutput()
        bitmasks, spec = step.grammar_bitmask, step.spec_token_ids
        prompt_rows: dict[str, tuple[RequestState, list[int]]] = {}
        sample_idx: list[int] = []
        rows: list[SamplingRow] = []
        owners: list[RequestState] = []
        masks: list[bytes | None] = []
        positions: dict[str, int] = {}  # spec keys: rows seen so far
        sampled_drafts: dict[str, list[tuple[int, SamplingRow, bytes | None]]] = {}  # verified by rejection
        for i, (r, _, samples) in enumerate(logit_rows):
            if not samples:
                prompt_rows.setdefault(r.key, (r, []))[1].append(i)
                continue
            params = replace(r.params, logprobs=0) if r.needs_logprob and r.params.logprobs is None else r.params
            drafts = spec.get(r.key)
            if drafts:
                # Position j samples as the plain decode would after drafts[:j] (penalties, min_tokens, bad words).
                spec_masks = step.spec_grammar_bitmask.get(r.key)
                if self.drafter is not None and not params.is_greedy:  # sampled drafts: the rejection sampler
                    verify = sampled_drafts.setdefault(r.key, [])
                    j = len(verify)
                    verify.append((i, SamplingRow(params, r.prompt_token_ids, r.output_token_ids + drafts[:j],
                                                  r.generators[0], r.bad_words_token_ids, r.eos_token_ids),
                                   spec_masks[j] if spec_masks else None))
                    continue
                j = positions.get(r.key, 0)
                positions[r.key] = j + 1
                sample_idx.append(i)
                rows.append(SamplingRow(params, r.prompt_token_ids, r.output_token_ids + drafts[:j], r.generators[0],
                                        r.bad_words_token_ids, r.eos_token_ids))
                owners.append(r)
                masks.append(spec_masks[j] if spec_masks else None)
                continue
            for g in r.generators:
                sample_idx.append(i)
                rows.append(SamplingRow(params, r.prompt_token_ids, r.output_token_ids, g,
                                        r.bad_words_token_ids, r.eos_token_ids))
                owners.append(r)
                masks.append(bitmasks.get(r.key))
        for r, idx in prompt_rows.values():
            start = r.num_computed_tokens
            targets = torch.tensor(r.token_ids[start + 1:start + 1 + len(idx)], device=self.device)
            k = r.params.prompt_logprobs
            out.prompt_logprobs[r.key] = _pack(*compute_prompt_logprobs(logits[idx], targets, k), k)
        for key, verify in sampled_drafts.items():
            r = self.requests[key]
            drafts = spec[key]
            tokens, lps = verify_sampled_drafts(self.sampler, logits, verify, drafts,
                                                self.drafter.draft_probs(key, drafts), r.generators[0])
            k = verify[0][1].params.logprobs
            packed_lps = _pack(lps.logprob_token_ids, lps.logprobs, lps.ranks, k) if lps is not None else None
            out.sampled[key] = [SampledSequence(tokens, packed_lps)]
        if not rows:
            return out
        # Seeded speculative rows draw K+1 noise vectors; keep the generator's state to replay only the used ones.
        saved = {k: self.requests[k].generators[0].get_state() for k in positions
                 if self.requests[k].generators[0] is not None}
        sample_logits = self._rows(logits, sample_idx)
        if any(m is not None for m in masks):
            apply_token_bitmask(sample_logits, masks)
        sampled = self.sampler(sample_logits, rows)
        packed = None
        if sampled.logprobs is not None:
            packed = _pack(sampled.logprob_token_ids, sampled.logprobs, sampled.ranks, sampled.logprobs.shape[1] - 1)
        for j, (r, token) in enumerate(zip(owners, sampled.token_ids.tolist())):
            k = rows[j].params.logprobs
            logprobs = [packed[j][:1 + k]] if packed is not None and k is not None else None
            if r.key in positions and r.key in out.sampled:  # a later position of a verify span
                seq = out.sampled[r.key][0]
                seq.token_ids.append(token)
                if logprobs:
                    seq.logprobs.extend(logprobs)
                continue
            out.sampled.setdefault(r.key, []).append(SampledSequence([token], logprobs))
        for key in positions:
            seq = out.sampled[key][0]
            accepted = accept_deterministic(spec[key], seq.token_ids)
            del seq.token_ids[accepted + 1:]
            if seq.logprobs:
                del seq.logprobs[accepted + 1:]
            if key in saved:
                self._replay_draws(self.requests[key], saved[key], accepted + 1, logits.shape[1])
        return out

    def _replay_draws(self, r: RequestState, state: torch.Tensor, used: int, vocab: int) -> None:
        """Leave a seeded generator as if only `used` positions had drawn (one Exp(1) vector each, as
        `Sampler._draw` does), so a seeded request continues exactly as with speculation off."""
        g = r.generators[0]
        g.set_state(state)
        if r.params.is_greedy:
            return
        scratch = torch.empty(vocab, dtype=torch.float32, device=self.device)
        for _ in range(used):
            scratch.exponential_(generator=g)


def _pack(ids: torch.Tensor, lps: torch.Tensor, ranks: torch.Tensor, k: int) -> list[TokenLogprobs]:
    ids_l, lps_l, ranks_l = ids.tolist(), lps.tolist(), ranks.tolist()
    out = []
    for row_ids, row_lps, rank in zip(ids_l, lps_l, ranks_l):
        entry = [[row_ids[0], row_lps[0], rank]]
        entry += [[row_ids[c], row_lps[c], c] for c in range(1, 1 + k)]
        out.append(entry)
    return out
