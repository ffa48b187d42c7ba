"""`empty_policy_model`: the model `load_policy_model` gives, built on the meta device.

Sharded loading builds it on every rank and fills it from rank 0's `from_pretrained` copy, so its
class, config and every state-dict name, shape and dtype must be those of the loaded model, for the
families whose weights transformers converts on load (MoE experts fused, VL renames, the omni
thinker's prefix), and nothing in it may have storage.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from relax_hpc.models.hf import empty_policy_model, load_policy_model
from relax_hpc.models.tiny_mm import write_tiny_multimodal
from relax_hpc.models.tiny_moe import write_tiny_moe_model

KINDS = ("text", "moe", "qwen2_5_vl", "qwen3_omni")


@pytest.fixture(scope="module")
def model_dirs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("empty-policy")
    dirs = {"text": tiny_model_dir, "moe": write_tiny_moe_model(root / "moe")}
    for arch in ("qwen2_5_vl", "qwen3_omni"):
        dirs[arch] = write_tiny_multimodal(root / arch, arch)
    return dirs


@pytest.mark.parametrize("kind", KINDS)
def test_built_on_meta_like_the_loaded_model(model_dirs: dict[str, Path], kind: str) -> None:
    loaded = load_policy_model(model_dirs[kind], dtype="bfloat16")
    empty = empty_policy_model(model_dirs[kind], dtype="bfloat16")
    assert type(empty) is type(loaded)
    assert empty.config.to_dict() == loaded.config.to_dict()
    layout = {name: (t.shape, t.dtype) for name, t in loaded.state_dict().items()}
    assert {name: (t.shape, t.dtype) for name, t in empty.state_dict().items()} == layout
    assert {name: (t.shape, t.dtype) for name, t in empty.named_buffers()} == {
        name: (t.shape, t.dtype) for name, t in loaded.named_buffers()}  # rotary tables stay float32
    assert {t.device for t in [*empty.parameters(), *empty.buffers()]} == {torch.device("meta")}
    assert empty.lm_head.weight is empty.get_input_embeddings().weight  # tied, as loaded


def test_refuses_an_unknown_dtype(model_dirs: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="dtype 'int8'.*float32, bfloat16, float16"):
        empty_policy_model(model_dirs["text"], dtype="int8")
