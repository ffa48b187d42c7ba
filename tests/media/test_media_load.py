"""load_media: cells of one value or a list, read, decoded and fitted (relax_hpc/media/load.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from media_samples import peak_hz, png_bytes, sine, video_frames

from relax_hpc.media.canonical import Geometry
from relax_hpc.media.encode import data_url, encode_audio_wav, encode_video_mkv
from relax_hpc.media.items import MediaError, MediaItem
from relax_hpc.media.load import load_media
from relax_hpc.spec.schema import DataSpec

GEOM = Geometry(patch=8, merge=2, temporal=2, min_pixels=16 * 16, max_pixels=64 * 64, audio_rate=16000)


def _limits(**keys: Any) -> DataSpec:
    """[data] with these media keys; load_media never reads its path."""
    return DataSpec(path="-", **keys)


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    (tmp_path / "media").mkdir()
    (tmp_path / "media" / "wide.png").write_bytes(png_bytes(np.full((20, 50, 3), 90, np.uint8)))
    (tmp_path / "media" / "tone.wav").write_bytes(encode_audio_wav(sine(1000, 44100), 44100))
    (tmp_path / "media" / "clip.mkv").write_bytes(encode_video_mkv(video_frames(5, 20, 30), 5))
    return tmp_path


def test_image_cell_one_value_and_a_list(data_dir: Path) -> None:
    [item] = load_media("media/wide.png", "image", base_dir=data_dir, geometry=GEOM)
    assert isinstance(item, MediaItem) and item.kind == "image" and item.data.shape == (16, 48, 3)
    square = png_bytes(np.zeros((32, 32, 3), np.uint8))
    items = load_media(
        ["media/wide.png", square, {"bytes": None, "path": "media/wide.png"}, data_url(square, "image/png")],
        "image",
        base_dir=data_dir,
        geometry=GEOM,
    )
    assert [i.data.shape for i in items] == [(16, 48, 3), (32, 32, 3), (16, 48, 3), (32, 32, 3)]
    assert items[0] == items[2] and items[0].digest != items[1].digest  # same pixels, same digest
    assert load_media(np.array(["media/wide.png"], dtype=object), "image", base_dir=data_dir, geometry=GEOM)


def test_no_media(data_dir: Path) -> None:
    assert load_media(None, "image", base_dir=data_dir, geometry=GEOM) == []
    assert load_media([], "audio", base_dir=data_dir, geometry=GEOM) == []


def test_audio_cell_resampled_to_the_geometry_rate(data_dir: Path) -> None:
    [item] = load_media("media/tone.wav", "audio", base_dir=data_dir, geometry=GEOM)
    assert item.kind == "audio" and item.rate == 16000 and item.data.shape == (16000,)
    assert peak_hz(item.data, 16000) == pytest.approx(1000, abs=2)


def test_video_cell_sampled_fitted_and_padded(data_dir: Path) -> None:
    [item] = load_media("media/clip.mkv", "video", base_dir=data_dir, geometry=GEOM, limits=_limits(video_fps=5))
    assert item.kind == "video" and item.rate == pytest.approx(5.0)
    assert item.data.shape == (6, 16, 32, 3)  # 5 frames padded to the temporal patch, 20x30 -> 16x32
    [capped] = load_media(
        "media/clip.mkv", "video", base_dir=data_dir, geometry=GEOM, limits=_limits(video_fps=5, max_frames=2)
    )
    assert capped.data.shape[0] == 2 and capped.rate == pytest.approx(2.0)


def test_errors_name_the_value(data_dir: Path) -> None:
    (data_dir / "media" / "bad.png").write_bytes(b"nope")
    with pytest.raises(MediaError) as e:
        load_media(["media/wide.png", "media/bad.png"], "image", base_dir=data_dir, geometry=GEOM)
    assert e.value.reason == "corrupt image" and "media/bad.png" in e.value.detail
    with pytest.raises(MediaError) as e:
        load_media("media/tone.wav", "audio", base_dir=data_dir, geometry=GEOM, limits=_limits(max_media_bytes=100))
    assert e.value.reason == "larger than max_media_bytes=100"
    with pytest.raises(MediaError) as e:
        load_media("media/tone.wav", "audio", base_dir=data_dir, geometry=GEOM, limits=_limits(max_media_seconds=0.5))
    assert e.value.reason == "longer than 0.5 s" and "media/tone.wav" in e.value.detail
    with pytest.raises(MediaError) as e:
        load_media("https://example.org/a.png", "image", base_dir=data_dir, geometry=GEOM)
    assert e.value.reason == "remote URL refused"
    with pytest.raises(ValueError, match="not one of"):
        load_media("media/wide.png", "picture", base_dir=data_dir, geometry=GEOM)  # type: ignore[arg-type]
