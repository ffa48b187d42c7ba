"""The prompt loader with media columns on a real tiny omni model: the synthetic omni task loads
whole with its placeholders expanded; unusable media are counted drops, never exceptions;
drop_media blanks the media; max_prompt_tokens counts the expanded placeholders
(relax_hpc/data/dataset.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from relax_hpc.data.dataset import load_dataset
from relax_hpc.media.encode import encode_image_png
from relax_hpc.media.processor import MediaProcessor
from relax_hpc.media.synthetic import OMNI_VIDEO_FPS, write_omni_task
from relax_hpc.models.hf import load_tokenizer
from relax_hpc.models.tiny_mm import write_tiny_multimodal
from relax_hpc.spec.schema import DataSpec

# The synthetic task's videos hold 8 frames at 8 fps; the default 2 fps would keep 2 of them.
FMT = dict(image_key="image", audio_key="audio", video_key="video", video_fps=OMNI_VIDEO_FPS,
           max_media_bytes=100_000)
LIMIT = 512


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_multimodal(tmp_path_factory.mktemp("omni") / "qwen2_5_omni", "qwen2_5_omni", seed=0)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def processor(model_dir: Path) -> MediaProcessor:
    return MediaProcessor(model_dir)


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_omni_task(tmp_path_factory.mktemp("task"), rows=12, seed=0)


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _placeholders(processor: MediaProcessor) -> set[int]:
    return {t for t in (processor.placeholders.image, processor.placeholders.video, processor.placeholders.audio)
            if t is not None}


def test_omni_task_loads_every_row(task: Path, tokenizer: Any, processor: MediaProcessor) -> None:
    rows, report = load_dataset(DataSpec(path=str(task), prompt_key="prompt", label_key="answer",
                                         max_prompt_tokens=LIMIT, **FMT), tokenizer, processor)
    records = _records(task)
    assert report.kept == report.rows_read == 12 and report.dropped == {}
    placeholders = _placeholders(processor)
    for row, record in zip(rows, records):
        assert row.media is not None and [i.kind for i in row.media.items] == [record["kind"]]
        [item] = row.media.items
        expected = processor.token_count(item)
        assert expected > 1  # a real expansion, not the template's single placeholder
        assert sum(t in placeholders for t in row.prompt_ids) == expected
        assert row.prompt_ids.count(getattr(processor.placeholders, record["kind"])) == expected
        # prompt_text holds the single placeholder; prompt_ids are its expansion.
        unexpanded = tokenizer(row.prompt_text, add_special_tokens=False)["input_ids"]
        assert len(row.prompt_ids) == len(unexpanded) - 1 + expected
        assert row.label == record["answer"] and record["prompt"] in row.prompt_text
        assert row.metadata == {"kind": record["kind"], "multimodal": {record["kind"] + "s": [record[record["kind"]]]}}
    video = next(r.media.items[0] for r in rows if r.media.items[0].kind == "video")  # type: ignore[union-attr]
    assert video.data.shape[0] == 8 and video.rate == OMNI_VIDEO_FPS  # every frame kept at 8 fps


def test_unusable_media_are_counted_drops(tmp_path: Path, tokenizer: Any, processor: MediaProcessor) -> None:
    task = write_omni_task(tmp_path, rows=12, seed=0)
    media = tmp_path / "media"
    (media / "garbage.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4)
    noise = np.random.default_rng(0).integers(0, 256, (256, 256, 3), dtype=np.uint8)
    (media / "huge.png").write_bytes(encode_image_png(noise))
    assert (media / "huge.png").stat().st_size > FMT["max_media_bytes"]
    bad = [
        {"prompt": "a", "image": "media/nowhere.png", "answer": "a"},
        {"prompt": "b", "image": "media/garbage.png", "answer": "a"},
        {"prompt": "c", "image": "http://example.com/cat.png", "answer": "a"},
        {"prompt": "d", "image": "media/huge.png", "answer": "a"},
        {"prompt": "e", "answer": "a"},
        {"prompt": "f", "image": None, "audio": None, "answer": "a"},
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_text(task.read_text() + "".join(json.dumps(r) + "\n" for r in bad))
    rows, report = load_dataset(DataSpec(path=str(path), prompt_key="prompt", label_key="answer",
                                         max_prompt_tokens=LIMIT, **FMT), tokenizer, processor)
    assert report.rows_read == 18 and report.kept == 12 and len(rows) == 12
    no_media = "no 'image' / 'audio' / 'video' field"
    assert report.dropped == {
        "missing file in 'image'": 1,
        "corrupt image in 'image'": 1,
        "remote URL refused in 'image'": 1,
        "larger than max_media_bytes=100000 in 'image'": 1,
        no_media: 2,
    }
    first = report.first
    assert first["missing file in 'image'"].startswith(f"{path}:13: ")
    assert "nowhere.png" in first["missing file in 'image'"]
    assert first["corrupt image in 'image'"].startswith(f"{path}:14: media/garbage.png")
    assert first["remote URL refused in 'image'"].startswith(f"{path}:15: ")
    assert "http://example.com/cat.png" in first["remote URL refused in 'image'"]
    assert first["larger than max_media_bytes=100000 in 'image'"].startswith(f"{path}:16: media/huge.png")
    assert first[no_media] == f"{path}:17"
    assert "12 of 18 rows kept" in report.summary()


def test_drop_media_blanks_the_content_only(task: Path, tokenizer: Any, processor: MediaProcessor) -> None:
    real, _ = load_dataset(DataSpec(path=str(task), prompt_key="prompt", label_key="answer", max_prompt_tokens=LIMIT,
                                    **FMT), tokenizer, processor)
    blank, report = load_dataset(DataSpec(path=str(task), prompt_key="prompt", label_key="answer",
                                          max_prompt_tokens=LIMIT, **FMT, drop_media=True), tokenizer, processor)
    assert report.kept == 12
    for a, b in zip(real, blank):
        assert b.prompt_ids == a.prompt_ids and b.prompt_text == a.prompt_text
        assert a.media is not None and b.media is not None
        for x, y in zip(a.media.items, b.media.items):
            assert (y.kind, y.rate, y.data.shape, y.data.dtype) == (x.kind, x.rate, x.data.shape, x.data.dtype)
            assert not y.data.any() and x.data.any()


def test_max_prompt_tokens_counts_expanded_placeholders(tmp_path: Path, tokenizer: Any,
                                                        processor: MediaProcessor) -> None:
    task = write_omni_task(tmp_path, rows=1, seed=0, kinds=("image",))
    pixels = np.random.default_rng(1).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    (tmp_path / "media" / "small.png").write_bytes(encode_image_png(pixels[:32, :32]))  # 32x32: 4 tokens
    (tmp_path / "media" / "big.png").write_bytes(encode_image_png(pixels))  # 64x64: 16 tokens
    [row] = _records(task)
    small_row, big_row = {**row, "image": "media/small.png"}, {**row, "image": "media/big.png"}
    task.write_text("".join(json.dumps(r) + "\n" for r in (small_row, big_row)))
    unlimited, _ = load_dataset(DataSpec(path=str(task), prompt_key="prompt", label_key="answer",
                                         max_prompt_tokens=LIMIT, **FMT), tokenizer, processor)
    small, big_ = (len(r.prompt_ids) for r in unlimited)
    unexpanded = len(tokenizer(unlimited[1].prompt_text, add_special_tokens=False)["input_ids"])
    assert unexpanded < small < big_  # same text, so the same unexpanded length
    rows, report = load_dataset(DataSpec(path=str(task), prompt_key="prompt", label_key="answer",
                                         max_prompt_tokens=small, **FMT), tokenizer, processor)
    assert [len(r.prompt_ids) for r in rows] == [small]
    assert report.dropped == {f"longer than max_prompt_tokens={small}": 1}
