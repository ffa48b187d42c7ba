"""Load Hugging Face policy models and tokenizers from local directories only (never from a hub).

Text models load through `AutoModelForCausalLM`. Multimodal ones are dispatched on config.json's
`model_type` (`MULTIMODAL_FAMILIES`): a VL model through `AutoModelForImageTextToText`, an omni
model as its *thinker* (the text-out part that is trained). A published omni checkpoint is the
full model, its weights named ``thinker.*``; the thinker class loads them with that prefix
dropped, so the trainer's parameter names lack it, and `checkpoint_weight_prefix` says what to
put back when weights go to an inference server that loads the full checkpoint.
`empty_policy_model` builds the same model on the meta device, for sharded loading
(`relax_hpc.backends.sharded_load`).
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# transformers 5 resolves `from transformers import X` through a lazy module that is not safe for
# two threads' first imports: one of them can get "cannot import name 'AutoTokenizer'" (seen when
# a rollout worker started two SGLang engines' clients on two threads). Every first use of a
# transformers name in relax-hpc goes through this lock; later ones are plain attribute lookups.
_TRANSFORMERS_IMPORT = threading.Lock()


def transformers_name(name: str) -> Any:
    """`transformers.<name>` (AutoTokenizer, AutoModelForCausalLM, ...), imported safely from any thread."""
    with _TRANSFORMERS_IMPORT:
        quiet_transformers()
        import transformers

        return getattr(transformers, name)


def quiet_transformers() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def cache_argument(model: torch.nn.Module) -> str:
    """The name `model`'s forward takes its KV cache under, and its output returns it as:
    transformers 5 renamed `past_key_values` to `cache` (the old name warns, and goes in 5.40);
    the 4.x of the Megatron environment knows only `past_key_values`."""
    import inspect

    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


def _require_model_dir(path: Path) -> None:
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"no Hugging Face model at {path} (config.json missing); set [model] path to a local "
            "model directory, or build_tiny_if_missing = true / `relax-hpc make-tiny DIR` for the tiny model"
        )


def load_causal_lm(path: str | Path, dtype: str = "float32", device: str = "cpu") -> torch.nn.Module:
    """Load a causal LM through `AutoModelForCausalLM.from_pretrained`, local files only."""
    AutoModelForCausalLM = transformers_name("AutoModelForCausalLM")

    torch_dtype = _torch_dtype(dtype)
    path = Path(path)
    _require_model_dir(path)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch_dtype, local_files_only=True, attn_implementation="sdpa"
    )
    return model.to(device)


@dataclass(frozen=True)
class MultimodalFamily:
    """How a multimodal `model_type` loads as a policy."""

    model_class: str  # a transformers class (or Auto class) name
    full_omni: bool = False  # a full omni checkpoint: the policy is its thinker, weights thinker.*

    @property
    def weight_prefix(self) -> str:
        return "thinker." if self.full_omni else ""


MULTIMODAL_FAMILIES: dict[str, MultimodalFamily] = {
    "qwen2_5_vl": MultimodalFamily("AutoModelForImageTextToText"),
    "qwen3_vl": MultimodalFamily("AutoModelForImageTextToText"),
    "qwen3_vl_moe": MultimodalFamily("AutoModelForImageTextToText"),
    "qwen2_5_omni": MultimodalFamily("Qwen2_5OmniThinkerForConditionalGeneration", full_omni=True),
    "qwen3_omni_moe": MultimodalFamily("Qwen3OmniMoeThinkerForConditionalGeneration", full_omni=True),
    "qwen2_5_omni_thinker": MultimodalFamily("Qwen2_5OmniThinkerForConditionalGeneration"),
    "qwen3_omni_moe_thinker": MultimodalFamily("Qwen3OmniMoeThinkerForConditionalGeneration"),
}

# Substrings of model_types that take images, video or audio. A match outside MULTIMODAL_FAMILIES
# is refused: AutoModelForCausalLM would load it as text only (or fail obscurely) and the media
# would be silently ignored. "..._text" model_types are the text towers of such families.
_MULTIMODAL_MARKERS = ("vl", "omni", "llava", "gemma3", "idefics", "whisper", "vision", "audio", "speech",
                       "pixtral", "mllama", "paligemma", "blip", "siglip", "clip", "mistral3", "phi4_multimodal")
_MULTIMODAL_CONFIG_KEYS = ("vision_config", "audio_config", "thinker_config")


def _read_config(path: Path) -> dict[str, Any]:
    _require_model_dir(path)
    return json.loads((path / "config.json").read_text())


def model_type_of(path: str | Path) -> str:
    """config.json's `model_type` of the model directory at `path`."""
    return _model_type(_read_config(Path(path)), Path(path))


def _model_type(config: dict[str, Any], path: Path) -> str:
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ValueError(f"{path / 'config.json'} has no model_type; is it a Hugging Face model directory?")
    return model_type


def _looks_multimodal(model_type: str, config: dict[str, Any]) -> bool:
    if model_type.endswith("_text"):
        return False
    return any(marker in model_type for marker in _MULTIMODAL_MARKERS) or any(
        key in config for key in _MULTIMODAL_CONFIG_KEYS
    )


def _family(path: Path) -> MultimodalFamily | None:
    """The multimodal family of the model at `path`, None for a text model; raises for a
    multimodal model that relax-hpc cannot train."""
    config = _read_config(path)
    model_type = _model_type(config, path)
    family = MULTIMODAL_FAMILIES.get(model_type)
    if family is None and _looks_multimodal(model_type, config):
        raise ValueError(
            f"model_type {model_type} ({path}) is not supported for multimodal training; supported: "
            f"{', '.join(MULTIMODAL_FAMILIES)} (and text models that AutoModelForCausalLM loads)"
        )
    return family


def is_multimodal(path: str | Path) -> bool:
    """Whether the model at `path` is one of `MULTIMODAL_FAMILIES`. Raises ValueError for a
    multimodal model outside them, so it is never mistaken for a text model."""
    return _family(Path(path)) is not None


def checkpoint_weight_prefix(path: str | Path) -> str:
    """What the checkpoint's weight names have before the policy's: "thinker." for a full omni
    checkpoint (the policy is its thinker), "" otherwise. Weight sync to an inference server that
    serves the full checkpoint must prepend it (see also `checkpoint_state_dict`).

    A thinker-only checkpoint has it too when it was saved from a thinker that was loaded from a
    full one (transformers keeps the prefix it stripped), so for those the weight names decide.
    """
    path = Path(path)
    family = _family(path)
    if family is None or family.full_omni:
        return family.weight_prefix if family else ""
    if "omni" not in model_type_of(path):
        return ""
    names = _weight_names(path)
    return "thinker." if names and all(name.startswith("thinker.") for name in names) else ""


def _weight_names(path: Path) -> list[str]:
    """The tensor names of the checkpoint at `path`, from its safetensors index or header
    (none for a checkpoint in another format)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return list(json.loads(index.read_text())["weight_map"])
    if not (path / "model.safetensors").is_file():
        return []
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as weights:
        return list(weights.keys())


def checkpoint_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`model`'s weights named and laid out as its checkpoint's model.safetensors stores them.

    transformers 5 renames some weights when it loads them (Qwen2.5-VL's ``model.*`` becomes
    ``model.language_model.*``, an omni thinker's ``thinker.audio_tower.*`` becomes
    ``model.audio_tower.*``) and fuses MoE experts into 3-D tensors; this undoes all of it, the
    ``thinker.`` prefix included, as `save_pretrained` does. A tied output embedding appears as
    ``lm_head.weight`` although the checkpoint omits it.
    """
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, dict(model.state_dict()))  # type: ignore[arg-type]


def load_policy_model(path: str | Path, dtype: str = "float32", device: str = "cpu") -> torch.nn.Module:
    """Load the model to train from `path`: a text model exactly as `load_causal_lm` does, a
    multimodal one with the class of its family (`MULTIMODAL_FAMILIES`), local files only."""
    path = Path(path)
    family = _family(path)
    if family is None:
        return load_causal_lm(path, dtype=dtype, device=device)
    model_class = transformers_name(family.model_class)
    kwargs: dict[str, Any] = {"dtype": _torch_dtype(dtype), "local_files_only": True, "attn_implementation": "sdpa"}
    if family.full_omni:  # the thinker's class, with the thinker's part of the full config
        kwargs["config"] = _policy_config(path, family)
    return model_class.from_pretrained(path, **kwargs).to(device)


def empty_policy_model(path: str | Path, dtype: str = "float32") -> torch.nn.Module:
    """The model `load_policy_model` gives for `path` (same class, config, parameter names,
    shapes and dtypes), built on the meta device: no storage and no weights read.

    FSDP2 ranks build this, shard it, and fill only their shards (`relax_hpc.backends.sharded_load`),
    so no rank holds the whole model on its device. Its buffers are meta tensors too, the
    non-persistent ones (rotary ``inv_freq``) included: the loader copies them from a loaded model.
    """
    path = Path(path)
    family = _family(path)
    model_class = transformers_name("AutoModelForCausalLM" if family is None else family.model_class)
    config = _policy_config(path, family)
    # Auto classes build from a config with `from_config`, concrete model classes with `_from_config`.
    build = getattr(model_class, "from_config", None) or model_class._from_config
    with torch.device("meta"):
        return build(config, dtype=_torch_dtype(dtype), attn_implementation="sdpa")


def _policy_config(path: Path, family: MultimodalFamily | None) -> Any:  # -> transformers.PretrainedConfig
    config = transformers_name("AutoConfig").from_pretrained(path, local_files_only=True)
    if family is not None and family.full_omni:
        config = config.thinker_config
        config._name_or_path = str(path)  # as from_pretrained records it
    return config


def _torch_dtype(dtype: str) -> torch.dtype:
    if dtype not in _DTYPES:
        raise ValueError(f"model dtype {dtype!r} is not supported; use one of {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def load_tokenizer(path: str | Path):  # -> transformers.PreTrainedTokenizerBase
    """Load the tokenizer that lives next to the model weights."""
    AutoTokenizer = transformers_name("AutoTokenizer")

    path = Path(path)
    _require_model_dir(path)
    return AutoTokenizer.from_pretrained(path, local_files_only=True)
