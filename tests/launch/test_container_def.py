"""Lint container/relax.def and its %post script, container/install-image.sh: no Apptainer runtime
exists here (tools/build-image-root and tools/check-image build and run the image root instead)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

from relax_hpc.launch.container import IMAGE_MEGATRON_PYTHON

REPO = Path(__file__).resolve().parents[2]
DEF = REPO / "container" / "relax.def"
INSTALL = REPO / "container" / "install-image.sh"
LOCKS = REPO / "container" / "locks"
KNOWN_SECTIONS = {"setup", "files", "environment", "post", "runscript", "startscript", "test", "labels",
                  "help", "arguments", "app"}
ENVS, VARIANTS = ("main", "sglang", "megatron"), ("cuda", "cpu")


def definition(kind: str, name: str, *args: str) -> str:
    """What container/definition.py (the reader tools/build-image-root uses) gives for the definition."""
    done = subprocess.run([sys.executable, str(REPO / "container" / "definition.py"), str(DEF), kind, name, *args],
                          capture_output=True, text=True, check=True)
    return done.stdout


def sections() -> dict[str, str]:
    found = re.findall(r"(?m)^%(\w+)", DEF.read_text())
    assert len(found) == len(set(found)), f"a section appears twice: {found}"
    return {name: definition("section", name) for name in found}


def test_header_bootstraps_debian_12_with_debootstrap() -> None:
    assert definition("header", "Bootstrap").strip() == "debootstrap"
    assert definition("header", "OSVersion").strip() == "bookworm"
    assert definition("header", "MirrorURL").strip().startswith("http")


def test_sections_are_known_and_post_is_the_shared_script_for_either_variant() -> None:
    found = sections()
    assert set(found) <= KNOWN_SECTIONS, set(found) - KNOWN_SECTIONS
    assert {"files", "environment", "post", "runscript", "test", "arguments"} <= set(found)
    assert found["arguments"].split() == ["variant=cuda"]  # the default: the GPU image
    assert found["post"] == "/opt/relax-hpc/container/install-image.sh cuda\n"
    assert definition("section", "post", "variant=cpu") == "/opt/relax-hpc/container/install-image.sh cpu\n"
    for variant in VARIANTS:  # the script names a lock of each environment for each variant
        for env in ENVS:
            assert (LOCKS / f"{env}-{variant}.txt").is_file(), f"{env}-{variant}.txt missing: container/locks/update"


def test_files_copy_what_the_build_and_the_jobs_need() -> None:
    pairs = [line.split() for line in sections()["files"].splitlines() if line.strip()]
    copied = {source for source, _ in pairs}
    assert {"pyproject.toml", "README.md", "LICENSE", "relax_hpc", "sbatch", "jobspecs", "container",
            "tools/sglang_cpu_stubs", "tools/megatron_cpu_stubs"} <= copied
    for source, target in pairs:
        assert (REPO / source).exists(), f"%files copies {source}, which does not exist"
        assert target == f"/opt/relax-hpc/{source}"  # the checkout's layout, so the tiny specs' paths hold


def test_environment_names_the_side_environments_and_leaves_ray_auth_alone() -> None:
    environment = sections()["environment"]
    assert "RAY_AUTH_MODE" not in environment  # jobs run Ray with token authentication
    assert "export RELAX_SGLANG_ENV=/opt/relax-hpc/.venv-sglang" in environment
    assert f"export RELAX_MEGATRON_ENV={IMAGE_MEGATRON_PYTHON.removesuffix('/bin/python')}" in environment
    assert "export PATH=/opt/relax-hpc/.venv/bin:$PATH" in environment  # the rendered `python3`


def _install_commands(text: str) -> list[list[str]]:
    """Every pip / uv pip install command of the script, as words (continuation lines joined)."""
    joined = text.replace("\\\n", " ")
    commands = []
    for line in joined.splitlines():
        line = line.split(" #")[0].strip()
        if line.startswith("#"):
            continue
        if re.search(r"\bpip\"? install\b", line):
            commands.append(shlex.split(line.replace("$", "")))
    return commands


def test_post_installs_only_what_the_lock_files_pin() -> None:
    commands = _install_commands(INSTALL.read_text())
    assert len(commands) >= 5, commands
    for words in commands:
        assert "--no-deps" in words, f"an install that may pull unpinned dependencies: {' '.join(words)}"
        sources = [words[i + 1] for i, w in enumerate(words) if w == "-r"]
        # Beyond the lock files: only the project's own wheel, built from the copied checkout.
        others = [w for w in words if w.endswith(".whl")]
        assert sources or others, f"installs neither a lock file nor the project's wheel: {' '.join(words)}"
        assert all(w.endswith("relax_hpc-*.whl") for w in others), others
        if others:
            assert "--no-index" in words
    assert "{{" not in INSTALL.read_text() and "apt-get install" in INSTALL.read_text()


def test_every_lock_pins_every_package_exactly() -> None:
    locks = sorted(LOCKS.glob("*.txt"))
    assert {p.name for p in locks} >= {f"{e}-{v}.txt" for e in ENVS for v in VARIANTS} | {"tools.txt"}
    for lock in locks:
        if lock.name.startswith("megatron-excludes"):
            continue
        for line in lock.read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                assert re.fullmatch(r"[A-Za-z0-9._-]+(\[[\w,-]+\])?==[\w.+!-]+( ; .+)?", line), f"{lock.name}: {line}"


def test_the_cpu_sglang_lock_is_tools_setup_sglang_cpu_s_list() -> None:
    # container/locks/update takes it from the script; a change there must be re-locked.
    script = (REPO / "tools" / "setup-sglang-cpu").read_text()
    pins = set()
    for name in ("torch_stack", "audio_stack", "sglang_stack"):
        body = re.search(rf"(?ms)^{name}=\((.*?)\)[ \t]*$", script).group(1)
        pins |= {w for line in body.splitlines() for w in line.split("#")[0].split()}
    locked = {line for line in (LOCKS / "sglang-cpu.txt").read_text().splitlines() if line and line[0] != "#"}
    assert locked == pins, sorted(locked ^ pins)


def test_the_lock_files_resolve_as_committed() -> None:
    # Resolving every lock again (uv pip compile, the package index as it stood on the locks'
    # --exclude-newer date) gives the committed files: the image's pins are reproducible, and a
    # change to pyproject.toml, an .in file or tools/setup-sglang-cpu that is not re-locked fails here.
    done = subprocess.run([str(LOCKS / "update"), "--check"], capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stdout + done.stderr
