"""Continuous batching with one token budget per step, chunked prefill, and preemption by recompute.

The scheduler owns every request's state: it decides what each step computes (`schedule`, which
returns the step contract with only what the workers do not know yet) and it alone applies what
the step produced (`update_from_output`: append tokens, stop checks, freeing, prefix-cache
registration). Everything the workers are told is decided here, before the step's KV slots are
allocated where it matters: n > 1 forks (`ForkData`), the drafts a grammar allows and their bitmasks
(`structured_step`). The EngineCore passes the step contract on unchanged.
"""
from __future__ import annotations

import bisect
import time

from tokenloom.config import SchedulerConfig, SpeculativeConfig
from tokenloom.core.contract import (
    CachedRequestData,
    ForkData,
    ForkedSequence,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from tokenloom.core.kv_connector import SchedulerConnector
from tokenloom.core.messages import EngineCoreOutput
from tokenloom.core.request import Request, RequestStatus
from tokenloom.scheduler.encoder_cache import EncoderCacheManager, run_over_whole_images
from tokenloom.scheduler.kv_cache_manager import KVCacheManager
from tokenloom.scheduler.lora_slots import LoRASlotTable
from tokenloom.scheduler.structured_step import constrain_drafts, forced_token_logprobs, next_token_bitmask
from tokenloom.spec_decode.proposer import make_proposer
from tokenloom.structured.jump_forward import forced_tokens


class Scheduler:
    """Running requests first (a decode costs one token, a partial prefill its next chunk), then waiting
    ones in (priority, arrival) order, within max_num_batched_tokens and max_num_seqs."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int,
                 prefix_reorder_window: int = 8, speculative: SpeculativeConfig | None = None,
                 connector: SchedulerConnector | None = None, vocab_size: int | None = None, max_loras: int = 0,
                 max_encoder_cache: int = 4096):
        """`max_loras`: the workers' LoRA slots (0: LoRA off; a request naming an adapter is refused);
        `max_encoder_cache`: image encoder rows the workers keep (`encoder_cache.py`)."""
        self.config = config
        # Async scheduling: the next step is scheduled while this one runs, before its samples are known
        # (`_schedule_ahead`); a step advances its sequences when it is scheduled, not when its outputs arrive.
        self.overlap = config.async_scheduling
        self.vocab_size = vocab_size  # the width of a grammar's bitmask (requests with a `structured` state)
        self.kv = kv
        self.connector = connector or SchedulerConnector()  # KV loads from elsewhere (tokenloom.kv_transfer)
        self.max_model_len = max_model_len
        self.waiting: list[Request] = []  # sorted by sort_key
        self.running: list[Request] = []
        self.loading: dict[str, Request] = {}  # waiting for their KV to arrive in the background, by key
        self.requests: dict[str, Request] = {}  # by sequence key
        self.pending_copies: list[tuple[int, int]] = []
        self.unannounced_forks: list[tuple[Request, list[Request]]] = []  # (parent, children): next step's forks
        self.finished_keys: list[str] = []  # sequences the workers still hold state for
        self.num_generation_tokens = 0
        self.num_steps = 0
        self.num_preemptions = 0
        self.prefix_reorder_window = prefix_reorder_window
        self.speculative = speculative
        self.proposer = None
        k = speculative.num_speculative_tokens if speculative is not None else 0
        # A proposer in the worker (draft model) drafts after each step into K slots past the sequence.
        self.lookahead = 0
        self.worker_drafts: dict[str, list[int]] = {}  # its latest drafts, per sequence key
        if speculative is not None:
            self.proposer = make_proposer(speculative)
            self.lookahead = k if self.proposer is None else 0
        self._speculate = False
        self.lora_slots = LoRASlotTable(max_loras) if max_loras else None
        self.encoder = EncoderCacheManager(max_encoder_cache, max(config.max_num_batched_tokens, 1))
        # vLLM's spec_decode counters: steps that verified drafts, drafts verified, drafts accepted, per position.
        self.spec_num_drafts = 0
        self.spec_num_draft_tokens = 0
        self.spec_num_accepted_tokens = 0
        self.spec_num_accepted_tokens_per_pos = [0] * k

    # ---- queue management -------------------------------------------------
    def add_request(self, request: Request) -> list[EngineCoreOutput]:
        """Queue a request; returns its output already (a first token produced by a remote prefill)."""
        if request.key in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.lora_int_id and self.lora_slots is None:
            raise ValueError("this engine serves no LoRA adapters (start it with --enable-lora)")
        too_large = [im.length for im in request.images if self.encoder.reuses and im.length > self.encoder.capacity]
        if too_large:
            raise ValueError(f"an image of {too_large[0]} encoder rows does not fit the encoder cache "
                             f"({self.encoder.capacity} rows, --max-encoder-cache)")
        step_tokens = self.config.max_num_batched_tokens
        whole = [im.length for im in request.images if im.attend_whole and im.length > step_tokens]
        if whole:
            raise ValueError(f"an image of {whole[0]} placeholder tokens must be prefilled in one step, more than "
                             f"--max-num-batched-tokens ({step_tokens})")
        first_token = self.connector.on_add(request)
        self.requests[request.key] = request
        outputs = []
        if first_token is not None:
            outputs.append(self._append(request, first_token, None, time.time(), self.max_model_len))
            if request.is_finished:
                return outputs
        self._enqueue(request)
        return outputs

    def _enqueue(self, request: Request, front: bool = False) -> None:
        keys = [r.sort_key() for r in self.waiting]
        pos = bisect.bisect_left(keys, request.sort_key()) if front else bisect.bisect_right(keys, request.sort_key())
        self.waiting.insert(pos, request)

    def abort(self, request_id: str) -> list[Request]:
        aborted = [r for r in list(self.requests.values()) if r.request_id == request_id]
        for r in aborted:
            self.finish(r, "abort")
        return aborted

    def finish(self, request: Request, reason: str, stop_reason=None) -> None:
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.loading.pop(request.key, None)
        self.encoder.release(request.key, request.images)
        hold, request.kv_transfer_params = self.connector.request_finished(request)
        if hold:  # the connector owns the blocks now (a producer's lease)
            request.block_ids = []
        else:
            self.kv.free(request)
        self.worker_drafts.pop(request.key, None)
        if self.requests.pop(request.key, None) is not None and request.sent_to_workers:
            self.finished_keys.append(request.key)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- one step ------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        scheduled: list[tuple[Request, int]] = []
        budget = self.config.max_num_batched_tokens

        preempted = False
        speculate = self._speculate = self._may_speculate(len(self.running))
        self.encoder.begin_step()
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            remaining = req.num_tokens + req.num_output_placeholders - req.num_computed_tokens
            if self.overlap and (remaining <= 0 or (req.num_output_placeholders and not self._feeds_forward(req))):
                i += 1  # waits for the step in flight: its outputs decide what it computes next
                continue
            drafting = speculate and remaining == 1
            req.spec_token_ids, req.spec_bitmasks = self._drafts(req, budget) if drafting else ([], None)
            start = req.num_computed_tokens
            n = 1 + len(req.spec_token_ids) if req.spec_token_ids else self._chunk(req, remaining, budget, start)
            if req.images and not req.spec_token_ids:
                n = self.encoder.fit_chunk(req.key, req.images, req.num_computed_tokens, n)
                if n == 0:  # its next token is an image this step cannot encode
                    i += 1
                    continue
            while not self.kv.allocate(req, n):
                victim = max(self.running, key=Request.sort_key)
                victim_index = self.running.index(victim)
                if victim_index < i:
                    i -= 1
                    done = next(item for item in scheduled if item[0] is victim)
                    scheduled.remove(done)
                    budget += done[1]
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                self._reserve_lookahead(req, n)
                scheduled.append((req, n))
                budget -= n
                i += 1

        deferred: list[Request] = []  # waiting for a LoRA slot: the requests behind them go ahead
        while self.waiting and budget > 0 and not preempted:
            idx = self._pick_waiting()
            req = self.waiting[idx]
            if req.num_output_placeholders:  # preempted with a sample in flight: back once it has arrived
                deferred.append(self.waiting.pop(idx))
                continue
            if req.lora_int_id and not self.lora_slots.acquire(req.lora_request, self._busy_loras()):
                deferred.append(self.waiting.pop(idx))
                continue
            if len(self.running) + len(self.loading) >= self.config.max_num_seqs:
                freed = self._preempt_for_priority(req, scheduled)
                if freed is None:
                    break
                budget += freed
                continue
            embed = req.params.embed  # one whole prefill, never chunked nor served from the prefix cache
            cached = self.kv.find_cached_prefix(req) if req.num_computed_tokens == 0 and not embed else []
            num_cached_tokens = len(cached) * self.kv.block_size
            external = 0
            if req.num_computed_tokens == 0 and not embed:
                external = self.connector.num_external_tokens(req, num_cached_tokens)
            start = num_cached_tokens + external
            n = req.num_tokens if embed else self._chunk(req, req.num_tokens - start, budget, start)
            if n > budget:
                break  # next step (validation keeps an embedding prompt within one step's budget)
            if req.images:
                n = self.encoder.fit_chunk(req.key, req.images, num_cached_tokens + external, n)
                if n == 0:
                    break  # its image waits for the next step's encoder budget
            if not self.kv.allocate(req, external + n, cached):
                self.encoder.release(req.key, req.images)  # a request left waiting holds no encoder room
                freed = self._preempt_for_priority(req, scheduled)
                if freed is None:
                    break
                budget += freed
                continue
            self.waiting.pop(idx)
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_cached_tokens + external
                self.kv.record_prefix_query(req, num_cached_tokens)
            background = bool(external) and self.connector.load_in_background(req, bool(scheduled))
            if external:
                self.connector.after_allocate(req, num_cached_tokens, external, background)
            req.num_computed_tokens = num_cached_tokens + external
            if background:  # scheduled once its KV has arrived (update_from_output)
                req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                self.loading[req.key] = req
                continue
            self._reserve_lookahead(req, n)
            req.status = RequestStatus.RUNNING
            if not req.first_scheduled_time:
                req.first_scheduled_time = time.time()
            self.running.append(req)
            scheduled.append((req, n))
            budget -= n
        for req in deferred:
            self._enqueue(req)
        return self._step_contract(scheduled)

    def _feeds_forward(self, req: Request) -> bool:
        """Whether a sequence whose sample is still in flight can be scheduled on: its worker feeds that
        sample in as the next input. Not under a grammar (the next bitmask follows from the token), nor when
        the sample forks the sequence (the siblings are made once the samples are known)."""
        return req.structured is None and not req.pending_forks

    def requeue_after_failure(self, steps: list[SchedulerOutput]) -> None:
        """Async scheduling: `steps` were launched and their outputs are lost (one failed, and the next one
        ran on samples it never produced). Their sequences compute again from their known tokens, as after a
        preemption; the workers drop the samples they fed forward (`CachedRequestData.num_tokens`)."""
        for key in {k for step in steps for k in step.num_scheduled_tokens}:
            req = self.requests.get(key)
            if req is None:
                continue
            req.num_output_placeholders = 0
            req.sent_tokens = min(req.sent_tokens, req.num_tokens)
            if req.status == RequestStatus.RUNNING:
                self._preempt(req)

    def forget_lora(self, lora_int_id: int) -> None:
        if self.lora_slots is not None:
            self.lora_slots.forget(lora_int_id, self._busy_loras())

    def _busy_loras(self) -> set[int]:
        """Adapters in use by running requests (or ones whose KV is loading): their slots stay."""
        return {r.lora_int_id for r in (*self.running, *self.loading.values()) if r.lora_int_id}

    def _step_contract(self, scheduled: list[tuple[Request, int]]) -> SchedulerOutput:
        """The step as the workers need it: new sequences whole, known ones as deltas."""
        self.num_steps += 1
        # The worker-side proposer drafts for the next step: only if that step may speculate, judged by the batch
        # after this step's admissions (a burst of new requests must not pay for drafting their prompts).
        out = SchedulerOutput(step_id=self.num_steps, block_copies=self.pending_copies,
                              forks=self._announce_forks(), finished_keys=self.finished_keys,
                              propose_drafts=self.lookahead > 0 and self._may_speculate(len(self.running)))
        self.pending_copies, self.finished_keys = [], []
        if self.lora_slots is not None:
            out.lora_loads = self.lora_slots.take_loads()
        out.encoder_cache_frees = self.encoder.take_frees()
        for req, n in scheduled:
            out.num_scheduled_tokens[req.key] = n
            fed = self.overlap and req.num_computed_tokens + n > req.num_tokens  # its input: a sample in flight
            self.connector.on_scheduled(req, n)
            if req.spec_token_ids:
                out.spec_token_ids[req.key] = req.spec_token_ids
                if req.spec_bitmasks is not None:
                    out.spec_grammar_bitmask[req.key] = req.spec_bitmasks
            elif req.structured is not None and req.num_computed_tokens + n == req.num_tokens:  # it samples
                row = next_token_bitmask(req.structured, self.vocab_size, req.token_ids[-1])
                if row is not None:
                    out.grammar_bitmask[req.key] = row
            if not req.sent_to_workers:
                out.new_requests.append(NewRequestData(
                    key=req.key, request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
                    sampling_params=req.params, block_ids=list(req.block_ids),
                    num_computed_tokens=req.num_computed_tokens, eos_token_ids=req.eos_token_ids,
                    bad_words_token_ids=req.bad_words_token_ids, output_token_ids=req.output_token_ids,
                    lora_int_id=req.lora_int_id, images=req.images))
                req.sent_to_workers = True
            else:
                first_block = 0 if req.resend_blocks else req.sent_blocks
                out.cached_requests.append(CachedRequestData(
                    key=req.key, new_token_ids=req.token_ids[req.sent_tokens:],
                    new_block_ids=req.block_ids[first_block:], num_computed_tokens=req.num_computed_tokens,
                    num_tokens=req.num_tokens + fed, replace_block_ids=req.resend_blocks, takes_last_sample=fed))
            req.sent_tokens, req.sent_blocks, req.resend_blocks = req.num_tokens + fed, len(req.block_ids), False
            req.latest_step = (self.num_steps, n)
            if self.overlap:
                self._schedule_ahead(req, n)
        out.kv_connector = self.connector.build_meta()
        return out

    def _schedule_ahead(self, req: Request, n: int) -> None:
        """Async scheduling: count the step as done for `req` now, so the next step can be scheduled before
        its outputs are known; a step that reaches the sequence's end samples, which holds a placeholder
        until `update_from_output` appends the token."""
        req.num_computed_tokens += n
        if req.num_computed_tokens == req.num_tokens + req.num_output_placeholders and not req.params.embed:
            req.num_output_placeholders += 1

    def _announce_forks(self) -> list[ForkData]:
        """The forks made since the last step, each child with its block table as of now (this step's
        allocations included), so the step's deltas for it start from there. A child that already finished
        is left out; so is a fork with nothing left of it (its parent's key is among the finished ones)."""
        forks = []
        for parent, children in self.unannounced_forks:
            alive = [c for c in children if not c.is_finished]
            if parent.is_finished and not alive:
                continue
            forks.append(ForkData(parent_key=parent.key, children=[
                ForkedSequence(key=c.key, index=c.index, block_ids=list(c.block_ids),
                               num_computed_tokens=c.num_computed_tokens) for c in alive]))
            for c in alive:
                c.sent_to_workers, c.sent_blocks, c.resend_blocks = True, len(c.block_ids), False
        self.unannounced_forks = []
        return forks

    def _drafts(self, req: Request, budget: int) -> tuple[list[int], list[bytes | None] | None]:
        """A decoding sequence's drafts to verify this step and, under a grammar, their bitmasks: decided before
        its KV slots are allocated, so it is given room for the drafts its grammar allows only."""
        drafts = self._propose(req, budget)
        if drafts and req.structured is not None:
            return constrain_drafts(req.structured, drafts, self.vocab_size)
        return drafts, None

    def _propose(self, req: Request, budget: int) -> list[int]:
        """Drafts for a decoding sequence, no more than its token budget, max_tokens and the context allow
        (a step never computes past what the sequence could still emit)."""
        k = min(self.speculative.num_speculative_tokens, budget - 1, self.max_model_len - req.num_tokens - 1)
        if req.params.max_tokens is not None:
            k = min(k, req.params.max_tokens - req.num_output_tokens - 1)
        if k <= 0 or req.pending_forks:
            return []
        if self.proposer is None:  # proposed in the worker after the sequence's last step
            return self.worker_drafts.get(req.key, [])[:k]
        return self.proposer.propose(req.token_ids, k)

    def _may_speculate(self, num_running: int) -> bool:
        spec = self.speculative
        return spec is not None and (spec.disable_by_batch_size is None or num_running <= spec.disable_by_batch_size)

    def _reserve_lookahead(self, req: Request, n: int) -> None:
        """Slots for a worker-side proposer's drafts past what the step computes, if the pool has them (the
        drafter never writes past a sequence's table, so being short only shortens its drafts). Not for a
        sequence about to fork: its last block must be the one the fork copies."""
        if self.lookahead and self._speculate and not req.pending_forks:
            self.kv.allocate(req, n + self.lookahead)

    def _preempt_for_priority(self, req: Request, scheduled: list[tuple[Request, int]]) -> int | None:
        """Make room for a waiting request by preempting the lowest-priority running one, if that one has a
        strictly lower priority (equal priorities never preempt each other, so nobody starves among equals).
        Returns the step tokens given back (the victim's, if it was scheduled this step), or None."""
        if not self.running:
            return None
        victim = max(self.running, key=Request.sort_key)
        if victim.priority <= req.priority:
            return None
        done = next((item for item in scheduled if item[0] is victim), None)
        if done is not None:
            scheduled.remove(done)
        self._preempt(victim)
        return done[1] if done is not None else 0

    def _chunk(self, req: Request, remaining: int, budget: int, start: int) -> int:
        """`start`: the chunk's first position."""
        n = min(remaining, budget)
        if remaining > 1:
            n = min(n, self.config.long_prefill_token_threshold)
        n = run_over_whole_images(req.images, start, n, min(remaining, budget))
        return max(n, 1) if budget > 0 else 0

    def _pick_waiting(self) -> int:
        """Among the first waiting requests of the head's priority, prefer one with a cached prefix.

        Bounded reordering: only a small window is considered, so nobody starves."""
        head = self.waiting[0]
        if not self.kv.pool.enable_caching or head.num_computed_tokens or head.num_cached_tokens >= 0:
            return 0
        for idx, req in enumerate(self.waiting[: self.prefix_reorder_window]):
            if req.priority != head.priority:
                break
            if req.num_cached_tokens < 0 and self.kv.find_cached_prefix(req):
                return idx
        return 0

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        self.encoder.release(req.key, req.images)
        req.resend_blocks = True
        req.spec_token_ids, req.spec_bitmasks = [], None
        req.num_computed_tokens = 0
        if req.prompt_logprobs is not None and req.num_output_tokens == 0:
            req.prompt_logprobs = [None]  # the recompute reports the prompt's positions again
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(req, front=True)

    # ---- after the forward -------------------------------------------------
    def fork(self, parent: Request) -> list[Request]:
        """Split a request with n>1 into its sequences once its prompt is computed and sampled them all. The
        workers hear of it once, in the next step's contract (`_announce_forks`)."""
        children = []
        needs_copy = parent.num_computed_tokens % self.kv.block_size != 0
        for index in range(1, parent.pending_forks + 1):
            child = parent.fork(index)
            child.status = RequestStatus.RUNNING
            self.running.append(child)
            self.requests[child.key] = child
            children.append(child)
            if needs_copy and self.kv.pool.num_free == 0:
                # No block to copy the partial last block into: recompute this sequence later.
                child.block_ids = []
                self._preempt(child)
                continue
            copy = self.kv.fork(parent, child)
            if copy:
                self.pending_copies.append(copy)
        parent.pending_forks = 0
        self.unannounced_forks.append((parent, children))
        return children

    def update_from_output(self, step: SchedulerOutput, result: ModelRunnerOutput,
                           max_model_len: int) -> list[EngineCoreOutput]:
        """Advance every scheduled sequence by what it computed and sampled; stop checks; outputs."""
        outputs = []
        now = time.time()
        self.connector.update(result.kv_connector)
        failed = result.kv_connector.failed if result.kv_connector is not None else {}
        if result.kv_connector is not None and self.loading:
            outputs.extend(self._background_loads_ended(result.kv_connector.loaded, failed))
        for key, n in step.num_scheduled_tokens.items():
            r = self.requests.get(key)
            if r is None:
                continue
            if key in failed:  # its loaded KV is missing: what the forward computed on top of it is void
                outputs.extend(self._load_failed(r, failed[key]))
                continue
            if not self.overlap:
                r.num_computed_tokens += n
            if r.images:
                self.encoder.release_past(key, r.images, r.num_computed_tokens)
            embedding = result.pooled.get(key)
            if embedding is not None:  # an embedding request is done after its one step
                self.finish(r, "stop")
                out = engine_output(r, [])
                out.embedding = embedding
                outputs.append(out)
                continue
            drafts = step.spec_token_ids.get(key)
            if drafts is None:
                self.kv.cache_computed_blocks(r, self._num_confirmed_tokens(r, step.step_id))
            prompt_logprobs = result.prompt_logprobs.get(key)
            if prompt_logprobs and r.prompt_logprobs is not None:
                r.prompt_logprobs.extend(prompt_logprobs)
            sampled = result.sampled.get(key)
            if sampled and r.num_output_placeholders:
                r.num_output_placeholders -= 1
            if not sampled:
                if drafts is not None:  # nothing verified (cannot happen on a healthy step): recompute them
                    r.num_computed_tokens -= len(drafts)
                continue
            sequences = [r] + (self.fork(r) if r.pending_forks else [])
            for seq, sample in zip(sequences, sampled):
                for i, token in enumerate(sample.token_ids):
                    logprobs = sample.logprobs[i] if sample.logprobs else None
                    outputs.append(self._append(seq, token, logprobs, now, max_model_len))
                    if seq.is_finished:
                        break
            if drafts is not None:
                self._settle_drafts(r, drafts, len(sampled[0].token_ids) - 1)
            if self.lookahead and not r.is_finished:
                self.worker_drafts[key] = result.draft_token_ids.get(key, [])
            for seq in sequences:
                if seq.structured is not None and not seq.is_finished:
                    outputs.extend(self._jump_forward(seq, now, max_model_len))
        return outputs

    def _num_confirmed_tokens(self, r: Request, step_id: int) -> int:
        """Tokens of `r` whose KV is computed once step `step_id` has run: under async scheduling, not those
        of a later step still in flight (its blocks are not registered in the prefix cache before it ran)."""
        later_step, later_tokens = r.latest_step
        return r.num_computed_tokens - (later_tokens if self.overlap and later_step > step_id else 0)

    def _jump_forward(self, r: Request, now: float, max_model_len: int) -> list[EngineCoreOutput]:
        """Append the tokens r's grammar forces after its last sampled token (jump-forward decoding): output
        tokens like sampled ones, emitted in this step's output, their KV computed by the next step as a
        chunk before it samples. Within max_tokens and the context; drafts made before them are void."""
        limit = max_model_len - r.num_tokens
        if r.params.max_tokens is not None:
            limit = min(limit, r.params.max_tokens - r.num_output_tokens)
        tokens = forced_tokens(r.structured, r.token_ids[-1], limit)
        if not tokens:
            return []
        self.worker_drafts.pop(r.key, None)
        for i, token in enumerate(tokens):
            self._advance(r, token, now, max_model_len)
            if r.is_finished:
                tokens = tokens[:i + 1]
                break
        k = r.params.logprobs
        out = engine_output(r, tokens)
        out.new_logprobs = [forced_token_logprobs(t, k) for t in tokens] if k is not None else None
        return [out]

    def _background_loads_ended(self, loaded: list[str], failed: dict[str, str]) -> list[EngineCoreOutput]:
        """Requests whose KV arrived run from the next step on; a failed load follows the policy."""
        outputs = []
        for key in loaded:
            r = self.loading.pop(key, None)
            if r is not None:
                r.status = RequestStatus.RUNNING
                r.first_scheduled_time = r.first_scheduled_time or time.time()
                self.running.append(r)
        for key, reason in failed.items():
            r = self.loading.pop(key, None)
            if r is not None:
                self.running.append(r)  # as if it had run: the policy's recompute preempts it from there
                outputs.extend(self._load_failed(r, reason))
        return outputs

    def _load_failed(self, r: Request, reason: str) -> list[EngineCoreOutput]:
        """A KV load failed: recompute the request from scratch, or end it with an error (the policy)."""
        if self.connector.failure_policy() == "recompute":
            self._preempt(r)
            r.num_cached_tokens = -1  # counted again when it is scheduled: what it reuses, not what failed to load
            return []
        self.finish(r, "error")
        out = engine_output(r, [])
        out.error = f"KV transfer failed: {reason}"
        return [out]

    def _settle_drafts(self, r: Request, drafts: list[int], accepted: int) -> None:
        """After verification: count, keep the KV of the accepted drafts only, release blocks that held
        rejected drafts alone."""
        self.spec_num_drafts += 1
        self.spec_num_draft_tokens += len(drafts)
        self.spec_num_accepted_tokens += accepted
        for pos in range(accepted):
            self.spec_num_accepted_tokens_per_pos[pos] += 1
        r.num_computed_tokens -= len(drafts) - accepted
        r.spec_token_ids, r.spec_bitmasks = [], None
        if r.is_finished:
            return
        self.kv.cache_computed_blocks(r)
        # Blocks past the sequence's tokens that a worker-side proposer just drafted into stay.
        keep = -(-(r.num_tokens + max(self.lookahead - 1, 0)) // self.kv.block_size)
        if len(r.block_ids) > keep:
            self.kv.pool.release(r.block_ids[keep:])
            r.block_ids = r.block_ids[:keep]
            r.resend_blocks = True  # the workers' table shrinks too

    def _append(self, r: Request, token: int, logprobs, now: float, max_model_len: int) -> EngineCoreOutput:
        first = r.num_output_tokens == 0
        self._advance(r, token, now, max_model_len)
        out = engine_output(r, [token], logprobs)
        if first and r.prompt_logprobs is not None and r.index == 0:
            out.prompt_logprobs = r.prompt_logprobs
        return out

    def _advance(self, r: Request, token: int, now: float, max_model_len: int) -> None:
        """Append one output token: the grammar accepts it, then the stop checks."""
        if r.num_output_tokens == 0:
            r.first_token_time = now
        r.token_ids.append(token)
        self.num_generation_tokens += 1
        params = r.params
        grammar_end = r.structured.accept(token) if r.structured is not None else None
        if token in r.stop_token_ids:
            reason = token if token in (params.stop_token_ids or ()) else None
            self.finish(r, "stop", reason)
        elif grammar_end is not None:  # the grammar is complete ("stop") or was broken ("error")
            self.finish(r, grammar_end)
        elif params.max_tokens is not None and r.num_output_tokens >= params.max_tokens:
            self.finish(r, "length")
        elif r.num_tokens >= max_model_len:
            self.finish(r, "length")


def engine_output(r: Request, tokens: list[int], logprobs=None) -> EngineCoreOutput:
    """What the frontend hears about one sequence after a step (its timestamps once it has finished)."""
    out = EngineCoreOutput(request_id=r.request_id, index=r.index, new_token_ids=tokens,
                           new_logprobs=[logprobs] if logprobs else None,
                           num_cached_tokens=max(r.num_cached_tokens, 0))
    if r.is_finished:
        out.finish_reason = r.finish_reason
        out.stop_reason = r.stop_reason
        out.arrival_time = r.arrival_time
        out.first_scheduled_time = r.first_scheduled_time
        out.first_token_time = r.first_token_time
        out.finished_time = time.time()
        out.kv_transfer_params = r.kv_transfer_params
    return out
