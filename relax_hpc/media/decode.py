"""Bytes -> arrays: images with Pillow, video with PyAV, audio with soundfile (else PyAV) and soxr.

- `decode_image`: uint8 (H, W, 3) RGB; EXIF orientation applied; transparency composited on
  white (as transformers' `convert_to_rgb` does, so our pixels match theirs);
- `decode_video`: uint8 (T, H, W, 3) RGB frames sampled uniformly in time at `fps` (all of them when
  the clip has fewer), at most `max_frames`, plus the rate of the returned frames;
- `decode_audio`: float32 mono in [-1, 1] at `sample_rate`.

The arrays are not yet fitted to a model (`relax_hpc.media.canonical` does that). Whatever the
bytes hold, the only exception that leaves this module is `MediaError` ("corrupt image", "longer
than 600 s", "too large to decode", "out of memory while decoding"): a broken file drops its row,
it never stops a run.

A few kilobytes of compressed data can stand for gigabytes of pixels or samples, so what a medium
decodes to is bounded from its header, before anything is decoded (`max_decoded_bytes`, default
MAX_DECODED_BYTES): an image's width x height x the decoder's bytes per pixel plus the RGB array,
a video's chosen frames x width x height x 3, an audio clip's frames x channels x 4 (float32), at
most MAX_AUDIO_CHANNELS channels. Audio is decoded in blocks and mixed to mono as it goes, so its
peak is the mono wave, not every channel of it.
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

# Per medium: the arrays decoding it makes (a 24-megapixel photo needs 168 MB, 32 frames of
# 1920x1080 video 200 MB, 10 minutes of 48 kHz stereo 230 MB).
MAX_DECODED_BYTES = 256 << 20
MAX_AUDIO_CHANNELS = 8  # 7.1 surround; more is a bomb (every channel is decoded, then mixed to mono)
AUDIO_BLOCK_FRAMES = 1 << 16  # samples per channel decoded at a time
_MIB = 1 << 20
# Reasons that refuse a medium for what it would cost, whichever library decodes it.
LIMIT_REASONS = frozenset({"too large to decode", "too many audio channels", "out of memory while decoding"})


@contextmanager
def _library_errors(reason: str) -> Iterator[None]:
    """Turn whatever a decoding library raises on bad input into MediaError(reason)."""
    try:
        yield
    except (MediaError, KeyboardInterrupt):
        raise
    except MemoryError as e:  # the limits below make this rare; it still drops the row, not the run
        raise MediaError("out of memory while decoding",
                         "lower [data] max_media_bytes or max_frames, or give the process more memory") from e
    except Image.DecompressionBombError as e:
        raise MediaError("image too large", str(e)) from e
    except UnidentifiedImageError as e:  # its message is the repr of a BytesIO
        raise MediaError(reason, "not an image format Pillow reads") from e
    except Exception as e:
        raise MediaError(reason, f"{type(e).__name__}: {e}") from e


def _check_seconds(seconds: float, max_seconds: float | None) -> None:
    if max_seconds is not None and seconds > max_seconds:
        raise MediaError(f"longer than {max_seconds:g} s", f"{seconds:.1f} s; cut it or raise max_seconds")


def check_decoded_size(needed: float, limit: int, what: str, fix: str) -> None:
    """Refuse a medium whose decoded arrays would take more than `limit` bytes (before decoding)."""
    if needed > limit:
        raise MediaError("too large to decode",
                         f"{what} would take {_size(needed)} decoded, over the {_size(limit)} limit; {fix}")


def _size(n: float) -> str:
    return f"{n / _MIB:,.0f} MiB" if n >= 10 * _MIB else f"{int(n):,} bytes"


def _pixel_bytes(mode: str) -> int:
    """Bytes per pixel Pillow stores for an image mode (bilevel, grey and palette 1, 16-bit grey
    2, everything else 4: RGB is stored as RGBX)."""
    if mode in ("1", "L", "P"):
        return 1
    return 2 if mode.startswith("I;16") else 4


# ---------------------------------------------------------------------------------------- image


def decode_image(data: bytes, *, max_decoded_bytes: int = MAX_DECODED_BYTES) -> np.ndarray:
    """uint8 (H, W, 3) RGB of the first frame of any image Pillow reads."""
    with _library_errors("corrupt image"), Image.open(io.BytesIO(data)) as im:
        width, height = im.size
        # Pillow refuses twice its limit in open() and only warns above it; refuse both.
        if Image.MAX_IMAGE_PIXELS and width * height > Image.MAX_IMAGE_PIXELS:
            raise MediaError("image too large", f"{width}x{height} is over {Image.MAX_IMAGE_PIXELS} pixels")
        check_decoded_size(width * height * (_pixel_bytes(im.mode) + 3), max_decoded_bytes,
                           f"a {width}x{height} {im.mode} image", "downscale it")
        im.load()
        return _to_rgb(ImageOps.exif_transpose(im))


def _to_rgb(im: Image.Image) -> np.ndarray:
    if im.mode.startswith("I"):  # 16/32-bit greyscale: Pillow's convert() would clip at 255
        return _grey16_to_rgb(np.array(im))
    if im.mode in ("RGBA", "LA", "PA", "La", "RGBa") or "transparency" in im.info:
        rgba = im.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        im = Image.alpha_composite(background, rgba)
    return np.asarray(im.convert("RGB"), dtype=np.uint8).copy()


def _grey16_to_rgb(grey: np.ndarray) -> np.ndarray:
    """The top 8 bits of 16-bit (or clipped 32-bit) grey, as RGB; in place, in the source dtype
    (an int64 copy of a 6000x6000 image is 288 MB)."""
    if grey.dtype.kind == "i" or grey.dtype.itemsize > 2:
        np.clip(grey, 0, 65535, out=grey)
    grey >>= 8
    top = grey.astype(np.uint8)
    del grey
    rgb = np.empty((*top.shape, 3), dtype=np.uint8)
    rgb[...] = top[..., None]
    return rgb


# ---------------------------------------------------------------------------------------- video


def decode_video(
    data: bytes, *, fps: float, max_frames: int, max_seconds: float | None = None,
    max_decoded_bytes: int = MAX_DECODED_BYTES,
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
        if width <= 0 or height <= 0:
            raise MediaError("corrupt video", f"the stream gives no frame size ({width}x{height})")
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
    # The frames returned, and the one being converted.
    check_decoded_size((len(picks) + 1) * width * height * 3, max_decoded_bytes,
                       f"{len(picks)} frames of {width}x{height}", "lower [data] max_frames or video_fps, or "
                       "downscale the video")
    with _library_errors("corrupt video"):
        frames = _decode_picks(data, [pts[i] for i in picks], pts, (width, height))
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


def _decode_picks(data: bytes, wanted: list[int], all_pts: list[int], size: tuple[int, int]) -> np.ndarray:
    """The frames at the pts in `wanted` (repeats allowed), each at `size` (width, height): the
    stream's, which the caller checked; a stream that changes resolution mid-way is scaled to it.

    A wanted pts takes the first decoded frame at or after it, and the last frame when the stream
    ends early, so a frame that fails to decode or a decoder that renumbers does not drop the clip.
    The frames are written into one array made up front: no list of frames, no copy to stack them.
    """
    import av

    targets = sorted(set(wanted))
    slots: dict[int, list[int]] = {}
    for k, p in enumerate(wanted):
        slots.setdefault(p, []).append(k)
    width, height = size
    out = np.empty((len(wanted), height, width, 3), dtype=np.uint8)
    done = 0
    last = None

    def put(frame: av.VideoFrame, pts: int) -> None:
        rgb = frame.to_ndarray(format="rgb24", width=width, height=height)
        for k in slots[pts]:
            out[k] = rgb

    with av.open(io.BytesIO(data), mode="r") as container:
        for index, frame in enumerate(container.decode(container.streams.video[0])):
            pts = frame.pts if frame.pts is not None else all_pts[min(index, len(all_pts) - 1)]
            last = frame
            while done < len(targets) and targets[done] <= pts:
                put(frame, targets[done])
                done += 1
            if done == len(targets):
                break
        if last is None:
            raise MediaError("corrupt video", "no frame of the video stream decodes")
        for pts in targets[done:]:
            put(last, pts)
    return out


# ---------------------------------------------------------------------------------------- audio


def decode_audio(
    data: bytes, *, sample_rate: int, max_seconds: float | None = None, max_decoded_bytes: int = MAX_DECODED_BYTES
) -> np.ndarray:
    """float32 mono in [-1, 1] at `sample_rate`: soundfile for wav/flac/ogg, else PyAV."""
    try:
        mono, rate = _read_soundfile(data, max_seconds, max_decoded_bytes)
    except MediaError as e:
        if e.reason.startswith("longer than") or e.reason in LIMIT_REASONS:
            raise  # a limit, not a format soundfile cannot read: PyAV would refuse it the same way
        with _library_errors("corrupt audio"):
            mono, rate = _read_pyav(data, max_seconds, max_decoded_bytes)
    if mono.shape[0] == 0:
        raise MediaError("corrupt audio", "no samples")
    if not np.isfinite(mono).all():
        raise MediaError("corrupt audio", "samples that are NaN or infinite")
    return resample_audio(mono, rate, sample_rate)


def resample_audio(wave: np.ndarray, rate: int, sample_rate: int) -> np.ndarray:
    """Mono float32 `wave` from `rate` to `sample_rate` (soxr, high quality), clipped to [-1, 1]."""
    wave = np.asarray(wave, dtype=np.float32)
    if rate != sample_rate:
        import soxr

        with _library_errors("corrupt audio"):
            wave = soxr.resample(wave, rate, sample_rate)
    return np.ascontiguousarray(np.clip(wave, -1.0, 1.0), dtype=np.float32)


class _MonoWave:
    """Blocks of decoded audio mixed to mono as they arrive, with the limits checked on the way
    (a header's length may be missing or wrong)."""

    def __init__(self, rate: int, channels: int, max_seconds: float | None, max_decoded_bytes: int) -> None:
        if rate <= 0:
            raise MediaError("corrupt audio", f"sample rate {rate}")
        if not 1 <= channels <= MAX_AUDIO_CHANNELS:
            raise MediaError("too many audio channels" if channels > 0 else "corrupt audio",
                             f"{channels} channels; at most {MAX_AUDIO_CHANNELS} are read: mix it down first")
        self.rate, self.channels = rate, channels
        self.max_seconds, self.max_decoded_bytes = max_seconds, max_decoded_bytes
        self.chunks: list[np.ndarray] = []
        self.frames = 0

    def check(self, frames: int) -> None:
        _check_seconds(frames / self.rate, self.max_seconds)
        check_decoded_size(frames * self.channels * 4, self.max_decoded_bytes,
                           f"{frames / self.rate:.1f} s of {self.channels}-channel audio at {self.rate} Hz",
                           "cut or downsample it")

    def add(self, block: np.ndarray) -> None:
        """One (frames, channels) block."""
        self.check(self.frames + block.shape[0])
        mono = block.mean(axis=1, dtype=np.float32) if block.shape[1] > 1 else block[:, 0].astype(np.float32)
        self.chunks.append(mono)
        self.frames += mono.shape[0]

    def wave(self) -> np.ndarray:
        return np.concatenate(self.chunks) if self.chunks else np.zeros(0, np.float32)


def _read_soundfile(data: bytes, max_seconds: float | None, max_decoded_bytes: int) -> tuple[np.ndarray, int]:
    import soundfile

    with _library_errors("corrupt audio"), soundfile.SoundFile(io.BytesIO(data)) as f:
        mono = _MonoWave(int(f.samplerate), int(f.channels), max_seconds, max_decoded_bytes)
        if f.frames > 0:
            mono.check(f.frames)
        while (block := f.read(AUDIO_BLOCK_FRAMES, dtype="float32", always_2d=True)).shape[0]:
            mono.add(block)
        return mono.wave(), mono.rate


def _read_pyav(data: bytes, max_seconds: float | None, max_decoded_bytes: int) -> tuple[np.ndarray, int]:
    import av

    with av.open(io.BytesIO(data), mode="r") as container:
        if not container.streams.audio:
            raise MediaError("corrupt audio", "no audio stream")
        if container.duration is not None:
            _check_seconds(container.duration / av.time_base, max_seconds)
        stream = container.streams.audio[0]
        context = stream.codec_context
        mono = _MonoWave(int(context.sample_rate or 0), int(context.channels or 0), max_seconds, max_decoded_bytes)
        if container.duration is not None:
            mono.check(int(container.duration / av.time_base * mono.rate))
        # Keeps the channels and rate, converts every frame to planar float: (channels, samples).
        resampler = av.AudioResampler(format="fltp")
        for frame in _resampled(container.decode(stream), resampler):
            if frame.sample_rate != mono.rate:
                raise MediaError("corrupt audio", f"the sample rate changes mid-stream ({mono.rate} -> "
                                                  f"{frame.sample_rate} Hz)")
            planar = frame.to_ndarray()
            if planar.shape[0] > mono.channels:
                mono = _more_channels(mono, planar.shape[0])
            mono.add(planar.T)
    if not mono.chunks:
        raise MediaError("corrupt audio", "the audio stream has no samples")
    return mono.wave(), mono.rate


def _more_channels(mono: _MonoWave, channels: int) -> _MonoWave:
    """The same wave, now counted at more channels (a stream whose header undercounted them)."""
    wider = _MonoWave(mono.rate, channels, mono.max_seconds, mono.max_decoded_bytes)
    wider.chunks, wider.frames = mono.chunks, mono.frames
    return wider


def _resampled(frames: Iterator[av.AudioFrame], resampler: av.AudioResampler) -> Iterator[av.AudioFrame]:
    for frame in frames:
        yield from resampler.resample(frame)
    yield from resampler.resample(None)  # flush what the resampler holds back
