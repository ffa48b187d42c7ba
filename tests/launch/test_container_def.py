"""Lint container/relax.def: no Apptainer runtime exists here, so check its structure instead."""

from __future__ import annotations

import re
from pathlib import Path

DEF = Path(__file__).resolve().parents[2] / "container" / "relax.def"
KNOWN_SECTIONS = {"setup", "files", "environment", "post", "runscript", "startscript", "test", "labels",
                  "help", "arguments", "app"}


def header_and_sections() -> tuple[dict[str, str], dict[str, list[str]]]:
    header: dict[str, str] = {}
    sections: dict[str, list[str]] = {}
    current = None
    for line in DEF.read_text().splitlines():
        if line.startswith("%"):
            current = line[1:].split()[0]
            assert current not in sections, f"section %{current} appears twice"
            sections[current] = []
        elif current is None:
            if line.strip() and not line.startswith("#"):
                key, _, value = line.partition(":")
                header[key.strip()] = value.strip()
        else:
            sections[current].append(line)
    return header, sections


def test_header_bootstraps_from_a_cuda_image() -> None:
    header, _ = header_and_sections()
    assert header["Bootstrap"] == "docker"
    assert re.match(r"nvidia/cuda:\d+\.\d+", header["From"])


def test_sections_are_known_and_the_needed_ones_exist() -> None:
    _, sections = header_and_sections()
    assert set(sections) <= KNOWN_SECTIONS, set(sections) - KNOWN_SECTIONS
    assert {"files", "environment", "post", "runscript", "test"} <= set(sections)


def test_files_copy_what_the_job_needs_and_post_installs_the_pinned_torch() -> None:
    _, sections = header_and_sections()
    copied = {line.split()[0] for line in sections["files"] if line.strip()}
    assert {"pyproject.toml", "relax_hpc", "sbatch"} <= copied
    for source in copied:
        assert (DEF.parents[1] / source).exists(), f"%files copies {source}, which does not exist"
    post = "\n".join(sections["post"])
    assert "torch==2.13.0" in post and "/opt/relax-hpc" in post
    # The rendered script runs `python3 -m relax_hpc...` inside the image.
    assert "/usr/local/bin/python3" in post
    environment = "\n".join(sections["environment"])
    assert "RAY_AUTH_MODE=" in environment and "RELAX_HPC_SBATCH_DIR=" in environment
