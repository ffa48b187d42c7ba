"""Decompression bombs: media whose few compressed bytes stand for gigabytes are refused from
their headers, before anything is decoded; what is decoded takes no whole-image or all-channel
copies; a MemoryError drops the row instead of stopping the load (relax_hpc/media/decode.py,
load.py, relax_hpc/data/dataset.py).

"Before decoding" is checked by counting calls into the decoder (Pillow's `Image.load`,
soundfile's `read`, the video's decoding pass), "no copies" by tracemalloc's peak, which numpy's
arrays report to.
"""

from __future__ import annotations

import inspect
import io
import json
import struct
import tracemalloc
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile
from media_samples import png_bytes, sine, video_frames
from PIL import Image, ImageFile

from relax_hpc.data.dataset import load_dataset
from relax_hpc.media import decode
from relax_hpc.media.canonical import Geometry
from relax_hpc.media.decode import MAX_AUDIO_CHANNELS, MAX_DECODED_BYTES, decode_audio, decode_image, decode_video
from relax_hpc.media.encode import encode_video_mkv
from relax_hpc.media.items import MediaError, PromptMedia
from relax_hpc.media.load import load_media
from relax_hpc.spec.schema import DataSpec

GEOM = Geometry(patch=8, merge=2, temporal=2, min_pixels=16 * 16, max_pixels=64 * 64, audio_rate=16000)


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def black_png(width: int, height: int, bit_depth: int, color_type: int = 0, channels: int = 1) -> bytes:
    """A valid PNG of zeros written row by row (Pillow would hold the whole image to save it)."""
    row = bytes(1 + (width * channels * bit_depth + 7) // 8)  # filter byte 0, then the zero pixels
    packer = zlib.compressobj(9)
    idat = b"".join(packer.compress(row * 500) for _ in range(height // 500))
    idat += packer.compress(row * (height % 500)) + packer.flush()
    header = struct.pack(">IIBBBBB", width, height, bit_depth, color_type, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")


@pytest.fixture
def pillow_loads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """The size of every image file Pillow decodes (Image.load, once per image) from now on."""
    sizes: list[tuple[int, int]] = []
    seen: set[int] = set()
    original = Image.Image.load

    def load(self: Image.Image) -> Any:
        if isinstance(self, ImageFile.ImageFile) and id(self) not in seen:  # opened, not made to save
            seen.add(id(self))
            sizes.append(self.size)
        return original(self)

    monkeypatch.setattr(Image.Image, "load", load)
    return sizes


def _peak_bytes(fn: Callable[[], Any]) -> tuple[Any, int]:
    tracemalloc.start()
    try:
        out = fn()
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


# ------------------------------------------------------------------------------------------ images


def test_a_small_png_of_a_huge_image_is_refused_before_pillow_decodes_it(pillow_loads: list) -> None:
    # 9000 x 9000 = 81 megapixels, under Pillow's own limit (89 M): 1 byte a pixel in Pillow and
    # 3 in the RGB array make 324 MB from about 10 KB.
    bomb = black_png(9000, 9000, bit_depth=1)
    assert len(bomb) < 20_000 and Image.open(io.BytesIO(bomb)).size == (9000, 9000)
    assert 9000 * 9000 < Image.MAX_IMAGE_PIXELS
    with pytest.raises(MediaError, match=r"^too large to decode: a 9000x9000 1 image would take 309 MiB decoded, "
                                         r"over the 256 MiB limit; downscale it"):
        decode_image(bomb)
    assert pillow_loads == []
    # The same file smaller decodes, so the count above is a real one.
    assert decode_image(black_png(300, 200, bit_depth=1)).shape == (200, 300, 3)
    assert pillow_loads == [(300, 200)]


def test_the_image_limit_counts_pillows_pixels_and_the_rgb_array(pillow_loads: list) -> None:
    png = png_bytes(np.zeros((100, 100, 3), np.uint8))  # RGB: Pillow keeps 4 bytes a pixel, the array 3
    with pytest.raises(MediaError, match="too large to decode"):
        decode_image(png, max_decoded_bytes=100 * 100 * 7 - 1)
    assert pillow_loads == []
    assert decode_image(png, max_decoded_bytes=100 * 100 * 7).shape == (100, 100, 3)


def test_a_16_bit_image_is_converted_without_whole_image_int64_copies() -> None:
    height, width = 1200, 1000
    grey = np.full((height, width), 0xABCD, np.uint16)
    grey[0, :3] = (0, 0x00FF, 0xFFFF)
    png = png_bytes(Image.fromarray(grey))
    rgb, peak = _peak_bytes(lambda: decode_image(png))
    assert rgb.dtype == np.uint8 and rgb.shape == (height, width, 3)
    assert rgb[0, :3, 0].tolist() == [0, 0, 0xFF] and (rgb[1:] == 0xAB).all()  # the top 8 bits
    # uint16 copy (2) + top bits (1) + RGB (3) + Pillow's bytes (2): an int64 copy alone is 8.
    assert peak < 9 * height * width, peak


# ------------------------------------------------------------------------------------------ video


@pytest.fixture
def video_decodes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The frame count of every video decoding pass (the demux-only first pass is not one)."""
    counts: list[int] = []
    original = decode._decode_picks

    def spy(data: bytes, wanted: list[int], *rest: Any) -> np.ndarray:
        counts.append(len(wanted))
        return original(data, wanted, *rest)

    monkeypatch.setattr(decode, "_decode_picks", spy)
    return counts


def _mp4(frames: int, width: int, height: int, rate: int) -> bytes:
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        frame = av.VideoFrame.from_ndarray(np.zeros((height, width, 3), np.uint8), format="rgb24")
        for i in range(frames):
            frame.pts = i
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))
    return buf.getvalue()


def test_a_small_video_of_many_large_frames_is_refused_before_decoding(video_decodes: list[int]) -> None:
    # 22 black 2048x2048 frames at 2 fps: the default 2 fps keeps all 22, 23 frames of 12 MiB
    # (the kept ones and the one being converted) from about 150 KB.
    bomb = _mp4(22, 2048, 2048, rate=2)
    assert len(bomb) < 300_000
    with pytest.raises(MediaError, match=r"too large to decode: 22 frames of 2048x2048 would take 276 MiB decoded, "
                                         r"over the 256 MiB limit; lower \[data\] max_frames or video_fps"):
        decode_video(bomb, fps=2.0, max_frames=32)
    assert video_decodes == []
    # Fewer frames fit: the same clip with max_frames = 8 decodes (9 x 12 MiB).
    frames, _ = decode_video(bomb, fps=2.0, max_frames=8)
    assert frames.shape == (8, 2048, 2048, 3) and video_decodes == [8]


def test_the_video_limit_is_the_chosen_frames_and_one_more(video_decodes: list[int]) -> None:
    clip = encode_video_mkv(video_frames(8, 32, 48), 8)
    needed = (8 + 1) * 32 * 48 * 3
    limits = DataSpec(path="-", video_fps=8.0)
    with pytest.raises(MediaError, match="too large to decode") as e:
        load_media(clip, "video", base_dir=Path("."), geometry=GEOM, limits=limits, max_decoded_bytes=needed - 1)
    assert e.value.detail.startswith("bytes cell") and video_decodes == []
    [item] = load_media(clip, "video", base_dir=Path("."), geometry=GEOM, limits=limits, max_decoded_bytes=needed)
    assert item.data.shape[0] == 8 and video_decodes == [8]


# ------------------------------------------------------------------------------------------ audio


@pytest.fixture
def soundfile_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The channel count of every soundfile read from now on."""
    channels: list[int] = []
    original = soundfile.SoundFile.read

    def read(self: soundfile.SoundFile, *args: Any, **kwargs: Any) -> Any:
        channels.append(self.channels)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(soundfile.SoundFile, "read", read)
    return channels


def _encoded(wave: np.ndarray, rate: int, fmt: str, subtype: str | None = None) -> bytes:
    buf = io.BytesIO()
    soundfile.write(buf, wave, rate, format=fmt, subtype=subtype)
    return buf.getvalue()


def test_audio_is_decoded_in_blocks_and_mixed_to_mono_as_it_goes() -> None:
    # 2 s of 8-channel 192 kHz FLAC: 12 MiB as float32 at once, a few KB compressed.
    rate, channels = 192_000, 8
    wave = np.zeros((2 * rate, channels), np.float32)
    wave[:, 0] = sine(440, rate, seconds=2.0, amplitude=0.8)
    flac = _encoded(wave, rate, "FLAC")
    assert len(flac) < 200_000
    mono, peak = _peak_bytes(lambda: decode_audio(flac, sample_rate=16_000))
    assert mono.shape == (2 * 16_000,) and mono.dtype == np.float32
    assert 0.09 < float(np.abs(mono).max()) < 0.11  # channel 0's 0.8 shared among 8 channels
    # A block (2 MiB) and the mono wave (1.5 MiB) joined once; reading it whole is 12 MiB.
    assert peak < wave.nbytes / 2, (peak, wave.nbytes)


def test_more_audio_channels_than_the_cap_are_refused_before_reading(soundfile_reads: list[int]) -> None:
    wav = _encoded(np.zeros((100, MAX_AUDIO_CHANNELS + 4), np.float32), 16_000, "WAV", "PCM_16")
    with pytest.raises(MediaError, match=rf"^too many audio channels: {MAX_AUDIO_CHANNELS + 4} channels; at most "
                                         rf"{MAX_AUDIO_CHANNELS} are read: mix it down first"):
        decode_audio(wav, sample_rate=16_000)
    assert soundfile_reads == []
    decode_audio(_encoded(np.zeros((100, MAX_AUDIO_CHANNELS), np.float32), 16_000, "WAV", "PCM_16"),
                 sample_rate=16_000)
    assert soundfile_reads[0] == MAX_AUDIO_CHANNELS


def test_audio_over_the_decoded_limit_is_refused_from_its_header(soundfile_reads: list[int]) -> None:
    stereo = _encoded(np.zeros((48_000, 2), np.float32), 48_000, "FLAC")  # 1 s: 384,000 bytes as float32
    with pytest.raises(MediaError, match=r"too large to decode: bytes cell \(\d+ bytes\): 1.0 s of 2-channel audio"):
        load_media(stereo, "audio", base_dir=Path("."), geometry=GEOM, max_decoded_bytes=383_999)
    assert soundfile_reads == []
    assert inspect.signature(load_media).parameters["max_decoded_bytes"].default == MAX_DECODED_BYTES
    load_media(stereo, "audio", base_dir=Path("."), geometry=GEOM, max_decoded_bytes=384_000)
    assert soundfile_reads


# ------------------------------------------------------------------------------------------ dataset


class _Tokenizer:
    """Word ids for the loader; the chat template lists the parts."""

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool, tokenize: bool) -> str:
        content = messages[-1]["content"]
        return " ".join(p.get("text", f"<{p['type']}>") for p in content) if isinstance(content, list) else content

    def __call__(self, text: str, add_special_tokens: bool) -> dict[str, list[int]]:
        return {"input_ids": list(range(1, len(text.split()) + 1))}


class _Reader:
    def geometry(self) -> Geometry:
        return GEOM

    def expand(self, prompt_ids: Sequence[int], media: PromptMedia) -> list[int]:
        return [*prompt_ids, *([0] * len(media.items))]


@pytest.fixture
def out_of_memory_at(monkeypatch: pytest.MonkeyPatch) -> Iterator[set[tuple[int, int]]]:
    """Pillow runs out of memory decoding images of the sizes put in the set."""
    sizes: set[tuple[int, int]] = set()
    original = Image.Image.load

    def load(self: Image.Image) -> Any:
        if self.size in sizes:
            raise MemoryError
        return original(self)

    monkeypatch.setattr(Image.Image, "load", load)
    yield sizes


def test_a_memory_error_while_decoding_drops_the_row_and_the_load_goes_on(
        tmp_path: Path, out_of_memory_at: set[tuple[int, int]]) -> None:
    (tmp_path / "small.png").write_bytes(png_bytes(np.zeros((32, 32, 3), np.uint8)))
    (tmp_path / "large.png").write_bytes(png_bytes(np.zeros((64, 96, 3), np.uint8)))
    out_of_memory_at.add((96, 64))
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"what is it {k}", "answer": "x", "image": name}) + "\n"
                            for k, name in enumerate(["small.png", "large.png", "small.png"])))
    rows, report = load_dataset(DataSpec(path=str(data), prompt_key="prompt", label_key="answer",
                                         max_prompt_tokens=64, image_key="image"), _Tokenizer(), _Reader())
    assert [r.prompt_text for r in rows] == ["<image> what is it 0", "<image> what is it 2"]
    assert report.dropped == {"out of memory while decoding in 'image'": 1}
    assert "large.png" in report.first["out of memory while decoding in 'image'"]
    # Loading again (a resume) meets the row again and drops it the same way.
    assert load_dataset(DataSpec(path=str(data), prompt_key="prompt", label_key="answer", max_prompt_tokens=64,
                                 image_key="image"), _Tokenizer(), _Reader())[1].dropped == report.dropped
