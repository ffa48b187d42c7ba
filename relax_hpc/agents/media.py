"""Images and audio in agent conversations: OpenAI content parts (the proxy) and environment
observations (the turn loop) -> canonical `MediaItem`s and the chat template parts that stand for
them, so that agent prompts are built as the dataset loader builds a multimodal one.

The proxy takes, in user messages (`parse_media_part`):

    {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}
    {"type": "input_audio", "input_audio": {"data": "<base64>", "format": "wav"}}

Only inline data is read: compute nodes usually have no network, and a path or file:// URL
would let an agent read the proxy's disk. An environment observation may be a list of parts
(`observation_parts`): `str` text, a `MediaItem` (any kind the model reads), or an image given
as an RGB uint8 (H, W, 3) numpy array or a PIL image. Every medium is fitted to the model's patch
grid (`relax_hpc.media.canonical`) once, here, so the engine and the trainer see the same pixels.

A data set row's own images and audio are offered to an agent as the same parts
(`offered_parts`; `offered` puts them in its chat messages too), encoded losslessly (PNG; 32-bit float WAV), so that a part the agent sends
back decodes and fits to exactly the row's item. Videos are not offered: the OpenAI API has no
video content part.

A prompt's media are its items in conversation order per kind (`prompt_media`): the chat
template writes one placeholder per part, and `MediaProcessor.expand` fills each kind's
placeholders with that kind's items in order.

At most MAX_CONCURRENT_DECODES request media decode at once, whatever the number of requests
(`load_part` takes one of `DECODE_SLOTS`): each may take up to `load_media`'s `max_decoded_bytes`
while it decodes, so the proxy's peak is bounded by that product, not by how many agents send
media at the same moment. The others wait for a slot in their worker thread.
"""

from __future__ import annotations

import base64
import struct
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from relax_hpc.media.canonical import fit_audio, fit_image, fit_video
from relax_hpc.media.encode import data_url, encode_image_png
from relax_hpc.media.items import (
    MEDIA_ORDER,
    MediaError,
    MediaItem,
    MediaKind,
    PromptMedia,
)
from relax_hpc.media.load import MediaLimits, load_media

# The OpenAI content part types that carry media, and the kind each one holds.
REQUEST_MEDIA_TYPES: dict[str, MediaKind] = {"image_url": "image", "input_audio": "audio"}

MAX_CONCURRENT_DECODES = 2  # request media decoded at the same time, over all requests
DECODE_SLOTS = threading.BoundedSemaphore(MAX_CONCURRENT_DECODES)


class PartError(ValueError):
    """A content part that cannot be used; the message names the part and says what to send."""


@dataclass(frozen=True)
class MediaPart:
    """One medium of a chat request, not yet decoded."""

    kind: MediaKind
    data_url: str
    where: str  # "messages[2].content[1]": what error messages name


def parse_media_part(part: dict[str, Any], where: str) -> MediaPart:
    """An `image_url` or `input_audio` part -> MediaPart; PartError when it is malformed or not
    inline data."""
    kind = REQUEST_MEDIA_TYPES[part["type"]]
    if kind == "image":
        spec = part.get("image_url")
        url = spec.get("url") if isinstance(spec, dict) else None
        if not isinstance(url, str):
            raise PartError(f'{where}: an image_url part is {{"type": "image_url", "image_url": {{"url": '
                            '"data:image/png;base64,..."}}')
        scheme = url.partition(":")[0].lower()
        if scheme in ("http", "https"):
            raise PartError(f"{where}: image_url is an {scheme}:// URL, which the proxy does not fetch (compute "
                            "nodes usually have no network); send the image inline as a data: URL "
                            "(data:image/png;base64,...)")
        if not url.startswith("data:"):
            raise PartError(f"{where}: image_url must be a data: URL (data:image/png;base64,...); got "
                            f"{url[:40]!r}")
        return MediaPart("image", url, where)
    spec = part.get("input_audio")
    data = spec.get("data") if isinstance(spec, dict) else None
    fmt = spec.get("format", "wav") if isinstance(spec, dict) else None
    if not isinstance(data, str) or not isinstance(fmt, str) or not fmt.isalnum():
        raise PartError(f'{where}: an input_audio part is {{"type": "input_audio", "input_audio": {{"data": '
                        '"<base64 of the file>", "format": "wav"}} (wav, mp3, flac, ogg, ...)')
    return MediaPart("audio", f"data:audio/{fmt.lower()};base64,{data}", where)


def load_part(part: MediaPart, processor: Any, limits: MediaLimits) -> MediaItem:
    """Decode and fit one request medium for the model of `processor` (a MediaProcessor);
    PartError naming the part when the model does not read its kind or it cannot be used."""
    family = processor.family
    if part.kind not in family.kinds:
        raise PartError(f"{part.where}: {family.model_type} does not read {part.kind}; it reads "
                        f"{', '.join(k for k in MEDIA_ORDER if k in family.kinds)}")
    try:
        with DECODE_SLOTS:
            [item] = load_media(part.data_url, part.kind, base_dir=Path("."), geometry=processor.geometry(),
                                limits=limits)
        processor.token_count(item)  # an audio clip too short to give a token is refused here
    except MediaError as e:
        raise PartError(f"{part.where}: cannot use this {part.kind}: {e}") from e
    return item


def prompt_media(items: Iterable[MediaItem]) -> PromptMedia:
    """The items as a prompt's media: images, videos, audios, each kind in conversation order."""
    return PromptMedia(tuple(sorted(items, key=lambda item: MEDIA_ORDER.index(item.kind))))


def offered_parts(media: PromptMedia | None) -> list[dict[str, Any]]:
    """A data set row's images and audio as OpenAI content parts, in the row's order (images,
    then audio clips); [] for a row without them. Videos are left out (no such part)."""
    return offered(None, "", media)[0]


def offered(messages: list[dict[str, Any]] | None, prompt_text: str, media: PromptMedia | None
            ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """What an agent is offered of a row: its media parts (`offered_parts`), each encoded once, and
    its chat messages with each medium's `{"type": kind}` placeholder part replaced by that part
    (a video's dropped: the API has none). A prompt used as plain text (`messages` None) is one
    user message of that text."""
    item_parts = _item_parts(media)
    parts = [part for _, part in item_parts if part is not None]
    if messages is None:
        return parts, [{"role": "user", "content": prompt_text}]
    by_kind: dict[str, list[dict[str, Any] | None]] = {}
    for kind, part in item_parts:
        by_kind.setdefault(kind, []).append(part)
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            filled = []
            for part in content:
                queue = by_kind.get(part.get("type", "")) if isinstance(part, dict) else None
                if not queue:
                    filled.append(part)
                elif (offered_part := queue.pop(0)) is not None:
                    filled.append(offered_part)
            message = {**message, "content": filled}
        out.append(dict(message))
    return parts, out


def _item_parts(media: PromptMedia | None) -> list[tuple[str, dict[str, Any] | None]]:
    """Each of the row's media with its offered part (None for a video), in the row's order."""
    parts: list[tuple[str, dict[str, Any] | None]] = []
    for item in media.items if media is not None else ():
        if item.kind == "image":
            url = data_url(encode_image_png(item.data), "image/png")
            parts.append((item.kind, {"type": "image_url", "image_url": {"url": url}}))
        elif item.kind == "audio":
            wav = base64.b64encode(_float_wav(item.data, int(item.rate))).decode("ascii")
            parts.append((item.kind, {"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}}))
        else:
            parts.append((item.kind, None))
    return parts


def _float_wav(wave: np.ndarray, rate: int) -> bytes:
    """Mono float32 -> a WAV of 32-bit float samples: read back bit for bit, where 16-bit PCM
    would round a resampled clip to 1/32768 steps. Written here, not by libsndfile, whose float
    WAVs carry a PEAK chunk with the time of writing: the same row must give the same bytes."""
    data = np.asarray(wave, dtype="<f4").tobytes()
    # fmt: WAVE_FORMAT_IEEE_FLOAT (3), 1 channel, rate, bytes/s, block align 4, 32 bits; a fact
    # chunk (sample frames), as the format requires for non-PCM data.
    fmt = struct.pack("<HHIIHH", 3, 1, rate, rate * 4, 4, 32)
    fact = struct.pack("<I", len(data) // 4)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"fact" + struct.pack("<I", 4) + fact
    body += b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", len(body)) + body


# -- environment observations -----------------------------------------------------------------


def observation_parts(content: Sequence[Any], processor: Any | None) -> tuple[list[dict[str, Any]], list[MediaItem]]:
    """A list observation's content -> chat template parts and the media items, in order.

    Text-only content comes back as one text part per string."""
    parts: list[dict[str, Any]] = []
    items: list[MediaItem] = []
    for k, value in enumerate(content):
        if isinstance(value, str):
            parts.append({"type": "text", "text": value})
        elif isinstance(value, dict) and value.get("type") == "text" and isinstance(value.get("text"), str):
            parts.append({"type": "text", "text": value["text"]})
        else:
            item = _observation_item(value, k, processor)
            parts.append({"type": item.kind})
            items.append(item)
    return parts, items


def _observation_item(value: Any, k: int, processor: Any | None) -> MediaItem:
    if isinstance(value, MediaItem):
        item = value
    elif isinstance(value, np.ndarray):
        if value.dtype != np.uint8 or value.ndim != 3 or value.shape[-1] != 3:
            raise TypeError(f"observation part {k}: an image array must be RGB uint8 (H, W, 3), got "
                            f"{value.dtype} {value.shape}")
        item = MediaItem("image", value)
    elif isinstance(value, Image.Image):
        item = MediaItem("image", np.asarray(value.convert("RGB"), dtype=np.uint8).copy())
    else:
        raise TypeError(f"observation part {k}: a {type(value).__name__}; a list observation holds text (str), "
                        "MediaItem, or images as RGB uint8 numpy arrays or PIL images")
    if processor is None:
        raise ValueError(f"observation part {k} is media ({item.kind}), but the model reads text only; "
                         "return text observations or train a multimodal model (docs/multimodal.md)")
    if item.kind not in processor.family.kinds:
        raise ValueError(f"observation part {k}: {processor.family.model_type} does not read {item.kind}")
    geometry = processor.geometry()
    if item.kind == "image":
        return MediaItem("image", fit_image(item.data, geometry))
    if item.kind == "video":
        return MediaItem("video", fit_video(item.data, geometry), rate=item.rate)
    return MediaItem("audio", fit_audio(item.data, int(item.rate), geometry), rate=float(geometry.audio_rate))


def is_media_value(value: Any) -> bool:
    """Whether an observation is a single medium (shown as a one-part list)."""
    return isinstance(value, (MediaItem, np.ndarray, Image.Image))
