"""Turn a DCP training checkpoint into a Hugging Face model directory.

``export_hf`` builds the HF model from the original ``model_dir`` (config, dtype and
code all come from there; local files only), loads the ``model.*`` part of a
checkpoint written by :class:`relax_hpc.ckpt.CheckpointManager` into it, and writes
``save_pretrained`` safetensors plus the tokenizer files of ``model_dir`` into
``out_dir`` via a temp directory and a rename. Used by ``relax-hpc convert``.

The checkpoint's parameter names must be the HF model's own (the trainer trains the
HF module itself; DDP/FSDP/compile wrappers are stripped by ``get_state_dict``).
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    set_model_state_dict,
)

from relax_hpc.ckpt.fs import fsync_dir, fsync_tree, remove_tree
from relax_hpc.ckpt.manager import single_process_quiet
from relax_hpc.ckpt.permissions import check_private
from relax_hpc.ckpt.validate import check_dcp_files

__all__ = ["TOKENIZER_FILES", "export_hf"]

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
    from transformers import AutoModelForCausalLM  # heavy import, only needed here

    checkpoint_dir, model_dir, out_dir = Path(checkpoint_dir), Path(model_dir), Path(out_dir)
    check_private(checkpoint_dir.parent, checkpoint_dir, action="export")  # dcp.load unpickles
    check_dcp_files(checkpoint_dir)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(
            f"model_dir {model_dir} has no config.json; pass the HF model directory the run started from"
        )
    if out_dir.exists() and not overwrite:
        raise FileExistsError(
            f"out_dir {out_dir} already exists; remove it, choose another path or pass overwrite=True"
        )

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, local_files_only=True, dtype=dtype if dtype is not None else "auto"
    )
    state = {"model": get_model_state_dict(model)}
    _check_keys(checkpoint_dir, state["model"].keys())
    with single_process_quiet():
        dcp.load(state, checkpoint_id=checkpoint_dir, no_dist=True)
    set_model_state_dict(model, state["model"])

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".tmp_{out_dir.name}.{os.getpid()}"
    remove_tree(tmp)
    try:
        model.save_pretrained(tmp)
        for name in TOKENIZER_FILES:
            source = model_dir / name
            if source.is_file() and not (tmp / name).exists():
                shutil.copy2(source, tmp / name)
        fsync_tree(tmp)
        _replace_dir(tmp, out_dir)
    except BaseException:
        remove_tree(tmp)
        raise
    log.info("exported %s to %s", checkpoint_dir, out_dir)
    return out_dir


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
