"""decode_image / decode_video / decode_audio on small synthetic media (relax_hpc/media/decode.py)."""

from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile
from media_samples import encode_audio_pyav, frame_ids, peak_hz, png_bytes, sine, video_frames
from PIL import Image

from relax_hpc.media.decode import decode_audio, decode_image, decode_video
from relax_hpc.media.encode import encode_audio_wav, encode_image_png, encode_video_mkv
from relax_hpc.media.items import MediaError

# ------------------------------------------------------------------------------------------ image


def test_rgb_png_and_jpeg() -> None:
    arr = np.random.default_rng(0).integers(0, 256, (5, 7, 3), dtype=np.uint8)
    out = decode_image(png_bytes(arr))
    assert out.dtype == np.uint8 and out.shape == (5, 7, 3) and (out == arr).all()
    jpeg = decode_image(png_bytes(np.full((8, 8, 3), 128, np.uint8), "JPEG"))
    assert jpeg.shape == (8, 8, 3) and abs(int(jpeg.mean()) - 128) <= 2


def test_greyscale_palette_and_16_bit() -> None:
    grey = np.arange(12, dtype=np.uint8).reshape(3, 4) * 20
    out = decode_image(png_bytes(grey))
    assert out.shape == (3, 4, 3) and (out == grey[..., None]).all()

    palette = Image.new("P", (4, 2))
    palette.putpalette([255, 0, 0, 0, 0, 255] + [0] * 762)
    palette.putpixel((1, 0), 1)
    out = decode_image(png_bytes(palette))
    assert tuple(out[0, 0]) == (255, 0, 0) and tuple(out[0, 1]) == (0, 0, 255)

    wide = Image.fromarray((np.arange(4, dtype=np.uint16) * 20000).reshape(1, 4))  # I;16: would clip at 255
    assert decode_image(png_bytes(wide))[0, :, 0].tolist() == [0, 78, 156, 234]


def test_transparency_composited_on_white() -> None:
    rgba = np.zeros((2, 2, 4), np.uint8)
    rgba[0, 0] = (255, 0, 0, 255)  # opaque red
    rgba[0, 1] = (255, 0, 0, 0)  # transparent: white shows
    rgba[1, 0] = (0, 0, 0, 128)  # half black over white
    out = decode_image(png_bytes(rgba))
    assert out.shape == (2, 2, 3)
    assert tuple(out[0, 0]) == (255, 0, 0) and tuple(out[0, 1]) == (255, 255, 255)
    assert abs(int(out[1, 0, 0]) - 127) <= 1

    palette = Image.new("P", (2, 1))
    palette.putpalette([0, 0, 0, 0, 255, 0] + [0] * 762)
    palette.putpixel((1, 0), 1)
    palette.info["transparency"] = 0  # index 0 is transparent
    assert decode_image(png_bytes(palette, transparency=0)).tolist() == [[[255, 255, 255], [0, 255, 0]]]


def test_exif_orientation_applied() -> None:
    arr = np.zeros((2, 4, 3), np.uint8)  # 4 wide, 2 high
    image = Image.fromarray(arr)
    exif = image.getexif()
    exif[0x0112] = 6  # "rotate 90 CW to display"
    out = decode_image(png_bytes(image, "JPEG", exif=exif.tobytes()))
    assert out.shape == (4, 2, 3)


@pytest.mark.parametrize("data", [b"", b"not an image", encode_image_png(np.zeros((4, 4, 3), np.uint8))[:40]])
def test_corrupt_image(data: bytes) -> None:
    with pytest.raises(MediaError) as e:
        decode_image(data)
    assert e.value.reason == "corrupt image" and e.value.detail


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_image_too_large(monkeypatch: pytest.MonkeyPatch) -> None:
    data = encode_image_png(np.zeros((32, 32, 3), np.uint8))  # 1024 pixels
    for limit in (600, 100):  # over the limit (we refuse), over twice it (Pillow refuses)
        monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", limit)
        with pytest.raises(MediaError) as e:
            decode_image(data)
        assert e.value.reason == "image too large"


# ------------------------------------------------------------------------------------------ video


def test_video_all_frames_when_fps_is_high() -> None:
    frames = video_frames(8)
    out, rate = decode_video(encode_video_mkv(frames, 8), fps=30, max_frames=100)
    assert out.dtype == np.uint8 and (out == frames).all() and rate == pytest.approx(8.0)


def test_video_sampled_at_fps() -> None:
    frames = video_frames(16)  # 2 s at 8 fps
    out, rate = decode_video(encode_video_mkv(frames, 8), fps=2, max_frames=100)
    assert len(out) == 4 and rate == pytest.approx(2.0)
    ids = frame_ids(out)
    assert np.diff(ids).tolist() == [4, 4, 4]  # 0.5 s apart
    assert ids[0] in (1, 2)  # centred: the grid starts half a step in


def test_video_frame_cap_spans_the_clip() -> None:
    frames = video_frames(24)  # 3 s at 8 fps
    out, rate = decode_video(encode_video_mkv(frames, 8), fps=8, max_frames=6)
    ids = frame_ids(out)
    assert len(out) == 6 and rate == pytest.approx(2.0)
    assert np.diff(ids).tolist() == [4] * 5 and ids[0] <= 2 and ids[-1] >= 21


def test_video_single_frame_and_odd_size() -> None:
    frames = video_frames(1, height=7, width=9)
    out, rate = decode_video(encode_video_mkv(frames, 5), fps=2, max_frames=4)
    assert out.shape == (1, 7, 9, 3) and (out == frames).all() and rate == pytest.approx(5.0)


def test_video_longer_than_limit() -> None:
    data = encode_video_mkv(video_frames(16), 4)  # 4 s
    with pytest.raises(MediaError) as e:
        decode_video(data, fps=2, max_frames=8, max_seconds=3)
    assert e.value.reason == "longer than 3 s"
    assert len(decode_video(data, fps=2, max_frames=8, max_seconds=5)[0]) == 8


@pytest.mark.parametrize(
    "data",
    [b"", b"garbage" * 10, encode_video_mkv(video_frames(4), 4)[:60], encode_audio_wav(sine(440, 8000), 8000)],
)
def test_corrupt_video(data: bytes) -> None:
    with pytest.raises(MediaError) as e:
        decode_video(data, fps=2, max_frames=4)
    assert e.value.reason == "corrupt video" and e.value.detail


# ------------------------------------------------------------------------------------------ audio


def test_wav_resampled_44k_to_16k_keeps_the_tone() -> None:
    buf = io.BytesIO()
    soundfile.write(buf, sine(1000, 44100), 44100, format="WAV", subtype="FLOAT")
    out = decode_audio(buf.getvalue(), sample_rate=16000)
    assert out.dtype == np.float32 and out.shape == (16000,)
    assert peak_hz(out, 16000) == pytest.approx(1000, abs=2)
    assert np.abs(out).max() == pytest.approx(0.5, abs=0.01)


def test_stereo_downmixed_by_mean() -> None:
    left, right = sine(500, 16000, amplitude=0.6), sine(2000, 16000, amplitude=0.2)
    buf = io.BytesIO()
    soundfile.write(buf, np.stack([left, right], axis=1), 16000, format="FLAC")
    out = decode_audio(buf.getvalue(), sample_rate=16000)
    assert out.shape == (16000,)
    np.testing.assert_allclose(out, (left + right) / 2, atol=2 / 32768)  # FLAC is 16-bit here


def test_pyav_fallback_for_containers_soundfile_cannot_read() -> None:
    data = encode_audio_pyav(sine(250, 22050, amplitude=0.4), 22050, fmt="matroska", codec="flac", channels=2)
    with pytest.raises(soundfile.LibsndfileError):
        soundfile.read(io.BytesIO(data))
    out = decode_audio(data, sample_rate=16000)
    assert out.dtype == np.float32 and out.shape == (16000,)
    assert peak_hz(out, 16000) == pytest.approx(250, abs=2)


def test_audio_longer_than_limit() -> None:
    for data in (
        encode_audio_wav(sine(440, 8000, seconds=3), 8000),
        encode_audio_pyav(sine(440, 8000, seconds=3), 8000, fmt="matroska", codec="flac"),
    ):
        with pytest.raises(MediaError) as e:
            decode_audio(data, sample_rate=8000, max_seconds=2)
        assert e.value.reason == "longer than 2 s"


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"RIFF....WAVEfmt garbage",
        encode_audio_wav(sine(440, 8000), 8000)[:30],
        encode_image_png(np.zeros((4, 4, 3), np.uint8)),
    ],
)
def test_corrupt_audio(data: bytes) -> None:
    with pytest.raises(MediaError) as e:
        decode_audio(data, sample_rate=16000)
    assert e.value.reason == "corrupt audio" and e.value.detail


def test_non_finite_audio_refused() -> None:
    buf = io.BytesIO()
    soundfile.write(buf, np.array([0.1, np.nan, 0.2], np.float32), 8000, format="WAV", subtype="FLOAT")
    with pytest.raises(MediaError) as e:
        decode_audio(buf.getvalue(), sample_rate=8000)
    assert e.value.reason == "corrupt audio"


def test_video_h264_mp4_with_b_frames() -> None:
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=10)
        stream.width = stream.height = 32
        stream.pix_fmt = "yuv420p"
        for i in range(30):  # 3 s; frame i is flat grey 8 * i
            frame = av.VideoFrame.from_ndarray(np.full((32, 32, 3), 8 * i, np.uint8), format="rgb24")
            frame.pts = i
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))
    frames, rate = decode_video(buf.getvalue(), fps=2, max_frames=32)
    assert frames.shape == (6, 32, 32, 3) and rate == pytest.approx(2.0)
    assert [round(float(f.mean()) / 8) for f in frames] == [2, 7, 12, 17, 22, 27]
