"""Where `strategy = "fsdp2"` cuts a model into FSDP2 units, known from config.json alone.

FSDP2 wraps each decoder layer of the language model, each media tower (vision, audio) as one
unit, then the root (`relax_hpc.backends.parallel.shard_model`). This module says where those
modules live for a model_type, and why a model cannot be wrapped, without torch or the weights,
so `relax-hpc validate` can refuse a spec before any rank has loaded the model:

    fsdp2_refusal(json.loads(Path(model_dir, "config.json").read_text()))  # None: it can

The paths are attribute paths from the module that is trained (the HF causal LM, a VL model, or
an omni model's thinker). `parallel.fsdp_units` finds the same modules on a built model (and
refuses a model without decoder layers there, for what this table does not know).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from relax_hpc.media.families import FAMILIES, family_of

__all__ = ["OMNI_LAYOUT", "TEXT_LAYOUT", "VL_LAYOUT", "Fsdp2Layout", "fsdp2_layout", "fsdp2_refusal"]


@dataclass(frozen=True)
class Fsdp2Layout:
    """The modules of a model that become FSDP2 units (the root takes everything else)."""

    layers: str  # the language model's decoder-layer list: one unit per layer
    towers: tuple[str, ...] = ()  # media encoders: one unit each


TEXT_LAYOUT = Fsdp2Layout("model.layers")  # every HF causal LM that keeps its blocks at <base>.layers
VL_LAYOUT = Fsdp2Layout("model.language_model.layers", ("model.visual",))
OMNI_LAYOUT = Fsdp2Layout("model.language_model.layers", ("model.visual", "model.audio_tower"))

# Text model_types whose AutoModelForCausalLM keeps its blocks elsewhere than model.layers.
_BLOCKS_ELSEWHERE: dict[str, str] = {
    "gpt2": "transformer.h",
    "gpt_bigcode": "transformer.h",
    "gpt_neo": "transformer.h",
    "gptj": "transformer.h",
    "codegen": "transformer.h",
    "bloom": "transformer.h",
    "falcon": "transformer.h",
    "mpt": "transformer.blocks",
    "opt": "model.decoder.layers",
}
_MEDIA_CONFIG_KEYS = ("vision_config", "audio_config", "thinker_config")


def fsdp2_layout(config: Mapping[str, Any]) -> Fsdp2Layout:
    """The FSDP2 units of the model that `config` (a parsed config.json) describes.

    Raises ValueError, saying what to do, for a model `strategy = "fsdp2"` cannot wrap.
    """
    reason = fsdp2_refusal(config)
    if reason is not None:
        raise ValueError(reason)
    family = family_of(str(config["model_type"]))
    if family is None:
        return TEXT_LAYOUT
    # Every multimodal family relax-hpc trains (a full omni checkpoint trains its thinker) keeps its
    # language model at model.language_model, a vision tower, and an audio tower when it hears.
    return OMNI_LAYOUT if "audio" in family.kinds else VL_LAYOUT


def fsdp2_refusal(config: Mapping[str, Any]) -> str | None:
    """Why `[train] strategy = "fsdp2"` cannot wrap the model `config` describes; None if it can.

    Pure (no torch, no files): what `validate` calls with the model's config.json.
    """
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        return ("[train] strategy = \"fsdp2\" needs the model's config.json to name its model_type; "
                "is [model] path a Hugging Face model directory?")
    if model_type in FAMILIES:
        return None
    if model_type in _BLOCKS_ELSEWHERE:
        return (f"[train] strategy = \"fsdp2\" wraps each decoder layer at model.layers, but model_type "
                f"{model_type} keeps its blocks at {_BLOCKS_ELSEWHERE[model_type]}; use strategy = \"ddp\" "
                "for this model")
    media = [key for key in _MEDIA_CONFIG_KEYS if key in config]
    if media:
        return (f"[train] strategy = \"fsdp2\" wraps the media towers of the families "
                f"{', '.join(FAMILIES)} only, and model_type {model_type} has {', '.join(media)}; "
                "use one of those families, or strategy = \"ddp\"")
    return None
