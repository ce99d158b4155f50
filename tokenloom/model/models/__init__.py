from tokenloom.model.models import (  # noqa: F401  (each registers itself)
    bert,
    gemma3,
    gemma3_mm,
    llama,
    llava,
    mistral,
    mixtral,
    qwen2,
    qwen2_5_vl,
    qwen3,
    qwen3_moe,
)
