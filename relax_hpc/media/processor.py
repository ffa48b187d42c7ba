"""Model inputs from token ids and canonical media, for the engine and the trainer alike.

A model directory's `AutoProcessor` cannot be built on a CPU-only install: every Qwen VL / Omni
processor owns a video processor, and those need torchvision, which has no CPU wheel for the
pinned torch. So this module builds the same inputs from the pieces that do load: the image
processor (its PIL backend), the Whisper feature extractor and the tokenizer's placeholder
tokens, and expands the placeholders itself (one token per merged patch, or per encoded audio
frame). Because media are already fitted to the patch grid when they are loaded
(`relax_hpc.media.canonical`), the image processor only rescales and normalises, so the
engine, the trainer and an SGLang server produce the same pixels.

Audio features are computed one clip at a time and then padded, so a clip's features never
depend on the other clips of its batch (Whisper's framing at the clip's end would otherwise
change with the batch's padding). Images and videos are likewise turned into patches one item at
a time, and every item's features or patches are kept by its content digest: the samples of a
GRPO group carry the same media, and each micro-batch of the trainer, the engine's prefill and
the forward roles ask for them again (`PIXEL_CACHE_BYTES` bounds what is kept).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from relax_hpc.media.families import Family, family_of, supported_model_types
from relax_hpc.media.items import MediaError, MediaItem, PromptMedia
from relax_hpc.models.hf import transformers_name

MARKUP_FLOOR = -1e30  # the logit of a media markup token: never sampled, probability exactly 0
MIN_AUDIO_SAMPLES = 400  # one Whisper FFT window (25 ms at 16 kHz); shorter clips cannot be framed
PIXEL_CACHE_BYTES = 256 * 2**20  # images' and videos' patches a processor keeps between calls (then it starts over)


def media_processor_for(model_dir: str | Path) -> MediaProcessor | None:
    """The processor of a multimodal model; None for a text model or a path with no config.json
    (tests' scripted engines). A multimodal model outside the supported families raises."""
    from relax_hpc.models.hf import is_multimodal

    if not (Path(model_dir) / "config.json").is_file() or not is_multimodal(model_dir):
        return None
    return MediaProcessor(model_dir)


def read_model_config(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no Hugging Face model at {model_dir} (config.json missing)")
    return json.loads(path.read_text())


def _token_config(config: dict[str, Any], family: Family) -> dict[str, Any]:
    return config.get("thinker_config", config) if family.thinker_config else config


@dataclass(frozen=True)
class PlaceholderIds:
    image: int | None
    video: int | None
    audio: int | None

    def kind_of(self, token: int) -> str | None:
        for kind in ("image", "video", "audio"):
            if token == getattr(self, kind):
                return kind
        return None


@dataclass
class BatchMedia:
    """The media tensors of a batch, concatenated in row order, as forward() takes them."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def kwargs(self) -> dict[str, torch.Tensor]:
        return dict(self.tensors)

    def __bool__(self) -> bool:
        return bool(self.tensors)


class MediaProcessor:
    """Expands placeholders and builds the media tensors of one model family."""

    def __init__(self, model_dir: str | Path) -> None:
        from relax_hpc.models.hf import quiet_transformers

        quiet_transformers()
        self.model_dir = Path(model_dir)
        config = read_model_config(self.model_dir)
        family = family_of(str(config.get("model_type", "")))
        if family is None:
            raise ValueError(
                f"{self.model_dir} holds a text-only model (model_type {config.get('model_type')!r}); media "
                f"need one of: {supported_model_types()}. Unset [data] image_key / audio_key / video_key "
                "or point [model] path at a multimodal model"
            )
        self.family = family
        tokens = _token_config(config, family)
        self.placeholders = PlaceholderIds(
            tokens.get("image_token_id", tokens.get("image_token_index")),
            tokens.get("video_token_id", tokens.get("video_token_index")),
            tokens.get("audio_token_id", tokens.get("audio_token_index")),
        )
        # Media markup the model must never sample: a placeholder or a media start/end token in a
        # response would be taken for a medium by the trainer's forward and position function.
        markup = ("image_token_id", "video_token_id", "audio_token_id", "image_token_index", "video_token_index",
                  "audio_token_index", "vision_start_token_id", "vision_end_token_id", "audio_start_token_id",
                  "audio_end_token_id")
        self.markup_ids = tuple(sorted({int(tokens[k]) for k in markup if isinstance(tokens.get(k), int)}))
        self.tokens_per_second = float(
            tokens.get("vision_config", {}).get("tokens_per_second", tokens.get("position_id_per_seconds", 1.0))
        )
        self.image_processor = self._image_processor() if family.kinds & {"image", "video"} else None
        self.feature_extractor = self._feature_extractor() if "audio" in family.kinds else None
        self._features: dict[str, tuple[np.ndarray, int]] = {}  # digest -> (features, frames)
        self._patches: dict[str, np.ndarray] = {}  # digest -> an image's or a video's patches
        self._patch_bytes = 0

    # -- loading the pieces ----------------------------------------------------------------
    def _image_processor(self) -> Any:
        AutoImageProcessor = transformers_name("AutoImageProcessor")
        try:
            return AutoImageProcessor.from_pretrained(self.model_dir, backend="pil", local_files_only=True)
        except (OSError, ValueError) as e:
            raise ValueError(
                f"{self.model_dir} has no usable image processor config (preprocessor_config.json or "
                f"processor_config.json): {e}"
            ) from e

    def _feature_extractor(self) -> Any:
        AutoFeatureExtractor = transformers_name("AutoFeatureExtractor")
        try:
            return AutoFeatureExtractor.from_pretrained(self.model_dir, local_files_only=True)
        except (OSError, ValueError) as e:
            raise ValueError(f"{self.model_dir} has no usable audio feature extractor config: {e}") from e

    def geometry(self) -> Any:  # -> relax_hpc.media.canonical.Geometry
        """The patch grid and audio rate media are fitted to when they are loaded."""
        from relax_hpc.media.canonical import Geometry

        ip = self.image_processor
        rate = int(self.feature_extractor.sampling_rate) if self.feature_extractor is not None else 16000
        if ip is None:
            return Geometry(patch=14, merge=2, temporal=2, min_pixels=0, max_pixels=1 << 62, audio_rate=rate)
        size = ip.size
        min_pixels = getattr(size, "shortest_edge", None) or getattr(ip, "min_pixels", None) or 56 * 56
        max_pixels = getattr(size, "longest_edge", None) or getattr(ip, "max_pixels", None) or 28 * 28 * 1280
        return Geometry(
            patch=int(ip.patch_size), merge=int(ip.merge_size), temporal=int(ip.temporal_patch_size),
            min_pixels=int(min_pixels), max_pixels=int(max_pixels), audio_rate=rate,
        )

    # -- placeholders -------------------------------------------------------------------------
    def check_kinds(self, media: PromptMedia) -> None:
        for item in media.items:
            if item.kind not in self.family.kinds:
                note = self.family.video_note if item.kind == "video" else ""
                raise MediaError(f"{item.kind} not read by {self.family.model_type}", note)

    def token_count(self, item: MediaItem) -> int:
        """How many placeholder tokens `item` becomes in the prompt."""
        if item.kind == "audio":
            assert self.family.audio_tokens is not None
            frames = self._audio_features(item)[1]
            count = self.family.audio_tokens(frames)
            if count < 1:  # the encoder would read nothing of it
                raise MediaError("audio too short", f"{frames} feature frames give no audio token")
            return count
        t, h, w = self._grid(item)
        return t * h * w // (self._merge() ** 2)

    def expand(self, prompt_ids: Sequence[int], media: PromptMedia) -> list[int]:
        """`prompt_ids` with each single placeholder replaced by its item's token count."""
        self.check_kinds(media)
        queues = {kind: list(media.of(kind)) for kind in ("image", "video", "audio")}
        out: list[int] = []
        for token in prompt_ids:
            kind = self.placeholders.kind_of(int(token))
            if kind is None:
                out.append(int(token))
                continue
            if not queues[kind]:
                raise MediaError(
                    f"more {kind} placeholders than {kind}s",
                    f"the prompt has more {kind} placeholder tokens than the row has {kind} items",
                )
            out.extend([int(token)] * self.token_count(queues[kind].pop(0)))
        left = {kind: len(q) for kind, q in queues.items() if q}
        if left:
            kind = next(iter(left))
            raise MediaError(
                f"more {kind}s than {kind} placeholders",
                f"{left[kind]} {kind} item(s) have no placeholder in the prompt; the chat template must "
                f"render one placeholder per {kind} content part",
            )
        return out

    def mask_markup(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` with the media markup tokens made impossible, the same way in the engine (before
        sampling) and the trainer (before its log-softmax), so both compute the same distribution.
        A finite floor keeps the entropy's p * log p at 0 rather than NaN."""
        if not self.markup_ids:
            return logits
        index = torch.tensor(self.markup_ids, device=logits.device)
        index = index[index < logits.shape[-1]]
        return logits.index_fill(-1, index, MARKUP_FLOOR)

    def mm_token_type_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """0 text, 1 image, 2 video: what the VL families' position function reads."""
        types = torch.zeros_like(input_ids, dtype=torch.int32)
        if self.placeholders.image is not None:
            types[input_ids == self.placeholders.image] = 1
        if self.placeholders.video is not None:
            types[input_ids == self.placeholders.video] = 2
        return types

    # -- tensors ------------------------------------------------------------------------------
    def _merge(self) -> int:
        return int(self.image_processor.merge_size)

    def _grid(self, item: MediaItem) -> tuple[int, int, int]:
        ip = self.image_processor
        patch, temporal = int(ip.patch_size), int(ip.temporal_patch_size)
        unit = patch * self._merge()
        height, width = item.data.shape[-3], item.data.shape[-2]
        if height % unit or width % unit:
            raise MediaError(
                f"{item.kind} not fitted to the patch grid",
                f"{height}x{width} is not a multiple of {unit}; load media through relax_hpc.media.load",
            )
        frames = 1 if item.kind == "image" else item.data.shape[0]
        return max(1, -(-frames // temporal)), height // patch, width // patch

    def _audio_features(self, item: MediaItem) -> tuple[np.ndarray, int]:
        cached = self._features.get(item.digest)
        if cached is not None:
            return cached
        fe = self.feature_extractor
        if fe is None:
            raise MediaError(f"audio not read by {self.family.model_type}")
        if item.rate != fe.sampling_rate:
            raise MediaError("audio at the wrong rate", f"{item.rate} Hz, the model reads {fe.sampling_rate} Hz")
        if item.data.shape[0] < MIN_AUDIO_SAMPLES:
            raise MediaError("audio too short", f"{item.data.shape[0]} samples, at least {MIN_AUDIO_SAMPLES}")
        out = fe([item.data], sampling_rate=fe.sampling_rate, padding="longest",
                 return_attention_mask=True, return_tensors="np")
        features = out["input_features"][0].astype(np.float32)
        result = (features, int(out["attention_mask"][0].sum()))
        if len(self._features) > 4096:
            self._features.clear()
        self._features[item.digest] = result
        return result

    def _pixels(self, frames: np.ndarray) -> np.ndarray:
        """Patches of (T, H, W, 3) uint8 frames in the Qwen-VL layout, rescaled and normalised."""
        ip = self.image_processor
        patch, temporal, merge = int(ip.patch_size), int(ip.temporal_patch_size), self._merge()
        x = frames.astype(np.float32) * np.float32(ip.rescale_factor)
        x = (x - np.asarray(ip.image_mean, np.float32)) / np.asarray(ip.image_std, np.float32)
        x = x.transpose(0, 3, 1, 2)  # T, C, H, W
        if x.shape[0] % temporal:
            x = np.concatenate([x, np.repeat(x[-1:], temporal - x.shape[0] % temporal, axis=0)])
        t, c, h, w = x.shape
        gt, gh, gw = t // temporal, h // patch, w // patch
        x = x.reshape(gt, temporal, c, gh // merge, merge, patch, gw // merge, merge, patch)
        x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
        return x.reshape(gt * gh * gw, c * temporal * patch * patch)

    def _item_patches(self, item: MediaItem) -> np.ndarray:
        """An image's (through the image processor) or a video's patches, kept by digest."""
        cached = self._patches.get(item.digest)
        if cached is not None:
            return cached
        if item.kind == "image":
            result = self.image_processor(images=[item.data], return_tensors="np")
            patches = np.asarray(result["pixel_values"], dtype=np.float32)
        else:
            patches = self._pixels(item.data)
        if self._patch_bytes + patches.nbytes > PIXEL_CACHE_BYTES:
            self._patches.clear()
            self._patch_bytes = 0
        self._patches[item.digest] = patches
        self._patch_bytes += patches.nbytes
        return patches

    def batch_media(self, rows: Sequence[PromptMedia | None]) -> BatchMedia:
        """The media tensors of a batch whose rows carry `rows` (None: a text-only row)."""
        images = [i for m in rows if m for i in m.of("image")]
        videos = [i for m in rows if m for i in m.of("video")]
        audios = [i for m in rows if m for i in m.of("audio")]
        out: dict[str, torch.Tensor] = {}
        if images:
            self._check_grid(images)
            out["pixel_values"] = torch.from_numpy(np.concatenate([self._item_patches(i) for i in images]))
            out["image_grid_thw"] = torch.tensor([self._grid(i) for i in images], dtype=torch.long)
        if videos:
            out["pixel_values_videos"] = torch.from_numpy(np.concatenate([self._item_patches(v) for v in videos]))
            out["video_grid_thw"] = torch.tensor([self._grid(v) for v in videos], dtype=torch.long)
            if self.family.video_seconds_key:
                temporal = int(self.image_processor.temporal_patch_size)
                seconds = [temporal / v.rate for v in videos]
                out[self.family.video_seconds_key] = torch.tensor(seconds, dtype=torch.float32)
        if audios:
            feats = [self._audio_features(a) for a in audios]
            longest = max(f.shape[1] for f, _ in feats)
            mel = feats[0][0].shape[0]
            features = np.zeros((len(feats), mel, longest), np.float32)
            mask = np.zeros((len(feats), longest), np.int64)
            for n, (f, frames) in enumerate(feats):
                features[n, :, : f.shape[1]] = f
                mask[n, :frames] = 1
            out["input_features"] = torch.from_numpy(features)
            out["feature_attention_mask"] = torch.from_numpy(mask)
        return BatchMedia(out)

    def _check_grid(self, images: list[MediaItem]) -> None:
        for item in images:
            self._grid(item)
