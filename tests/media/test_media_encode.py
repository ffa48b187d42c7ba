"""Arrays -> bytes -> arrays round trips (relax_hpc/media/encode.py)."""

from __future__ import annotations

import base64

import numpy as np
import pytest
from media_samples import sine, video_frames

from relax_hpc.media.decode import decode_audio, decode_image, decode_video
from relax_hpc.media.encode import (
    data_url,
    encode_audio_wav,
    encode_image_png,
    encode_video_mkv,
    item_data_url,
)
from relax_hpc.media.items import MediaItem
from relax_hpc.media.sources import read_source


def test_image_round_trip_is_exact() -> None:
    arr = np.random.default_rng(0).integers(0, 256, (9, 13, 3), dtype=np.uint8)
    data = encode_image_png(arr)
    assert data.startswith(b"\x89PNG")
    np.testing.assert_array_equal(decode_image(data), arr)


def test_video_round_trip_is_exact_and_bytes_are_reproducible() -> None:
    frames = video_frames(6, height=10, width=14)
    data = encode_video_mkv(frames, 3)
    out, rate = decode_video(data, fps=3, max_frames=100)
    np.testing.assert_array_equal(out, frames)
    assert rate == pytest.approx(3.0)
    assert encode_video_mkv(frames, 3) == data


def test_audio_round_trip_within_one_step() -> None:
    wave = np.concatenate([sine(300, 16000, amplitude=0.9), np.array([1.0, -1.0, 0.0], np.float32)])
    data = encode_audio_wav(wave, 16000)
    assert data[:4] == b"RIFF"
    out = decode_audio(data, sample_rate=16000)
    assert out.shape == wave.shape
    assert np.abs(out - wave).max() <= 1 / 32767


def test_data_urls_decode_back() -> None:
    assert data_url(b"\x00\x01", "image/png") == "data:image/png;base64," + base64.b64encode(b"\x00\x01").decode()
    image = MediaItem("image", np.random.default_rng(1).integers(0, 256, (4, 6, 3), dtype=np.uint8))
    audio = MediaItem("audio", sine(500, 8000, seconds=0.25), rate=8000)
    video = MediaItem("video", video_frames(4, height=8, width=8), rate=4)
    for item, mime in ((image, "image/png"), (audio, "audio/wav"), (video, "video/x-matroska")):
        url = item_data_url(item)
        assert url.startswith(f"data:{mime};base64,")
        data, _ = read_source(url, base_dir=None, max_bytes=1 << 20)  # type: ignore[arg-type]
        if item.kind == "image":
            np.testing.assert_array_equal(decode_image(data), item.data)
        elif item.kind == "video":
            frames, rate = decode_video(data, fps=item.rate, max_frames=100)
            np.testing.assert_array_equal(frames, item.data)
            assert rate == pytest.approx(item.rate)
        else:
            assert np.abs(decode_audio(data, sample_rate=8000) - item.data).max() <= 1 / 32767
