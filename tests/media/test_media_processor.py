"""MediaProcessor and M-RoPE positions on the tiny multimodal models: placeholder expansion
agrees with the Hugging Face arithmetic, bad media are refused with reasons, positions do not
depend on padding, our video patches equal the HF image processor's, markup masking
(relax_hpc/media/processor.py, relax_hpc/media/positions.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from relax_hpc.media.items import MediaError, MediaItem, PromptMedia
from relax_hpc.media.positions import mrope_positions, rope_owner, rows_forward_kwargs, shared_prefix_positions
from relax_hpc.media.processor import MARKUP_FLOOR, MediaProcessor
from relax_hpc.models.hf import load_policy_model, load_tokenizer
from relax_hpc.models.tiny import write_tiny_model
from relax_hpc.models.tiny_mm import (
    AUDIO_END,
    AUDIO_PAD,
    AUDIO_START,
    IMAGE_PAD,
    TINY_MM_ARCHS,
    VIDEO_PAD,
    VISION_END,
    VISION_START,
    is_omni,
    mm_token_ids,
    write_tiny_multimodal,
)

# The tiny models' grid (tiny_mm): 8-pixel patches, 2x2 merged into one token, 2 frames per
# temporal patch; images between 16x16 and 64x64 pixels.
PATCH, MERGE, TEMPORAL = 8, 2, 2


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("processor")
    return {arch: write_tiny_multimodal(root / arch, arch, seed=0) for arch in TINY_MM_ARCHS}


@pytest.fixture(scope="module")
def processors(model_dirs: dict[str, Path]) -> dict[str, MediaProcessor]:
    return {arch: MediaProcessor(path) for arch, path in model_dirs.items()}


def _image(height: int, width: int, seed: int = 0) -> MediaItem:
    rng = np.random.default_rng(seed)
    return MediaItem("image", rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _video(frames: int, height: int = 32, width: int = 32) -> MediaItem:
    rng = np.random.default_rng(frames)
    return MediaItem("video", rng.integers(0, 256, (frames, height, width, 3), dtype=np.uint8), rate=2.0)


def _audio(samples: int, rate: int = 16000) -> MediaItem:
    return MediaItem("audio", (0.3 * np.sin(np.arange(samples) * 0.05)).astype(np.float32), rate=float(rate))


def _ids(arch: str, path: Path, kinds: list[str], text: str = "what?") -> list[int]:
    """A rendered user turn with one placeholder per kind, unexpanded."""
    tok = load_tokenizer(path)
    content = [*({"type": k} for k in kinds), {"type": "text", "text": text}]
    rendered = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                       tokenize=False)
    return tok(rendered, add_special_tokens=False)["input_ids"]


def _count(ids: list[int], arch: str, token: str) -> int:
    return ids.count(mm_token_ids(arch)[token])


@pytest.mark.parametrize("arch", TINY_MM_ARCHS)
@pytest.mark.parametrize("size", [(32, 32), (16, 48), (64, 48)])
def test_image_tokens_are_the_hf_grid_over_merge_squared(
    arch: str, size: tuple[int, int], processors: dict[str, MediaProcessor], model_dirs: dict[str, Path]
) -> None:
    processor, image = processors[arch], _image(*size)
    assert processor.image_processor is not None
    grid = processor.image_processor(images=[image.data], return_tensors="pt")["image_grid_thw"]
    assert grid.tolist() == [[1, size[0] // PATCH, size[1] // PATCH]]  # fitted: HF does not resize
    ids = _ids(arch, model_dirs[arch], ["image"])
    expanded = processor.expand(ids, PromptMedia((image,)))
    assert _count(expanded, arch, IMAGE_PAD) == int(grid.prod()) // MERGE**2 == processor.token_count(image)
    assert len(expanded) == len(ids) - 1 + processor.token_count(image)
    # Everything but the placeholder run is kept in order.
    pad = mm_token_ids(arch)[IMAGE_PAD]
    assert [t for t in expanded if t != pad] == [t for t in ids if t != pad]


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen2_5_omni", "qwen3_omni"])
@pytest.mark.parametrize("frames", [1, 2, 3, 4, 5])
def test_video_tokens_round_frames_up_to_the_temporal_patch(
    arch: str, frames: int, processors: dict[str, MediaProcessor], model_dirs: dict[str, Path]
) -> None:
    processor, video = processors[arch], _video(frames, 32, 48)
    per_step = (32 // PATCH) * (48 // PATCH) // MERGE**2  # 4 x 6 patches -> 6 tokens
    steps = -(-frames // TEMPORAL)
    expanded = processor.expand(_ids(arch, model_dirs[arch], ["video"]), PromptMedia((video,)))
    assert _count(expanded, arch, VIDEO_PAD) == steps * per_step
    tensors = processor.batch_media([PromptMedia((video,))]).tensors
    assert tensors["video_grid_thw"].tolist() == [[steps, 32 // PATCH, 48 // PATCH]]
    assert tensors["pixel_values_videos"].shape == (steps * 4 * 6, 3 * TEMPORAL * PATCH * PATCH)


def _hf_audio_tokens(arch: str, frames: int) -> int:
    from transformers.models.qwen2_5_omni import processing_qwen2_5_omni
    from transformers.models.qwen3_omni_moe import processing_qwen3_omni_moe

    module: Any = processing_qwen3_omni_moe if arch == "qwen3_omni" else processing_qwen2_5_omni
    return int(module._get_feat_extract_output_lengths(torch.tensor([frames]))[0])


@pytest.mark.parametrize("arch", ["qwen2_5_omni", "qwen3_omni"])
@pytest.mark.parametrize("samples", [480, 1000, 16000, 16159, 16160, 40037, 48000])
def test_audio_tokens_match_transformers(
    arch: str, samples: int, processors: dict[str, MediaProcessor], model_dirs: dict[str, Path]
) -> None:
    processor, audio = processors[arch], _audio(samples)
    assert processor.feature_extractor is not None
    frames = samples // processor.feature_extractor.hop_length  # Whisper: one frame per hop
    expanded = processor.expand(_ids(arch, model_dirs[arch], ["audio"]), PromptMedia((audio,)))
    assert _count(expanded, arch, AUDIO_PAD) == _hf_audio_tokens(arch, frames) >= 1
    tensors = processor.batch_media([PromptMedia((audio,))]).tensors
    assert tensors["feature_attention_mask"].sum().item() == frames


def test_audio_features_do_not_depend_on_the_batch(processors: dict[str, MediaProcessor]) -> None:
    processor = processors["qwen3_omni"]
    short, long = _audio(8000), _audio(24000)
    alone = processor.batch_media([PromptMedia((short,))]).tensors
    batched = processor.batch_media([PromptMedia((long,)), None, PromptMedia((short,))]).tensors
    assert batched["input_features"].shape[0] == 2 and batched["feature_attention_mask"].sum(-1).tolist() == [150, 50]
    frames = alone["input_features"].shape[-1]
    assert torch.equal(batched["input_features"][1, :, :frames], alone["input_features"][0])
    assert not batched["input_features"][1, :, frames:].any()  # padded with zeros beyond the clip


@pytest.mark.parametrize("arch", TINY_MM_ARCHS)
def test_placeholder_and_item_counts_must_match(
    arch: str, processors: dict[str, MediaProcessor], model_dirs: dict[str, Path]
) -> None:
    processor, image = processors[arch], _image(32, 32)
    two_placeholders = _ids(arch, model_dirs[arch], ["image", "image"])
    with pytest.raises(MediaError) as e:
        processor.expand(two_placeholders, PromptMedia((image,)))
    assert e.value.reason == "more image placeholders than images"
    with pytest.raises(MediaError) as e:
        processor.expand(_ids(arch, model_dirs[arch], ["image"]), PromptMedia((image, _image(16, 16))))
    assert e.value.reason == "more images than image placeholders" and "chat template" in e.value.detail
    with pytest.raises(MediaError, match="more images than image placeholders"):
        processor.expand(_ids(arch, model_dirs[arch], []), PromptMedia((image,)))
    assert _count(processor.expand(two_placeholders, PromptMedia((image, image))), arch, IMAGE_PAD) == 8


@pytest.mark.parametrize("arch", TINY_MM_ARCHS)
def test_unfitted_image_is_refused(
    arch: str, processors: dict[str, MediaProcessor], model_dirs: dict[str, Path]
) -> None:
    processor, unfitted = processors[arch], _image(30, 32)  # 30 is not a multiple of 16
    with pytest.raises(MediaError) as e:
        processor.expand(_ids(arch, model_dirs[arch], ["image"]), PromptMedia((unfitted,)))
    assert e.value.reason == "image not fitted to the patch grid" and "30x32" in e.value.detail
    with pytest.raises(MediaError, match="not fitted to the patch grid"):
        processor.batch_media([PromptMedia((unfitted,))])


@pytest.mark.parametrize(("arch", "item", "explains"), [
    ("qwen2_5_vl", _audio(16000), "audio not read by qwen2_5_vl"),
    ("qwen3_vl", _audio(16000), "audio not read by qwen3_vl"),
    ("qwen3_vl", _video(2), "Qwen3-VL video needs per-frame timestamp text.*Qwen3-Omni model for video"),
])
def test_kind_the_family_does_not_read(
    arch: str, item: MediaItem, explains: str, processors: dict[str, MediaProcessor], model_dirs: dict[str, Path]
) -> None:
    ids = _ids(arch, model_dirs[arch], ["image"])  # the template cannot render audio for a VL model
    with pytest.raises(MediaError, match=explains) as e:
        processors[arch].expand(ids, PromptMedia((item,)))
    assert e.value.reason == f"{item.kind} not read by {processors[arch].family.model_type}"


@pytest.mark.parametrize("arch", ["qwen2_5_omni", "qwen3_omni"])
def test_short_or_wrong_rate_audio_is_refused(arch: str, processors: dict[str, MediaProcessor]) -> None:
    processor = processors[arch]
    with pytest.raises(MediaError) as e:
        processor.token_count(_audio(399))
    assert e.value.reason == "audio too short" and "399 samples" in e.value.detail
    with pytest.raises(MediaError) as e:
        processor.batch_media([PromptMedia((_audio(16000, rate=8000),))])
    assert e.value.reason == "audio at the wrong rate" and "16000 Hz" in e.value.detail


def _mixed(arch: str, path: Path, processor: MediaProcessor) -> list[tuple[list[int], PromptMedia]]:
    kinds = processor.family.kinds
    cases = [["image"], []]
    if "video" in kinds:
        cases.append(["video"])
    if "audio" in kinds:
        cases += [["audio"], ["image", "audio"]]
    items = {"image": _image(32, 48), "video": _video(4, 16, 32), "audio": _audio(12000)}
    out = []
    for n, kinds_ in enumerate(cases):
        media = PromptMedia(tuple(items[k] for k in kinds_))
        out.append((processor.expand(_ids(arch, path, kinds_, "q" * (n + 1)), media), media))
    return out


@pytest.mark.parametrize("arch", TINY_MM_ARCHS)
@pytest.mark.parametrize("side", ["left", "right"])
def test_positions_do_not_depend_on_padding(
    arch: str, side: str, processors: dict[str, MediaProcessor], model_dirs: dict[str, Path]
) -> None:
    processor, model = processors[arch], load_policy_model(model_dirs[arch]).eval()
    rows = _mixed(arch, model_dirs[arch], processor)
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    spans = []
    for i, (ids, _) in enumerate(rows):
        start = width - len(ids) if side == "left" else 0
        input_ids[i, start : start + len(ids)] = torch.tensor(ids)
        mask[i, start : start + len(ids)] = 1
        spans.append(slice(start, start + len(ids)))
    media = processor.batch_media([m for _, m in rows])
    batch, deltas = mrope_positions(model, processor, input_ids, mask, media)
    assert batch.shape == (3, len(rows), width)
    for i, (ids, m) in enumerate(rows):
        one = torch.tensor([ids])
        alone, alone_delta = mrope_positions(model, processor, one, torch.ones_like(one), processor.batch_media([m]))
        assert torch.equal(batch[:, i, spans[i]], alone[:, 0]), (i, [x.kind for x in m.items])
        assert int(deltas[i]) == int(alone_delta[0])
    # Media place tokens on a grid: positions are not their indices (else the test would prove nothing).
    image_row = rows[0][0]
    alone, _ = mrope_positions(model, processor, torch.tensor([image_row]), torch.ones(1, len(image_row)),
                               processor.batch_media([rows[0][1]]))
    assert not torch.equal(alone[0, 0], torch.arange(len(image_row)))


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_omni"])
def test_own_video_patches_equal_the_hf_image_processor(arch: str, processors: dict[str, MediaProcessor]) -> None:
    processor, image = processors[arch], _image(32, 48, seed=3)
    assert processor.image_processor is not None
    hf = processor.image_processor(images=[image.data], return_tensors="np")["pixel_values"]
    ours = processor._pixels(np.stack([image.data, image.data]))  # HF repeats an image to the temporal patch
    assert ours.shape == hf.shape
    np.testing.assert_allclose(ours, hf, rtol=0, atol=1e-6)
    other = processor._pixels(np.stack([image.data, _image(32, 48, seed=4).data]))
    assert np.abs(other - hf).max() > 0.1  # the second frame does count


def test_text_model_is_refused(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path / "text", seed=0)
    with pytest.raises(ValueError, match=r"text-only model \(model_type 'qwen3'\).*qwen2_5_omni.*qwen2_5_vl.*"
                                         r"qwen3_omni_moe.*qwen3_vl") as e:
        MediaProcessor(path)
    assert "image_key" in str(e.value)  # says what to change


@pytest.mark.parametrize("arch", TINY_MM_ARCHS)
def test_mask_markup_floors_exactly_the_markup(arch: str, processors: dict[str, MediaProcessor]) -> None:
    processor, ids = processors[arch], mm_token_ids(arch)
    expected = [VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD] + ([AUDIO_START, AUDIO_END, AUDIO_PAD]
                                                                   if is_omni(arch) else [])
    assert processor.markup_ids == tuple(sorted(ids[t] for t in expected))
    vocab = len(ids) + 60
    logits = torch.randn(2, 3, vocab, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    masked = processor.mask_markup(logits)
    assert torch.equal(logits, before)  # not in place
    markup = torch.zeros(vocab, dtype=torch.bool)
    markup[list(processor.markup_ids)] = True
    assert (masked[..., markup] == MARKUP_FLOOR).all()
    assert torch.equal(masked[..., ~markup], logits[..., ~markup])
    assert torch.softmax(masked, -1)[..., markup].sum() == 0 and torch.isfinite(masked).all()


@pytest.mark.parametrize("arch", TINY_MM_ARCHS)
def test_a_batch_of_repeated_media_equals_hf_and_each_item_is_processed_once(
        arch: str, model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    processor = MediaProcessor(model_dirs[arch])  # its own cache
    assert processor.image_processor is not None
    a, b = _image(32, 48, seed=5), _image(16, 16, seed=6)
    a_again = MediaItem("image", a.data.copy())  # another object, the same pixels
    rows: list[PromptMedia | None] = [PromptMedia((a,)), PromptMedia((b,)), None, PromptMedia((a_again,))]
    if "video" in processor.family.kinds:
        v = _video(3)
        rows += [PromptMedia((v,)), PromptMedia((v,))]
    calls: list[int] = []
    real = processor.image_processor.__class__.__call__

    def counting(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(len(kwargs["images"]))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(processor.image_processor.__class__, "__call__", counting)
    tensors = processor.batch_media(rows).tensors
    assert calls == [1, 1]  # a and b, once each
    hf = real(processor.image_processor, images=[a.data, b.data, a.data], return_tensors="pt")
    assert torch.equal(tensors["pixel_values"], hf["pixel_values"].to(torch.float32))
    assert torch.equal(tensors["image_grid_thw"], hf["image_grid_thw"].to(torch.long))
    if "video" in processor.family.kinds:
        own = np.concatenate([processor._pixels(v.data)] * 2)
        assert np.array_equal(tensors["pixel_values_videos"].numpy(), own)
    again = processor.batch_media(rows).tensors  # the next micro-batch: nothing processed again
    assert calls == [1, 1] and all(torch.equal(again[k], tensors[k]) for k in tensors)


@pytest.mark.parametrize("arch", TINY_MM_ARCHS)
def test_positions_shared_by_a_groups_rows_equal_the_models_own(
        arch: str, processors: dict[str, MediaProcessor], model_dirs: dict[str, Path]) -> None:
    """The trainer's batch: each prompt (with its media) several times, each with its own response
    (text) of its own length, right-padded. Computed once per group, the positions equal what the
    model's get_rope_index gives the whole batch, padding included."""
    processor, model = processors[arch], load_policy_model(model_dirs[arch]).eval()
    rows = []
    for ids, media in _mixed(arch, model_dirs[arch], processor):
        for n in (3, 1, 5):  # a group's responses
            rows.append((ids + [11 + n + k for k in range(n)], media))
    width = max(len(ids) for ids, _ in rows) + 2
    input_ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for i, (ids, _) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        mask[i, : len(ids)] = 1
    media_rows = [m for _, m in rows]
    want, _ = mrope_positions(model, processor, input_ids, mask, processor.batch_media(media_rows))
    owner = rope_owner(model)
    real, batch_rows = owner.get_rope_index, []

    def counting(ids: torch.Tensor, **kwargs: Any) -> Any:
        batch_rows.append(ids.shape[0])
        return real(ids, **kwargs)

    owner.get_rope_index = counting
    try:
        got = shared_prefix_positions(model, processor, input_ids, mask, media_rows)
    finally:
        del owner.get_rope_index
    assert batch_rows == [len(rows) // 3]  # one row of each group
    assert got is not None and torch.equal(got, want)
    assert torch.equal(rows_forward_kwargs(model, processor, input_ids, mask, media_rows)["position_ids"], want)
    # Left padding (the engine's prefill) is not grouped: the model computes it whole.
    assert shared_prefix_positions(model, processor, input_ids.flip(1), mask.flip(1), media_rows) is None
