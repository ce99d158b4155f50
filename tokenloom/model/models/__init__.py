from tokenloom.model.models import llama, mistral, qwen2, qwen3  # noqa: F401  (registration)
