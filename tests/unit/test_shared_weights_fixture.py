"""The session's shared weights (conftest.make_llm) stay float32 when an engine with another matmul dtype
is built: build_engine casts its model in place, so such an engine must get its own copy."""
from __future__ import annotations

import torch


def _linear_dtypes(model) -> set:
    from tokenloom.model.matmul_dtype import Linear

    dtypes = {m.weight.dtype for m in model.modules() if isinstance(m, Linear)}
    assert dtypes, "no linear layers found"
    return dtypes


def test_bfloat16_matmul_engine_does_not_cast_the_shared_weights(make_llm, embedded_loaded):
    assert _linear_dtypes(embedded_loaded.model) <= {torch.float32}
    llm = make_llm(num_blocks=16, max_model_len=128, matmul_dtype="bfloat16")
    assert llm is not None
    assert _linear_dtypes(embedded_loaded.model) <= {torch.float32}
