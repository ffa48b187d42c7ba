"""What `relax-hpc validate` says a spec's media need, checked on tiny models of the production
specs' architectures: the right classes and pieces, and the combinations this version refuses."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest
import tomli_w

from relax_hpc.backends.megatron import refuse_multimodal
from relax_hpc.media.plan import check_media_plan, media_plan
from relax_hpc.media.processor import MediaProcessor
from relax_hpc.models.hf import load_policy_model
from relax_hpc.models.tiny_mm import write_tiny_multimodal
from relax_hpc.spec import SpecError
from relax_hpc.spec.loader import parse_spec

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("plan-models")
    return {arch: write_tiny_multimodal(base / arch, arch) for arch in ("qwen3_vl", "qwen3_omni", "qwen2_5_omni")}


def _spec(name: str, **changes: dict[str, Any]) -> Any:
    table = tomllib.loads((REPO / "jobspecs" / f"{name}.toml").read_text())
    for section, values in changes.items():
        table.setdefault(section, {}).update(values)
    return parse_spec(tomli_w.dumps(table), f"{name}.toml")


def test_qwen3_omni_spec_on_a_tiny_qwen3_omni_names_the_thinker_and_both_processor_pieces(tiny: dict) -> None:
    spec = _spec("qwen3_omni", model={"path": str(tiny["qwen3_omni"])})
    plan = check_media_plan(spec, "qwen3_omni.toml")
    assert plan.family is not None and plan.family.model_type == "qwen3_omni_moe"
    text = "\n".join(plan.lines)
    assert "trainer: loads Qwen3OmniMoeThinkerForConditionalGeneration" in text
    assert "image processor (PIL backend) and the Whisper feature extractor" in text
    assert "videos from 'video', audios from 'audio'" in text and "SGLang serves qwen3_omni_moe: yes" in text
    # ... and what the plan names is what loads.
    assert type(load_policy_model(tiny["qwen3_omni"])).__name__ == "Qwen3OmniMoeThinkerForConditionalGeneration"
    processor = MediaProcessor(tiny["qwen3_omni"])
    assert processor.image_processor is not None and processor.feature_extractor is not None


def test_qwen3_vl_spec_on_a_tiny_qwen3_vl_loads_the_vl_class_and_refuses_video(tiny: dict) -> None:
    spec = _spec("qwen3_vl_4b_openr1", model={"path": str(tiny["qwen3_vl"])})
    plan = check_media_plan(spec, "qwen3_vl_4b_openr1.toml")
    assert "trainer: loads Qwen3VLForConditionalGeneration (qwen3_vl; image)" in "\n".join(plan.lines)
    assert MediaProcessor(tiny["qwen3_vl"]).feature_extractor is None  # no audio tower, no extractor

    with_video = _spec("qwen3_vl_4b_openr1", model={"path": str(tiny["qwen3_vl"])}, data={"video_key": "video"})
    with pytest.raises(SpecError, match=r"data.video_key = 'video': qwen3_vl does not read videos: .*timestamp"):
        check_media_plan(with_video, "x.toml")


def test_unreadable_production_model_still_gets_each_components_needs() -> None:
    plan = check_media_plan(_spec("qwen3_omni"), "qwen3_omni.toml")
    assert plan.model_type is None
    assert [line.split(":")[0] for line in plan.lines] == ["data", "model", "trainer", "rollout"]


@pytest.mark.parametrize("change, key", [
    ({"train": {"backend": "megatron", "strategy": "ddp"}}, "train.backend"),
    ({"model": {"path": "QWEN2_5_OMNI"}}, "rollout.engine"),  # SGLang has no Qwen2.5-Omni model
    ({"model": {"path": "TEXT"}}, "model.path"),  # media columns with a text-only model
    ({"train": {"device": "cpu"}}, "data.video_key"),  # SGLang on CPU cannot decode video
])
def test_what_this_version_cannot_run_is_refused_with_the_key_to_change(
    tiny: dict, tiny_model_dir: Path, change: dict, key: str
) -> None:
    paths = {"QWEN2_5_OMNI": str(tiny["qwen2_5_omni"]), "TEXT": str(tiny_model_dir)}
    if "model" in change:
        change = {"model": {"path": paths[change["model"]["path"]]}}
    spec = _spec("qwen3_omni", **change)
    problems = media_plan(spec).problems
    assert [p.key for p in problems] == [key]
    with pytest.raises(SpecError, match=key.replace(".", r"\.")):
        check_media_plan(spec, "qwen3_omni.toml")


def test_a_text_spec_has_no_media_plan(tiny_model_dir: Path) -> None:
    plan = media_plan(_spec("tiny_local", model={"path": str(tiny_model_dir)}))
    assert plan.kinds == () and plan.lines == [] and plan.problems == []


def test_the_megatron_backend_refuses_a_multimodal_model_before_building_anything(tiny: dict,
                                                                                   tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"no vision or audio towers yet; set \[train\] backend = \"torch\""):
        refuse_multimodal(tiny["qwen3_vl"])
    refuse_multimodal(tiny_model_dir)  # a text model passes


def test_the_loader_and_the_media_layer_know_the_same_families() -> None:
    # relax_hpc.models.hf loads them and relax_hpc.media.families builds their inputs; a family
    # in one table only would load without inputs, or have inputs for a class nothing loads.
    from relax_hpc.media.families import FAMILIES
    from relax_hpc.models.hf import MULTIMODAL_FAMILIES

    assert sorted(MULTIMODAL_FAMILIES) == sorted(FAMILIES)


def test_a_spec_with_audio_and_video_is_refused_where_the_media_extra_is_not_installed(
        tiny: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    table = tomllib.loads((REPO / "jobspecs" / "qwen3_omni.toml").read_text())
    table["model"]["path"] = str(tiny["qwen3_omni"])
    del table["container"]  # the host's environment decodes, not an image's
    spec = parse_spec(tomli_w.dumps(table), "qwen3_omni.toml")
    check_media_plan(spec, "qwen3_omni.toml")  # the decoders are installed here: no problem

    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("av", "soxr") else real(name, *a))
    with pytest.raises(SpecError) as refused:
        check_media_plan(spec, "qwen3_omni.toml")
    text = str(refused.value)
    assert "data.video_key = 'video': this environment has no av, which decode video" in text
    assert "data.audio_key = 'audio': this environment has no soxr, av, which decode audio" in text
    assert "pip install 'relax-hpc[media]'" in text
