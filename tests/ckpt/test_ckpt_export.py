"""DCP checkpoint -> Hugging Face directory, with a tiny Qwen3 model built here."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from ckpt_helpers import resume_state
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedTokenizerFast,
    Qwen3Config,
)

from relax_hpc.ckpt import CheckpointManager
from relax_hpc.ckpt.export import export_hf


def _tiny_model_dir(path: Path, tied: bool = False) -> Path:
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    vocab = {"[UNK]": 0, "[PAD]": 1, **{f"w{i}": i + 2 for i in range(62)}}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[PAD]")
    fast.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny_model_dir(tmp_path_factory.mktemp("hf_base"))


def _trained_checkpoint(model_dir: Path, root: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 64, (2, 8))
    for _ in range(2):
        optimizer.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
    path = CheckpointManager(root).save(2, model, optimizer, resume_state(2))
    return path, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_export_round_trips_trained_weights(model_dir: Path, tmp_path: Path) -> None:
    checkpoint, trained = _trained_checkpoint(model_dir, tmp_path / "ckpt")
    out = export_hf(checkpoint, model_dir, tmp_path / "export" / "hf")

    assert out == tmp_path / "export" / "hf"
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    assert [p.name for p in out.parent.iterdir()] == ["hf"]  # no temp dir left behind
    reloaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    base = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    reloaded_sd, base_sd = reloaded.state_dict(), base.state_dict()
    assert reloaded_sd.keys() == trained.keys()
    for name, tensor in trained.items():
        assert torch.equal(reloaded_sd[name], tensor), name
    assert not torch.equal(base_sd["model.embed_tokens.weight"], trained["model.embed_tokens.weight"])
    assert AutoTokenizer.from_pretrained(out).convert_tokens_to_ids("w5") == 7


def test_export_refuses_existing_out_dir_unless_overwrite(model_dir: Path, tmp_path: Path) -> None:
    checkpoint, trained = _trained_checkpoint(model_dir, tmp_path / "ckpt")
    out = tmp_path / "hf"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        export_hf(checkpoint, model_dir, out)
    export_hf(checkpoint, model_dir, out, overwrite=True)
    assert not (out / "stale.txt").exists()
    reloaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert torch.equal(reloaded.state_dict()["lm_head.weight"], trained["lm_head.weight"])


def test_export_names_what_is_wrong(model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"\.metadata is missing"):
        export_hf(tmp_path, model_dir, tmp_path / "out")
    wrong = torch.nn.Linear(2, 2)
    checkpoint = CheckpointManager(tmp_path / "ckpt").save(
        1, wrong, torch.optim.SGD(wrong.parameters(), lr=0.1), resume_state(1)
    )
    with pytest.raises(KeyError, match="lacks .* parameters of the HF model"):
        export_hf(checkpoint, model_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_export_keeps_tied_embeddings_tied(tmp_path: Path) -> None:
    base = _tiny_model_dir(tmp_path / "base", tied=True)
    checkpoint, trained = _trained_checkpoint(base, tmp_path / "ckpt")
    reloaded = AutoModelForCausalLM.from_pretrained(export_hf(checkpoint, base, tmp_path / "hf"))
    sd = reloaded.state_dict()
    assert all(torch.equal(sd[name], tensor) for name, tensor in trained.items())
    assert sd["lm_head.weight"].data_ptr() == sd["model.embed_tokens.weight"].data_ptr()


def test_export_refuses_a_checkpoint_others_can_change(model_dir: Path, tmp_path: Path) -> None:
    from relax_hpc.ckpt.permissions import UnsafeCheckpointError

    checkpoint, _ = _trained_checkpoint(model_dir, tmp_path / "ckpt")
    os.chmod(checkpoint / ".metadata", 0o662)  # anyone in the group could have swapped the pickle
    with pytest.raises(UnsafeCheckpointError, match=r"refusing to export .*\.metadata.*chmod -R go-w.*run it again"):
        export_hf(checkpoint, model_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists()
