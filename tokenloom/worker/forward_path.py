"""How the runner computes a step's hidden states, chosen once at start-up and fixed for the engine's life.

* eager: the model's layer-by-layer forward (any model, any backend; every step under `--enforce-eager`).
* native_stack (CPU): a Llama-family model on the native kernels runs its whole decoder in one native call
  (`tokenloom.model.native_stack`); a model it does not serve stays eager.
* cuda_graphs (CUDA, FlashInfer): decode-only steps replay a captured graph (`worker/cuda_graphs.py`); the
  graphs are captured in the worker's warm-up phase, after the runner that holds them is built.

Whatever the path, a step with a KV connector's per-layer hooks, or one a fast path cannot take (a prefill
in a graph engine, a step under the profiler, rows with a LoRA adapter where the path has no LoRA:
`fast_path_takes_lora`), runs eagerly.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from tokenloom.config import EngineConfig
from tokenloom.distributed.parallel_state import tp_group
from tokenloom.model.arch_config import ArchConfig
from tokenloom.model.layers.attention_backend import AttentionBackend
from tokenloom.model.native_stack import NativeStack
from tokenloom.worker.cuda_graphs import DecodeGraphs, capture_sizes
from tokenloom.worker.kv_cache import kv_heads_per_rank

logger = logging.getLogger("tokenloom.engine")


@dataclass(frozen=True)
class ForwardPath:
    kind: str  # "eager", "native_stack" or "cuda_graphs"
    native_stack: NativeStack | None = None
    graphs: DecodeGraphs | None = None
    graph_heads: tuple[int, int, int] | None = None  # (query heads, KV heads, head dim) per rank, for capture

    def capture(self, progress: bool) -> None:
        """Capture the CUDA graphs (the warm-up phase); nothing for the other paths."""
        if self.graphs is not None:
            self.graphs.capture(self.graph_heads, progress)


EAGER = ForwardPath("eager")


def fast_path_takes_lora(kind: str) -> bool:
    """Whether a fast path ("native_stack", "cuda_graphs") computes a step some of whose rows use a LoRA adapter.
    The native stack does (each linear adds its rows' deltas, csrc/decoder_stack.cpp); a CUDA graph does not
    carry them, so such a step runs layer by layer (the linear layers add them)."""
    return kind == "native_stack"


def wants_cuda_graphs(config: EngineConfig, device: torch.device, attention: AttentionBackend) -> bool:
    if device.type != "cuda" or config.model.enforce_eager:
        return False
    if attention.name != "flashinfer":
        logger.info("decode steps run eagerly: CUDA graphs need the flashinfer attention backend")
        return False
    return True


def choose_forward_path(config: EngineConfig, device: torch.device, attention: AttentionBackend, model,
                        arch: ArchConfig, kv_caches: list[torch.Tensor], max_model_len: int,
                        cuda_graphs: bool) -> ForwardPath:
    """The path for this engine (`cuda_graphs`: `wants_cuda_graphs`, decided with the device). With graphs,
    the caches hold one block past the pool's: the padding rows' scratch block (`kv_cache.size_kv_cache`)."""
    if cuda_graphs:
        tp = tp_group().size
        sizes = capture_sizes(config.scheduler.max_num_seqs, config.model.cuda_graph_sizes)
        graphs = DecodeGraphs(model, kv_caches, scratch_block=kv_caches[0].shape[1] - 1, sizes=sizes,
                              max_blocks_per_seq=-(-max_model_len // config.cache.block_size))
        return ForwardPath("cuda_graphs", graphs=graphs,
                           graph_heads=(arch.num_heads // tp, kv_heads_per_rank(arch, tp), arch.head_dim))
    if device.type == "cpu" and not config.model.enforce_eager:
        stack = NativeStack.build(model, attention.name)
        if stack is not None:
            return ForwardPath("native_stack", native_stack=stack)
    return EAGER
