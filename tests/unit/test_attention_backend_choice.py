"""An explicit attention backend is the one that runs: with the native kernels loaded, an engine asked for
`--attention-backend torch` calls no native attention op (it runs what CUDA and kernel-less CPUs run), and
one on the native backend calls them; both greedy outputs agree."""
from __future__ import annotations

import pytest
from helpers import generate_tokens, greedy_params, random_prompts
from torch.utils._python_dispatch import TorchDispatchMode

NATIVE_ATTENTION_OPS = {"paged_attention_decode", "paged_attention_prefill", "write_kv_cache"}
PROMPTS = random_prompts(3, [5, 19, 33], vocab=512, seed=11)


class OpRecorder(TorchDispatchMode):
    """The names of the `tokenloom::` ops dispatched while it is active."""

    def __init__(self):
        super().__init__()
        self.tokenloom_ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "tokenloom":
            self.tokenloom_ops.add(func._opname)
        return func(*args, **(kwargs or {}))


def _run(core) -> tuple[list[list[int]], set[str]]:
    with OpRecorder() as recorder:
        out = generate_tokens(core, PROMPTS, greedy_params(6))
    return out, recorder.tokenloom_ops


@pytest.mark.kernels
def test_the_torch_backend_runs_no_native_attention_op_with_the_kernels_loaded(make_core):
    torch_out, torch_ops = _run(make_core("llama", attention_backend="torch"))
    native_out, native_ops = _run(make_core("llama", attention_backend="native"))
    assert not torch_ops & NATIVE_ATTENTION_OPS, torch_ops
    assert NATIVE_ATTENTION_OPS <= native_ops, native_ops
    assert torch_out == native_out
