"""The tiny omni task end to end on CPU: the reward rises only when the model sees the media.

jobspecs/tiny_omni.toml as shipped (its data set and its tiny Qwen3-Omni model are written
on first use), shortened to 80 steps, and the same with `[data] drop_media = true`: without
the media the best policy scores 0.25, so the control must end clearly below the media run.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import tomli_w

from e2e_helpers import REPO
from relax_hpc.driver.run import run_job
from relax_hpc.ops.metrics import read_metrics
from relax_hpc.spec import parse_spec

pytestmark = pytest.mark.slow

# 80 steps (16 prompts x 8 samples): the media run ends at 0.42-0.51 (job seeds 1 and 2), the control
# at 0.24 (2026-11-29; docs/testing.md, "Learning tests").
STEPS = 80


def _run(tmp: Path, name: str, drop_media: bool) -> list[float]:
    table = tomllib.loads((REPO / "jobspecs" / "tiny_omni.toml").read_text())
    table["job"].update(name=name, output_dir=str(tmp / name))
    table["model"]["path"] = str(tmp / "model")  # written by the first run, reused by the second
    table["data"].update(path=str(tmp / "data" / "train.jsonl"), drop_media=drop_media)
    table["train"]["steps"] = STEPS
    table["checkpoint"]["save_interval"] = STEPS
    report = run_job(parse_spec(tomli_w.dumps(table), f"{name}.toml"), in_process=True, progress=False)
    return report.result.rewards


@pytest.fixture(scope="module")
def omni_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("omni")


@pytest.fixture(scope="module")
def media_rewards(omni_dir: Path) -> list[float]:
    return _run(omni_dir, "omni", drop_media=False)


@pytest.fixture(scope="module")
def control_rewards(omni_dir: Path, media_rewards: list[float]) -> list[float]:
    return _run(omni_dir, "omni-control", drop_media=True)  # after the media run: it wrote the model


# Two tests, one run each (each within the per-test budget, docs/testing.md); the control's test
# compares with the media run's rewards.
def test_the_reward_rises_with_the_media(omni_dir: Path, media_rewards: list[float]) -> None:
    media = media_rewards
    first, last = sum(media[:5]) / 5, sum(media[-10:]) / 10
    assert len(media) == STEPS
    assert last >= 3 * first and last > 0.3, (first, last)
    metrics = read_metrics(omni_dir / "omni" / "metrics.jsonl")
    assert {"reward/by_media/image", "reward/by_media/audio", "reward/by_media/video"} <= set(metrics[-1])


def test_the_reward_stays_at_chance_without_the_media(media_rewards: list[float], control_rewards: list[float]) -> None:
    last = sum(media_rewards[-10:]) / 10
    control = sum(control_rewards[-10:]) / 10
    assert len(control_rewards) == STEPS
    # Four options per question and nothing in the text to tell them apart: chance is 0.25.
    assert control < 0.3 and control < last - 0.07, (control, last)
