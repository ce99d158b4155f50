"""The leaf every layer shares: requests, the step contract, engine messages, errors, process helpers.

Nothing in here imports from a layer above it (the layering contract in pyproject.toml checks it)."""
