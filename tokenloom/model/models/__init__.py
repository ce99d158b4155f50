from tokenloom.model.models import bert, llama, mistral, qwen2, qwen3  # noqa: F401  (registration)
