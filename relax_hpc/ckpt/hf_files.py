"""The safetensors side of an HF export: which tensors a model directory holds, and putting a
full omni checkpoint's layout back around an exported thinker.

A published Qwen2.5-Omni / Qwen3-Omni checkpoint is the full model: config.json describes thinker,
talker and code2wav, and its weights are ``thinker.*``, ``talker.*``, ``code2wav.*``. The policy
is the thinker alone, and its ``save_pretrained`` writes the ``thinker.*`` tensors (transformers
keeps the prefix it stripped when loading) with a thinker-only config. ``restore_full_omni_layout``
turns that into a drop-in replacement of the source: the source's config.json and
generation_config.json, and every source tensor the thinker did not write, copied unchanged
(one source file at a time, so a 30B checkpoint's talker never sits in memory at once), with
one safetensors index over all of it.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import torch

__all__ = ["INDEX_FILE", "SINGLE_FILE", "restore_full_omni_layout", "weight_files"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Bytes per element of safetensors' dtype names (for the index's total_size).
_ELEMENT_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
                  "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}


def weight_files(model_dir: Path) -> dict[str, str]:
    """Tensor name -> the safetensors file (relative) that holds it, from the index or the single
    file; raises FileNotFoundError for a directory without safetensors weights."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    if (model_dir / INDEX_FILE).is_file():
        return dict(json.loads((model_dir / INDEX_FILE).read_text())["weight_map"])
    if (model_dir / SINGLE_FILE).is_file():
        with safe_open(str(model_dir / SINGLE_FILE), "pt") as weights:
            return {name: SINGLE_FILE for name in weights.keys()}
    raise FileNotFoundError(
        f"{model_dir} has no {SINGLE_FILE} or {INDEX_FILE}; export keeps a full omni checkpoint's layout "
        "from its safetensors files, so pass the model directory the run started from"
    )


def restore_full_omni_layout(source: Path, exported: Path, prefix: str, *, dtype: torch.dtype | None) -> None:
    """Make ``exported`` (a thinker's ``save_pretrained``) a full omni checkpoint like ``source``.

    ``prefix`` is the thinker's weight prefix ("thinker."). ``dtype`` (None: the source's) is what
    the thinker was exported in; the copied floating-point tensors and the config follow it.
    """
    written = weight_files(exported)
    unknown = sorted(name for name in written if not name.startswith(prefix))
    source_files = weight_files(source)
    strangers = sorted(set(written) - set(source_files))
    if unknown or strangers:
        raise RuntimeError(
            f"the exported thinker's tensors do not fit the layout of {source}: e.g. "
            f"{(unknown or strangers)[:3]} are not among its {prefix}* tensors. This transformers version "
            "saves the thinker under other names than the checkpoint has; export with the transformers "
            "version the run trained with"
        )
    copied = _copy_other_tensors(source, exported, {n: f for n, f in source_files.items() if n not in written}, dtype)
    _write_index(exported, written, copied)
    for name in ("config.json", "generation_config.json"):
        if (Path(source) / name).is_file():
            shutil.copy2(Path(source) / name, exported / name)
    if dtype is not None:
        _set_config_dtype(exported / "config.json", dtype)


def _copy_other_tensors(source: Path, exported: Path, names: dict[str, str],
                        dtype: torch.dtype | None) -> dict[str, str]:
    """Copy ``names`` (tensor -> source file) into new files of ``exported``, one per source file;
    returns tensor -> new file."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    by_file: dict[str, list[str]] = {}
    for name, file in sorted(names.items()):
        by_file.setdefault(file, []).append(name)
    copied: dict[str, str] = {}
    for i, (file, group) in enumerate(sorted(by_file.items())):
        target = f"copied-{i:05d}.safetensors"
        with safe_open(str(Path(source) / file), "pt") as weights:
            tensors = {name: weights.get_tensor(name) for name in group}
        if dtype is not None:
            tensors = {n: t.to(dtype) if t.is_floating_point() else t for n, t in tensors.items()}
        save_file(tensors, str(exported / target), metadata={"format": "pt"})
        copied.update(dict.fromkeys(group, target))
    return copied


def _write_index(exported: Path, written: dict[str, str], copied: dict[str, str]) -> None:
    """Rename every weight file to ``model-0000i-of-0000N.safetensors`` and write one index over
    them (a lone model.safetensors would hide the index from from_pretrained)."""
    if not copied:
        return
    files = sorted(set(written.values())) + sorted(set(copied.values()))
    renamed = {old: f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i, old in enumerate(files)}
    staged = {old: exported / f".staged-{i}.safetensors" for i, old in enumerate(files)}
    for old, path in staged.items():  # two steps: a new name may be an old one
        os.rename(exported / old, path)
    for old, path in staged.items():
        os.rename(path, exported / renamed[old])
    weight_map = {name: renamed[file] for name, file in sorted({**written, **copied}.items())}
    total = sum(_tensor_bytes(exported / file) for file in renamed.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (exported / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _tensor_bytes(path: Path) -> int:
    from safetensors import safe_open

    total = 0
    with safe_open(str(path), "pt") as weights:
        for name in weights.keys():
            piece = weights.get_slice(name)
            total += math.prod(piece.get_shape()) * _ELEMENT_BYTES[piece.get_dtype()]
    return total


def _set_config_dtype(config_path: Path, dtype: torch.dtype) -> None:
    config = json.loads(config_path.read_text())
    name = str(dtype).removeprefix("torch.")
    for section in (config, config.get("thinker_config") or {}):
        for key in ("dtype", "torch_dtype"):
            if key in section:
                section[key] = name
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
