# The two commands of the README:
#   make run    set up .venv and train the embedded default (jobspecs/tiny_local.toml) on CPU
#   make test   set up .venv, .venv-sglang and .venv-megatron and run the whole test suite (it starts
#               a local Slurm for its Slurm tests, SGLang servers on CPU for its SGLang tests and
#               Megatron on CPU for its Megatron tests)
VENV ?= .venv
SPEC ?= jobspecs/tiny_local.toml
PYTEST_ARGS ?=
RELAX_SGLANG_ENV ?= .venv-sglang
RELAX_MEGATRON_ENV ?= .venv-megatron
export RAY_AUTH_MODE ?= disabled

.PHONY: setup run test rehearse clean sglang-env megatron-env envs

setup:
	tools/setup-env

run: setup
	$(VENV)/bin/relax-hpc run $(SPEC)

# The SGLang and Megatron tests need their own environments (tools/setup-sglang-cpu,
# tools/setup-megatron-cpu). tools/test-all builds them in the background while the tests start
# (each such test waits for its build); a failed install fails the run, naming its log, rather
# than skipping those tests.
test:
	RELAX_SGLANG_ENV=$(RELAX_SGLANG_ENV) RELAX_MEGATRON_ENV=$(RELAX_MEGATRON_ENV) tools/test-all $(PYTEST_ARGS)

# Every shipped production spec rehearsed as it is (run, resume, export at its real layout with a
# tiny model; about 3 minutes each on 2 cores, so not part of `make test`): docs/rehearsal.md.
rehearse:
	RELAX_SGLANG_ENV=$(RELAX_SGLANG_ENV) RELAX_MEGATRON_ENV=$(RELAX_MEGATRON_ENV) tools/rehearse-production

# SGLang 0.5.23 serving on CPU, in its own venv (it pins another torch): docs/engines.md, "SGLang on CPU".
sglang-env:
	tools/setup-sglang-cpu $(RELAX_SGLANG_ENV)

# megatron-core 0.16.1 + megatron-bridge 0.3.1 on CPU, in its own venv (the bridge needs
# transformers < 5): docs/backends.md, "Megatron on CPU".
megatron-env:
	tools/setup-megatron-cpu $(RELAX_MEGATRON_ENV)

# The three environments: .venv, then .venv-megatron (both install relax-hpc editable from this
# checkout, so not at the same time), and .venv-sglang beside them, which does not touch the
# checkout: one build's single-threaded import checks overlap the other's bytecode compilation
# (docs/benchmarks.md, "Building the environments"). Each script prefixes its lines with its name;
# make fails if any of them failed.
envs:
	@tools/setup-sglang-cpu $(RELAX_SGLANG_ENV) & sglang=$$!; \
	tools/setup-env && tools/setup-megatron-cpu $(RELAX_MEGATRON_ENV); rc=$$?; \
	wait $$sglang && exit $$rc

clean:
	rm -rf runs .pytest_cache
