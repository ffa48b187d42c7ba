"""Turn a DCP training checkpoint into a Hugging Face model directory.

``export_hf`` builds the policy from the original ``model_dir`` exactly as training does
(``relax_hpc.models.hf.load_policy_model``: a text model through AutoModelForCausalLM, a VL model
through its family's class, an omni model as its thinker; config, dtype and code all come from
``model_dir``, local files only), loads the ``model.*`` part of a checkpoint written by
:class:`relax_hpc.ckpt.CheckpointManager` into it, and writes ``save_pretrained`` safetensors
plus the tokenizer and processor files of ``model_dir`` into ``out_dir`` via a temp directory and
a rename. Used by ``relax-hpc convert``.

The exported directory is a drop-in replacement of ``model_dir``: for a full omni checkpoint (the
published Qwen2.5-Omni / Qwen3-Omni layout, weights ``thinker.*``) it keeps the full model's
config and every tensor that is not the thinker's (talker, code2wav) as the source had them, so
both the thinker's class and the full omni class load it (``relax_hpc.ckpt.hf_files``).

The checkpoint's parameter names must be the policy's own (the trainer trains the HF module
itself; DDP/FSDP/compile wrappers are stripped by ``get_state_dict``). A checkpoint of the
Megatron backend is in Megatron's layout (``relax_hpc.ckpt.formats``) and is converted through
megatron-bridge instead (``relax_hpc.backends.megatron_export``; ``relax-hpc convert`` picks it).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    set_model_state_dict,
)

from relax_hpc.ckpt.formats import checkpoint_backend
from relax_hpc.ckpt.fs import fsync_dir, fsync_tree, remove_tree
from relax_hpc.ckpt.hf_files import restore_full_omni_layout
from relax_hpc.ckpt.manager import single_process_quiet
from relax_hpc.ckpt.permissions import check_private
from relax_hpc.ckpt.validate import check_dcp_files

__all__ = [
    "MODEL_FILES",
    "PROCESSOR_FILES",
    "SPEAKER_FILES",
    "TOKENIZER_FILES",
    "check_export_paths",
    "copy_model_files",
    "export_dtype_name",
    "export_hf",
    "write_export_dir",
]

log = logging.getLogger(__name__)

# Files a tokenizer (and its chat template) may consist of; whichever exist are copied.
TOKENIZER_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
)
# What AutoProcessor reads besides the tokenizer: image, video and audio processors' configs.
PROCESSOR_FILES: tuple[str, ...] = (
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
)
# Qwen2.5-Omni's speaker voices: its full class refuses to load without them.
SPEAKER_FILES: tuple[str, ...] = ("spk_dict.pt",)
MODEL_FILES = TOKENIZER_FILES + PROCESSOR_FILES + SPEAKER_FILES
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def export_hf(
    checkpoint_dir: Path,
    model_dir: Path,
    out_dir: Path,
    *,
    overwrite: bool = False,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write an HF model directory at ``out_dir`` holding the weights of ``checkpoint_dir``.

    ``dtype`` None keeps the dtype ``model_dir`` declares. An existing ``out_dir`` is an
    error unless ``overwrite`` is set. Returns ``out_dir``.
    """
    from relax_hpc.models.hf import MULTIMODAL_FAMILIES, load_policy_model, model_type_of

    checkpoint_dir, model_dir, out_dir = check_export_paths(checkpoint_dir, model_dir, out_dir, overwrite=overwrite)
    if checkpoint_backend(checkpoint_dir) == "megatron":
        raise ValueError(
            f"{checkpoint_dir} was written by the megatron backend (megatron-core's dist_checkpointing "
            "layout, not HF names); convert it with `relax-hpc convert JOB_DIR OUT` run from the Megatron "
            "environment (e.g. .venv-megatron/bin/relax-hpc), which goes through megatron-bridge "
            "(relax_hpc.backends.megatron_export)"
        )
    model_type = model_type_of(model_dir)
    try:
        model = load_policy_model(model_dir, dtype=export_dtype_name(model_dir, dtype))
    except (ValueError, KeyError, ImportError) as exc:
        raise ValueError(
            f"cannot export {checkpoint_dir}: the model at {model_dir} (model_type {model_type}) does not "
            f"load as a relax-hpc policy ({exc}). Export rebuilds the model the run trained, so pass the HF "
            "model directory the run started from ([model] path of its spec)"
        ) from exc
    state = {"model": get_model_state_dict(model)}
    _check_keys(checkpoint_dir, state["model"].keys())
    with single_process_quiet():
        dcp.load(state, checkpoint_id=checkpoint_dir, no_dist=True)
    set_model_state_dict(model, state["model"])
    family = MULTIMODAL_FAMILIES.get(model_type)

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp)
        if family is not None and family.full_omni:
            restore_full_omni_layout(model_dir, tmp, family.weight_prefix, dtype=dtype)
        copy_model_files(model_dir, tmp)

    write_export_dir(out_dir, write)
    log.info("exported %s to %s", checkpoint_dir, out_dir)
    return out_dir


def check_export_paths(
    checkpoint_dir: Path, model_dir: Path, out_dir: Path, *, overwrite: bool, action: str = "export"
) -> tuple[Path, Path, Path]:
    """The three paths, once the checkpoint is safe to read and complete, ``model_dir`` is an HF
    model directory and ``out_dir`` may be written (shared by every backend's export)."""
    checkpoint_dir, model_dir, out_dir = Path(checkpoint_dir), Path(model_dir), Path(out_dir)
    check_private(checkpoint_dir.parent, checkpoint_dir, action=action)  # loading unpickles
    check_dcp_files(checkpoint_dir)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(
            f"model_dir {model_dir} has no config.json; pass the HF model directory the run started from"
        )
    if out_dir.exists() and not overwrite:
        raise FileExistsError(
            f"out_dir {out_dir} already exists; remove it, choose another path or pass overwrite=True"
        )
    return checkpoint_dir, model_dir, out_dir


def export_dtype_name(model_dir: Path, dtype: torch.dtype | None) -> str:
    """``dtype``'s name, or (None) the dtype ``model_dir``'s config.json declares (float32 when
    it declares none): what the exported weights are stored in."""
    if dtype is not None:
        if dtype not in _DTYPE_NAMES:
            raise ValueError(f"export dtype {dtype} is not supported; use one of {', '.join(map(str, _DTYPE_NAMES))}")
        return _DTYPE_NAMES[dtype]
    config = json.loads((Path(model_dir) / "config.json").read_text())
    declared = config.get("dtype") or config.get("torch_dtype")
    return declared if declared in _DTYPE_NAMES.values() else "float32"


def copy_model_files(model_dir: Path, directory: Path) -> None:
    """Copy the tokenizer, processor and speaker files ``model_dir`` has into ``directory`` (where
    ``save_pretrained`` did not write them), so AutoTokenizer / AutoProcessor (and a full omni
    class) load from it."""
    for name in MODEL_FILES:
        source = Path(model_dir) / name
        if source.is_file() and not (directory / name).exists():
            shutil.copy2(source, directory / name)


def write_export_dir(out_dir: Path, write: Callable[[Path], None]) -> None:
    """Run ``write(tmp)`` on a fresh temp sibling of ``out_dir``, then put it in ``out_dir``'s
    place: a crash never leaves a half-written export under the requested name."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".tmp_{out_dir.name}.{os.getpid()}"
    remove_tree(tmp)
    tmp.mkdir()
    try:
        write(tmp)
        fsync_tree(tmp)
        _replace_dir(tmp, out_dir)
    except BaseException:
        remove_tree(tmp)
        raise


def _check_keys(checkpoint_dir: Path, wanted: Iterable[str]) -> None:
    """Fail with the names on both sides when the checkpoint does not fit the model."""
    metadata = FileSystemReader(checkpoint_dir).read_metadata()
    available = {key[len("model.") :] for key in metadata.state_dict_metadata if key.startswith("model.")}
    missing = sorted(set(wanted) - available)
    if missing:
        raise KeyError(
            f"{checkpoint_dir} lacks {len(missing)} parameters of the HF model, e.g. {missing[:3]}; "
            f"it holds e.g. {sorted(available)[:3]}. Export needs a checkpoint of this model "
            "(same architecture and parameter names) written by CheckpointManager"
        )


def _replace_dir(tmp: Path, out_dir: Path) -> None:
    old: Path | None = None
    if out_dir.exists():
        old = out_dir.parent / f".old_{out_dir.name}.{os.getpid()}"
        remove_tree(old)
        os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    fsync_dir(out_dir.parent)
    if old is not None:
        remove_tree(old)
