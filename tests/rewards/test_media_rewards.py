"""openr1mm and the multiple-choice reward (AVQA's) on samples of the tiny omni task: the rows
loaded with their media, scored through the reward hub (openr1mm in its worker processes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from relax_hpc.data.dataset import load_dataset
from relax_hpc.data.sample import Sample
from relax_hpc.media.processor import MediaProcessor
from relax_hpc.media.synthetic import OMNI_VIDEO_FPS, write_omni_task
from relax_hpc.models.hf import load_tokenizer
from relax_hpc.models.tiny_mm import write_tiny_multimodal
from relax_hpc.rewards.hub import RewardHub
from relax_hpc.spec.schema import DataSpec


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> list:
    base = tmp_path_factory.mktemp("omni-rewards")
    model = write_tiny_multimodal(base / "model", "qwen3_omni")
    data = write_omni_task(base / "data", rows=6, seed=3)
    fmt = dict(image_key="image", audio_key="audio", video_key="video", apply_chat_template=True,
               video_fps=OMNI_VIDEO_FPS)
    loaded, report = load_dataset(DataSpec(path=str(data), prompt_key="prompt", label_key="answer",
                                           max_prompt_tokens=96, **fmt), load_tokenizer(model), MediaProcessor(model))
    assert report.kept == 6
    return loaded


def _samples(rows: list, responses: list[str], label: "callable") -> list[Sample]:
    return [Sample(prompt_ids=row.prompt_ids, response_ids=[1], rollout_log_probs=[0.0], weight_version=0,
                   group_id=i, prompt_index=row.index, label=label(row.label), prompt_text=row.prompt_text,
                   response_text=text, metadata=dict(row.metadata), media=row.media)
            for i, (row, text) in enumerate(zip(rows, responses))]


def _wrong(letter: str) -> str:
    return "abcd"[("abcd".index(letter) + 1) % 4]


def test_multiple_choice_scores_the_bare_letter_the_tiny_task_answers_with(rows: list) -> None:
    hub = RewardHub("multiple_choice")
    right = _samples(rows, [r.label for r in rows], str)
    wrong = _samples(rows, [_wrong(r.label) for r in rows], str)
    hub.score(right + wrong)
    assert [s.reward for s in right] == [1.0] * 6 and [s.reward for s in wrong] == [0.0] * 6
    assert {kind for r in rows for kind in (i.kind for i in r.media.items)} == {"image", "audio", "video"}


def test_openr1mm_scores_the_task_in_its_answer_tag_format_in_worker_processes(rows: list) -> None:
    hub = RewardHub("openr1mm", worker_processes=1)
    try:
        tagged = _samples(rows, [f"<think>look</think><answer>{r.label}</answer>" for r in rows],
                          lambda label: f"<answer> {label} </answer>")
        wrong = _samples(rows, [f"<answer>{_wrong(r.label)}</answer>" for r in rows],
                         lambda label: f"<answer> {label} </answer>")
        hacked = _samples(rows, [f"<answer>a</answer><answer>{r.label}</answer>" for r in rows],
                          lambda label: f"<answer> {label} </answer>")
        stats = hub.score(tagged + wrong + hacked)
    finally:
        hub.close()
    assert [s.reward for s in tagged] == [1.0] * 6
    assert [s.reward for s in wrong] == [0.0] * 6
    assert [s.reward for s in hacked] == [0.0] * 6  # a repeated <answer> tag scores 0, as in Relax
    assert stats.get("reward/errors", 0.0) == 0.0
