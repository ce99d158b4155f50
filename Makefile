# The two commands of the README's quick start. `setup` is a no-op when nothing changed
# (scripts/setup.sh keeps a stamp in .venv), so `make serve` starts the server at once.
.PHONY: serve test setup setup-test soak bench

MODEL ?= smollm2-135m-instruct
ARGS ?=

setup:
	@scripts/setup.sh

setup-test:
	@scripts/setup.sh test

serve: setup
	@.venv/bin/tokenloom serve $(MODEL) $(ARGS)

test: setup-test
	.venv/bin/python -m pytest -q $(ARGS)

soak: setup-test
	.venv/bin/python -m pytest -q --run-slow -m slow $(ARGS)

bench: setup
	@.venv/bin/tokenloom bench throughput $(ARGS)
