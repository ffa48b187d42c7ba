"""Load Hugging Face causal LMs and tokenizers from local directories only (never from a hub)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def quiet_transformers() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def _require_model_dir(path: Path) -> None:
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"no Hugging Face model at {path} (config.json missing); set [model] path to a local "
            "model directory, or build_tiny_if_missing = true / `relax-hpc make-tiny DIR` for the tiny model"
        )


def load_causal_lm(path: str | Path, dtype: str = "float32", device: str = "cpu") -> torch.nn.Module:
    """Load a causal LM through `AutoModelForCausalLM.from_pretrained`, local files only."""
    quiet_transformers()
    from transformers import AutoModelForCausalLM

    if dtype not in _DTYPES:
        raise ValueError(f"model dtype {dtype!r} is not supported; use one of {', '.join(_DTYPES)}")
    path = Path(path)
    _require_model_dir(path)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=_DTYPES[dtype], local_files_only=True, attn_implementation="sdpa"
    )
    return model.to(device)


def load_tokenizer(path: str | Path):  # -> transformers.PreTrainedTokenizerBase
    """Load the tokenizer that lives next to the model weights."""
    quiet_transformers()
    from transformers import AutoTokenizer

    path = Path(path)
    _require_model_dir(path)
    return AutoTokenizer.from_pretrained(path, local_files_only=True)
