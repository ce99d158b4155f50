from tokenloom.model.models import bert, gemma3, llama, mistral, qwen2, qwen3  # noqa: F401  (registration)
from tokenloom.model.models import mixtral, qwen3_moe  # noqa: F401  (mixture of experts)
