"""EngineCore: owns the scheduler, the KV block pool and the executor; one step = schedule, execute, update.

The step contract the scheduler returns goes to the executor as it is: forks, drafts and grammar bitmasks
are the scheduler's decisions, made before it allocates the step's KV slots.

With async scheduling (--async-scheduling) a step is launched before the outputs of the step before it are
applied: `step()` schedules step N+1, hands it to the workers, then applies step N's outputs while N+1 runs,
and returns them (the process loop then sends them, still during N+1). The workers feed each sequence's
newest sample into N+1 themselves, so the scheduler needs nothing of N to schedule N+1; a sequence that N
finishes wastes its slot in N+1, whose output for it is dropped.
"""
from __future__ import annotations

import logging
import time
from collections import deque

import torch

from tokenloom.config import EngineConfig
from tokenloom.core.contract import ExpertLoadReport, ModelRunnerOutput, SchedulerOutput
from tokenloom.core.lora_request import LoRARequest
from tokenloom.core.messages import EngineCoreOutput, EngineCoreRequest
from tokenloom.core.request import Request
from tokenloom.engine.faults import FaultInjector, recover_failed_step, requeue_lost_steps
from tokenloom.engine.lora_registry import LoRARegistry
from tokenloom.engine.weight_control import WeightControl
from tokenloom.executor.base import Executor, ExecutorFault, FinishedStep, StepFuture
from tokenloom.executor.factory import make_executor
from tokenloom.kv_transfer.factory import make_scheduler_connector
from tokenloom.profiler import PROFILER
from tokenloom.scheduler.kv_cache_manager import KVCacheManager
from tokenloom.scheduler.scheduler import Scheduler, engine_output
from tokenloom.structured.engine import StructuredEngine

logger = logging.getLogger("tokenloom.engine")


class EngineCore:
    """The step loop's state. Frontends call add_request / abort_requests / step; no text in here."""

    def __init__(self, config: EngineConfig, progress: bool = True, executor: Executor | None = None):
        self.config = config
        self.executor = executor or make_executor(config, progress=progress)
        try:
            self.info = self.executor.initialize()
        except BaseException:
            self.executor.shutdown()
            raise
        self.max_model_len = self.info.max_model_len
        self.kv_manager = KVCacheManager(self.info.num_blocks, self.info.block_size,
                                         config.cache.enable_prefix_caching, self.info.kv_release_window)
        self.kv_connector = make_scheduler_connector(config, self.kv_manager, self.info.kv_connector)
        self.scheduler = Scheduler(config.scheduler, self.kv_manager, self.max_model_len,
                                   speculative=config.speculative_config, connector=self.kv_connector,
                                   vocab_size=self.info.vocab_size, max_loras=config.lora.num_slots,
                                   max_encoder_cache=config.multimodal.max_encoder_cache)
        self.loras = LoRARegistry(config.lora, self.info.lora_target_shapes, self.info.num_layers)
        self._finished: list[EngineCoreOutput] = []
        self.last_step_tokens = 0  # tokens the latest step computed
        self.counters = {"prompt_tokens": 0, "steps": 0, "batched_tokens": 0}
        self._last_log = time.time()
        self._log_tokens = 0
        self.faults = FaultInjector.from_env()  # tests only (TOKENLOOM_FAULTS)
        self.structured = StructuredEngine(self.info.model_path, self.info.vocab_size, config.reasoning_parser)
        self.weights = WeightControl(self.kv_manager)
        self.expert_load: ExpertLoadReport | None = None  # the latest re-placement's figures (--enable-eplb)
        self.overlap = config.scheduler.async_scheduling
        self._in_flight: deque[tuple[SchedulerOutput, StepFuture]] = deque()  # launched, outputs not applied
        self.one_step_at_a_time: set[str] = set()  # sequences run without overlap after a failed step (faults.py)

    # ---- requests ---------------------------------------------------------
    def add_request(self, req: EngineCoreRequest) -> None:
        if req.lora_request is not None:
            self.loras.check(req.lora_request)
        request = Request(req.request_id, req.prompt_token_ids, req.sampling_params, arrival_time=req.arrival_time,
                          priority=req.priority, eos_token_ids=req.eos_token_ids,
                          bad_words_token_ids=req.bad_words_token_ids,
                          cache_salt=self.weights.salted(req.cache_salt), lora_request=req.lora_request,
                          images=req.images)
        request.structured = self.structured.new_state(req.prompt_token_ids, req.sampling_params,
                                                       req.eos_token_ids)
        self._finished.extend(self.scheduler.add_request(request))
        self.counters["prompt_tokens"] += len(req.prompt_token_ids)

    def abort_requests(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            for r in self.scheduler.abort(rid):
                self._finished.append(engine_output(r, []))

    def add_lora(self, name: str, lora_int_id: int, path: str) -> bool:
        """Check an adapter against the model and accept it (LoRAAdapterError says why not); it goes into a
        slot when a request first uses it."""
        self.loras.check(LoRARequest(name, lora_int_id, path))
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter: no new request may use it; its slot goes to the next adapter."""
        self.scheduler.forget_lora(lora_int_id)
        return self.loras.remove(lora_int_id)

    def has_unfinished_requests(self) -> bool:
        """Whether a step would do something: outputs to hand back, a step in flight, or requests to run (none
        while paused)."""
        return (bool(self._finished) or bool(self._in_flight)
                or (self.scheduler.has_unfinished() and self.weights.running))

    # ---- weights and memory (training loops: tokenloom/engine/weight_control.py) --------------------------
    def update_weights_from_disk(self, path: str) -> bool:
        self.drain()
        self.weights.update(lambda: self.executor.collective_rpc("update_weights_from_path", path))
        return True

    def update_weights(self, tensors: dict[str, torch.Tensor]) -> bool:
        self.drain()
        self.weights.update(lambda: self.executor.update_weights_from_tensors(tensors))
        return True

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, backend: str = "gloo") -> bool:
        self.drain()
        self.weights.on_workers(lambda: self.executor.collective_rpc(
            "init_weights_update_group", master_address, master_port, rank_offset, world_size, backend))
        return True

    def update_weights_from_distributed(self, metas_json: str) -> bool:
        self.drain()
        self.weights.update(lambda: self.executor.collective_rpc("update_weights_from_distributed", metas_json))
        return True

    def destroy_weights_update_group(self) -> bool:
        self.drain()
        self.weights.on_workers(lambda: self.executor.collective_rpc("destroy_weights_update_group"))
        return True

    def pause_generation(self) -> bool:
        self.weights.paused = True
        return True

    def continue_generation(self) -> bool:
        self.weights.paused = False
        return True

    def sleep(self, level: int = 1) -> bool:
        self.drain()
        self.weights.check_can_sleep(level, self.scheduler.has_unfinished())
        self.weights.on_workers(lambda: self.executor.collective_rpc("sleep", level))
        self.weights.sleep_level = level
        self.kv_manager.reset_prefix_cache()
        return True

    def wake_up(self) -> bool:
        if self.weights.sleep_level:
            self.drain()
            self.weights.on_workers(lambda: self.executor.collective_rpc("wake_up"))
            self.weights.sleep_level = 0
        return True

    def is_sleeping(self) -> bool:
        return self.weights.sleep_level > 0

    def reset_prefix_cache(self) -> bool:
        return self.kv_manager.reset_prefix_cache()

    def check_health(self) -> None:
        """Raise ExecutorFault when a worker is gone (the process loop calls this between steps too)."""
        self.executor.check_health()

    def shutdown(self) -> None:
        try:
            self.drain()
            self._last_connector_step()
        finally:
            self.executor.shutdown()

    def _last_connector_step(self) -> None:
        """A clean shutdown's last step for the KV connector (the disk offload tier saves its cached blocks)."""
        meta = self.kv_connector.at_shutdown() if self.kv_connector is not None else None
        if meta is None:
            return
        self.scheduler.num_steps += 1
        try:
            self.executor.execute_model(SchedulerOutput(step_id=self.scheduler.num_steps, kv_connector=meta))
        except Exception:  # noqa: BLE001 - a worker already gone: the blocks are lost, the shutdown goes on
            logger.warning("the KV connector's shutdown step failed; cached blocks were not saved", exc_info=True)

    # ---- one step -------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        """Schedule and launch a step, then apply the outputs of the steps before it, oldest first: all of
        them, or with async scheduling all but the one just launched."""
        outputs, self._finished = self._finished, []
        self.last_step_tokens = 0
        launched = False
        if self.weights.running:
            with PROFILER.section("schedule"):
                step = self.scheduler.schedule()
            if step:
                launched = self._launch(step)
        ahead = 1 if launched and self._overlapping() else 0
        while len(self._in_flight) > ahead:
            outputs.extend(self._complete(*self._in_flight.popleft()))
        return outputs

    def drain(self) -> None:
        """Apply the outputs of the step in flight, so the workers are idle (before a weight update, sleep or
        shutdown); the next `step()` returns them."""
        while self._in_flight:
            self._finished.extend(self._complete(*self._in_flight.popleft()))

    def _overlapping(self) -> bool:
        self.one_step_at_a_time &= self.scheduler.requests.keys()
        return self.overlap and not self.one_step_at_a_time

    def _launch(self, step: SchedulerOutput) -> bool:
        """Hand `step` to the workers; False when it failed before reaching them (then it is dealt with
        before any later step is scheduled)."""
        try:
            if self.faults is not None:
                self.faults.before_execute(step, self.scheduler.requests)
            self._in_flight.append((step, self.executor.submit_model(step)))
            return True
        except Exception as exc:  # noqa: BLE001 - read back in order, like a failure in a worker
            self._in_flight.append((step, FinishedStep(error=exc)))
            return False

    def _complete(self, step: SchedulerOutput, future: StepFuture) -> list[EngineCoreOutput]:
        try:
            result = future.result()
        except Exception as exc:  # noqa: BLE001 - one request's fault must not fail the batch
            if self._in_flight:  # a later step ran on this one's samples: both are void
                outputs = requeue_lost_steps(self, [step, *self._abandon_in_flight()], exc)
            else:
                outputs = recover_failed_step(self, step, exc)
        else:
            with PROFILER.section("update"):
                outputs = self.update(step, result)
        PROFILER.steps += 1
        self.counters["steps"] += 1
        self.counters["batched_tokens"] += step.num_tokens
        self.last_step_tokens += step.num_tokens
        self._maybe_log(step.num_tokens)
        return outputs

    def execute(self, step: SchedulerOutput) -> ModelRunnerOutput:
        if self.faults is not None:
            self.faults.before_execute(step, self.scheduler.requests)
        return self.executor.execute_model(step)

    def _abandon_in_flight(self) -> list[SchedulerOutput]:
        """Wait for the steps in flight and drop their outputs; returns them."""
        steps = []
        while self._in_flight:
            step, future = self._in_flight.popleft()
            try:
                future.result()
            except ExecutorFault:
                raise
            except Exception:  # noqa: BLE001 - its outputs are void whether it ran or not
                pass
            steps.append(step)
        return steps

    def update(self, step: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        if result.expert_load is not None:
            self.expert_load = result.expert_load
        return self.scheduler.update_from_output(step, result, self.max_model_len)

    # ---- observability ----------------------------------------------------------
    def stats(self) -> dict:
        kv = self.kv_manager
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_cache_usage": kv.pool.usage(),
            "kv_blocks_used": kv.pool.num_used,
            "kv_blocks_total": kv.pool.num_blocks,
            "prefix_cache_queries": kv.prefix_queries,
            "prefix_cache_hits": kv.prefix_hits,
            "num_preemptions": self.scheduler.num_preemptions,
            "generation_tokens": self.scheduler.num_generation_tokens,
            **self._spec_stats(),
            **self._expert_load_stats(),
            **self.scheduler.connector.stats(),
            **self.counters,
        }

    def _spec_stats(self) -> dict:
        s = self.scheduler
        if s.speculative is None:
            return {}
        return {"spec_num_drafts": s.spec_num_drafts, "spec_num_draft_tokens": s.spec_num_draft_tokens,
                "spec_num_accepted_tokens": s.spec_num_accepted_tokens,
                "spec_num_accepted_tokens_per_pos": list(s.spec_num_accepted_tokens_per_pos)}

    def _expert_load_stats(self) -> dict:
        load = self.expert_load
        if load is None:
            return {}
        return {"eplb_rebalances": load.rebalances, "eplb_experts_moved": load.experts_moved,
                "eplb_imbalance": load.imbalance, "eplb_planned_imbalance": load.planned_imbalance}

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
        if "spec_num_drafts" in s:
            logger.info("speculative decoding: %s", spec_summary(s))
        self._last_log, self._log_tokens = now, 0


def spec_summary(stats: dict) -> str:
    """vLLM's figures: draft acceptance rate, mean accepted length (tokens per verify span, the bonus
    token included), and the acceptance rate per draft position."""
    drafts, tokens = stats.get("spec_num_drafts", 0), stats.get("spec_num_draft_tokens", 0)
    accepted = stats.get("spec_num_accepted_tokens", 0)
    rate = accepted / tokens if tokens else 0.0
    mean_len = 1 + accepted / drafts if drafts else 0.0
    per_pos = ", ".join(f"{c / drafts:.2f}" for c in stats.get("spec_num_accepted_tokens_per_pos", [])
                        ) if drafts else ""
    return (f"acceptance rate {100 * rate:.1f}%, mean accepted length {mean_len:.2f}, drafts {drafts}, "
            f"draft tokens {tokens}, accepted {accepted}, per-position acceptance [{per_pos}]")
