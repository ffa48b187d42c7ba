"""Small synthetic media for tests/media: made in memory, in milliseconds."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image


def png_bytes(arr: np.ndarray | Image.Image, fmt: str = "PNG", **save: object) -> bytes:
    image = arr if isinstance(arr, Image.Image) else Image.fromarray(arr)
    buf = io.BytesIO()
    image.save(buf, format=fmt, **save)
    return buf.getvalue()


def sine(hertz: float, rate: int, seconds: float = 1.0, amplitude: float = 0.5) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return (amplitude * np.sin(2 * np.pi * hertz * t)).astype(np.float32)


def peak_hz(wave: np.ndarray, rate: int) -> float:
    """The frequency of the largest FFT bin."""
    spectrum = np.abs(np.fft.rfft(wave * np.hanning(len(wave))))
    return float(np.fft.rfftfreq(len(wave), 1 / rate)[int(np.argmax(spectrum))])


def encode_audio_pyav(wave: np.ndarray, rate: int, *, fmt: str, codec: str, channels: int = 1) -> bytes:
    """A float wave encoded with PyAV (a container soundfile does not read, e.g. Matroska)."""
    import av

    layout = "mono" if channels == 1 else "stereo"
    planar = np.ascontiguousarray(np.repeat(wave[None, :], channels, axis=0), dtype=np.float32)
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=fmt) as out:
        stream = out.add_stream(codec, rate=rate, layout=layout)
        frame = av.AudioFrame.from_ndarray(planar, format="fltp", layout=layout)
        frame.sample_rate = rate
        frame.pts = 0
        out.mux(stream.encode(frame))
        out.mux(stream.encode(None))
    return buf.getvalue()


def video_frames(count: int, height: int = 16, width: int = 16, seed: int = 0) -> np.ndarray:
    """Frames that tell apart: frame i has value 10 * i in channel 0 and noise elsewhere."""
    rng = np.random.default_rng(seed)
    frames = rng.integers(0, 256, (count, height, width, 3), dtype=np.uint8)
    frames[..., 0] = (np.arange(count) * 10 % 256).astype(np.uint8)[:, None, None]
    return frames


def frame_ids(frames: np.ndarray) -> list[int]:
    """Which frames of `video_frames` these are (by their channel-0 value)."""
    return [int(f[0, 0, 0]) // 10 for f in frames]
