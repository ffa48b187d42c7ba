"""The separate environments some tests run code in, found and checked one way.

SGLang pins its own torch and transformers, and megatron-bridge needs transformers < 5, so each
lives in its own venv, built by a script under tools/ (docs/engines.md "SGLang on CPU",
docs/backends.md "Megatron on CPU"). `SGLANG.find()` / `MEGATRON.find()` return the venv's
python, or why it cannot be used together with the command that builds it.

    def test_the_sglang_environment_is_built() -> None:
        SGLANG.require_built()      # fails with RELAX_TEST_SGLANG=1 (make test), else skips

    @pytest.fixture(scope="module")
    def sglang_python() -> Path:
        return SGLANG.python_or_skip()
"""

from __future__ import annotations

import os
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
# tools/test-all builds the side environments while the tests run: a test that needs one waits
# for its build this long at most (a build from an empty cache takes a few minutes).
BUILD_WAIT_S = 30 * 60
_waited_s = [0.0]  # seconds this process spent waiting for builds: not a test's own time


def build_wait_s() -> float:
    """Seconds this process has waited for background builds so far (tests/time_budget.py takes
    them out of the waiting test's time)."""
    return _waited_s[0]


@dataclass(frozen=True)
class FoundEnv:
    """A side environment: `python` when it is usable, else None and `reason` says why and what to run."""

    env_dir: Path
    python: Path | None
    reason: str = ""


@dataclass(frozen=True)
class SideEnv:
    """One kind of side environment and how it is built."""

    name: str  # "SGLang"
    variable: str  # where it is (RELAX_SGLANG_ENV), default REPO/default_dir
    default_dir: str
    script: str  # tools/setup-...
    make_target: str
    size: str  # what a build costs, for the message
    strict_variable: str  # set to 1 (make test): a missing env fails instead of skipping

    @property
    def stamp(self) -> str:
        """Written by the setup script as its last step, once the libraries imported."""
        return f".relax-{self.make_target.removesuffix('-env')}-cpu-installed"

    def build_command(self, env_dir: Path) -> str:
        where = "" if env_dir == REPO / self.default_dir else f" {shlex.quote(str(env_dir))}"
        return f"{self.script}{where}" + ("" if where else f" (or `make {self.make_target}`)")

    def wait_for_build(self) -> None:
        """Under tools/test-all ($RELAX_ENV_BUILDS set), wait until this environment's background
        build has ended; fail naming its log if it failed."""
        builds = os.environ.get("RELAX_ENV_BUILDS")
        if not builds:
            return
        log, status = Path(builds) / f"{self.make_target}.log", Path(builds) / f"{self.make_target}.rc"
        if not log.exists():
            return
        start = time.monotonic()
        try:
            while not status.exists():
                if time.monotonic() > start + BUILD_WAIT_S:
                    pytest.fail(f"the {self.name} environment's build is still running after {BUILD_WAIT_S} s; "
                                f"see {log}", pytrace=False)
                time.sleep(1)
        finally:
            _waited_s[0] += time.monotonic() - start
        code = status.read_text().strip()
        if code != "0":
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
            pytest.fail(f"building the {self.name} environment failed (exit {code}); "
                        f"fix what its log says and run `{self.build_command(self.env_dir())}`. "
                        f"The end of {log}:\n{tail}", pytrace=False)

    def env_dir(self) -> Path:
        """Where this environment is: $variable, else default_dir in the repo."""
        return Path(os.environ.get(self.variable) or REPO / self.default_dir).absolute()

    def find(self, env_dir: Path | None = None) -> FoundEnv:
        """The venv at `env_dir` (default: `self.env_dir()`)."""
        env_dir = (env_dir or self.env_dir()).absolute()
        python = env_dir / "bin" / "python"
        build = f"build it with `{self.build_command(env_dir)}` from {REPO} ({self.size})"
        if not python.exists():
            return FoundEnv(env_dir, None, f"no {self.name} environment at {env_dir} ({python} is missing); {build}")
        if not (env_dir / self.stamp).is_file():
            return FoundEnv(env_dir, None, f"the {self.name} environment at {env_dir} is unfinished "
                                           f"({self.stamp} is missing: setup stopped part-way); {build}")
        return FoundEnv(env_dir, python)

    def require_built(self) -> None:
        """The one test that fails on a missing env (with strict_variable=1); the tests that need
        it skip then, so the reason and the command to build it are reported once."""
        self.wait_for_build()
        found = self.find()
        if found.python is None:
            if os.environ.get(self.strict_variable) == "1":
                pytest.fail(f"{self.strict_variable}=1 but {found.reason}", pytrace=False)
            pytest.skip(f"{found.reason}; {self.strict_variable}=1 turns this skip into a failure")

    def python_or_skip(self) -> Path:
        self.wait_for_build()
        found = self.find()
        if found.python is None:
            pytest.skip(f"{found.reason} (see the test that checks the {self.name} environment is built)")
        return found.python


SGLANG = SideEnv("SGLang", "RELAX_SGLANG_ENV", ".venv-sglang", "tools/setup-sglang-cpu", "sglang-env",
                 "about 3 minutes, 5.7 GB", "RELAX_TEST_SGLANG")
MEGATRON = SideEnv("Megatron", "RELAX_MEGATRON_ENV", ".venv-megatron", "tools/setup-megatron-cpu",
                   "megatron-env", "about 2 minutes, 2 GB", "RELAX_TEST_MEGATRON")


def side_process_env(**extra: str) -> dict[str, str]:
    """This process's environment minus what points into the project venv, offline, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["HF_HUB_OFFLINE"] = "1"  # local model directories only
    env.update(extra)
    return env


def run_json_script(python: Path, script: Path, *args: str, timeout_s: float) -> dict[str, Any]:
    """Run a check script with a side environment's python (one thread per process: a script's
    ranks are processes of their own); its last stdout line is JSON, returned. On failure the test
    fails with the command, its stdout and the tail of its stderr."""
    import json
    import subprocess

    command = [str(python), "-W", "ignore", str(script), *args]
    done = subprocess.run(command, check=False, cwd=REPO, capture_output=True, text=True, timeout=timeout_s,
                          env=side_process_env(OMP_NUM_THREADS="1"))
    if done.returncode != 0:
        pytest.fail(f"{' '.join(command)} exited {done.returncode}:\n{done.stdout}\n{done.stderr[-6000:]}",
                    pytrace=False)
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps(result, indent=1))  # the numbers, visible with -s or on failure
    return result
