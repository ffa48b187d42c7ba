# The two commands of the README:
#   make run    set up .venv and train the embedded default (jobspecs/tiny_local.toml) on CPU
#   make test   set up .venv and .venv-sglang and run the whole test suite (it starts a local Slurm
#               for its Slurm tests and SGLang servers on CPU for its SGLang tests)
VENV ?= .venv
SPEC ?= jobspecs/tiny_local.toml
PYTEST_ARGS ?=
RELAX_SGLANG_ENV ?= .venv-sglang
export RAY_AUTH_MODE ?= disabled

.PHONY: setup run test clean sglang-env

setup:
	tools/setup-env

run: setup
	$(VENV)/bin/relax-hpc run $(SPEC)

# The SGLang tests need their own environment (tools/setup-sglang-cpu); a failed install stops
# here with the step that broke, rather than skipping those tests.
test: setup sglang-env
	RELAX_TEST_SGLANG=1 RELAX_SGLANG_ENV=$(RELAX_SGLANG_ENV) tools/run-tests $(PYTEST_ARGS)

# SGLang 0.5.23 serving on CPU, in its own venv (it pins another torch): docs/engines.md, "SGLang on CPU".
sglang-env:
	tools/setup-sglang-cpu $(RELAX_SGLANG_ENV)

clean:
	rm -rf runs .pytest_cache
