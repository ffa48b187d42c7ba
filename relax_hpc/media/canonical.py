"""Fit decoded media to a model's patch grid, once, at load time.

The PIL and torchvision backends of the Qwen-VL image processors agree to 1e-7 when they need not
resize, and only to 1e-2 when they do (.dev-notes/omni-research.md §0.2). So relax-hpc resizes
every image and video frame itself, here, with PIL bicubic, to exactly the size that
`smart_resize` picks; every processor after that (ours, SGLang's, a GPU one) finds nothing to
resize and only rescales and normalises. Audio is brought to the feature extractor's rate.

`Geometry` holds what a Qwen-VL / Omni processor config gives. For video, build it from the
video processor's config (its pixel limits are per frame here).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

from relax_hpc.media.decode import resample_audio
from relax_hpc.media.items import MediaError

MAX_ASPECT_RATIO = 200  # what the Qwen processors refuse above


@dataclass(frozen=True)
class Geometry:
    patch: int  # vision patch side, pixels
    merge: int  # spatial merge: merge x merge patches become one token
    temporal: int  # video frames per temporal patch
    min_pixels: int  # per image / frame, after resizing
    max_pixels: int
    audio_rate: int = 16000  # the feature extractor's sampling rate

    def __post_init__(self) -> None:
        problems = [
            f"{name}={getattr(self, name)} must be >= 1"
            for name in ("patch", "merge", "temporal", "min_pixels", "max_pixels", "audio_rate")
            if getattr(self, name) < 1
        ]
        if self.min_pixels > self.max_pixels:
            problems.append(f"min_pixels={self.min_pixels} is above max_pixels={self.max_pixels}")
        if problems:
            raise ValueError("invalid media geometry: " + "; ".join(problems))

    @property
    def factor(self) -> int:
        """Image sides are multiples of this: one merged token covers factor x factor pixels."""
        return self.patch * self.merge


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The (height, width) a Qwen-VL processor resizes to: multiples of `factor`, pixel count
    within [min_pixels, max_pixels], aspect ratio kept as closely as possible.

    The same arithmetic as transformers' `smart_resize` (Python's round-half-even included), so
    that our sizes and theirs agree; tests/media checks this over many sizes.
    """
    if height < 1 or width < 1:
        raise MediaError("empty image", f"{width}x{height}")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise MediaError(
            f"aspect ratio over {MAX_ASPECT_RATIO}",
            f"{width}x{height}; crop or pad it below {MAX_ASPECT_RATIO}:1",
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def fitted_size(height: int, width: int, geom: Geometry) -> tuple[int, int]:
    return smart_resize(height, width, geom.factor, geom.min_pixels, geom.max_pixels)


def _resize(arr: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    if arr.shape[:2] == size:
        return arr
    resized = Image.fromarray(np.ascontiguousarray(arr)).resize((size[1], size[0]), Image.Resampling.BICUBIC)
    return np.asarray(resized, dtype=np.uint8).copy()


def fit_image(arr: np.ndarray, geom: Geometry) -> np.ndarray:
    """uint8 (H, W, 3) resized with PIL bicubic to its smart_resize size (as is when already so)."""
    return _resize(arr, fitted_size(arr.shape[0], arr.shape[1], geom))


def fit_video(frames: np.ndarray, geom: Geometry) -> np.ndarray:
    """Every frame to the size of the first's fit; T padded to a multiple of `geom.temporal` by
    repeating the last frame (what the processors do, done here so they agree)."""
    size = fitted_size(frames.shape[1], frames.shape[2], geom)
    fitted = [_resize(f, size) for f in frames]
    fitted += [fitted[-1]] * (-len(fitted) % geom.temporal)
    return np.stack(fitted)


def fit_audio(wave: np.ndarray, rate: int, geom: Geometry) -> np.ndarray:
    """Mono float32 at the feature extractor's rate (resampled with soxr when it differs)."""
    return resample_audio(wave, int(rate), geom.audio_rate)
