"""The fault suite, `relax-hpc faults SPEC`: run a job spec with faults injected mid-run and check
each run recovered with every planned sample trained exactly once. docs/operations.md, "Fault suite".

fault.py: the faults, the spec each run uses, one fault in a run of its own, the verdict and the
table; scenarios.py: how each fault is injected (inject.py: the injections themselves); chain.py:
several faults in one run; process.py: the run as a subprocess and its metrics; suite.py: the
driver the CLI calls (`run_suite`).
"""
