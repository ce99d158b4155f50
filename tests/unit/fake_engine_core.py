"""A tiny stand-in EngineCore for testing the process plumbing without a model.

Each request "generates" its prompt's token ids + 1, one per step, up to max_tokens.
A prompt whose first token is 999999 makes `step()` raise (engine failure);
666666 makes the process exit at once (engine crash); 555555 makes the step leave 64 MiB of freed holes
in malloc's heap (as freed activations do), between small blocks it keeps.
"""
from __future__ import annotations

import os
import time

from tokenloom.core.messages import EngineCoreOutput
from tokenloom.worker.worker_info import WorkerInfo


class FakeCore:
    def __init__(self, config):
        self.config = config
        self.reqs = {}
        self.step_delay = float(os.environ.get("FAKE_CORE_STEP_DELAY", "0.01"))
        self.kept: list[bytes] = []

    def add_request(self, req):
        if req.prompt_token_ids and req.prompt_token_ids[0] == 666666:
            os._exit(3)
        self.reqs[req.request_id] = [req, 0]

    def abort_requests(self, ids):
        for i in ids:
            self.reqs.pop(i, None)

    def has_unfinished_requests(self):
        return bool(self.reqs)

    def step(self):
        time.sleep(self.step_delay)
        outs = []
        for rid, st in list(self.reqs.items()):
            req, k = st
            if req.prompt_token_ids and req.prompt_token_ids[0] == 999999:
                raise RuntimeError("boom")
            if req.prompt_token_ids and req.prompt_token_ids[0] == 555555:
                self._fragment_heap()
            tok = req.prompt_token_ids[k % len(req.prompt_token_ids)] + 1
            st[1] += 1
            done = st[1] >= (req.sampling_params.max_tokens or 16)
            outs.append(EngineCoreOutput(request_id=rid, new_token_ids=[tok],
                                         finish_reason="length" if done else None,
                                         arrival_time=req.arrival_time))
            if done:
                del self.reqs[rid]
        return outs

    def _fragment_heap(self, holes: int = 640, hole_bytes: int = 100_000) -> None:
        """Written (so resident) 100 kB blocks, under malloc's 128 KiB mmap threshold so they come from the
        heap, each followed by a small block that stays: freeing the big ones leaves holes glibc does not trim
        by itself."""
        freed = []
        for i in range(holes):
            freed.append(bytes([i % 251]) * hole_bytes)
            self.kept.append(bytes([i % 251]) * 1000)
        del freed

    last_step_tokens = 0

    def check_health(self):
        pass  # no workers to lose

    def shutdown(self):
        pass

    def stats(self):
        return {"num_running": len(self.reqs), "num_waiting": 0, "kv_cache_usage": 0.0,
                "prefix_cache_queries": 0, "prefix_cache_hits": 0, "num_preemptions": 0}

    info = WorkerInfo(model_path="fake", architecture="Fake", vocab_size=1000, max_position_embeddings=128,
                      eos_token_ids=[2], device="cpu", dtype="float32", kv_cache_dtype="float32", num_blocks=64,
                      block_size=16, max_model_len=128, tensor_parallel_size=1, summary="fake")


def make(config):
    return FakeCore(config)
