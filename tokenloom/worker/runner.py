"""ModelRunner: one step of the contract -> flat input tensors -> one forward -> sampled tokens.

It keeps each sequence's device-side state between steps (`RequestState`), so the scheduler
sends deltas only. Every tensor-parallel rank runs the same forward; the logits are gathered
to rank 0, which alone samples and answers.

It is built once with everything it uses, and nothing is set on it afterwards: the attention
backend instance (its metadata builder, bound to these caches), the forward path
(`forward_path.py`), the drafter, the KV connector's hooks, the pooling config. The flat batch
comes from `batch_layout.py` and the draws from `sampling_plan.py`, which the draft model shares.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from tokenloom.core.contract import ModelRunnerOutput, SampledSequence, SchedulerOutput, TokenLogprobs
from tokenloom.core.pooling import PoolingConfig
from tokenloom.distributed.parallel_state import tp_group
from tokenloom.kv_transfer.worker_hook import ConnectorHook
from tokenloom.lora.slots import LoRASlots
from tokenloom.model.host_copy import to_host
from tokenloom.model.layers.attention_backend import AttentionBackend
from tokenloom.model.logits_processor import LogitsProcessor
from tokenloom.model.models.vision.mrope import takes_mrope
from tokenloom.model.native_stack import StackLoRA
from tokenloom.model.pooler import pool
from tokenloom.model.sampler import Sampler, compute_prompt_logprobs
from tokenloom.profiler import PROFILER
from tokenloom.spec_decode.proposer import WorkerProposer
from tokenloom.spec_decode.rejection_sampler import accept_deterministic, verify_sampled_drafts
from tokenloom.structured.matcher import apply_token_bitmask
from tokenloom.worker.batch_layout import BatchLayout, LogitRow, step_layout
from tokenloom.worker.encoder_cache import EncoderCache, ImageRows, embeddings_with_images
from tokenloom.worker.forward_path import EAGER, ForwardPath, fast_path_takes_lora
from tokenloom.worker.image_attention import ImageSpanAttention, needs_image_spans
from tokenloom.worker.request_state import RequestState, apply_forks
from tokenloom.worker.sampling_plan import SamplingPlan
from tokenloom.worker.step_states import follow_step


class TokenOutOfVocabulary(IndexError):
    """A step input no rank can embed. Raised while preparing inputs, before any collective, and alike on
    every rank, so the ranks stay in step and the EngineCore isolates the request as in one process."""

    before_collectives = True


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], block_size: int,
                 device: torch.device, attention: AttentionBackend, forward: ForwardPath = EAGER,
                 drafter: WorkerProposer | None = None, pooling: PoolingConfig | None = None,
                 kv_connector: ConnectorHook | None = None, logits_processors: Sequence[LogitsProcessor] = (),
                 lora: LoRASlots | None = None):
        """`attention` is bound to `kv_caches` already; `drafter`: a proposer that runs here (draft model);
        `pooling`: an embedding engine's (model/pooler.py); `kv_connector`: a KV connector's worker half
        (tokenloom.kv_transfer), whose hooks run around each step's forward; `logits_processors`: applied by
        the sampler first (on the sampling rank only); `lora`: the LoRA adapters' slots on the model's layers
        (--enable-lora)."""
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.attention = attention
        self.forward = forward
        self.drafter = drafter
        self.pooling = pooling
        self.kv_connector = kv_connector
        self.lora = lora
        self.sampler = Sampler(logits_processors)
        self.requests: dict[str, RequestState] = {}
        self.last_step_id = -1
        # Each sequence's newest sampled token: async scheduling takes it as the next step's input before the
        # scheduler has seen it (CachedRequestData.takes_last_sample).
        self.last_samples: dict[str, int] = {}
        self.encoder_cache = EncoderCache(device)  # image encoder rows (multimodal models)
        self.image_attention = ImageSpanAttention(attention, kv_caches)  # steps with both-ways image spans

    def swap_model(self, model: torch.nn.Module, forward: ForwardPath) -> None:
        """Serve another model of the same shapes (a weight update) from the next step on; the requests'
        states and the KV cache stay."""
        self.model = model
        self.forward = forward
        self.encoder_cache.clear()

    # ---- state --------------------------------------------------------------
    def update_states(self, step: SchedulerOutput) -> None:
        """Apply the step's deltas and block copies, once per step id."""
        if step.step_id == self.last_step_id:
            return
        self.last_step_id = step.step_id
        if self.drafter is not None:
            self.drafter.update_states(step)
        if step.lora_loads:
            self.lora.apply(step.lora_loads)
        for key in step.finished_keys:
            self.last_samples.pop(key, None)
        self.encoder_cache.free(step.encoder_cache_frees)
        follow_step(step, self.kv_caches, self.requests, lambda new: RequestState.from_new(new, self.device),
                    lambda state, delta: state.apply(delta, self.last_samples.get(delta.key)), apply_forks)

    # ---- one step -------------------------------------------------------------
    def execute(self, step: SchedulerOutput) -> ModelRunnerOutput | None:
        """The worker's entry: the step's deltas, then its forward, with the KV connector's hooks around it
        (loads begun before, the layers walked with its per-layer hooks, saves waited for after)."""
        hook = self.kv_connector
        if hook is None:
            self.update_states(step)
            return self.execute_model(step)
        first = hook.begin(step)
        self.update_states(step)
        layers = hook.layer_caches(self.kv_caches) if first else None
        try:
            out = self.execute_model(step, layers)
        finally:
            hook.finish(step, first, layers, self.requests)
        return hook.attach(out)

    @torch.inference_mode()
    def execute_model(self, step: SchedulerOutput, kv_layers=None) -> ModelRunnerOutput | None:
        """The step's samples on the first tensor-parallel rank; None on the others. `kv_layers`: for this step,
        the caches with a KV connector's per-layer hooks (tokenloom.kv_transfer.layerwise)."""
        if not step.num_scheduled_tokens:
            return ModelRunnerOutput() if tp_group().is_first else None
        scheduled = [(self.requests[k], n) for k, n in step.num_scheduled_tokens.items()]
        with PROFILER.section("prepare_inputs"):
            self._set_prompt_rope(scheduled)
            layout = step_layout(scheduled, step.spec_token_ids, self.block_size)
            self._check_vocabulary(layout.batch.input_ids)
            logit_rows = layout.logit_rows
            row_slots = self._lora_rows(layout.batch, scheduled)
        with PROFILER.section("encoder"):
            images = self.encoder_cache.step_image_rows(self.model, layout.batch, scheduled)
        with PROFILER.section("forward"):
            hidden = self._forward(layout.batch, kv_layers, row_slots, images)
            pooled = {key: pool(hidden[first:first + n], self.pooling).tolist()
                      for key, first, n in layout.pool_spans}
            if not logit_rows:
                return ModelRunnerOutput(pooled=pooled) if tp_group().is_first else None
            with PROFILER.section("matmul"):
                logits = self.model.compute_logits(self._rows(hidden, [row for _, row, _ in logit_rows]))
        out = None
        if logits is not None:  # the first rank; the others only contributed their share of the vocabulary
            with PROFILER.section("sampling"):
                out = self._sample(logit_rows, logits, step)
                out.pooled = pooled
            self.last_samples.update((key, seqs[0].token_ids[-1]) for key, seqs in out.sampled.items())
        forking = {r.key for r, _, samples in logit_rows if samples and r.forks}  # they fork next step
        if out is not None and self.drafter is not None and step.propose_drafts:
            with PROFILER.section("draft"):
                out.draft_token_ids = self.drafter.propose([(self.requests[key], seqs[0].token_ids)
                                                            for key, seqs in out.sampled.items() if key not in forking])
        return out

    def _set_prompt_rope(self, scheduled: list[tuple[RequestState, int]]) -> None:
        """An M-RoPE model's positions for each new prompt with images (text-only prompts need none)."""
        pending = [r for r, _ in scheduled if r.images and r.rope is None]
        if pending and takes_mrope(type(self.model)):
            for r in pending:
                r.rope = self.model.prompt_rope(r.prompt_token_ids, r.images)

    def _check_vocabulary(self, ids: list[int]) -> None:
        vocab_size = self.model.config.vocab_size
        if ids and not 0 <= min(ids) <= max(ids) < vocab_size:
            bad = next(t for t in ids if not 0 <= t < vocab_size)
            raise TokenOutOfVocabulary(f"token id {bad} is outside the vocabulary (0..{vocab_size - 1})")

    def _lora_rows(self, batch: BatchLayout, scheduled: list[tuple[RequestState, int]]) -> torch.Tensor | None:
        """Each row's LoRA slot (-1: the base model), or None when no row of the step uses an adapter."""
        if self.lora is None:
            return None
        return self.lora.row_slots(batch.row_values([r.lora_int_id for r, _ in scheduled]))

    def _forward(self, batch: BatchLayout, kv_layers, row_slots: torch.Tensor | None = None,
                 images: list[ImageRows] = ()) -> torch.Tensor:
        """Hidden states of the flat batch along the forward path: a captured CUDA graph for a decode-only
        step that fits one, the native decoder stack on the CPU, else the layer-by-layer forward (always,
        with the connector's per-layer hooks, and for a step with image rows). `row_slots`: the rows' LoRA
        slots, set on the layers for this forward only; `images`: encoder rows over placeholder rows."""
        graphs, stack = self.forward.graphs, self.forward.native_stack
        fast = (row_slots is None or fast_path_takes_lora(self.forward.kind)) and not images
        if fast and graphs is not None and kv_layers is None and graphs.can_run(batch.spans):
            return graphs.run(batch.input_ids, batch.positions, batch.slot_mapping, batch.spans)
        if needs_image_spans(images):
            meta = self.image_attention.metadata(batch, images, self.device)
        else:
            meta = batch.metadata(self.attention, self.device)
        ids_t, pos_t = batch.tensors(self.device)
        if fast and stack is not None and kv_layers is None and stack.can_run():
            lora = None if row_slots is None else StackLoRA(self.lora.targets, self.lora.batch.scaling, row_slots)
            return stack.run(ids_t, pos_t, self.kv_caches, meta, lora)
        caches = self.kv_caches if kv_layers is None else kv_layers
        embeds = {"inputs_embeds": embeddings_with_images(self.model, ids_t, images)} if images else {}
        if row_slots is None:
            return self.model(ids_t, pos_t, caches, meta, **embeds)
        self.lora.batch.row_slots = row_slots
        try:
            return self.model(ids_t, pos_t, caches, meta, **embeds)
        finally:
            self.lora.batch.row_slots = None

    def _rows(self, t: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """t[rows], without the copy when rows is every row in order (a decode-only step)."""
        if rows == list(range(t.shape[0])):
            return t
        return t[torch.tensor(rows, device=self.device)]

    def _sample(self, logit_rows: list[LogitRow], logits: torch.Tensor, step: SchedulerOutput) -> ModelRunnerOutput:
        out = ModelRunnerOutput()
        spec = step.spec_token_ids
        plan = SamplingPlan.for_step(logit_rows, step, drafts_sampled=self.drafter is not None)
        sample_idx, rows, owners, masks, positions = plan.sample_idx, plan.rows, plan.owners, plan.masks, plan.positions
        for r, idx in plan.prompt_rows.values():
            start = r.num_computed_tokens
            targets = torch.tensor(r.token_ids[start + 1:start + 1 + len(idx)], device=self.device)
            k = r.params.prompt_logprobs
            out.prompt_logprobs[r.key] = _pack(*compute_prompt_logprobs(logits[idx], targets, k), k)
        for key, verify in plan.sampled_drafts.items():
            r = self.requests[key]
            drafts = spec[key]
            tokens, lps = verify_sampled_drafts(self.sampler, logits, verify, drafts,
                                                self.drafter.draft_probs(key, drafts), r.generators[0])
            k = verify[0].row.params.logprobs
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
        token_ids, lp_ids, lps, ranks = to_host(sampled.token_ids, sampled.logprob_token_ids, sampled.logprobs,
                                                sampled.ranks)
        packed = None
        if lps is not None:
            packed = _pack(lp_ids, lps, ranks, lps.shape[1] - 1)
        for j, (r, token) in enumerate(zip(owners, token_ids.tolist())):
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
