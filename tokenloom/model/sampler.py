"""Batched token sampler.

The model runner calls `Sampler()(logits, rows)` once per step with the last-position
logits of every running sequence ([B, V] float32, on any device) and one `SamplingRow`
per batch row. Processing order (as vLLM v1):

    logits processors (--logits-processors) -> allowed_token_ids mask -> bad words
    -> min_tokens (suppress EOS / stop ids) -> logit_bias -> penalties (repetition, frequency, presence)
    -> temperature -> top-k -> top-p -> min-p -> draw

Every stage is vectorized over the batch (small per-row tensors are built from Python
lists each step) and skipped when no row uses it, so an all-greedy batch without
logprobs is a single argmax. Greedy rows (temperature ~0 or top_k == 1) never consume
random numbers and take the argmax of the logits after the masks/bias/penalties;
temperature, top-k, top-p and min-p only apply to random rows. Random rows draw by an
exponential race (argmax of probs / Exp(1) noise); rows with a generator draw their
noise from it, one row at a time, so a seeded row yields the same tokens whatever else
shares the batch; the other random rows share one batched draw from the global RNG.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenloom.core.sampling_params import SamplingParams
from tokenloom.kernels.sampling_ops import argmax_rows
from tokenloom.model.host_copy import tensor_on
from tokenloom.model.logits_processor import LogitsProcessor
from tokenloom.model.sampling_row import SamplingRow

_NEG_INF = float("-inf")
# Rows of prompt logits processed at once by compute_prompt_logprobs (bounds the
# temporary [chunk, V] log-softmax).
_PROMPT_LOGPROBS_CHUNK = 1024


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    # [B, 1+K] int64: the chosen token, then the top-K (K = max logprobs in the batch).
    # Rows asking for k < K logprobs should keep the first 1+k columns.
    logprob_token_ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None  # [B, 1+K] float32
    ranks: torch.Tensor | None = None  # [B] int64: 1-based rank of the chosen token


def _tensor(data, dtype, device) -> torch.Tensor:
    return tensor_on(data, dtype, device)


def _rank_of(lp: torch.Tensor, chosen_lp: torch.Tensor) -> torch.Tensor:
    """1-based rank: 1 + number of tokens strictly more likely than the chosen one."""
    return (lp > chosen_lp.unsqueeze(-1)).sum(-1).to(torch.int64) + 1


def logprobs_mode(params: SamplingParams) -> str:
    """The request's logprobs mode; None (the engine's default when the server did not fill it in) is raw."""
    return params.logprobs_mode or "raw_logprobs"


def _reported(mode: str, processed: "ProcessedLogits") -> torch.Tensor:
    """The [B, V] values a row in `mode` reports: log-softmax or logits, before or after processing."""
    source = processed.raw_logits if mode.startswith("raw") else processed.logits
    assert source is not None, "raw logits are kept whenever a row reports them"
    return torch.log_softmax(source, dim=-1) if mode.endswith("logprobs") else source


def _gather_logprobs(lp: torch.Tensor, chosen: torch.Tensor, k: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    chosen = chosen.to(torch.int64).unsqueeze(-1)
    chosen_lp = lp.gather(-1, chosen)
    ranks = _rank_of(lp, chosen_lp.squeeze(-1))
    k = min(k, lp.shape[-1])
    if k > 0:
        top_lp, top_ids = lp.topk(k, dim=-1)
        ids = torch.cat([chosen, top_ids], dim=-1)
        lps = torch.cat([chosen_lp, top_lp], dim=-1)
    else:
        ids, lps = chosen, chosen_lp
    return ids, lps.to(torch.float32), ranks


def compute_prompt_logprobs(logits: torch.Tensor, target_ids: torch.Tensor, k: int
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logprobs of prompt tokens: logits [P, V] predict target_ids [P] (the next tokens).

    Returns (ids [P, 1+k] int64: target then top-k, logprobs [P, 1+k] float32, ranks [P]).
    Always raw log_softmax of the logits (no sampling transforms).
    """
    P = logits.shape[0]
    target_ids = target_ids.to(device=logits.device, dtype=torch.int64)
    k = min(max(k, 0), logits.shape[-1])
    if P == 0:
        empty = logits.new_empty((0, 1 + k))
        return (empty.to(torch.int64), empty.to(torch.float32),
                torch.empty(0, dtype=torch.int64, device=logits.device))
    parts = []
    for s in range(0, P, _PROMPT_LOGPROBS_CHUNK):
        lp = torch.log_softmax(logits[s:s + _PROMPT_LOGPROBS_CHUNK].float(), dim=-1)
        parts.append(_gather_logprobs(lp, target_ids[s:s + _PROMPT_LOGPROBS_CHUNK], k))
    if len(parts) == 1:
        return parts[0]
    return tuple(torch.cat(t, dim=0) for t in zip(*parts))  # type: ignore[return-value]


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                       top_p: torch.Tensor | None, max_k: int) -> torch.Tensor:
    """Mask logits [R, V] outside top-k (k [R], V = disabled) and the top-p nucleus.

    Without top-p this avoids a full sort (topk + threshold; ties at the k-th value are
    all kept). With top-p the rows are sorted once and both masks applied on the sort.
    """
    V = logits.shape[-1]
    if top_p is None:
        assert top_k is not None  # max_k = top_k.max(), known on the host (no sync)
        kth = logits.topk(max_k, dim=-1).values.gather(-1, (top_k - 1).unsqueeze(-1))
        return logits.masked_fill(logits < kth, _NEG_INF)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        pos = torch.arange(V, device=logits.device)
        sorted_logits = sorted_logits.masked_fill(pos >= top_k.unsqueeze(-1), _NEG_INF)
    probs = sorted_logits.softmax(dim=-1)
    # Mass of the strictly more likely tokens; a token is dropped once that mass reaches
    # p, which keeps the smallest prefix whose cumulative probability is >= p (and
    # always keeps the most likely token).
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p.unsqueeze(-1), _NEG_INF)
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


@dataclass
class ProcessedLogits:
    """Logits after every stage but the draw: what a token is drawn from (softmax of `logits` on random
    rows, their argmax on greedy ones). Speculative decoding needs these distributions themselves."""

    logits: torch.Tensor  # [B, V] float32
    # The logits as given (before any stage), kept when a row reports raw logprobs or raw logits.
    raw_logits: torch.Tensor | None
    random_idx: list[int]  # the rows that draw (the others are greedy)


class Sampler:
    """Stateless batched sampler; see the module docstring for the processing order. `processors`: the
    engine's `--logits-processors` (tokenloom/model/logits_processor.py), applied first, in order."""

    def __init__(self, processors: Sequence[LogitsProcessor] = ()) -> None:
        self.processors = tuple(processors)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        processed = self.process(logits, rows)
        if processed.random_idx:
            greedy = [p.is_greedy for p in (r.params for r in rows)]
            token_ids = self._draw(processed.logits, rows, processed.random_idx, greedy)
        else:
            token_ids = argmax_rows(processed.logits)
        return self.with_logprobs(processed, rows, token_ids)

    def with_logprobs(self, processed: ProcessedLogits, rows: list[SamplingRow],
                      token_ids: torch.Tensor) -> SamplerOutput:
        """The output for `token_ids` (drawn here or chosen by a verifier), with the logprobs rows ask for."""
        params = [r.params for r in rows]
        k_list = [p.logprobs for p in params if p.logprobs is not None]
        out = SamplerOutput(token_ids=token_ids)
        if not k_list:
            return out
        modes = [logprobs_mode(p) if p.logprobs is not None else None for p in params]
        sources = {mode: _reported(mode, processed) for mode in dict.fromkeys(m for m in modes if m is not None)}
        first, *others = sources
        values = sources[first]
        for mode in others:
            rows_of_mode = _tensor([m == mode for m in modes], torch.bool, values.device).unsqueeze(-1)
            values = torch.where(rows_of_mode, sources[mode], values)
        out.logprob_token_ids, out.logprobs, out.ranks = _gather_logprobs(values, token_ids, max(k_list))
        return out

    def process(self, logits: torch.Tensor, rows: list[SamplingRow]) -> ProcessedLogits:
        """Every stage of the module docstring but the draw."""
        B, V = logits.shape
        assert len(rows) == B, f"{len(rows)} rows for {B} logits"
        device = logits.device
        params = [r.params for r in rows]
        cloned = logits.dtype != torch.float32  # .float() below then already copies
        logits = logits.float()

        keep_raw = any(p.logprobs is not None and logprobs_mode(p).startswith("raw") for p in params)
        raw_logits = logits.clone() if keep_raw else None

        greedy = [p.is_greedy for p in params]
        random_idx = [i for i, g in enumerate(greedy) if not g]

        def writable() -> torch.Tensor:
            nonlocal logits, cloned
            if not cloned:
                logits = logits.clone()
                cloned = True
            return logits

        for processor in self.processors:
            logits = processor.apply(writable(), rows).float()

        # 1. allowed_token_ids: everything else -> -inf.
        allowed = [(i, p.allowed_token_ids) for i, p in enumerate(params)
                   if p.allowed_token_ids is not None]
        if allowed:
            mask = torch.zeros(B, V, dtype=torch.bool, device=device)
            r_idx = _tensor([i for i, _ in allowed], torch.int64, device)
            mask[r_idx] = True
            rr, tt = [], []
            for i, ids in allowed:
                ids = [t for t in ids if t < V]
                rr.extend([i] * len(ids))
                tt.extend(ids)
            if rr:
                mask[_tensor(rr, torch.int64, device), _tensor(tt, torch.int64, device)] = False
            writable().masked_fill_(mask, _NEG_INF)

        # 2. bad words and 3. min_tokens: one list of (row, token) pairs to ban.
        ban_r: list[int] = []
        ban_t: list[int] = []
        for i, r in enumerate(rows):
            out = r.output_token_ids
            for seq in r.bad_words_token_ids:
                n = len(seq)
                if n == 0:
                    continue
                prefix_len = n - 1
                if prefix_len == 0 or (
                        len(out) >= prefix_len and list(out[-prefix_len:]) == list(seq[:-1])):
                    ban_r.append(i)
                    ban_t.append(seq[-1])
            p = r.params
            if p.min_tokens and len(out) < p.min_tokens:
                stop_ids = list(p.stop_token_ids)
                if not p.ignore_eos:
                    stop_ids.extend(r.eos_token_ids)
                ban_r.extend([i] * len(stop_ids))
                ban_t.extend(stop_ids)
        if ban_r:
            pairs = [(i, t) for i, t in zip(ban_r, ban_t) if 0 <= t < V]
            if pairs:
                rr, tt = zip(*pairs)
                writable()[_tensor(rr, torch.int64, device),
                           _tensor(tt, torch.int64, device)] = _NEG_INF

        # 4. logit_bias (added; duplicates impossible since it is a dict per row).
        bias_r: list[int] = []
        bias_t: list[int] = []
        bias_v: list[float] = []
        for i, p in enumerate(params):
            if p.logit_bias:
                for t, v in p.logit_bias.items():
                    if t < V:
                        bias_r.append(i)
                        bias_t.append(t)
                        bias_v.append(v)
        if bias_r:
            writable().index_put_(
                (_tensor(bias_r, torch.int64, device), _tensor(bias_t, torch.int64, device)),
                _tensor(bias_v, torch.float32, device), accumulate=True)

        # 5. penalties.
        if any(p.uses_penalties for p in params):
            self._apply_penalties(writable(), rows, V)

        # Greedy rows: argmax of the logits so far (temperature etc. leave them untouched).
        if random_idx:
            logits = self._process_random(writable(), params, random_idx, greedy)
        return ProcessedLogits(logits, raw_logits, random_idx)

    # ------------------------------------------------------------------ stages

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow], V: int) -> None:
        """In place. Repetition penalty (HF: seen in prompt+output, positive logits divided,
        negative multiplied); frequency/presence (OpenAI: over output tokens only)."""
        B = logits.shape[0]
        device = logits.device
        params = [r.params for r in rows]

        def token_matrix(lists: list[list[int]]) -> torch.Tensor:
            # Padded [B, L] with V as the pad id (a spare column dropped afterwards).
            L = max((len(x) for x in lists), default=0)
            data = [list(x) + [V] * (L - len(x)) for x in lists]
            t = _tensor(data, torch.int64, device) if L else torch.empty(
                (B, 0), dtype=torch.int64, device=device)
            return t.clamp_(0, V)

        outputs = [r.output_token_ids if r.params.uses_penalties else [] for r in rows]
        out_tok = token_matrix(outputs)
        counts = torch.zeros(B, V + 1, dtype=torch.float32, device=device)
        counts.scatter_add_(1, out_tok, torch.ones_like(out_tok, dtype=torch.float32))
        counts = counts[:, :V]
        out_seen = counts > 0

        rep = [p.repetition_penalty for p in params]
        if any(x != 1.0 for x in rep):
            prompts = [r.prompt_token_ids if r.params.repetition_penalty != 1.0 else []
                       for r in rows]
            prompt_tok = token_matrix(prompts)
            seen = torch.zeros(B, V + 1, dtype=torch.bool, device=device)
            seen.scatter_(1, prompt_tok, True)
            seen = seen[:, :V] | out_seen
            rep_t = _tensor(rep, torch.float32, device).unsqueeze(-1)
            penalized = torch.where(logits < 0, logits * rep_t, logits / rep_t)
            logits.copy_(torch.where(seen, penalized, logits))

        freq = [p.frequency_penalty for p in params]
        if any(x != 0.0 for x in freq):
            logits.sub_(_tensor(freq, torch.float32, device).unsqueeze(-1) * counts)
        pres = [p.presence_penalty for p in params]
        if any(x != 0.0 for x in pres):
            logits.sub_(_tensor(pres, torch.float32, device).unsqueeze(-1) * out_seen)

    @staticmethod
    def _process_random(logits: torch.Tensor, params: list[SamplingParams],
                        random_idx: list[int], greedy: list[bool]) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p on the random rows (in place where possible);
        greedy rows are left untouched."""
        B, V = logits.shape
        device = logits.device

        temps = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
        if any(t != 1.0 for t in temps):
            logits.div_(_tensor(temps, torch.float32, device).unsqueeze(-1))

        # top-k / top-p on the subset of random rows that use them.
        tk_rows = [i for i in random_idx
                   if (0 < params[i].top_k < V) or params[i].top_p < 1.0]
        if tk_rows:
            sub_idx = _tensor(tk_rows, torch.int64, device)
            ks = [params[i].top_k if 0 < params[i].top_k < V else V for i in tk_rows]
            # p >= 1 -> 2: float error in the cumsum must not drop the tail.
            ps = [params[i].top_p if params[i].top_p < 1.0 else 2.0 for i in tk_rows]
            top_k = _tensor(ks, torch.int64, device) if any(k < V for k in ks) else None
            top_p = _tensor(ps, torch.float32, device) if any(p < 1.0 for p in ps) else None
            sub = logits if len(tk_rows) == B else logits.index_select(0, sub_idx)
            sub = _apply_top_k_top_p(sub, top_k, top_p, max(ks))
            if len(tk_rows) == B:
                logits = sub
            else:
                logits.index_copy_(0, sub_idx, sub)

        # min-p: drop tokens with prob < min_p * max prob, i.e. logit < max + log(min_p).
        mp_rows = [i for i in random_idx if params[i].min_p > 0.0]
        if mp_rows:
            min_p = torch.zeros(B, dtype=torch.float32, device=device)
            min_p[_tensor(mp_rows, torch.int64, device)] = _tensor(
                [params[i].min_p for i in mp_rows], torch.float32, device)
            # log(0) = -inf: rows without min-p keep everything.
            threshold = logits.max(dim=-1, keepdim=True).values + min_p.log().unsqueeze(-1)
            logits.masked_fill_(logits < threshold, _NEG_INF)
        return logits

    @staticmethod
    def _draw(logits: torch.Tensor, rows: list[SamplingRow], random_idx: list[int],
              greedy: list[bool]) -> torch.Tensor:
        B, V = logits.shape
        device = logits.device
        all_random = len(random_idx) == B
        r_idx = None if all_random else _tensor(random_idx, torch.int64, device)
        sub = logits if all_random else logits.index_select(0, r_idx)
        probs = sub.softmax(dim=-1)
        q = torch.empty_like(probs)
        seeded = [j for j, i in enumerate(random_idx) if rows[i].generator is not None]
        if len(seeded) < len(random_idx):
            q.exponential_()  # one batched draw for the unseeded rows
        for j in seeded:
            q[j].exponential_(generator=rows[random_idx[j]].generator)
        # Exp(1) noise can be exactly 0 in float32; a 0 would turn 0/0 into NaN.
        q.clamp_min_(torch.finfo(torch.float32).tiny)
        sampled = argmax_rows(probs.div_(q))
        if all_random:
            return sampled
        token_ids = argmax_rows(logits)
        token_ids.index_copy_(0, r_idx, sampled)
        return token_ids
