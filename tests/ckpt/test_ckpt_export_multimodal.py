"""HF export of VL and omni checkpoints: the family's own class, the source's layout, its processor.

The tiny Qwen2.5-VL, Qwen3-VL, Qwen2.5-Omni and Qwen3-Omni of `relax-hpc make-tiny` (tiny_mm.py),
loaded as the trainer loads them (`load_policy_model`), every weight changed, saved through
CheckpointManager, exported, and loaded back. A fifth source is the tiny Qwen3-Omni rewritten as a
published omni checkout looks:
two safetensors shards with an index, and talker / code2wav tensors the thinker does not train.
The AutoProcessor check runs in the SGLang environment (its torchvision), skipped without it.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from ckpt_helpers import resume_state
from safetensors.torch import load_file, save_file
from side_env import SGLANG, run_json_script

from relax_hpc.ckpt import CheckpointManager
from relax_hpc.ckpt.export import MODEL_FILES, export_hf
from relax_hpc.ckpt.formats import UnknownCheckpointLayout, checkpoint_backend
from relax_hpc.ckpt.hf_files import INDEX_FILE, weight_files
from relax_hpc.models.hf import checkpoint_weight_prefix, load_policy_model
from relax_hpc.models.tiny_mm import write_tiny_multimodal

ARCHS = ("qwen2_5_vl", "qwen3_vl", "qwen2_5_omni", "qwen3_omni")
CASES = (*ARCHS, "qwen3_omni_sharded")
FULL_OMNI_CLASS = {"qwen2_5_omni": "Qwen2_5OmniForConditionalGeneration",
                   "qwen3_omni": "Qwen3OmniMoeForConditionalGeneration"}
# Tensors a published omni checkpoint has besides the thinker's (the talker's, code2wav's).
NOT_THINKER = ("talker.codec_head.weight", "code2wav.pre_transformer.norm.weight", "code2wav.code_offset")


@dataclass
class Case:
    source: Path
    job: Path  # a job directory: spec.toml and checkpoints/
    checkpoint: Path
    out: Path
    trained: dict[str, torch.Tensor]
    policy_class: type


def _published_omni_layout(tiny: Path, dest: Path) -> Path:
    """``tiny`` as two shards plus an index, with tensors of the parts that are not the thinker."""
    shutil.copytree(tiny, dest)
    tensors = load_file(dest / "model.safetensors")
    (dest / "model.safetensors").unlink()
    generator = torch.Generator().manual_seed(7)
    others = {NOT_THINKER[0]: torch.randn(8, 4, generator=generator),
              NOT_THINKER[1]: torch.randn(4, generator=generator),
              NOT_THINKER[2]: torch.arange(6, dtype=torch.int64)}
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": {n: tensors[n] for n in names[: len(names) // 2]} | others,
              "model-00002-of-00002.safetensors": {n: tensors[n] for n in names[len(names) // 2 :]}}
    for file, part in shards.items():
        save_file(part, str(dest / file), metadata={"format": "pt"})
    index = {"metadata": {"total_size": 0}, "weight_map": {n: f for f, part in shards.items() for n in part}}
    (dest / INDEX_FILE).write_text(json.dumps(index))
    return dest


def _spec(source: Path) -> str:
    text = (Path(__file__).resolve().parents[2] / "jobspecs" / "tiny_omni.toml").read_text()
    return text.replace('"runs/models/tiny-qwen3-omni"', f'"{source}"', 1)


def _case(root: Path, name: str, tiny: dict[str, Path]) -> Case:
    source = _published_omni_layout(tiny["qwen3_omni"], root / name) if name.endswith("_sharded") else tiny[name]
    policy = load_policy_model(source)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # every weight moves, the vision and audio towers' too
        for parameter in policy.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.02)
    job = root / f"job-{name}"
    job.mkdir()
    (job / "spec.toml").write_text(_spec(source))
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    checkpoint = CheckpointManager(job / "checkpoints").save(3, policy, optimizer, resume_state(3))
    out = export_hf(checkpoint, source, root / f"hf-{name}")
    trained = {k: v.detach().clone() for k, v in policy.state_dict().items()}
    return Case(source, job, checkpoint, out, trained, type(policy))


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Case]:
    root = tmp_path_factory.mktemp("mm_export")
    tiny = {arch: write_tiny_multimodal(root / f"tiny-{arch}", arch) for arch in ARCHS}
    # A published Qwen2.5-Omni has its speakers' voices beside the weights; its full class needs them.
    torch.save({"Chelsie": {"bos_token": 151870, "cond": torch.randn(4)}}, tiny["qwen2_5_omni"] / "spk_dict.pt")
    return {name: _case(root, name, tiny) for name in CASES}


def _assert_equal_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


@pytest.mark.parametrize("name", CASES)
def test_the_export_loads_back_with_its_family_class_and_exactly_the_trained_weights(
    cases: dict[str, Case], name: str
) -> None:
    case = cases[name]
    back = load_policy_model(case.out)
    assert type(back) is case.policy_class
    _assert_equal_state(back.state_dict(), case.trained)
    source = load_policy_model(case.source).state_dict()
    assert not [n for n, t in case.trained.items() if torch.equal(source[n], t)]  # every tensor was trained
    if name.endswith("_vl"):
        from transformers import AutoModelForImageTextToText

        _assert_equal_state(AutoModelForImageTextToText.from_pretrained(case.out).state_dict(), case.trained)
    else:  # the full omni class loads it too: the export replaces the published checkout
        import transformers

        full = getattr(transformers, FULL_OMNI_CLASS[name.removesuffix("_sharded")]).from_pretrained(case.out)
        _assert_equal_state(full.thinker.state_dict(), case.trained)


@pytest.mark.parametrize("name", CASES)
def test_the_export_keeps_the_sources_layout_config_and_processor_files(cases: dict[str, Case], name: str) -> None:
    case = cases[name]
    assert sorted(weight_files(case.out)) == sorted(weight_files(case.source))  # thinker.* for omni
    assert checkpoint_weight_prefix(case.out) == checkpoint_weight_prefix(case.source)
    config = json.loads((case.out / "config.json").read_text())
    source_config = json.loads((case.source / "config.json").read_text())
    assert config["model_type"] == source_config["model_type"]
    if not name.endswith("_vl"):  # the full model's config, talker and code2wav included
        assert (case.out / "config.json").read_bytes() == (case.source / "config.json").read_bytes()
    copied = [n for n in MODEL_FILES if (case.source / n).is_file()]
    assert "processor_config.json" in copied and "tokenizer.json" in copied
    assert ("spk_dict.pt" in copied) == (name == "qwen2_5_omni")
    for file in copied:
        assert (case.out / file).read_bytes() == (case.source / file).read_bytes(), file
    from relax_hpc.media.processor import media_processor_for

    assert media_processor_for(case.out) is not None  # the project's own processor builds from it


def test_tensors_the_thinker_does_not_train_are_copied_unchanged(cases: dict[str, Case]) -> None:
    case = cases["qwen3_omni_sharded"]
    files = weight_files(case.out)
    assert (case.out / INDEX_FILE).is_file() and not (case.out / "model.safetensors").exists()
    assert sorted(set(files.values())) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    source_files = weight_files(case.source)
    for name in NOT_THINKER:
        got = load_file(case.out / files[name])[name]
        want = load_file(case.source / source_files[name])[name]
        assert got.dtype == want.dtype and torch.equal(got, want), name
    index = json.loads((case.out / INDEX_FILE).read_text())
    sizes = sum(t.numel() * t.element_size() for f in set(files.values()) for t in load_file(case.out / f).values())
    assert index["metadata"]["total_size"] == sizes


def test_an_export_in_another_dtype_stores_everything_and_says_so_in_that_dtype(
    cases: dict[str, Case], tmp_path: Path
) -> None:
    import transformers

    case = cases["qwen3_omni_sharded"]
    out = export_hf(case.checkpoint, case.source, tmp_path / "bf16", dtype=torch.bfloat16)
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["thinker_config"] == json.loads(
        (case.source / "config.json").read_text())["thinker_config"]
    files = weight_files(out)
    copied = {n: load_file(out / files[n])[n] for n in NOT_THINKER}
    assert [t.dtype for t in copied.values()] == [torch.bfloat16, torch.bfloat16, torch.int64]
    full = getattr(transformers, FULL_OMNI_CLASS["qwen3_omni"]).from_pretrained(out)
    _assert_equal_state(full.thinker.state_dict(), {n: t.to(torch.bfloat16) for n, t in case.trained.items()})


def test_convert_exports_a_torch_backend_checkpoint_of_an_omni_run(cases: dict[str, Case], tmp_path: Path) -> None:
    from relax_hpc.cli.main import main

    case = cases["qwen3_omni"]
    assert main(["convert", str(case.job), str(tmp_path / "hf")]) == 0
    _assert_equal_state(load_policy_model(tmp_path / "hf").state_dict(), case.trained)


@pytest.mark.slow
@pytest.mark.sglang
def test_auto_processor_of_the_export_equals_the_sources(cases: dict[str, Case]) -> None:
    python = SGLANG.python_or_skip()
    script = Path(__file__).with_name("processor_check.py")
    pairs = {name: (cases[name].source, cases[name].out) for name in ARCHS}
    result = run_json_script(python, script, *(str(p) for pair in pairs.values() for p in pair), timeout_s=600)
    for source, out in pairs.values():
        assert result[str(out)] == result[str(source)]
    got = {name: result[str(out)] for name, (_, out) in pairs.items()}
    assert got["qwen2_5_vl"]["processor"] == "Qwen2_5_VLProcessor"
    assert got["qwen3_vl"]["processor"] == "Qwen3VLProcessor"
    assert got["qwen2_5_omni"]["processor"] == "Qwen2_5OmniProcessor"
    assert got["qwen3_omni"]["processor"] == "Qwen3OmniMoeProcessor"
    for omni in (got["qwen2_5_omni"], got["qwen3_omni"]):
        assert omni["feature_extractor"] == "WhisperFeatureExtractor"
        assert {"pixel_values", "input_features"} <= set(omni["outputs"])


# -- what cannot be exported, and what to do --------------------------------------------------


def _raw_checkpoint(path: Path, tensors: dict[str, torch.Tensor], megatron_metadata: bool) -> Path:
    import torch.distributed.checkpoint as dcp

    from relax_hpc.ckpt.manager import single_process_quiet

    path.mkdir(mode=0o700)
    with single_process_quiet():
        dcp.save(tensors, checkpoint_id=path, no_dist=True)
    if megatron_metadata:  # what megatron-core's dist_checkpointing writes beside DCP's files
        (path / "metadata.json").write_text('{"sharded_backend": "torch_dist", "sharded_backend_version": 1}')
    return path


def test_which_backend_wrote_a_checkpoint_is_read_from_its_files(cases: dict[str, Case], tmp_path: Path) -> None:
    assert checkpoint_backend(cases["qwen3_vl"].checkpoint) == "torch"
    weight = torch.ones(2, 2)
    megatron = _raw_checkpoint(tmp_path / "megatron", {"decoder.layers.mlp.linear_fc1.weight": weight}, True)
    assert checkpoint_backend(megatron) == "megatron"
    lost = _raw_checkpoint(tmp_path / "lost", {"embedding.word_embeddings.weight": weight}, False)
    with pytest.raises(UnknownCheckpointLayout, match=r"Megatron-named .*no metadata.json.*incomplete"):
        checkpoint_backend(lost)
    other = _raw_checkpoint(tmp_path / "other", {"encoder.weight": weight}, False)
    with pytest.raises(UnknownCheckpointLayout, match=r"not a relax-hpc checkpoint.*encoder.weight"):
        checkpoint_backend(other)


def test_export_hf_refuses_a_megatron_checkpoint_and_names_the_command(cases: dict[str, Case], tmp_path: Path) -> None:
    megatron = _raw_checkpoint(tmp_path / "step_1", {"decoder.final_layernorm.weight": torch.ones(4)}, True)
    with pytest.raises(ValueError, match=r"megatron backend.*relax-hpc convert.*\.venv-megatron"):
        export_hf(megatron, cases["qwen3_vl"].source, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_multimodal_family_that_cannot_be_trained_cannot_be_exported(cases: dict[str, Case], tmp_path: Path) -> None:
    case = cases["qwen3_vl"]
    other = shutil.copytree(case.source, tmp_path / "llava")
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(config | {"model_type": "llava_next"}))
    with pytest.raises(ValueError, match=r"model_type llava_next.*does not load as a relax-hpc policy.*supported: "
                                         r"qwen2_5_vl.*\[model\] path"):
        export_hf(case.checkpoint, other, tmp_path / "out")
    assert not (tmp_path / "out").exists()
