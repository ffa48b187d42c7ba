"""Bytes -> arrays: images with Pillow, video with PyAV, audio with soundfile (else PyAV) and soxr.

- `decode_image`: uint8 (H, W, 3) RGB; EXIF orientation applied; transparency composited on
  white (as transformers' `convert_to_rgb` does, so our pixels match theirs);
- `decode_video`: uint8 (T, H, W, 3) RGB frames sampled uniformly in time at `fps` (all of them when
  the clip has fewer), at most `max_frames`, plus the rate of the returned frames;
- `decode_audio`: float32 mono in [-1, 1] at `sample_rate`.

The arrays are not yet fitted to a model (`relax_hpc.media.canonical` does that). Whatever the
bytes hold, the only exception that leaves this module is `MediaError` ("corrupt image", "longer
than 600 s", ...): a broken file drops its row, it never stops a run.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from relax_hpc.media.items import MediaError

if TYPE_CHECKING:
    import av


@contextmanager
def _library_errors(reason: str) -> Iterator[None]:
    """Turn whatever a decoding library raises on bad input into MediaError(reason)."""
    try:
        yield
    except (MediaError, MemoryError, KeyboardInterrupt):
        raise
    except Image.DecompressionBombError as e:
        raise MediaError("image too large", str(e)) from e
    except UnidentifiedImageError as e:  # its message is the repr of a BytesIO
        raise MediaError(reason, "not an image format Pillow reads") from e
    except Exception as e:
        raise MediaError(reason, f"{type(e).__name__}: {e}") from e


def _check_seconds(seconds: float, max_seconds: float | None) -> None:
    if max_seconds is not None and seconds > max_seconds:
        raise MediaError(f"longer than {max_seconds:g} s", f"{seconds:.1f} s; cut it or raise max_seconds")


# ---------------------------------------------------------------------------------------- image


def decode_image(data: bytes) -> np.ndarray:
    """uint8 (H, W, 3) RGB of the first frame of any image Pillow reads."""
    with _library_errors("corrupt image"), Image.open(io.BytesIO(data)) as im:
        width, height = im.size
        # Pillow refuses twice its limit in open() and only warns above it; refuse both.
        if Image.MAX_IMAGE_PIXELS and width * height > Image.MAX_IMAGE_PIXELS:
            raise MediaError("image too large", f"{width}x{height} is over {Image.MAX_IMAGE_PIXELS} pixels")
        im.load()
        return _to_rgb(ImageOps.exif_transpose(im))


def _to_rgb(im: Image.Image) -> np.ndarray:
    if im.mode.startswith("I"):  # 16/32-bit greyscale: Pillow's convert() would clip at 255
        grey = np.asarray(im).astype(np.int64)
        grey = (np.clip(grey, 0, 65535) >> 8).astype(np.uint8)
        return np.ascontiguousarray(np.repeat(grey[..., None], 3, axis=2))
    if im.mode in ("RGBA", "LA", "PA", "La", "RGBa") or "transparency" in im.info:
        rgba = im.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        im = Image.alpha_composite(background, rgba)
    return np.asarray(im.convert("RGB"), dtype=np.uint8).copy()


# ---------------------------------------------------------------------------------------- video


def decode_video(
    data: bytes, *, fps: float, max_frames: int, max_seconds: float | None = None
) -> tuple[np.ndarray, float]:
    """uint8 (T, H, W, 3) frames sampled at `fps` from the stream's timestamps, and their rate.

    Two passes over the container: the first only demuxes (cheap) to learn every frame's
    timestamp, so the choice of frames, the frame cap and the duration limit are known before
    anything is decoded; the second decodes and converts only the chosen frames.
    """
    if fps <= 0 or max_frames < 1:
        raise ValueError(f"decode_video needs fps > 0 and max_frames >= 1, got {fps}, {max_frames}")
    import av

    with _library_errors("corrupt video"), av.open(io.BytesIO(data), mode="r") as container:
        if not container.streams.video:
            raise MediaError("corrupt video", "no video stream")
        if container.duration is not None:
            _check_seconds(container.duration / av.time_base, max_seconds)
        stream = container.streams.video[0]
        width, height = stream.codec_context.width, stream.codec_context.height
        if Image.MAX_IMAGE_PIXELS and width * height > Image.MAX_IMAGE_PIXELS:
            raise MediaError("video too large", f"{width}x{height} frames")
        pts = sorted({p.pts for p in container.demux(stream) if p.pts is not None and p.size})
        base = float(stream.time_base or 0) or 1.0 / float(stream.average_rate or fps)
        rate = float(stream.average_rate or 0)
    if not pts:
        raise MediaError("corrupt video", "the video stream has no frames")
    times = (np.asarray(pts, dtype=np.float64) - pts[0]) * base
    picks, seconds = _sample_times(times, fps=fps, max_frames=max_frames, native_rate=rate)
    _check_seconds(seconds, max_seconds)
    with _library_errors("corrupt video"):
        frames = _decode_picks(data, [pts[i] for i in picks], pts)
    return frames, len(picks) / seconds


def _sample_times(times: np.ndarray, *, fps: float, max_frames: int, native_rate: float) -> tuple[list[int], float]:
    """Indices of the frames nearest to `n` uniform times over the clip, and its duration (s)."""
    count = len(times)
    if count > 1:
        seconds = float(times[-1]) * count / (count - 1)  # one frame interval past the last start
    else:
        seconds = 1.0 / (native_rate or fps)
    if native_rate > 0 and abs(seconds - count / native_rate) <= 0.5 / native_rate:
        seconds = count / native_rate  # constant rate: undo the container's timestamp rounding
    n = min(count, max_frames, max(1, round(seconds * fps)))
    # n times exactly 1/rate apart (rate = n / seconds), centred in the clip: with n == count
    # they are the frames' own times, with n == 1 the middle of the clip.
    step = seconds / n
    targets = np.arange(n) * step + (step - seconds / count) / 2
    right = np.minimum(np.searchsorted(times, targets), count - 1)
    left = np.maximum(right - 1, 0)
    nearest = np.where(np.abs(times[left] - targets) <= np.abs(times[right] - targets), left, right)
    return [int(i) for i in nearest], seconds


def _decode_picks(data: bytes, wanted: list[int], all_pts: list[int]) -> np.ndarray:
    """The frames at the pts in `wanted` (repeats allowed), each at the first frame's size.

    A wanted pts takes the first decoded frame at or after it, and the last frame when the stream
    ends early, so a frame that fails to decode or a decoder that renumbers does not drop the clip.
    """
    import av

    targets = sorted(set(wanted))
    got: dict[int, np.ndarray] = {}
    size: tuple[int, int] | None = None
    last = None
    with av.open(io.BytesIO(data), mode="r") as container:
        for index, frame in enumerate(container.decode(container.streams.video[0])):
            if size is None:
                # A stream may change resolution mid-way; every frame takes the first one's size.
                size = (frame.width, frame.height)
            pts = frame.pts if frame.pts is not None else all_pts[min(index, len(all_pts) - 1)]
            last = frame
            while len(got) < len(targets) and targets[len(got)] <= pts:
                got[targets[len(got)]] = frame.to_ndarray(format="rgb24", width=size[0], height=size[1])
            if len(got) == len(targets):
                break
        if last is None or size is None:
            raise MediaError("corrupt video", "no frame of the video stream decodes")
        for pts in targets[len(got) :]:
            got[pts] = last.to_ndarray(format="rgb24", width=size[0], height=size[1])
    return np.stack([got[p] for p in wanted]).astype(np.uint8, copy=False)


# ---------------------------------------------------------------------------------------- audio


def decode_audio(data: bytes, *, sample_rate: int, max_seconds: float | None = None) -> np.ndarray:
    """float32 mono in [-1, 1] at `sample_rate`: soundfile for wav/flac/ogg, else PyAV."""
    try:
        wave, rate = _read_soundfile(data, max_seconds)
    except MediaError as e:
        if e.reason.startswith("longer than"):
            raise
        with _library_errors("corrupt audio"):
            wave, rate = _read_pyav(data, max_seconds)
    if wave.shape[0] == 0:
        raise MediaError("corrupt audio", "no samples")
    if not np.isfinite(wave).all():
        raise MediaError("corrupt audio", "samples that are NaN or infinite")
    mono = wave.mean(axis=1, dtype=np.float32) if wave.shape[1] > 1 else wave[:, 0]
    return resample_audio(mono, rate, sample_rate)


def resample_audio(wave: np.ndarray, rate: int, sample_rate: int) -> np.ndarray:
    """Mono float32 `wave` from `rate` to `sample_rate` (soxr, high quality), clipped to [-1, 1]."""
    wave = np.asarray(wave, dtype=np.float32)
    if rate != sample_rate:
        import soxr

        with _library_errors("corrupt audio"):
            wave = soxr.resample(wave, rate, sample_rate)
    return np.ascontiguousarray(np.clip(wave, -1.0, 1.0), dtype=np.float32)


def _read_soundfile(data: bytes, max_seconds: float | None) -> tuple[np.ndarray, int]:
    import soundfile

    with _library_errors("corrupt audio"), soundfile.SoundFile(io.BytesIO(data)) as f:
        if f.samplerate <= 0:
            raise MediaError("corrupt audio", f"sample rate {f.samplerate}")
        _check_seconds(f.frames / f.samplerate, max_seconds)
        return f.read(dtype="float32", always_2d=True), int(f.samplerate)


def _read_pyav(data: bytes, max_seconds: float | None) -> tuple[np.ndarray, int]:
    import av

    with av.open(io.BytesIO(data), mode="r") as container:
        if not container.streams.audio:
            raise MediaError("corrupt audio", "no audio stream")
        if container.duration is not None:
            _check_seconds(container.duration / av.time_base, max_seconds)
        stream = container.streams.audio[0]
        # Keeps the channels and rate, converts every frame to planar float: (channels, samples).
        resampler = av.AudioResampler(format="fltp")
        chunks: list[np.ndarray] = []
        total, rate = 0, 0
        for frame in _resampled(container.decode(stream), resampler):
            rate = frame.sample_rate
            chunks.append(frame.to_ndarray())
            total += chunks[-1].shape[1]
            _check_seconds(total / rate, max_seconds)  # the container's duration may be missing
    if not chunks:
        raise MediaError("corrupt audio", "the audio stream has no samples")
    return np.concatenate(chunks, axis=1).T.astype(np.float32, copy=False), int(rate)


def _resampled(frames: Iterator[av.AudioFrame], resampler: av.AudioResampler) -> Iterator[av.AudioFrame]:
    for frame in frames:
        yield from resampler.resample(frame)
    yield from resampler.resample(None)  # flush what the resampler holds back
