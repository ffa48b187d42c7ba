"""A prompt's media in transfer-queue rows: the MEDIA_FIELDS codec, its trip through the queue's
wire encoding, and pack_rows / TrainBatch.slice keeping each row's media with its tokens
(relax_hpc/data/rows.py, relax_hpc/backends/batch.py)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from relax_hpc.backends.batch import pack_rows, pack_samples
from relax_hpc.data.rows import (
    MEDIA_FIELDS,
    media_from_fields,
    media_to_fields,
    row_to_sample,
    sample_to_row,
)
from relax_hpc.data.sample import Sample
from relax_hpc.media.items import MediaItem, PromptMedia
from relax_hpc.transfer.wire_decode import materialize_blocks
from relax_hpc.transfer.wire_encode import blocks_to_wire, encode_blocks

PAD = 0


def _media(seed: int, kinds: tuple[str, ...] = ("image", "video", "audio")) -> PromptMedia:
    rng = np.random.default_rng(seed)
    make = {
        "image": lambda: MediaItem("image", rng.integers(0, 256, (16, 32, 3), dtype=np.uint8)),
        "video": lambda: MediaItem("video", rng.integers(0, 256, (2, 16, 16, 3), dtype=np.uint8), rate=2.5),
        "audio": lambda: MediaItem("audio", rng.uniform(-1, 1, 800).astype(np.float32), rate=16000.0),
    }
    return PromptMedia(tuple(make[k]() for k in kinds))


def _assert_same_media(got: PromptMedia | None, want: PromptMedia | None) -> None:
    if want is None:
        assert got is None
        return
    assert got is not None and len(got.items) == len(want.items)
    for a, b in zip(got.items, want.items):
        assert (a.kind, a.rate, a.data.dtype, a.data.shape) == (b.kind, b.rate, b.data.dtype, b.data.shape)
        assert np.array_equal(a.data, b.data) and a.digest == b.digest


def _sample(index: int, media: PromptMedia | None, prompt: int = 4, response: int = 3) -> Sample:
    return Sample(prompt_ids=list(range(10 + index, 10 + index + prompt)), response_ids=[7] * response,
                  rollout_log_probs=[-0.5 - index] * response, weight_version=0, group_id=index,
                  prompt_index=index, media=media)


def test_fields_round_trip() -> None:
    media = PromptMedia((*_media(0, ("image", "image")).items, *_media(1, ("video", "audio", "audio")).items))
    fields = media_to_fields(media)
    assert tuple(fields) == MEDIA_FIELDS
    assert fields["media_kinds"].tolist() == [0, 0, 1, 2, 2]
    assert fields["media_shapes"].tolist() == [[16, 32, 3, 0], [16, 32, 3, 0], [2, 16, 16, 3], [800, 0, 0, 0],
                                               [800, 0, 0, 0]]
    assert fields["media_u8"].numel() == 2 * 16 * 32 * 3 + 2 * 16 * 16 * 3 and fields["media_f32"].numel() == 1600
    _assert_same_media(media_from_fields(fields), media)


def test_empty_media_and_no_media() -> None:
    empty = media_to_fields(PromptMedia())
    assert tuple(empty) == MEDIA_FIELDS and all(t.numel() == 0 for t in empty.values())
    back = media_from_fields(empty)
    assert back is not None and back.items == ()  # a text prompt of a multimodal job: fields, no items
    assert not set(MEDIA_FIELDS) & set(sample_to_row(_sample(0, None)))
    assert media_from_fields(sample_to_row(_sample(0, None))) is None
    assert row_to_sample(sample_to_row(_sample(0, None))).media is None


def _through_wire(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    frames: list[Any] = []
    descs = blocks_to_wire(encode_blocks(rows), frames)
    return materialize_blocks(descs, [bytes(memoryview(f)) for f in frames])  # as received: read-only bytes


def test_media_survive_the_queue_wire() -> None:
    samples = [_sample(0, _media(0)), _sample(1, PromptMedia()), _sample(2, _media(2, ("audio",)), prompt=6)]
    received = _through_wire([sample_to_row(s) for s in samples])
    for row, s in zip(received, samples):
        assert row["media_u8"].dtype == torch.uint8 and row["media_f32"].dtype == torch.float32
        back = row_to_sample(row)
        _assert_same_media(back.media, s.media)
        assert back.prompt_ids == s.prompt_ids and back.response_ids == s.response_ids


def test_pack_rows_keeps_media_aligned_through_slices() -> None:
    media = [_media(0), PromptMedia(), _media(2, ("image",)), _media(3, ("video", "audio")), None]
    samples = [_sample(i, m, prompt=3 + i) for i, m in enumerate(media)]
    rows = _through_wire([sample_to_row(s) for s in samples[:4]]) + [sample_to_row(samples[4])]
    batch = pack_rows(rows, PAD)
    assert batch.media is not None and len(batch.media) == len(samples)
    for got, want in zip(batch.media, media):
        _assert_same_media(got, want)
    assert torch.equal(batch.input_ids, pack_samples(samples, PAD).input_ids)
    for start in range(0, len(samples), 2):
        micro = batch.slice(start, start + 2)
        assert micro.media is not None and len(micro.media) == len(micro)
        for row, (got, want) in enumerate(zip(micro.media, media[start : start + 2])):
            _assert_same_media(got, want)
            s = samples[start + row]
            assert micro.input_ids[row, : len(s.prompt_ids)].tolist() == s.prompt_ids  # the media's own row
    assert pack_rows([sample_to_row(_sample(0, None))], PAD).media is None  # a text-only job
