"""The tiny omni task: multiple-choice questions whose answer is only in the media.

    write_omni_task(Path("data/tiny_omni"), rows=512, seed=0)

writes `train.jsonl` and, under `media/`, one file per row (kinds round-robin):

- image: a 64x64 PNG, black, with one solid 32x32 square of red / green / blue / white
  (brightness 200..255) at a random place. "square colour? a:red b:green c:blue d:white"
- audio: a 1 s, 16 kHz, 16-bit mono WAV sine of 250 / 500 / 1000 / 2000 Hz, random phase and
  amplitude 0.3..0.8. "tone? a:250 b:500 c:1000 d:2000"
- video: 8 frames of 32x32 at 8 fps (lossless ffv1 in Matroska), grey (40) with 1..4 white
  frames at random distinct places. "flashes? a:1 b:2 c:3 d:4"
  Load it with `[data] video_fps = 8` (OMNI_VIDEO_FPS) or more: at the default 2 fps only two
  of its frames remain and the flashes can no longer be counted.

A row is `{"prompt", "<kind>": "media/00012.png", "answer": "c", "kind"}`; the text is the same
for every row of a kind, so a model that ignores the media scores 0.25 at best. Prompts use only
the characters of the tiny character tokenizer. The same seed gives the same bytes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from relax_hpc.media.encode import encode_audio_wav, encode_image_png, encode_video_mkv
from relax_hpc.media.items import MediaKind

OMNI_TASK_CHOICES: dict[MediaKind, dict[str, str]] = {
    "image": {"a": "red", "b": "green", "c": "blue", "d": "white"},
    "audio": {"a": "250", "b": "500", "c": "1000", "d": "2000"},  # Hz
    "video": {"a": "1", "b": "2", "c": "3", "d": "4"},  # white frames
}
_QUESTIONS: dict[MediaKind, str] = {"image": "square colour?", "audio": "tone?", "video": "flashes?"}
OMNI_TASK_PROMPTS: dict[MediaKind, str] = {
    kind: f"{_QUESTIONS[kind]} " + " ".join(f"{letter}:{meaning}" for letter, meaning in choices.items())
    for kind, choices in OMNI_TASK_CHOICES.items()
}
_EXTENSIONS: dict[MediaKind, str] = {"image": "png", "audio": "wav", "video": "mkv"}

# Sizes that give each image and each clip 16 tokens of the tiny model (8x8 patches, 2x2 merged,
# 2 frames a patch): with 4 each (32x32 images, 16x16 frames) the media were a few tokens among
# some 60 of text, the policy learned them slowly, and the clips' flashes not at all.
IMAGE_SIZE, SQUARE_SIZE = 64, 32
AUDIO_RATE, AUDIO_SECONDS = 16000, 1.0
VIDEO_SIZE, VIDEO_FRAMES, OMNI_VIDEO_FPS = 32, 8, 8
VIDEO_GREY, VIDEO_FLASH = 40, 255
_CHANNELS = {"red": (0,), "green": (1,), "blue": (2,), "white": (0, 1, 2)}


def write_omni_task(
    out_dir: Path, rows: int, seed: int, kinds: Sequence[MediaKind] = ("image", "audio", "video")
) -> Path:
    """Write the task under `out_dir`; returns the path of its `train.jsonl`."""
    unknown = [k for k in kinds if k not in OMNI_TASK_CHOICES]
    if unknown or not kinds:
        raise ValueError(f"kinds must be a non-empty selection of {', '.join(OMNI_TASK_CHOICES)}, got {kinds}")
    out_dir = Path(out_dir)
    (out_dir / "media").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    makers: dict[str, Callable[[np.random.Generator, int], bytes]] = {
        "image": _image_bytes,
        "audio": _audio_bytes,
        "video": _video_bytes,
    }
    lines = []
    for index in range(rows):
        kind = kinds[index % len(kinds)]
        choice = int(rng.integers(4))
        letter = "abcd"[choice]
        relative = f"media/{index:05d}.{_EXTENSIONS[kind]}"
        _write_atomic(out_dir / relative, makers[kind](rng, choice))
        row = {"prompt": OMNI_TASK_PROMPTS[kind], kind: relative, "answer": letter, "kind": kind}
        lines.append(json.dumps(row) + "\n")
    path = out_dir / "train.jsonl"
    _write_atomic(path, "".join(lines).encode())
    return path


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _image_bytes(rng: np.random.Generator, choice: int) -> bytes:
    colour = OMNI_TASK_CHOICES["image"]["abcd"[choice]]
    top, left = (int(v) for v in rng.integers(0, IMAGE_SIZE - SQUARE_SIZE + 1, size=2))
    brightness = int(rng.integers(200, 256))
    image = np.zeros((IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)
    for channel in _CHANNELS[colour]:
        image[top : top + SQUARE_SIZE, left : left + SQUARE_SIZE, channel] = brightness
    return encode_image_png(image)


def _audio_bytes(rng: np.random.Generator, choice: int) -> bytes:
    hertz = float(OMNI_TASK_CHOICES["audio"]["abcd"[choice]])
    phase, amplitude = rng.uniform(0, 2 * np.pi), rng.uniform(0.3, 0.8)
    t = np.arange(int(AUDIO_RATE * AUDIO_SECONDS)) / AUDIO_RATE
    return encode_audio_wav(amplitude * np.sin(2 * np.pi * hertz * t + phase), AUDIO_RATE)


def _video_bytes(rng: np.random.Generator, choice: int) -> bytes:
    flashes = int(OMNI_TASK_CHOICES["video"]["abcd"[choice]])
    frames = np.full((VIDEO_FRAMES, VIDEO_SIZE, VIDEO_SIZE, 3), VIDEO_GREY, dtype=np.uint8)
    frames[rng.choice(VIDEO_FRAMES, size=flashes, replace=False)] = VIDEO_FLASH
    return encode_video_mkv(frames, OMNI_VIDEO_FPS)
