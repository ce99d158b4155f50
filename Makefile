# The two commands of the README's quick start. `setup` is a no-op when nothing changed
# (scripts/setup.sh keeps a stamp in .venv), so `make serve` starts the server at once.
.PHONY: serve test lint test-fallback setup setup-test soak bench

MODEL ?= smollm2-135m-instruct
ARGS ?=

setup:
	@scripts/setup.sh

setup-test:
	@scripts/setup.sh test

serve: setup
	@.venv/bin/tokenloom serve $(MODEL) $(ARGS)

# -rs prints every skip's reason; a skip outside tests/skip_policy.py's allow-list, or native kernels that did
# not load on a machine that can build them (TOKENLOOM_KERNELS=off asks for none), fails the run.
test: setup-test lint
	.venv/bin/python -m pytest -q -rs $(ARGS)

# The layering contract (pyproject.toml [tool.importlinter]) and ruff: an upward import, a file circle or
# an unused name fails before any test runs.
lint: setup-test
	.venv/bin/lint-imports --no-cache
	.venv/bin/ruff check tokenloom tests scripts

# The tests whose numbers depend on the native kernels, again on the torch path (TOKENLOOM_KERNELS=off), the path
# CUDA and kernel-less CPUs run: transformers parity (tiny families, sliding windows, Gemma 3, mixture of experts,
# the embedded model) and speculative decoding against speculation off (the tiny models': the embedded model's
# speculation tests cost ~290 s of CPU on this path, more than the rest of the list). docs/testing.md lists them.
KERNEL_SENSITIVE ?= $(wildcard tests/unit/test_kernels_*.py) tests/unit/test_gguf_loading.py tests/unit/test_decode_attention.py \
	tests/unit/test_tensor_parallel.py tests/unit/test_reference_tiny.py tests/unit/test_sliding_window.py \
	tests/unit/test_gemma3.py tests/unit/test_moe.py tests/unit/test_spec_decode.py \
	tests/unit/test_spec_decode_draft_model.py tests/e2e/test_reference_embedded.py
test-fallback: setup-test
	TOKENLOOM_KERNELS=off .venv/bin/python -m pytest -q -rs $(KERNEL_SENSITIVE) $(ARGS)

soak: setup-test
	.venv/bin/python -m pytest -q --run-slow -m slow $(ARGS)

bench: setup
	@.venv/bin/tokenloom bench throughput $(ARGS)
