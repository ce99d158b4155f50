"""EngineCore: owns the model, the KV cache and the scheduler; one step = schedule, forward, update."""
from __future__ import annotations

import logging
import time


from tokenloom.config import EngineConfig
from tokenloom.engine.faults import FaultInjector, recover_failed_step
from tokenloom.engine.messages import EngineCoreOutput, EngineCoreRequest
from tokenloom.engine.request import Request
from tokenloom.engine.setup import EngineSetup, build_engine
from tokenloom.profiler import PROFILER
from tokenloom.scheduler.scheduler import Scheduler, SchedulerOutput
from tokenloom.structured.engine import StructuredEngine

logger = logging.getLogger("tokenloom.engine")


class EngineCore:
    """The step loop's state. Frontends call add_request / abort_requests / step; no text in here."""

    def __init__(self, config: EngineConfig, progress: bool = True, setup: EngineSetup | None = None):
        self.config = config
        self.setup = setup or build_engine(config, progress=progress)
        self.runner = self.setup.runner
        self.kv = self.setup.kv_manager
        self.max_model_len = self.setup.max_model_len
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len)
        self.device = self.setup.device
        self._finished: list[EngineCoreOutput] = []
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0, "batched_tokens": 0}
        self._last_log = time.time()
        self._log_tokens = 0
        self.faults = FaultInjector.from_env()  # tests only (TOKENLOOM_FAULTS)
        self.structured = StructuredEngine(str(self.setup.loaded.path), self.setup.arch.vocab_size,
                                           config.reasoning_parser)

    # ---- requests ---------------------------------------------------------
    def add_request(self, req: EngineCoreRequest) -> None:
        request = Request(req.request_id, req.prompt_token_ids, req.sampling_params, arrival_time=req.arrival_time,
                          priority=req.priority, eos_token_ids=req.eos_token_ids,
                          bad_words_token_ids=req.bad_words_token_ids, cache_salt=req.cache_salt,
                          device=self.device)
        self.counters["prompt_tokens"] += len(req.prompt_token_ids)
        request.structured = self.structured.new_state(req.prompt_token_ids, req.sampling_params,
                                                       req.eos_token_ids)
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            for r in self.scheduler.abort(rid):
                self._finished.append(self._output(r, []))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._finished)

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()

    # ---- one step -------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        outputs, self._finished = self._finished, []
        with PROFILER.section("schedule"):
            sched = self.scheduler.schedule()
        if not sched:
            return outputs
        try:
            sampled = self._execute(sched)
        except Exception as exc:  # noqa: BLE001 - one request's fault must not fail the batch
            outputs.extend(recover_failed_step(self, sched, exc))
        else:
            with PROFILER.section("update"):
                outputs.extend(self._update(sched, sampled))
        PROFILER.steps += 1
        self.counters["steps"] += 1
        self.counters["batched_tokens"] += sched.num_tokens
        self._maybe_log(sched.num_tokens)
        return outputs

    def _execute(self, sched: SchedulerOutput):
        if self.faults is not None:
            self.faults.before_execute(sched)
        return self.runner.execute(sched)

    def _update(self, sched: SchedulerOutput, sampled) -> list[EngineCoreOutput]:
        outputs = []
        now = time.time()
        for s in sched.scheduled:
            r = s.request
            r.num_computed_tokens += s.num_new_tokens
            self.kv.cache_computed_blocks(r)
            result = sampled.get(id(r))
            if result is None:
                continue
            if result.prompt_logprobs:
                r.prompt_logprobs.extend(result.prompt_logprobs)
            if not result.token_ids:
                continue
            sequences = [r] + (self.scheduler.fork(r) if r.pending_forks else [])
            for seq, token, logprobs in zip(sequences, result.token_ids, result.logprobs):
                outputs.append(self._append(seq, token, logprobs, now))
        return outputs

    def _append(self, r: Request, token: int, logprobs, now: float) -> EngineCoreOutput:
        first = r.num_output_tokens == 0
        r.token_ids.append(token)
        self.counters["generation_tokens"] += 1
        if first:
            r.first_token_time = now
        if logprobs:
            r.cumulative_logprob += logprobs[0][1]
        params = r.params
        grammar_end = r.structured.accept(token) if r.structured is not None else None
        if token in r.stop_token_ids:
            reason = token if token in (params.stop_token_ids or ()) else None
            self.scheduler.finish(r, "stop", reason)
        elif grammar_end is not None:  # the grammar is complete ("stop") or was broken ("error")
            self.scheduler.finish(r, grammar_end)
        elif params.max_tokens is not None and r.num_output_tokens >= params.max_tokens:
            self.scheduler.finish(r, "length")
        elif r.num_tokens >= self.max_model_len:
            self.scheduler.finish(r, "length")
        out = self._output(r, [token], logprobs)
        if first and r.prompt_logprobs is not None and r.index == 0:
            out.prompt_logprobs = r.prompt_logprobs
        return out

    def _output(self, r: Request, tokens: list[int], logprobs=None) -> EngineCoreOutput:
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
        return out

    # ---- observability ----------------------------------------------------------
    def stats(self) -> dict:
        kv = self.kv
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_cache_usage": kv.pool.usage(),
            "kv_blocks_used": kv.pool.num_used,
            "kv_blocks_total": kv.pool.num_blocks,
            "prefix_cache_queries": kv.prefix_queries,
            "prefix_cache_hits": kv.prefix_hits,
            "num_preemptions": self.scheduler.num_preemptions,
            **self.counters,
        }

    def _maybe_log(self, tokens: int) -> None:
        interval = self.config.log_stats_interval
        self._log_tokens += tokens
        now = time.time()
        if not interval or now - self._last_log < interval:
            return
        s = self.stats()
        hit = s["prefix_cache_hits"] / s["prefix_cache_queries"] if s["prefix_cache_queries"] else 0.0
        logger.info("engine: %.1f tokens/s, running %d, waiting %d, KV usage %.1f%%, prefix cache hit rate %.1f%%",
                    self._log_tokens / (now - self._last_log), s["num_running"], s["num_waiting"],
                    100 * s["kv_cache_usage"], 100 * hit)
        self._last_log, self._log_tokens = now, 0
