"""`relax-hpc validate` refuses media that the SGLang servers' environment cannot read
(relax_hpc/media/plan.py, `SGLANG_MEDIA_PACKAGES`): audio without torchaudio, video without
torchcodec or decord. The environments here are venv layouts on disk (pyvenv.cfg and
site-packages with dist-info folders), read as the check reads any venv, without running it; the
last test reads the real SGLang environment when it is built.

    .venv/bin/python -m pytest tests/media/test_sglang_env_media.py -q
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest
import tomli_w
from side_env import SGLANG

from relax_hpc.media.plan import check_media_plan, installed_packages
from relax_hpc.spec import SpecError
from relax_hpc.spec.loader import parse_spec

REPO = Path(__file__).resolve().parents[2]


def _venv(root: Path, *dists: str, system_site: bool = False) -> Path:
    """A venv's layout with `dists` ("name-version") installed; returns its bin/python."""
    site = root / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    for dist in ("sglang-0.5.23", "soundfile-0.13.1", *dists):
        (site / f"{dist}.dist-info").mkdir()
    (root / "pyvenv.cfg").write_text(f"home = /usr/bin\ninclude-system-site-packages = {str(system_site).lower()}\n")
    (root / "bin").mkdir()
    (root / "bin" / "python").write_text("")
    return root / "bin" / "python"


def _omni_spec(python: Path, **changes: dict[str, Any]) -> Any:
    """jobspecs/qwen3_omni.toml (audio and video columns, SGLang engines on GPUs) served from `python`."""
    table = tomllib.loads((REPO / "jobspecs" / "qwen3_omni.toml").read_text())
    table["rollout"].setdefault("sglang", {})["python"] = str(python)
    for section, values in changes.items():
        table.setdefault(section, {}).update(values)
    return parse_spec(tomli_w.dumps(table), "qwen3_omni.toml")


def test_audio_and_video_to_an_env_without_their_packages_are_refused_naming_the_fix(tmp_path: Path) -> None:
    python = _venv(tmp_path / "bare")
    with pytest.raises(SpecError) as error:
        check_media_plan(_omni_spec(python), "qwen3_omni.toml")
    text = str(error.value)
    assert f"data.audio_key = 'audio': the SGLang environment of [rollout.sglang] python = '{python}' has no " \
           "torchaudio" in text and "tools/setup-sglang-cpu adds it" in text
    assert "data.video_key = 'video'" in text and "has no torchcodec or decord" in text


def test_an_env_with_the_packages_passes_and_one_that_cannot_be_read_is_not_judged(tmp_path: Path) -> None:
    full = _venv(tmp_path / "full", "torchaudio-2.11.1", "torchcodec-0.9.0")
    assert {"torchaudio", "torchcodec", "sglang"} <= (installed_packages(str(full)) or set())
    check_media_plan(_omni_spec(full), "qwen3_omni.toml")
    # Audio only on CPU (video is refused there whatever is installed): torchaudio is all it takes.
    audio_only = _venv(tmp_path / "audio", "torchaudio-2.11.1")
    with pytest.raises(SpecError) as error:
        check_media_plan(_omni_spec(audio_only, train={"device": "cpu"}), "qwen3_omni.toml")
    assert "data.audio_key" not in str(error.value) and "on CPU cannot decode video" in str(error.value)
    # A venv that also sees the system's packages, or a python that is not in a venv here (a
    # cluster path, a container's): validate cannot tell, and leaves it to the servers.
    seeing_system = _venv(tmp_path / "system", system_site=True)
    assert installed_packages(str(seeing_system)) is None
    check_media_plan(_omni_spec(seeing_system), "qwen3_omni.toml")
    assert installed_packages(str(tmp_path / "nowhere" / "bin" / "python")) is None


def test_the_sglang_environment_this_repository_builds_takes_audio() -> None:
    python = SGLANG.python_or_skip()
    installed = installed_packages(str(python))
    assert installed is not None and {"sglang", "torchaudio", "soundfile"} <= installed, \
        f"{python}'s venv lacks torchaudio: re-run tools/setup-sglang-cpu"
