"""The tiny Qwen3 model directory: loads through the stock Hugging Face entry points, has a
character-level tokenizer with the chat template, and is written atomically."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from relax_hpc.models import tiny
from relax_hpc.models.hf import load_causal_lm, load_tokenizer
from relax_hpc.models.tiny import IM_END, IM_START, PAD_TOKEN, write_tiny_model


def test_loads_through_auto_classes(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.config.vocab_size == tiny.vocab_size() == len(tokenizer)
    logits = model(input_ids=torch.tensor([[4, 5, 13]])).logits
    assert logits.shape == (1, 3, tiny.vocab_size())
    assert torch.isfinite(logits).all()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json"):
        assert (tiny_model_dir / name).is_file(), name


def test_tokenizer_round_trips_digits(tiny_model_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    ids = tokenizer("12+7=", add_special_tokens=False)["input_ids"]
    # Special tokens take ids 0..2, then the alphabet in order: "0" -> 3, so "1" -> 4, "7" -> 10.
    assert ids == [4, 5, 13, 10, 16]
    assert tokenizer.decode(ids) == "12+7="


def test_special_token_ids(tiny_model_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    model = load_causal_lm(tiny_model_dir)
    assert tokenizer.convert_tokens_to_ids([PAD_TOKEN, IM_START, IM_END]) == [0, 1, 2]
    assert tokenizer.pad_token_id == 0 == model.config.pad_token_id
    assert tokenizer.eos_token_id == 2 == model.config.eos_token_id
    assert tokenizer.eos_token == IM_END


def test_chat_template(tiny_model_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    messages = [{"role": "user", "content": "12+7="}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user:12+7=<|im_end|><|im_start|>assistant:"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    # Each special marker is one token, every other character is one token.
    assert len(ids) == len("user:12+7=") + len("assistant:") + 3
    assert ids[0] == 1 and ids[11] == 2 and ids[12] == 1
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert tokenizer.decode(ids, skip_special_tokens=True) == "user:12+7=assistant:"


def test_same_seed_same_weights_different_seed_different(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    a = load_file(write_tiny_model(tmp_path / "a", seed=1) / "model.safetensors")
    b = load_file(write_tiny_model(tmp_path / "b", seed=1) / "model.safetensors")
    c = load_file(write_tiny_model(tmp_path / "c", seed=2) / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(a[name], b[name])
    assert not torch.equal(a[name], c[name])


def test_refuses_to_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "model"
    out.mkdir()
    (out / "keep.txt").write_text("trained weights")
    with pytest.raises(FileExistsError, match="already exists"):
        write_tiny_model(out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_no_partial_directory_on_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> str:
        raise RuntimeError("disk full")

    monkeypatch.setattr(tiny, "build_tokenizer_json", broken)
    out = tmp_path / "parent" / "model"
    with pytest.raises(RuntimeError, match="disk full"):
        write_tiny_model(out)
    assert not out.exists()
    assert list(out.parent.iterdir()) == []  # the temp dir was removed too


def test_load_errors_name_the_fix(tmp_path: Path, tiny_model_dir: Path) -> None:
    with pytest.raises(FileNotFoundError, match="make-tiny"):
        load_causal_lm(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="'float64'.*bfloat16"):
        load_causal_lm(tiny_model_dir, dtype="float64")


def test_tokenizer_config_is_plain_json(tiny_model_dir: Path) -> None:
    config = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    assert config["eos_token"] == IM_END and config["pad_token"] == PAD_TOKEN
