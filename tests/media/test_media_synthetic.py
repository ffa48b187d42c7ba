"""The tiny omni task's generator: deterministic, and every label is in its media (relax_hpc/media/synthetic.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from media_samples import peak_hz

from relax_hpc.media.canonical import Geometry
from relax_hpc.media.decode import decode_audio, decode_image, decode_video
from relax_hpc.media.load import load_media
from relax_hpc.media.synthetic import OMNI_TASK_CHOICES, OMNI_TASK_PROMPTS, OMNI_VIDEO_FPS, write_omni_task
from relax_hpc.models.tiny import ALPHABET
from relax_hpc.spec.schema import DataSpec

COLOURS = {"red": (1, 0, 0), "green": (0, 1, 0), "blue": (0, 0, 1), "white": (1, 1, 1)}


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_rows_are_round_robin_with_one_media_column(tmp_path: Path) -> None:
    path = write_omni_task(tmp_path, rows=9, seed=3)
    assert path == tmp_path / "train.jsonl"
    rows = _rows(path)
    assert [r["kind"] for r in rows] == ["image", "audio", "video"] * 3
    for index, row in enumerate(rows):
        kind = row["kind"]
        assert set(row) == {"prompt", kind, "answer", "kind"}
        assert row[kind] == f"media/{index:05d}.{ {'image': 'png', 'audio': 'wav', 'video': 'mkv'}[kind] }"
        assert row["prompt"] == OMNI_TASK_PROMPTS[kind] and row["answer"] in OMNI_TASK_CHOICES[kind]
        assert set(row["prompt"]) <= set(ALPHABET), row["prompt"]
    assert OMNI_TASK_PROMPTS["image"] == "square colour? a:red b:green c:blue d:white"
    assert not list(tmp_path.rglob("*.tmp"))


def test_same_seed_same_bytes(tmp_path: Path) -> None:
    write_omni_task(tmp_path / "a", rows=6, seed=7)
    write_omni_task(tmp_path / "b", rows=6, seed=7)
    write_omni_task(tmp_path / "c", rows=6, seed=8)
    assert _files(tmp_path / "a") == _files(tmp_path / "b")
    assert _files(tmp_path / "a") != _files(tmp_path / "c")


def test_labels_match_the_media(tmp_path: Path) -> None:
    rows = _rows(write_omni_task(tmp_path, rows=48, seed=0))
    assert {r["answer"] for r in rows if r["kind"] == "image"} == set("abcd")  # 16 rows of each kind
    for row in rows:
        kind, meaning = row["kind"], OMNI_TASK_CHOICES[row["kind"]][row["answer"]]
        data = (tmp_path / row[kind]).read_bytes()
        if kind == "image":
            image = decode_image(data)
            assert image.shape == (64, 64, 3)
            lit = image.max(axis=2) > 0
            assert lit.sum() == 32 * 32
            rows_lit, cols_lit = np.nonzero(lit)
            assert np.ptp(rows_lit) == 31 and np.ptp(cols_lit) == 31  # one 32x32 square
            pixel = image[rows_lit[0], cols_lit[0]]
            assert tuple(int(v > 0) for v in pixel) == COLOURS[meaning] and pixel.max() >= 200
        elif kind == "audio":
            wave = decode_audio(data, sample_rate=16000)
            assert wave.shape == (16000,) and 0.29 <= np.abs(wave).max() <= 0.81
            assert peak_hz(wave, 16000) == float(meaning)
        else:
            frames, rate = decode_video(data, fps=OMNI_VIDEO_FPS, max_frames=32)
            assert frames.shape == (8, 32, 32, 3) and rate == OMNI_VIDEO_FPS
            assert set(np.unique(frames)) <= {40, 255}
            assert int((frames.reshape(8, -1).mean(axis=1) == 255).sum()) == int(meaning)


def test_loads_through_load_media(tmp_path: Path) -> None:
    rows = _rows(write_omni_task(tmp_path, rows=3, seed=1))
    geom = Geometry(patch=8, merge=2, temporal=2, min_pixels=16 * 16, max_pixels=64 * 64)
    limits = DataSpec(path="-", video_fps=OMNI_VIDEO_FPS)
    shapes = [
        load_media(row[row["kind"]], row["kind"], base_dir=tmp_path, geometry=geom, limits=limits)[0].data.shape
        for row in rows
    ]
    assert shapes == [(64, 64, 3), (16000,), (8, 32, 32, 3)]


def test_kinds_subset(tmp_path: Path) -> None:
    rows = _rows(write_omni_task(tmp_path, rows=4, seed=0, kinds=("image",)))
    assert [r["kind"] for r in rows] == ["image"] * 4
