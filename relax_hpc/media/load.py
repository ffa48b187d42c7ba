"""One call for the dataset loader: a media cell -> canonical, model-fitted `MediaItem`s.

    items = load_media(row["image"], "image", base_dir=data_file.parent, geometry=geom, limits=limits)

A cell is one value or a list of them (see `relax_hpc.media.sources` for the forms a value may
take); `None` means the row has no media of this kind. Each value becomes one item, read,
decoded and fitted to `geometry`. A bad value raises `MediaError`, whose detail names the value.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np

from relax_hpc.media.canonical import Geometry, fit_audio, fit_image, fit_video
from relax_hpc.media.decode import MAX_DECODED_BYTES, decode_audio, decode_image, decode_video
from relax_hpc.media.items import MEDIA_ORDER, MediaError, MediaItem, MediaKind
from relax_hpc.media.sources import read_source
from relax_hpc.spec.schema import DataSpec


class MediaLimits(Protocol):
    """The [data] keys that bound each medium (a DataSpec is one)."""

    @property
    def max_media_bytes(self) -> int: ...  # per file, checked before reading it

    @property
    def video_fps(self) -> float: ...  # frames per second sampled from a video

    @property
    def max_frames(self) -> int: ...  # per video, by uniform subsampling of the whole clip

    @property
    def max_media_seconds(self) -> float: ...  # per video or audio clip


# [data] at its defaults, for media read outside a dataset (an agent's requests); the path the
# spec requires of the table is never read through it.
DEFAULT_MEDIA_LIMITS: MediaLimits = DataSpec(path="-")


def load_media(
    cell: object, kind: MediaKind, *, base_dir: Path, geometry: Geometry,
    limits: MediaLimits = DEFAULT_MEDIA_LIMITS, max_decoded_bytes: int = MAX_DECODED_BYTES,
) -> list[MediaItem]:
    """`max_decoded_bytes`: per medium, what decoding it makes, checked from its header before decoding it."""
    if kind not in MEDIA_ORDER:
        raise ValueError(f"media kind {kind!r} is not one of {', '.join(MEDIA_ORDER)}")
    if cell is None:
        return []
    if isinstance(cell, np.ndarray) and cell.dtype == object:  # a list column read through pandas
        cell = cell.tolist()
    values = cell if isinstance(cell, (list, tuple)) else [cell]
    return [_load_one(value, kind, base_dir, geometry, limits, max_decoded_bytes) for value in values]


def _load_one(value: object, kind: MediaKind, base_dir: Path, geometry: Geometry, limits: MediaLimits,
              max_decoded_bytes: int) -> MediaItem:
    data, name = read_source(value, base_dir=base_dir, max_bytes=limits.max_media_bytes)
    try:
        return _decode_and_fit(data, kind, geometry, limits, max_decoded_bytes)
    except MediaError as e:
        raise MediaError(e.reason, f"{name}: {e.detail}" if e.detail else name) from e
    except MemoryError as e:  # fitting a large medium: the row is dropped, the run goes on
        raise MediaError("out of memory while decoding",
                         f"{name}: lower [data] max_media_bytes or max_frames, or give the process more memory") from e


def _decode_and_fit(data: bytes, kind: MediaKind, geometry: Geometry, limits: MediaLimits,
                    max_decoded_bytes: int) -> MediaItem:
    if kind == "image":
        return MediaItem("image", fit_image(decode_image(data, max_decoded_bytes=max_decoded_bytes), geometry))
    if kind == "video":
        frames, fps = decode_video(data, fps=limits.video_fps, max_frames=limits.max_frames,
                                   max_seconds=limits.max_media_seconds, max_decoded_bytes=max_decoded_bytes)
        return MediaItem("video", fit_video(frames, geometry), rate=fps)
    wave = decode_audio(data, sample_rate=geometry.audio_rate, max_seconds=limits.max_media_seconds,
                        max_decoded_bytes=max_decoded_bytes)
    return MediaItem("audio", fit_audio(wave, geometry.audio_rate, geometry), rate=float(geometry.audio_rate))
