from tokenloom.model.models import bert, gemma3, llama, mistral, mixtral, qwen2, qwen3, qwen3_moe  # noqa: F401  (each registers itself)
