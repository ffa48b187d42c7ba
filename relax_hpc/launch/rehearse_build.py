"""What a rehearsal writes before it runs: the tiny model of the spec's architecture and, when the
spec's data file is not readable, synthetic rows with the spec's columns and media kinds.

    write_tiny_model_of("qwen3_omni", work / "model", seed=1, on_sglang=True)
    write_synthetic_rows(spec.data, "multiple_choice", ("audio",), work / "data" / "train.jsonl", rows=64, seed=1)

The rows use only the characters of the tiny character tokenizer (relax_hpc/models/tiny.py), and
each label has the shape the spec's reward parses, so rewards are computed as in production
(a random policy mostly scores 0: the rehearsal proves the path, not learning). Media come from
the tiny omni task's generators (relax_hpc/media/synthetic.py): one file of each kind a row needs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from relax_hpc.launch.rehearse_spec import synthetic_columns
from relax_hpc.spec.schema import DataSpec

# Labels in the shape each built-in reward parses; any other reward gets a number.
_CHOICE_REWARDS = ("multiple_choice", "gpqa")
_TAGGED_REWARDS = ("openr1mm",)
CHOICES = "a:red b:green c:blue d:white"


def write_tiny_model_of(arch: str, out_dir: Path, seed: int, on_sglang: bool) -> Path:
    """A tiny model of `arch` at `out_dir` (relax_hpc/models/tiny*.py), shaped as its engines need
    (tiny_mm.shape_for_engine: 14-pixel patches for Qwen2.5-VL, three deepstack layers for
    Qwen3-Omni on SGLang)."""
    if arch == "qwen3":
        from relax_hpc.models.tiny import write_tiny_model

        return write_tiny_model(out_dir, seed=seed)
    if arch == "qwen3_tools":
        from relax_hpc.models.tiny_tools import write_tool_model

        return write_tool_model(out_dir, seed=seed)
    if arch == "qwen3_moe":
        from relax_hpc.models.tiny_moe import write_tiny_moe_model

        return write_tiny_moe_model(out_dir, seed=seed)
    from relax_hpc.models.tiny_mm import shape_for_engine, write_tiny_multimodal

    return write_tiny_multimodal(out_dir, arch, seed=seed, **shape_for_engine(arch, on_sglang))


def give_positions(model_dir: Path, positions: int) -> None:
    """Raise the text tower's max_position_embeddings (and the tokenizer's model_max_length) to
    `positions`: the rotary text towers have no position table, so only the declared limit grows
    (the engines and the length checks read it). The vision tower's learned positions stay."""
    def raise_limit(config: dict[str, Any]) -> None:
        if "max_position_embeddings" in config:
            config["max_position_embeddings"] = max(int(config["max_position_embeddings"]), positions)
        for key in ("text_config", "thinker_config"):
            if isinstance(config.get(key), dict):
                raise_limit(config[key])

    for name, update in (("config.json", raise_limit),
                         ("tokenizer_config.json", lambda c: c.update(model_max_length=positions))):
        path = Path(model_dir) / name
        config = json.loads(path.read_text())
        update(config)
        path.write_text(json.dumps(config, indent=2, sort_keys=True))


def synthetic_label(reward: str, choice: int, number: int) -> str:
    """The label as `reward` reads it: the letter of `choice` (0..3) for a multiple-choice reward,
    else `number` (in <answer> tags for openr1mm)."""
    if reward in _CHOICE_REWARDS:
        return "abcd"[choice]
    if reward in _TAGGED_REWARDS:
        return f"<answer> {number} </answer>"
    return str(number)


def write_synthetic_rows(data: DataSpec, reward: str, kinds: tuple[str, ...], out_path: Path, rows: int,
                         seed: int) -> Path:
    """Write `rows` JSON lines at `out_path` with the columns `data` reads (dotted keys nested),
    the media of `kinds` beside them; returns `out_path`. Same seed, same bytes."""
    import numpy as np

    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    media = {kind: _media_files(kind, out_path.parent, rows, seed) for kind in kinds}
    keys = {"image": data.image_key, "audio": data.audio_key, "video": data.video_key}
    rng = np.random.default_rng(seed)
    lines = []
    for index in range(rows):
        answer = int(rng.integers(4))
        a, b = int(rng.integers(1, 5)), int(rng.integers(1, 5))
        text = f"pick one: {CHOICES}" if reward in _CHOICE_REWARDS else f"what is {a}+{b}? answer:"
        record: dict[str, Any] = {}
        for column in synthetic_columns(data):
            if column != data.label_key and column not in keys.values():
                _put(record, column, text)  # the prompt, and the fields its template names
        if reward in _CHOICE_REWARDS and "choices" in record:
            record["choices"] = CHOICES
        _put(record, data.label_key, synthetic_label(reward, answer, a + b))
        for kind, files in media.items():
            _put(record, str(keys[kind]), files[index])
        lines.append(json.dumps(record) + "\n")
    tmp = out_path.with_name(out_path.name + ".tmp")
    tmp.write_text("".join(lines))
    os.replace(tmp, out_path)
    return out_path


def _media_files(kind: str, root: Path, rows: int, seed: int) -> list[str]:
    """One `kind` file per row under root/<kind>/media/, as paths relative to root."""
    from relax_hpc.media.synthetic import write_omni_task

    listing = write_omni_task(root / kind, rows=rows, seed=seed, kinds=(kind,))  # type: ignore[arg-type]
    written = [json.loads(line)[kind] for line in listing.read_text().splitlines()]
    listing.unlink()  # the task's own rows; the rehearsal's are written beside them
    return [f"{kind}/{relative}" for relative in written]


def _put(record: dict[str, Any], key: str, value: Any) -> None:
    """record[key] = value, a dotted key ("reward_model.ground_truth") as nested fields."""
    *parents, last = key.split(".")
    node = record
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
