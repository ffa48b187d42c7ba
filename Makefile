# The two commands of the README:
#   make run    set up .venv and train the embedded default (jobspecs/tiny_local.toml) on CPU
#   make test   set up .venv and run the whole test suite (it starts a local Slurm for its Slurm tests)
VENV ?= .venv
SPEC ?= jobspecs/tiny_local.toml
PYTEST_ARGS ?=
export RAY_AUTH_MODE ?= disabled

.PHONY: setup run test clean

setup:
	tools/setup-env

run: setup
	$(VENV)/bin/relax-hpc run $(SPEC)

test: setup
	tools/run-tests $(PYTEST_ARGS)

clean:
	rm -rf runs .pytest_cache
