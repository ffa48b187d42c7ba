"""AutoProcessor of model directories, run by the SGLang environment's python (it has torchvision,
which every Qwen VL / Omni processor's video processor needs and the project's venv lacks).

    .venv-sglang/bin/python tests/ckpt/processor_check.py DIR [DIR ...]

For each directory: builds ``AutoProcessor.from_pretrained(DIR)`` and runs it on one prompt with
an image (and, for an omni processor, a second of audio); prints one JSON line mapping each
directory to its processor's class names and a digest of every output tensor, so a test can
compare an export's processor with its source's.
"""

from __future__ import annotations

import hashlib
import json
import sys
from typing import Any


def describe(directory: str) -> dict[str, Any]:
    import numpy as np
    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(directory, local_files_only=True)
    tokenizer = processor.tokenizer
    text = f"{tokenizer.vision_bos_token}{tokenizer.image_token}{tokenizer.vision_eos_token}what is this?"
    kwargs: dict[str, Any] = {"images": [Image.new("RGB", (32, 48), (200, 30, 90))]}
    audio = getattr(processor, "feature_extractor", None)
    if audio is not None:
        text += f"{tokenizer.audio_bos_token}{tokenizer.audio_token}{tokenizer.audio_eos_token}"
        kwargs["audio"] = [np.sin(np.arange(audio.sampling_rate, dtype=np.float32) / 7.0)]
    outputs = processor(text=[text], return_tensors="pt", **kwargs)
    digests = {key: hashlib.sha256(value.numpy().tobytes()).hexdigest()[:16] + f" {tuple(value.shape)}"
               for key, value in sorted(outputs.items())}
    return {"processor": type(processor).__name__, "tokenizer": type(tokenizer).__name__,
            "feature_extractor": None if audio is None else type(audio).__name__, "outputs": digests}


if __name__ == "__main__":
    print(json.dumps({directory: describe(directory) for directory in sys.argv[1:]}))
