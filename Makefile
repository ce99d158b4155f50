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
	tests/unit/test_spec_decode_draft_model.py tests/e2e/test_reference_embedded.py \
	tests/unit/test_qwen2_5_vl_vision.py tests/unit/test_mrope.py \
	tests/unit/test_kv_cache_int8.py tests/e2e/test_kv_cache_int8_embedded.py
test-fallback: setup-test
	TOKENLOOM_KERNELS=off .venv/bin/python -m pytest -q -rs $(KERNEL_SENSITIVE) $(ARGS)

soak: setup-test
	.venv/bin/python -m pytest -q --run-slow -m slow $(ARGS)

# The slow checks CI runs on every landing (.ci/run, after test and test-fallback): the real Gemma 3 270M
# against transformers past its 512-token window and at TP=2, a prefill/decode pair of real servers (directly
# and through `tokenloom router --pd`), speculative decoding's output distribution end to end, the
# 400-request flood, and a client that stops reading. `make soak` runs these and every other slow test.
.PHONY: soak-ci
SOAK_CI ?= tests/unit/test_gemma3.py::test_gemma3_270m_greedy_is_token_identical_to_transformers_past_the_512_token_window \
	tests/unit/test_gemma3_tensor_parallel.py::test_gemma3_270m_at_tp2_matches_tp1_past_the_512_token_window \
	tests/e2e/test_pd_e2e.py \
	tests/e2e/test_spec_decode_embedded.py::test_unseeded_sampling_has_the_same_distribution \
	tests/e2e/test_admission.py::test_full_flood_default_flags \
	tests/e2e/test_admission.py::test_clients_that_never_read_do_not_hold_admission \
	tests/unit/test_weight_updates.py::test_three_ranks_take_updates_from_disk_and_from_a_trainer \
	tests/e2e/test_fuzz_soak.py::test_soak_short \
	tests/e2e/test_lora_serving.py::test_tp3_adapter_and_base_rows_in_one_batch_equal_tp1_and_peft \
	tests/e2e/test_engine_faults.py::test_engine_dying_during_restart_ends_the_server \
	tests/e2e/test_router_e2e.py::test_a_frozen_worker_is_taken_out_and_brought_back_by_health_checks
soak-ci: setup-test
	.venv/bin/python -m pytest -q --run-slow $(SOAK_CI) $(ARGS)

bench: setup
	@.venv/bin/tokenloom bench throughput $(ARGS)
