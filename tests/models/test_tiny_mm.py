"""The tiny multimodal model directories (Qwen2.5-VL, Qwen3-VL, Qwen2.5-Omni, Qwen3-Omni): what
they hold, that `load_policy_model` picks the right Hugging Face class with the saved weights,
that the tokenizer and chat template render one placeholder per media part, and that a forward
with a real image (and audio) through the Hugging Face processors uses the media."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from relax_hpc.cli.main import main
from relax_hpc.models.hf import (
    checkpoint_state_dict,
    checkpoint_weight_prefix,
    is_multimodal,
    load_policy_model,
    load_tokenizer,
    model_type_of,
)
from relax_hpc.models.tiny_mm import (
    AUDIO_PAD,
    IMAGE_PAD,
    TINY_MM_ARCHS,
    VIDEO_PAD,
    VISION_END,
    VISION_START,
    is_omni,
    mm_token_ids,
    shape_for_engine,
    write_tiny_multimodal,
)

MODEL_TYPE = {"qwen2_5_vl": "qwen2_5_vl", "qwen3_vl": "qwen3_vl", "qwen2_5_omni": "qwen2_5_omni",
              "qwen3_omni": "qwen3_omni_moe"}
POLICY_CLASS = {
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "qwen2_5_omni": "Qwen2_5OmniThinkerForConditionalGeneration",
    "qwen3_omni": "Qwen3OmniMoeThinkerForConditionalGeneration",
}


@pytest.fixture(scope="module", params=TINY_MM_ARCHS)
def mm_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    arch = request.param
    return arch, write_tiny_multimodal(tmp_path_factory.mktemp("mm") / arch, arch, seed=0)


@pytest.fixture(scope="module")
def policy(mm_dir: tuple[str, Path]) -> Any:  # a transformers PreTrainedModel
    return load_policy_model(mm_dir[1]).eval()


def test_directory_contents(mm_dir: tuple[str, Path]) -> None:
    arch, path = mm_dir
    names = {p.name for p in path.iterdir()}
    expected = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                "tokenizer_config.json", "processor_config.json"}
    # An omni processor's image processor and feature extractor live nested in processor_config.json.
    assert names == expected | (set() if is_omni(arch) else {"preprocessor_config.json"})
    assert sum(p.stat().st_size for p in path.iterdir()) < 2 * 1024 * 1024
    assert model_type_of(path) == MODEL_TYPE[arch]
    processor = json.loads((path / "processor_config.json").read_text())
    assert {"processor_class", "image_processor", "video_processor"} <= set(processor)
    assert ("feature_extractor" in processor) == is_omni(arch)
    keys = load_file(path / "model.safetensors").keys()
    if is_omni(arch):  # the full model's layout, thinker only: enable_audio_output = false
        assert all(k.startswith("thinker.") for k in keys)
        assert json.loads((path / "config.json").read_text())["enable_audio_output"] is False


def test_processor_pieces_load(mm_dir: tuple[str, Path]) -> None:
    from transformers import AutoFeatureExtractor, AutoImageProcessor

    arch, path = mm_dir
    image = AutoImageProcessor.from_pretrained(path, backend="pil", local_files_only=True)
    assert (image.patch_size, image.merge_size, image.temporal_patch_size) == (8, 2, 2)
    if is_omni(arch):
        audio = AutoFeatureExtractor.from_pretrained(path, local_files_only=True)
        assert (audio.feature_size, audio.sampling_rate) == (16, 16000)


@pytest.mark.parametrize("arch", TINY_MM_ARCHS)
def test_refuses_to_overwrite(tmp_path: Path, arch: str) -> None:
    out = tmp_path / "model"
    out.mkdir()
    (out / "keep.txt").write_text("trained weights")
    with pytest.raises(FileExistsError, match="already exists"):
        write_tiny_multimodal(out, arch)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_unknown_arch_names_the_choices(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="llava.*qwen2_5_vl, qwen3_vl, qwen2_5_omni, qwen3_omni"):
        write_tiny_multimodal(tmp_path / "m", "llava")
    assert not (tmp_path / "m").exists()


def test_policy_class_and_weights_equal_the_checkpoint(mm_dir: tuple[str, Path], policy: Any) -> None:
    arch, path = mm_dir
    assert type(policy).__name__ == POLICY_CLASS[arch]
    assert policy.config._attn_implementation == "sdpa"
    assert is_multimodal(path)
    prefix = checkpoint_weight_prefix(path)
    assert prefix == ("thinker." if is_omni(arch) else "")
    assert not any(name.startswith("thinker.") for name in policy.state_dict())  # the trainer's names lack it
    saved = load_file(path / "model.safetensors")
    ours = checkpoint_state_dict(policy)
    # Every saved tensor reaches the model unchanged and nothing was newly initialised: the only
    # name the file lacks is the output embedding, tied to the input one.
    assert set(ours) - set(saved) == {prefix + "lm_head.weight"}
    assert set(saved) <= set(ours)
    for name, tensor in saved.items():
        assert torch.equal(ours[name], tensor), name
    assert policy.get_output_embeddings().weight is policy.get_input_embeddings().weight


def test_thinker_checkpoint_loads_as_thinker(tmp_path: Path) -> None:
    # What saving the trained policy of a full omni checkpoint writes: a thinker-only config whose
    # weights keep the thinker. prefix, which checkpoint_weight_prefix reads from the names.
    full = write_tiny_multimodal(tmp_path / "full", "qwen3_omni")
    thinker: Any = load_policy_model(full)
    thinker.save_pretrained(tmp_path / "thinker")
    assert model_type_of(tmp_path / "thinker") == "qwen3_omni_moe_thinker"
    assert checkpoint_weight_prefix(tmp_path / "thinker") == "thinker."
    reloaded = load_policy_model(tmp_path / "thinker")
    assert type(reloaded).__name__ == "Qwen3OmniMoeThinkerForConditionalGeneration"


def test_tokenizer_special_tokens(mm_dir: tuple[str, Path], tiny_model_dir: Path) -> None:
    arch, path = mm_dir
    tokenizer = load_tokenizer(path)
    text_tokenizer = load_tokenizer(tiny_model_dir)
    ids = mm_token_ids(arch)
    assert (tokenizer.image_token, tokenizer.video_token) == (IMAGE_PAD, VIDEO_PAD)
    assert (tokenizer.vision_bos_token, tokenizer.vision_eos_token) == (VISION_START, VISION_END)
    assert tokenizer.image_token_id == ids[IMAGE_PAD]
    if is_omni(arch):
        assert tokenizer.audio_token == AUDIO_PAD and tokenizer.audio_token_id == ids[AUDIO_PAD]
        assert (tokenizer.audio_bos_token, tokenizer.audio_eos_token) == ("<|audio_start|>", "<|audio_end|>")
    config = json.loads((path / "config.json").read_text())
    config = config.get("thinker_config", config)
    # Qwen2.5-Omni's config spells it image_token_index, as the published checkpoint does.
    assert config.get("image_token_id", config.get("image_token_index")) == ids[IMAGE_PAD]
    assert config["text_config"]["vocab_size"] == len(tokenizer)
    # The text task's characters keep their ids.
    assert tokenizer("12+7=", add_special_tokens=False)["input_ids"] == [4, 5, 13, 10, 16]
    assert tokenizer.eos_token_id == text_tokenizer.eos_token_id


def test_chat_template(mm_dir: tuple[str, Path], tiny_model_dir: Path) -> None:
    arch, path = mm_dir
    tokenizer = load_tokenizer(path)
    text_messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "12+7="}]
    text = tokenizer.apply_chat_template(text_messages, add_generation_prompt=True, tokenize=False)
    assert text == load_tokenizer(tiny_model_dir).apply_chat_template(
        text_messages, add_generation_prompt=True, tokenize=False)
    parts: list[dict[str, Any]] = [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "video"}]
    if is_omni(arch):
        parts.append({"type": "audio"})
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": parts}], tokenize=False)
    expected = "<|im_start|>user:<|vision_start|><|image_pad|><|vision_end|>and<|vision_start|><|video_pad|><|vision_end|>"
    if is_omni(arch):
        expected += "<|audio_start|><|audio_pad|><|audio_end|>"
    assert rendered == expected + "<|im_end|>"
    if not is_omni(arch):
        with pytest.raises(Exception, match="audio is not supported.*text, image, video"):
            tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "audio"}]}], tokenize=False)


def _audio_token_count(arch: str, frames: torch.Tensor) -> int:
    from transformers.models.qwen2_5_omni import processing_qwen2_5_omni
    from transformers.models.qwen3_omni_moe import processing_qwen3_omni_moe

    if arch == "qwen3_omni":
        return int(processing_qwen3_omni_moe._get_feat_extract_output_lengths(frames)[0])
    return int(processing_qwen2_5_omni._get_feat_extract_output_lengths(frames)[0])


def _logits(arch: str, path: Path, model: Any, colour: tuple[int, int, int], hz: float) -> torch.Tensor:
    """One forward over a prompt with a 32x32 image (and 1 s of a `hz` tone for omni), its
    placeholders expanded to the encoders' token counts as a processor would."""
    from PIL import Image
    from transformers import AutoFeatureExtractor, AutoImageProcessor

    tokenizer = load_tokenizer(path)
    parts = [{"type": "image"}, *([{"type": "audio"}] if is_omni(arch) else []), {"type": "text", "text": "what?"}]
    text = tokenizer.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True,
                                         tokenize=False)
    image_processor = AutoImageProcessor.from_pretrained(path, backend="pil", local_files_only=True)
    media: dict[str, torch.Tensor] = dict(image_processor(images=[Image.new("RGB", (32, 32), colour)],
                                                          return_tensors="pt"))
    # A 32x32 image is a 4x4 grid of 8-pixel patches; 2x2 of them merge into one token.
    assert media["image_grid_thw"].tolist() == [[1, 4, 4]]
    text = text.replace(IMAGE_PAD, IMAGE_PAD * (int(media["image_grid_thw"][0].prod()) // 4))
    if is_omni(arch):
        extractor = AutoFeatureExtractor.from_pretrained(path, local_files_only=True)
        wave = (0.5 * np.sin(2 * np.pi * hz * np.arange(16000) / 16000)).astype(np.float32)
        audio = extractor([wave], sampling_rate=16000, padding="longest", return_attention_mask=True,
                          return_tensors="pt")
        text = text.replace(AUDIO_PAD, AUDIO_PAD * _audio_token_count(arch, audio["attention_mask"].sum(-1)))
        media |= {"input_features": audio["input_features"], "feature_attention_mask": audio["attention_mask"]}
    batch = tokenizer([text], return_tensors="pt", add_special_tokens=False)
    if not is_omni(arch):  # 1 marks image placeholders (2 would be video) for the rope index
        media["mm_token_type_ids"] = (batch["input_ids"] == tokenizer.image_token_id).int()
    with torch.no_grad():
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **media).logits


def test_forward_uses_the_media(mm_dir: tuple[str, Path], policy: Any) -> None:
    arch, path = mm_dir
    red = _logits(arch, path, policy, (255, 0, 0), 440.0)
    assert torch.isfinite(red).all()
    assert torch.equal(red, _logits(arch, path, policy, (255, 0, 0), 440.0))  # deterministic
    blue = _logits(arch, path, policy, (0, 0, 255), 440.0)
    assert (red - blue).abs().max() > 1e-3
    if is_omni(arch):
        # The random audio tower moves the logits only slightly (Qwen3-Omni's ~1e-5), but a forward
        # is exactly reproducible (above), so any change is the audio's doing.
        higher = _logits(arch, path, policy, (255, 0, 0), 1760.0)
        assert (red - higher).abs().max() > 1e-6


def test_text_model_loads_as_before(tiny_model_dir: Path) -> None:
    model = load_policy_model(tiny_model_dir)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert not is_multimodal(tiny_model_dir) and checkpoint_weight_prefix(tiny_model_dir) == ""
    assert model_type_of(tiny_model_dir) == "qwen3"


@pytest.mark.parametrize("config", [{"model_type": "llava"}, {"model_type": "qwen2_vl"},
                                    {"model_type": "mystery", "vision_config": {}}])
def test_unsupported_multimodal_is_refused_clearly(tmp_path: Path, config: dict[str, Any]) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))
    message = f"model_type {config['model_type']} .* is not supported for multimodal training; supported: qwen2_5_vl"
    with pytest.raises(ValueError, match=message):
        load_policy_model(tmp_path)
    with pytest.raises(ValueError, match=message):
        is_multimodal(tmp_path)


def test_missing_model_names_the_fix(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json missing.*make-tiny"):
        load_policy_model(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="config.json missing"):
        model_type_of(tmp_path)


@pytest.mark.parametrize(("args", "model_type"), [(["--kind", "vl"], "qwen2_5_vl"),
                                                  (["--kind", "omni", "--arch", "qwen2_5_omni"], "qwen2_5_omni")])
def test_cli_make_tiny_multimodal(tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str],
                                  model_type: str) -> None:
    assert main(["make-tiny", str(tmp_path / "m"), *args]) == 0
    assert model_type_of(tmp_path / "m") == model_type
    out = capsys.readouterr().out
    assert str(tmp_path / "m") in out and "parameters" in out and "KiB" in out


@pytest.mark.parametrize("args", [["--kind", "vl", "--arch", "qwen3_omni"], ["--kind", "text", "--arch", "qwen3_vl"]])
def test_cli_make_tiny_kind_and_arch_must_agree(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                args: list[str]) -> None:
    assert main(["make-tiny", str(tmp_path / "m"), *args]) == 2
    assert "pass --kind" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()



@pytest.mark.parametrize(("arch", "on_sglang", "shape"), [
    ("qwen3_omni", True, {"deepstack_layers": 3}), ("qwen2_5_vl", True, {"patch_size": 14}),
    ("qwen3_vl", True, {}), ("qwen3_omni", False, {}), ("qwen2_5_vl", False, {}),
])
def test_shape_for_engine_names_what_sglang_reads(arch: str, on_sglang: bool, shape: dict[str, int]) -> None:
    # SGLang 0.5.23's Qwen3-VL-MoE text model (the omni thinker's) adds range(3) deepstack slices
    # whatever the config says, so a tiny omni with one feature fails on its first image.
    assert shape_for_engine(arch, on_sglang) == shape


def test_omni_with_three_deepstack_layers_feeds_three_features(tmp_path: Path) -> None:
    out = write_tiny_multimodal(tmp_path / "omni", "qwen3_omni", seed=0, deepstack_layers=3)
    vision = json.loads((out / "config.json").read_text())["thinker_config"]["vision_config"]
    assert vision["deepstack_visual_indexes"] == [0, 1, 2] and vision["depth"] == 3
    model = load_policy_model(out).eval()
    assert len(model.model.visual.merger_list) == 3  # one deepstack merger per feature
