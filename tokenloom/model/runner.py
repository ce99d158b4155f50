"""ModelRunner: scheduled requests -> flat input tensors -> one forward -> sampled tokens."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenloom.model.layers.attention import AttentionMetadata, PrefillChunk, decode_group_size
from tokenloom.profiler import PROFILER
from tokenloom.model.sampler import Sampler, SamplingRow, compute_prompt_logprobs
from tokenloom.scheduler.scheduler import ScheduledRequest, SchedulerOutput
from tokenloom.structured.matcher import apply_structured_bitmask

# One sampled token's logprobs: [[token_id, logprob, rank], ...], the chosen token first.
TokenLogprobs = list[list[float]]


@dataclass
class SampledTokens:
    token_ids: list[int]  # one per sequence (several when a request forks into n)
    logprobs: list[TokenLogprobs | None]
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # for this chunk's prompt positions


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], block_size: int,
                 device: torch.device):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler()
        self._workspace = torch.empty(0, device=device, dtype=kv_caches[0].dtype)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> dict[int, SampledTokens]:
        """Returns, keyed by id(request), what each request that completed its known tokens sampled."""
        for src, dst in sched.block_copies:
            for cache in self.kv_caches:
                cache[:, dst].copy_(cache[:, src])
        # Decodes first, shortest context first, so each attention group pads only to its own longest.
        order = sorted(sched.scheduled, key=lambda s: (s.num_new_tokens > 1, s.request.num_computed_tokens))
        with PROFILER.section("prepare_inputs"):
            input_ids, positions, meta, logit_rows = self._prepare(order)
        with PROFILER.section("forward"):
            hidden = self.model(input_ids, positions, self.kv_caches, meta)
            if not logit_rows:
                return {}
            with PROFILER.section("matmul"):
                logits = self.model.compute_logits(self._rows(hidden, [row for _, row, _ in logit_rows]))
        with PROFILER.section("sampling"):
            return self._sample(logit_rows, logits)

    def _prepare(self, order: list[ScheduledRequest]):
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        prefills: list[PrefillChunk] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        logit_rows: list[tuple[ScheduledRequest, int, bool]] = []  # (request, flat row, samples?)
        for s in order:
            r, start = s.request, s.request.num_computed_tokens
            end = start + s.num_new_tokens
            first = len(ids)
            ids.extend(r.token_ids[start:end])
            pos.extend(range(start, end))
            table = r.block_ids
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if s.num_new_tokens == 1:
                decode_tables.append(table)
                decode_lens.append(end)
            else:
                prefills.append(PrefillChunk(first, len(ids), end, torch.tensor(table, device=self.device)))
            if r.prompt_logprobs is not None and r.num_output_tokens == 0 and start < r.num_prompt_tokens - 1:
                upto = min(end, r.num_prompt_tokens - 1)
                logit_rows.extend((s, first + p - start, False) for p in range(start, upto))
            if s.completes_prompt:
                logit_rows.append((s, len(ids) - 1, True))
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            num_decodes=len(decode_tables), decode_block_tables=None, decode_context_lens=None,
            decode_mask=None, prefills=prefills)
        if decode_tables:
            width = max((n + bs - 1) // bs for n in decode_lens)
            table = torch.tensor([t[:width] + [0] * (width - len(t)) for t in decode_tables], dtype=torch.long,
                                 device=dev)
            lens = torch.tensor(decode_lens, device=dev)
            meta.decode_block_tables = table
            group = decode_group_size(len(decode_tables), dev)
            meta.decode_workspace = self._decode_workspace(group * width)
            meta.decode_context_lens = lens
            meta.decode_group_blocks = [(max(decode_lens[i:i + group]) + bs - 1) // bs
                                        for i in range(0, len(decode_lens), group)]
            padding = torch.arange(width * bs, device=dev).unsqueeze(0) >= lens.unsqueeze(1)
            # Additive, in the dtype SDPA computes in: a boolean mask is converted on every call (~10%).
            meta.decode_mask = torch.zeros(padding.shape, dtype=self.kv_caches[0].dtype, device=dev).masked_fill_(
                padding, float("-inf")).view(len(decode_tables), 1, 1, width * bs)
        return (torch.tensor(ids, dtype=torch.long, device=dev), torch.tensor(pos, dtype=torch.long, device=dev),
                meta, logit_rows)

    def _rows(self, t: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """t[rows], without the copy when rows is every row in order (a decode-only step)."""
        if rows == list(range(t.shape[0])):
            return t
        return t[torch.tensor(rows, device=self.device)]

    def _decode_workspace(self, num_blocks: int) -> torch.Tensor:
        cache = self.kv_caches[0]
        block_elems = cache[0, 0].numel()
        if self._workspace.numel() < 2 * num_blocks * block_elems:
            self._workspace = torch.empty(2 * num_blocks * block_elems, dtype=cache.dtype, device=self.device)
        return self._workspace[: 2 * num_blocks * block_elems].view(2, num_blocks, block_elems)

    def _sample(self, logit_rows, logits: torch.Tensor) -> dict[int, SampledTokens]:
        results: dict[int, SampledTokens] = {}
        prompt_rows: dict[int, tuple[ScheduledRequest, list[int]]] = {}
        sample_idx: list[int] = []
        rows: list[SamplingRow] = []
        owners: list[ScheduledRequest] = []
        for i, (s, _, samples) in enumerate(logit_rows):
            r = s.request
            if not samples:
                prompt_rows.setdefault(id(r), (s, []))[1].append(i)
                continue
            params = _with_logprobs(r.params) if r.needs_logprob and r.params.logprobs is None else r.params
            for g in (r.generators if r.pending_forks else [r.generator]):
                sample_idx.append(i)
                rows.append(SamplingRow(params, r.prompt_token_ids, r.output_token_ids, g,
                                        r.bad_words_token_ids, r.eos_token_ids))
                owners.append(s)
        for s, idx in prompt_rows.values():
            r = s.request
            start = r.num_computed_tokens
            targets = torch.tensor(r.token_ids[start + 1:start + 1 + len(idx)], device=self.device)
            k = r.params.prompt_logprobs
            packed = compute_prompt_logprobs(logits[idx], targets, k)
            results.setdefault(id(r), SampledTokens([], [])).prompt_logprobs = _pack(*packed, k)
        if rows:
            sample_logits = self._rows(logits, sample_idx)
            apply_structured_bitmask(sample_logits, [s.request.structured for s in owners])  # no-op if unconstrained
            out = self.sampler(sample_logits, rows)
            packed = None
            if out.logprobs is not None:
                packed = _pack(out.logprob_token_ids, out.logprobs, out.ranks, out.logprobs.shape[1] - 1)
            for j, (s, token) in enumerate(zip(owners, out.token_ids.tolist())):
                entry = results.setdefault(id(s.request), SampledTokens([], []))
                entry.token_ids.append(token)
                k = rows[j].params.logprobs
                entry.logprobs.append(packed[j][:1 + k] if packed is not None and k is not None else None)
        return results


def _with_logprobs(params):
    from dataclasses import replace
    return replace(params, logprobs=0)


def _pack(ids: torch.Tensor, lps: torch.Tensor, ranks: torch.Tensor, k: int) -> list[TokenLogprobs]:
    ids_l, lps_l, ranks_l = ids.tolist(), lps.tolist(), ranks.tolist()
    out = []
    for row_ids, row_lps, rank in zip(ids_l, lps_l, ranks_l):
        entry = [[row_ids[0], row_lps[0], rank]]
        entry += [[row_ids[c], row_lps[c], c] for c in range(1, 1 + k)]
        out.append(entry)
    return out
