"""Arrays -> file bytes, losslessly where it matters: PNG, 16-bit WAV, ffv1 video in Matroska.

Used to send canonical media to an inference server as `data:` URLs (so it decodes the very
pixels the trainer sees) and by the synthetic data generator. Image and video round trips are
exact; audio comes back within one 16-bit step (1/32768).
"""

from __future__ import annotations

import base64
import io
import wave
from fractions import Fraction

import numpy as np
from PIL import Image

from relax_hpc.media.items import MediaItem

MIME = {"image": "image/png", "audio": "audio/wav", "video": "video/x-matroska"}


def encode_image_png(arr: np.ndarray) -> bytes:
    """uint8 (H, W, 3) RGB -> PNG bytes."""
    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(arr, dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def encode_audio_wav(wave_: np.ndarray, rate: int) -> bytes:
    """Mono float [-1, 1] -> 16-bit PCM WAV.

    Scaled by 32768 (and clipped at 32767) because readers (soundfile, PyAV) divide by 32768:
    the round trip then errs by at most half a step, where scaling by 32767 would err by 1.5.
    """
    pcm = np.clip(np.rint(np.asarray(wave_, dtype=np.float64) * 32768.0), -32768, 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(int(rate))
        w.writeframes(pcm.tobytes())
    return buf.getvalue()


def encode_video_mkv(frames: np.ndarray, fps: float) -> bytes:
    """uint8 (T, H, W, 3) RGB -> lossless ffv1 (RGB planes, no YUV conversion) in Matroska.

    Written bit-exact (no random segment id, no date), so the same frames give the same bytes.
    """
    import av

    frames = np.ascontiguousarray(frames, dtype=np.uint8)
    rate = Fraction(fps).limit_denominator(1001)
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="matroska", options={"fflags": "+bitexact"}) as out:
        stream = out.add_stream("ffv1", rate=rate)
        stream.height, stream.width = frames.shape[1], frames.shape[2]
        stream.pix_fmt = "bgr0"  # ffv1 stores RGB losslessly only in this layout
        stream.codec_context.time_base = 1 / rate
        for i, arr in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(arr, format="rgb24")
            frame.pts = i
            frame.time_base = stream.codec_context.time_base
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))
    return buf.getvalue()


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


def encode_item(item: MediaItem) -> tuple[bytes, str]:
    """The file bytes of a canonical item and their MIME type."""
    if item.kind == "image":
        return encode_image_png(item.data), MIME["image"]
    if item.kind == "audio":
        return encode_audio_wav(item.data, int(item.rate)), MIME["audio"]
    return encode_video_mkv(item.data, item.rate), MIME["video"]


def item_data_url(item: MediaItem) -> str:
    return data_url(*encode_item(item))
