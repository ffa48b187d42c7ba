"""Find the separate Megatron environment (built by tools/setup-megatron-cpu) and run code in it.

megatron-bridge 0.3.1 needs transformers < 5 while the project's .venv has 5.x, so megatron-core
and the bridge live in their own venv, by default .venv-megatron in the repo root
(`RELAX_MEGATRON_ENV=DIR` points elsewhere). `find_megatron_env()` returns that venv's python,
or why it cannot be used together with the command that builds it. Used by
tests/backends/test_megatron_cpu.py; docs/backends.md, "Megatron on CPU", has the story.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ENV_DIR_VARIABLE = "RELAX_MEGATRON_ENV"
DEFAULT_ENV_DIR = REPO / ".venv-megatron"
# Written by tools/setup-megatron-cpu as its last step, after megatron.bridge imported.
STAMP_NAME = ".relax-megatron-cpu-installed"


@dataclass(frozen=True)
class MegatronEnv:
    """The Megatron venv: `python` when it is usable, else None and `reason` says why and what to run."""

    env_dir: Path
    python: Path | None
    reason: str = ""


def build_command(env_dir: Path) -> str:
    where = "" if env_dir == DEFAULT_ENV_DIR else f" {shlex.quote(str(env_dir))}"
    command = f"tools/setup-megatron-cpu{where}"
    return command + (" (or `make megatron-env`)" if not where else "")


def find_megatron_env(env_dir: Path | None = None) -> MegatronEnv:
    """The Megatron venv at `env_dir` (default: $RELAX_MEGATRON_ENV, else .venv-megatron in the repo)."""
    if env_dir is None:
        env_dir = Path(os.environ.get(ENV_DIR_VARIABLE) or DEFAULT_ENV_DIR)
    env_dir = env_dir.absolute()
    python = env_dir / "bin" / "python"
    build = f"build it with `{build_command(env_dir)}` from {REPO} (about 1.5 minutes, 2 GB)"
    if not python.exists():
        missing = f"no Megatron environment at {env_dir} ({python} is missing)"
        return MegatronEnv(env_dir, None, f"{missing}; {build}")
    if not (env_dir / STAMP_NAME).is_file():
        return MegatronEnv(env_dir, None, f"the Megatron environment at {env_dir} is unfinished "
                                          f"({STAMP_NAME} is missing: setup stopped part-way); {build}")
    return MegatronEnv(env_dir, python)


def megatron_process_env() -> dict[str, str]:
    """This process's environment minus what points into the project venv, offline, one thread."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["HF_HUB_OFFLINE"] = "1"  # local model directories only
    env["OMP_NUM_THREADS"] = "1"  # each TP rank is its own process
    return env
