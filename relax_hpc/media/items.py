"""Canonical media: decoded, model-ready arrays that every layer passes around.

A `MediaItem` is what a dataset cell, an agent's content part or an environment observation
becomes once decoded and fitted to the model's patch grid (`relax_hpc.media.canonical`):

- image: uint8 (H, W, 3) RGB, H and W multiples of patch * merge;
- video: uint8 (T, H, W, 3) RGB frames, T a multiple of the temporal patch, `rate` frames/s;
- audio: float32 (N,) mono in [-1, 1], `rate` samples/s (the feature extractor's rate).

Canonical arrays are what travels (in sample rows, to SGLang as data URLs); every processor
after that only rescales and normalises, so the engine, the trainer and SGLang see identical
pixels. `digest` is a content hash used to share one copy among the samples of a group.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

MediaKind = Literal["image", "video", "audio"]
MEDIA_ORDER: tuple[MediaKind, ...] = ("image", "video", "audio")  # order of a prompt's content parts

_DTYPES: dict[str, np.dtype] = {"image": np.dtype(np.uint8), "video": np.dtype(np.uint8), "audio": np.dtype(np.float32)}
_NDIM = {"image": 3, "video": 4, "audio": 1}


class MediaError(ValueError):
    """A media cell that cannot be used; `reason` is short enough to count drops by."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


def media_digest(kind: str, data: np.ndarray, rate: float) -> str:
    h = hashlib.sha256()
    h.update(f"{kind}|{data.dtype.str}|{data.shape}|{rate!r}|".encode())
    h.update(np.ascontiguousarray(data).tobytes())
    return h.hexdigest()[:32]


@dataclass(frozen=True, eq=False)
class MediaItem:
    kind: MediaKind
    data: np.ndarray
    rate: float = 0.0  # video: frames per second; audio: samples per second; image: 0
    digest: str = field(default="")

    def __post_init__(self) -> None:
        if self.kind not in _DTYPES:
            raise ValueError(f"media kind {self.kind!r} is not one of {', '.join(_DTYPES)}")
        if self.data.dtype != _DTYPES[self.kind] or self.data.ndim != _NDIM[self.kind]:
            raise ValueError(
                f"{self.kind} must be a {_NDIM[self.kind]}-d {_DTYPES[self.kind]} array, got "
                f"{self.data.ndim}-d {self.data.dtype}"
            )
        if self.kind in ("image", "video") and self.data.shape[-1] != 3:
            raise ValueError(f"{self.kind} must be RGB (last axis 3), got shape {self.data.shape}")
        if self.kind != "image" and self.rate <= 0:
            raise ValueError(f"{self.kind} needs a positive rate, got {self.rate}")
        if not self.digest:
            object.__setattr__(self, "digest", media_digest(self.kind, self.data, self.rate))

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MediaItem) and other.digest == self.digest

    def __hash__(self) -> int:
        return hash(self.digest)


@dataclass(frozen=True)
class PromptMedia:
    """The media of one prompt, in the order of its placeholders (images, videos, audios)."""

    items: tuple[MediaItem, ...] = ()

    def __post_init__(self) -> None:
        order = [MEDIA_ORDER.index(i.kind) for i in self.items]
        if order != sorted(order):
            raise ValueError("a prompt's media must be ordered images, then videos, then audios")

    def of(self, kind: MediaKind) -> tuple[MediaItem, ...]:
        return tuple(i for i in self.items if i.kind == kind)

    @property
    def nbytes(self) -> int:
        return sum(i.nbytes for i in self.items)

    @property
    def digest(self) -> str:
        return hashlib.sha256("|".join(i.digest for i in self.items).encode()).hexdigest()[:32]

    def __bool__(self) -> bool:
        return bool(self.items)
