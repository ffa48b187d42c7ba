"""What a spec's media need from each component, checked before a job starts (`relax-hpc validate`).

`media_plan` reads the model's config.json where it is readable here (or knows the tiny model
`build_tiny_if_missing` will write) and says, per component, what it will load and what it needs;
its problems are the combinations this version cannot run, named with the key to change.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from relax_hpc.media.families import Family, family_of, supported_model_types
from relax_hpc.spec.errors import SpecError, SpecProblem, show_value
from relax_hpc.spec.schema import JobSpec

# What an SGLang server's environment must hold to read each media kind: SGLang 0.5.23 reads audio
# with soundfile and torchaudio (`load_audio` imports it; without it every request with audio answers
# HTTP 500 "No module named 'torchaudio'"), and decodes video with torchcodec or decord. Any one
# package of a kind's tuple serves it.
SGLANG_MEDIA_PACKAGES: dict[str, tuple[str, ...]] = {"audio": ("torchaudio",), "video": ("torchcodec", "decord")}

# The model_type of each tiny architecture `[model] tiny_arch` names.
TINY_MODEL_TYPES = {"qwen3": "qwen3", "qwen3_tools": "qwen3", "qwen2_5_vl": "qwen2_5_vl", "qwen3_vl": "qwen3_vl",
                    "qwen2_5_omni": "qwen2_5_omni", "qwen3_omni": "qwen3_omni_moe"}


@dataclass
class MediaPlan:
    kinds: tuple[str, ...]  # the media kinds [data] names columns for
    model_type: str | None  # None: config.json not readable here
    family: Family | None
    lines: list[str] = field(default_factory=list)  # per component: what it loads and needs
    problems: list[SpecProblem] = field(default_factory=list)


def _media_columns(spec: JobSpec) -> dict[str, str]:
    keys = {"image": spec.data.image_key, "video": spec.data.video_key, "audio": spec.data.audio_key}
    return {kind: key for kind, key in keys.items() if key}


def _model_config(spec: JobSpec) -> dict | None:
    path = Path(spec.model.path).expanduser() / "config.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        if spec.model.build_tiny_if_missing:
            return {"model_type": TINY_MODEL_TYPES[spec.model.tiny_arch], "architectures": []}
        return None


def media_plan(spec: JobSpec) -> MediaPlan:
    columns = _media_columns(spec)
    config = _model_config(spec)
    model_type = str(config.get("model_type", "")) if config is not None else None
    family = family_of(model_type) if model_type else None
    plan = MediaPlan(tuple(columns), model_type, family)
    if not columns and family is None:
        return plan
    _check(spec, plan, columns)
    _explain(spec, plan, columns, config)
    return plan


def _check(spec: JobSpec, plan: MediaPlan, columns: dict[str, str]) -> None:
    family, problems = plan.family, plan.problems
    if columns and plan.model_type is not None and family is None:
        problems.append(SpecProblem(
            "model.path", show_value(spec.model.path),
            f"is a text-only model (model_type {plan.model_type}) but [data] names media columns; use a "
            f"multimodal model ({supported_model_types()}) or unset image_key / audio_key / video_key"))
    for kind, key in columns.items():
        if family is not None and kind not in family.kinds:
            note = f": {family.video_note}" if kind == "video" and family.video_note else ""
            problems.append(SpecProblem(f"data.{kind}_key", show_value(key),
                                        f"{family.model_type} does not read {kind}s{note}"))
    if columns and spec.train.backend == "megatron":
        problems.append(SpecProblem(
            "train.backend", show_value(spec.train.backend),
            'the Megatron backend has no vision or audio towers yet; set backend = "torch" '
            '(strategy = "fsdp2" shards a large model) for a data set with media'))
    if "video" in columns and spec.rollout.on_sglang and spec.train.device == "cpu":
        problems.append(SpecProblem(
            "data.video_key", show_value(columns["video"]),
            'an SGLang server on CPU cannot decode video (it needs torchcodec or decord); set [rollout] '
            'engine = "native" to train on video on CPU, or run the engines on GPUs'))
    if columns and spec.rollout.on_sglang:
        problems += _sglang_env_problems(spec, columns)
    if spec.container.image is None:  # in an image, `validate --image` checks its environment
        problems += _decoder_problems(columns)
    if columns and spec.rollout.on_sglang and family is not None and not family.sglang:
        problems.append(SpecProblem(
            "rollout.engine", show_value(spec.rollout.engine),
            f'SGLang has no model for {family.model_type}; set engine = "native" for this model'))


# The packages relax_hpc/media/decode.py reads each kind with (the [media] extra).
MEDIA_DECODERS = {"video": ("av",), "audio": ("soundfile", "soxr", "av")}


def _decoder_problems(columns: dict[str, str]) -> list[SpecProblem]:
    """The media kinds whose decoders this interpreter lacks (looked up, not imported)."""
    problems = []
    for kind, key in columns.items():
        missing = [name for name in MEDIA_DECODERS.get(kind, ()) if importlib.util.find_spec(name) is None]
        if missing:
            problems.append(SpecProblem(
                f"data.{kind}_key", show_value(key),
                f"this environment has no {', '.join(missing)}, which decode {kind}: pip install "
                f"'relax-hpc[media]', or unset [data] {kind}_key"))
    return problems


def _sglang_env_problems(spec: JobSpec, columns: dict[str, str]) -> list[SpecProblem]:
    """The media kinds whose packages the SGLang environment lacks, where it is on this machine."""
    python = spec.rollout.sglang.python
    installed = installed_packages(python)
    if installed is None:
        return []
    where = f"the SGLang environment of [rollout.sglang] python = {python!r}" if python else "this interpreter"
    fixes = {"audio": "tools/setup-sglang-cpu adds it to an existing environment",
             "video": "pip install torchcodec into it"}
    problems = []
    for kind, key in columns.items():
        need = SGLANG_MEDIA_PACKAGES.get(kind, ())
        if kind == "video" and spec.train.device == "cpu":
            continue  # refused above, whatever is installed
        if need and not installed & set(need):
            problems.append(SpecProblem(
                f"data.{kind}_key", show_value(key),
                f"{where} has no {' or '.join(need)}, so its servers would answer every request with {kind} "
                f'with HTTP 500: install it ({fixes[kind]}), set [rollout] engine = "native", or unset '
                f"[data] {kind}_key"))
    return problems


def installed_packages(python: str | None) -> set[str] | None:
    """The distributions (normalised names) of the venv that `python` belongs to (a path relative
    to the working directory, or a name on PATH), read from its site-packages without running it;
    for None, this interpreter's, when it can import sglang. None where that cannot be told here
    (no such file, not a venv, or a venv that also sees the system's packages)."""
    if python is None:
        if importlib.util.find_spec("sglang") is None:
            return None  # the start check (engines/factory.py) names what to set
        return {name for name in ("torchaudio", "torchcodec", "decord") if importlib.util.find_spec(name)}
    found = Path(python) if "/" in python else Path(shutil.which(python) or python)
    env = found.absolute().parent.parent  # DIR/bin/python, not resolved: the link leads out of the venv
    try:
        config = (env / "pyvenv.cfg").read_text(encoding="utf-8")
    except OSError:
        return None
    if re.search(r"(?m)^include-system-site-packages\s*=\s*true", config):
        return None
    return {re.sub(r"[-_.]+", "-", meta.name.split("-")[0]).lower()
            for meta in env.glob("lib/python3*/site-packages/*.dist-info")}


def _explain(spec: JobSpec, plan: MediaPlan, columns: dict[str, str], config: dict | None) -> None:
    lines = plan.lines
    if columns:
        what = ", ".join(f"{kind}s from '{key}'" for kind, key in columns.items())
        video = (f"; video sampled at {spec.data.video_fps:g} fps, at most {spec.data.max_frames} frames"
                 if "video" in columns else "")
        blank = " (blanked: drop_media = true)" if spec.data.drop_media else ""
        lines.append(f"data: {what}{blank}, read beside {spec.data.path}, at most "
                     f"{spec.data.max_media_bytes} bytes each{video}; unusable media drop their row (counted)")
    if plan.family is None:
        if plan.model_type is None:
            lines.append(f"model: {spec.model.path} is not readable here (validate where it is to check it); "
                         f"to read the media it must be one of {supported_model_types()}")
            lines.append("trainer: will load the model's multimodal class (an Omni checkpoint's thinker) with "
                         "its image processor and, for audio, its Whisper feature extractor "
                         "(preprocessor_config.json or processor_config.json beside the weights)")
            lines.append("rollout: " + ("the native engine loads the same" if not spec.rollout.on_sglang else
                                        "each SGLang server loads the model and its processor; relax-hpc sends "
                                        "each prompt's media as data URLs" +
                                        ("; video only on GPU servers" if "video" in columns else "")))
        return
    from relax_hpc.models.hf import MULTIMODAL_FAMILIES

    family = plan.family
    loader = MULTIMODAL_FAMILIES[family.model_type].model_class if family.model_type in MULTIMODAL_FAMILIES else "?"
    if loader.startswith("Auto") and config and config.get("architectures"):
        loader = str(config["architectures"][0])
    pieces = " and ".join(p for p in (
        "the image processor (PIL backend)" if family.kinds & {"image", "video"} else "",
        "the Whisper feature extractor" if "audio" in family.kinds else "") if p)
    inputs = (f"loads {loader} ({family.model_type}; {', '.join(sorted(family.kinds))}) and {pieces} "
              f"from {spec.model.path}")
    lines.append(f"trainer: {inputs}; rebuilds each micro-batch's media tensors and M-RoPE positions from "
                 "the rows' canonical media")
    if not spec.rollout.on_sglang:
        lines.append("rollout: the native engine loads the same model and pieces; it prefills with the media "
                     "and never samples media markup tokens")
    else:
        video = "; video only on GPU servers" if "video" in columns else ""
        lines.append(f"rollout: SGLang servers load the model with their own processor; relax-hpc sends each "
                     f"prompt's media as data URLs and checks the servers' placeholder expansion against its "
                     f"own (SGLang serves {family.model_type}: {'yes' if family.sglang else 'no'}{video})")


def check_media_plan(spec: JobSpec, source: str) -> MediaPlan:
    """The spec's media plan; SpecError listing what this version cannot run."""
    plan = media_plan(spec)
    if plan.problems:
        raise SpecError(plan.problems, source)
    return plan
