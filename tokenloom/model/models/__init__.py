from tokenloom.model.models import (  # noqa: F401  (each registers itself)
    bert,
    gemma3,
    llama,
    llava,
    mistral,
    mixtral,
    qwen2,
    qwen3,
    qwen3_moe,
)
