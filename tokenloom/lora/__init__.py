"""LoRA adapters: the adapter model, loading PEFT folders, and the fixed pool of slots they are served from."""
