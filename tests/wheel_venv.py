"""A fresh venv with the relax-hpc wheel installed, for tests of what a non-editable install can do.

The wheel is built from a copy of the sources (the checkout stays untouched) and installed
with --no-deps --no-index into a fresh venv that borrows this venv's dependencies through a
.pth file, so nothing is downloaded. Used by tests/cli/test_wheel_install.py and the Slurm tests
(through the `wheel_venv` fixture in tests/conftest.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def check(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    assert done.returncode == 0, f"{' '.join(cmd)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done


def build_wheel_venv(root: Path) -> tuple[Path, dict[str, str]]:
    """(bin dir of a fresh venv with the relax-hpc wheel installed, the environment to run it with)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["RAY_AUTH_MODE"] = "disabled"
    source = root / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(REPO / "relax_hpc", source / "relax_hpc", ignore=shutil.ignore_patterns("__pycache__"))
    check([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
            "-q", "-w", str(root / "dist"), str(source)], root, env)
    (wheel,) = (root / "dist").glob("relax_hpc-*.whl")

    venv = root / "venv"
    check([sys.executable, "-m", "venv", "--without-pip", str(venv)], root, env)
    purelib = Path(check([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          root, env).stdout.strip())
    # A plain path line: this venv's own site-packages (the wheel) comes first, and the .pth files
    # over there (the checkout's editable install among them) are not run.
    (purelib / "borrowed_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    check([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-index",
            "--ignore-installed", str(wheel)], root, env)
    # The dependencies' console scripts (ray, used by the Slurm job) stay in the venv they were
    # borrowed from; a real install puts them beside relax-hpc.
    env["PATH"] = os.pathsep.join([str(venv / "bin"), str(Path(sys.executable).parent), env.get("PATH", "")])
    imported = check([str(venv / "bin" / "python"), "-c", "import relax_hpc; print(relax_hpc.__file__)"], root, env)
    assert Path(imported.stdout.strip()).is_relative_to(venv), imported.stdout
    return venv / "bin", env
