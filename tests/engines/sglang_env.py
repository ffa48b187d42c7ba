"""Find the separate SGLang environment (built by tools/setup-sglang-cpu) and say how to serve from it.

SGLang pins its own torch and transformers, so it lives in its own venv, by default
.venv-sglang in the repo root (`RELAX_SGLANG_ENV=DIR` points elsewhere). `find_sglang_env()`
returns that venv's python, or why it cannot be used together with the command that builds it.
Used by tests/engines/test_sglang_server_cpu.py; docs/engines.md, "SGLang on CPU", has the story.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ENV_DIR_VARIABLE = "RELAX_SGLANG_ENV"
DEFAULT_ENV_DIR = REPO / ".venv-sglang"
# Written by tools/setup-sglang-cpu as its last step, after sglang and its HTTP server imported.
STAMP_NAME = ".relax-sglang-cpu-installed"

# The flags under which SGLang 0.5.23 serves on CPU with the sgl_kernel stand-in: only the
# torch-native attention and sampling paths call no compiled kernel. --skip-tokenizer-init: the
# caller sends and receives token ids. --max-total-tokens: otherwise the KV cache takes ~70% of
# the host's memory (14 GB on a 23 GB machine) and 45 s to allocate.
CPU_SERVER_FLAGS = (
    "--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
    "--dtype", "float32", "--skip-tokenizer-init", "--max-total-tokens", "4096",
)


@dataclass(frozen=True)
class SglangEnv:
    """The SGLang venv: `python` when it is usable, else None and `reason` says why and what to run."""

    env_dir: Path
    python: Path | None
    reason: str = ""


def build_command(env_dir: Path) -> str:
    where = "" if env_dir == DEFAULT_ENV_DIR else f" {shlex.quote(str(env_dir))}"
    command = f"tools/setup-sglang-cpu{where}"
    return command + (" (or `make sglang-env`)" if not where else "")


def find_sglang_env(env_dir: Path | None = None) -> SglangEnv:
    """The SGLang venv at `env_dir` (default: $RELAX_SGLANG_ENV, else .venv-sglang in the repo)."""
    if env_dir is None:
        env_dir = Path(os.environ.get(ENV_DIR_VARIABLE) or DEFAULT_ENV_DIR)
    env_dir = env_dir.absolute()
    python = env_dir / "bin" / "python"
    build = f"build it with `{build_command(env_dir)}` from {REPO} (about 3 minutes, 5.7 GB)"
    if not python.exists():
        return SglangEnv(env_dir, None, f"no SGLang environment at {env_dir} ({python} is missing); {build}")
    if not (env_dir / STAMP_NAME).is_file():
        return SglangEnv(env_dir, None, f"the SGLang environment at {env_dir} is unfinished "
                                        f"({STAMP_NAME} is missing: setup stopped part-way); {build}")
    return SglangEnv(env_dir, python)


def cpu_server_command(python: Path, model_dir: Path, port: int, host: str = "127.0.0.1") -> list[str]:
    """The command line that serves `model_dir` on CPU at http://host:port (run it with `cpu_server_env()`)."""
    return [str(python), "-m", "sglang.launch_server", "--model-path", str(model_dir),
            "--host", host, "--port", str(port), *CPU_SERVER_FLAGS]


def cpu_server_env() -> dict[str, str]:
    """This process's environment minus what points into the project venv, plus SGLang's CPU switch."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    env["HF_HUB_OFFLINE"] = "1"  # local model directories only
    return env
