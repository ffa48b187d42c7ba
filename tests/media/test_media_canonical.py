"""Fitting media to a model's grid (relax_hpc/media/canonical.py), checked against transformers."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from media_samples import peak_hz, sine
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize

from relax_hpc.media.canonical import Geometry, fit_audio, fit_image, fit_video, smart_resize
from relax_hpc.media.items import MediaError

QWEN = Geometry(patch=14, merge=2, temporal=2, min_pixels=56 * 56, max_pixels=28 * 28 * 1280)
TINY = Geometry(patch=8, merge=2, temporal=2, min_pixels=16 * 16, max_pixels=64 * 64)


def test_smart_resize_matches_transformers() -> None:
    sides = [1, 3, 7, 13, 14, 27, 28, 29, 41, 55, 56, 57, 99, 100, 223, 224, 333, 480, 640, 1000, 1080, 1920, 4000]
    limits = [(56 * 56, 28 * 28 * 1280), (16 * 16, 64 * 64), (4 * 28 * 28, 16384 * 28 * 28), (1, 10**9)]
    checked = 0
    for (h, w), (low, high), factor in itertools.product(itertools.product(sides, sides), limits, (16, 28, 32)):
        if max(h, w) / min(h, w) > 200:
            continue
        assert smart_resize(h, w, factor, low, high) == hf_smart_resize(h, w, factor, low, high), (h, w, low, high)
        checked += 1
    assert checked > 4000


def test_smart_resize_refuses_extreme_aspect_ratio() -> None:
    with pytest.raises(MediaError) as e:
        smart_resize(10, 2010, 28, 56 * 56, 28 * 28 * 1280)
    assert e.value.reason == "aspect ratio over 200"
    assert smart_resize(10, 2000, 28, 56 * 56, 28 * 28 * 1280) == hf_smart_resize(10, 2000, 28, 56 * 56, 28 * 28 * 1280)


def test_geometry_is_checked() -> None:
    with pytest.raises(ValueError, match="min_pixels=10 is above max_pixels=5"):
        Geometry(patch=14, merge=2, temporal=2, min_pixels=10, max_pixels=5)
    with pytest.raises(ValueError, match="patch=0"):
        Geometry(patch=0, merge=2, temporal=2, min_pixels=1, max_pixels=5)


@pytest.mark.parametrize("geom", [QWEN, TINY], ids=["qwen", "tiny"])
@pytest.mark.parametrize("size", [(32, 32), (48, 40), (37, 91), (300, 17), (480, 640), (5, 5)])
def test_processor_does_not_resize_a_fitted_image(geom: Geometry, size: tuple[int, int]) -> None:
    arr = np.random.default_rng(sum(size)).integers(0, 256, (*size, 3), dtype=np.uint8)
    fitted = fit_image(arr, geom)
    assert fitted.dtype == np.uint8 and fitted.shape[2] == 3
    assert fitted.shape[0] % geom.factor == 0 and fitted.shape[1] % geom.factor == 0
    processor = Qwen2VLImageProcessorPil(
        patch_size=geom.patch,
        merge_size=geom.merge,
        temporal_patch_size=geom.temporal,
        size={"shortest_edge": geom.min_pixels, "longest_edge": geom.max_pixels},
    )
    out = processor(images=[fitted], return_tensors="np")
    t, gh, gw = out["image_grid_thw"][0].tolist()
    assert (t, gh * geom.patch, gw * geom.patch) == (1, *fitted.shape[:2])
    as_is = processor(images=[fitted], do_resize=False, return_tensors="np")
    np.testing.assert_array_equal(out["pixel_values"], as_is["pixel_values"])
    if fitted.shape != arr.shape:  # the control: the raw image would have been resized
        t, gh, gw = processor(images=[arr], return_tensors="np")["image_grid_thw"][0].tolist()
        assert (gh * geom.patch, gw * geom.patch) == fitted.shape[:2] != arr.shape[:2]


def test_fit_image_keeps_a_fitted_image_and_resizes_bicubic() -> None:
    arr = np.zeros((32, 32, 3), np.uint8)
    assert fit_image(arr, TINY) is arr
    wide = np.full((20, 50, 3), 200, np.uint8)
    out = fit_image(wide, TINY)
    assert out.shape == (16, 48, 3) and (out == 200).all()  # flat stays flat under bicubic


def test_fit_video_sizes_every_frame_and_pads_time() -> None:
    frames = np.stack([np.full((20, 30, 3), 10 * i, np.uint8) for i in range(5)])
    out = fit_video(frames, TINY)
    assert out.shape == (6, 16, 32, 3)
    assert [int(f.mean()) for f in out] == [0, 10, 20, 30, 40, 40]  # the last frame repeated
    already = np.zeros((4, 16, 16, 3), np.uint8)
    assert fit_video(already, TINY).shape == (4, 16, 16, 3)


def test_fit_audio_resamples_to_the_extractor_rate() -> None:
    wave = sine(440, 44100)
    out = fit_audio(wave, 44100, TINY)
    assert out.dtype == np.float32 and out.shape == (16000,)
    assert peak_hz(out, 16000) == pytest.approx(440, abs=2)
    same = sine(440, 16000)
    np.testing.assert_array_equal(fit_audio(same, 16000, TINY), same)
