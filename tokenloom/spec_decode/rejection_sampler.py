"""Verification rules that keep the target model's distribution exactly.

Two cases:

* Deterministic drafts (n-gram, a greedy draft model): the draft puts all its mass on one token d, so
  speculative sampling's rule "accept d with min(1, p(d)/q(d)) = p(d), else draw from the normalized
  residual max(0, p - q)" reduces to: draw x ~ p at that position with the ordinary sampler; if x == d,
  accept and go on, else emit x and stop. P(emit d) = p(d) and P(emit y != d) = p(y), which is p itself.
  `accept_deterministic` applies it to the K+1 tokens the sampler drew at once. Because the sampler draws
  each position exactly as the plain decode would (same processed distribution, same seeded noise in the
  same order), a seeded request even yields the same tokens as with speculation off.

* Probabilistic drafts (a draft model sampling a request that samples): `rejection_sample` implements the
  general rule on probability tensors, and `verify_sampled_drafts` applies it to a verify span's rows with
  the target's distributions after the sampler's whole processing (grammar mask, penalties, temperature,
  top-k/p...), so what it preserves is exactly the distribution the plain decode samples from. It is
  exact in distribution, not draw for draw: a seeded request reproduces itself, not speculation off.
"""
from __future__ import annotations

import torch

from tokenloom.model.sampler import ProcessedLogits, Sampler, SamplerOutput, SamplingRow
from tokenloom.structured.matcher import apply_token_bitmask


def accept_deterministic(drafts: list[int], sampled: list[int]) -> int:
    """How many drafts are accepted, given the K drafts and the K+1 tokens drawn from the target at each
    position (position i conditioned on drafts[:i]). The sequence then gains sampled[:accepted + 1]."""
    accepted = 0
    for d, x in zip(drafts, sampled):
        if d != x:
            break
        accepted += 1
    return accepted


def rejection_sample(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_ids: torch.Tensor,
                     generator: torch.Generator | None = None) -> list[int]:
    """Speculative sampling for one sequence with a probabilistic draft.

    target_probs [K+1, V]: the target's distribution at each position (the last one for the bonus token);
    draft_probs [K, V]: the draft's distribution each draft token was drawn from; draft_ids [K].
    Accept draft i with probability min(1, p_i(d)/q_i(d)); at the first rejection draw from
    normalize(max(0, p_i - q_i)) and stop; if all are accepted draw the bonus token from p_K.
    Returns the emitted tokens (accepted drafts, then one more)."""
    K = draft_ids.shape[0]
    out: list[int] = []
    u = torch.rand(K, generator=generator, dtype=torch.float64, device=target_probs.device)
    for i in range(K):
        d = int(draft_ids[i])
        p, q = float(target_probs[i, d]), float(draft_probs[i, d])
        if q > 0 and u[i].item() * q <= p:
            out.append(d)
            continue
        residual = (target_probs[i] - draft_probs[i]).clamp_min(0)
        total = residual.sum()
        dist = residual / total if total > 0 else target_probs[i]
        out.append(int(torch.multinomial(dist, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(target_probs[K], 1, generator=generator)))
    return out


def verify_sampled_drafts(sampler: Sampler, logits: torch.Tensor, rows: list[tuple[int, SamplingRow, bytes | None]],
                          drafts: list[int], draft_probs: torch.Tensor | None, generator: torch.Generator | None
                          ) -> tuple[list[int], SamplerOutput | None]:
    """One verify span of a sampled request: `rows` are its K+1 positions (row in `logits`, how that position
    samples, its grammar bitmask), `draft_probs` [K, V] what each draft was drawn from (None: chosen
    deterministically, i.e. one-hot). Returns the emitted tokens and, when the request asks, their logprobs."""
    target = logits[torch.tensor([i for i, _, _ in rows], device=logits.device)]
    masks = [m for _, _, m in rows]
    if any(m is not None for m in masks):
        apply_token_bitmask(target, masks)
    sampling = [row for _, row, _ in rows]
    processed = sampler.process(target, sampling)
    p = processed.logits.softmax(dim=-1).double()
    ids = torch.tensor(drafts, dtype=torch.long, device=p.device)
    if draft_probs is None:
        q = torch.zeros(len(drafts), p.shape[1], dtype=torch.float64, device=p.device)
        q[torch.arange(len(drafts), device=p.device), ids] = 1.0
    else:
        q = draft_probs.double()
    emitted = rejection_sample(p, q, ids, generator)
    if sampling[0].params.logprobs is None:
        return emitted, None
    m = len(emitted)
    used = ProcessedLogits(processed.logits[:m], None if processed.raw_logits is None else processed.raw_logits[:m],
                           [])
    return emitted, sampler.with_logprobs(used, sampling[:m], torch.tensor(emitted, device=logits.device))
