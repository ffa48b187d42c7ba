"""Build a tiny Qwen3-architecture model directory locally, with no downloads.

The directory has the same shape as a real Hugging Face checkout (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json, generation_config.json), so every code path that loads it
(`AutoModelForCausalLM.from_pretrained`, `AutoTokenizer.from_pretrained`) is the one a Qwen3-4B
checkout goes through. Run it as `relax-hpc make-tiny DIR`.

The tokenizer is character level over a small alphabet: the embedded task (see
`relax_hpc.data.tiny_task`) is arithmetic on digits, and a small vocabulary keeps a randomly
initialised policy's chance of a right answer small but non-zero, which is what makes the
reward curve of the demo start low and rise.
"""

from __future__ import annotations

import json
import shutil
import string
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"  # end of a turn; the tiny model's EOS, as in Qwen3's chat models
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END)
ALPHABET = string.digits + "+-*=?:., " + string.ascii_lowercase

# Qwen3's chat template, reduced to what the tiny model needs: role headers and turn ends.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + ':' + message['content'] + '<|im_end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant:' }}{% endif %}"
)


@dataclass(frozen=True)
class TinyModelSize:
    """Shape of the tiny model; the defaults train the embedded task in minutes on 2 CPU cores."""

    hidden_size: int = 64
    intermediate_size: int = 192
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    max_position_embeddings: int = 256


def build_tokenizer_json(extra_specials: Sequence[str] = ()) -> str:
    """Return the text of a character-level tokenizer.json built with the `tokenizers` library.

    `extra_specials` (the multimodal placeholders of `relax_hpc.models.tiny_mm`) take the ids after
    the alphabet, so every character keeps the id it has in the text model.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in ALPHABET:
        vocab[ch] = len(vocab)
    for special in extra_specials:
        vocab[special] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([*SPECIAL_TOKENS, *extra_specials])
    return tok.to_str()


def vocab_size(extra_specials: Sequence[str] = ()) -> int:
    return len(SPECIAL_TOKENS) + len(ALPHABET) + len(extra_specials)


def write_tiny_model(out_dir: Path, seed: int = 0, size: TinyModelSize = TinyModelSize()) -> Path:
    """Write a randomly initialised tiny Qwen3 model + tokenizer to `out_dir` (write-then-rename).

    Refuses to overwrite an existing directory so that a trained model is never clobbered.
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from relax_hpc.models.hf import quiet_transformers

    quiet_transformers()
    out_dir = refuse_existing(out_dir)
    token_ids = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    config = Qwen3Config(
        vocab_size=vocab_size(),
        hidden_size=size.hidden_size,
        intermediate_size=size.intermediate_size,
        num_hidden_layers=size.num_hidden_layers,
        num_attention_heads=size.num_attention_heads,
        num_key_value_heads=size.num_key_value_heads,
        head_dim=size.head_dim,
        max_position_embeddings=size.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=token_ids[PAD_TOKEN],
        bos_token_id=token_ids[IM_START],
        eos_token_id=token_ids[IM_END],
    )
    torch.manual_seed(seed)
    return save_model_dir(Qwen3ForCausalLM(config), out_dir, size.max_position_embeddings)


def refuse_existing(out_dir: Path) -> Path:
    """`out_dir` as a Path; raises if it exists, so that a trained model is never clobbered."""
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(
            f"{out_dir} already exists; remove it or choose another directory for the tiny model"
        )
    return out_dir


def save_model_dir(
    model: torch.nn.Module,
    out_dir: Path,
    max_positions: int,
    extra_config: dict[str, Any] | None = None,
    *,
    tokenizer_json: str | None = None,
    tokenizer_config_extra: Mapping[str, Any] | None = None,
    extra_files: Mapping[str, str] | None = None,
) -> Path:
    """Save `model` with the character-level tokenizer to `out_dir`: written to a temporary
    directory beside it, then renamed, so a crash never leaves a half-written model.
    `extra_config`: keys added to the saved config.json. The multimodal models pass their own
    `tokenizer_json` (default: `build_tokenizer_json()`), keys that replace or extend those of
    tokenizer_config.json (chat template, placeholder tokens), and `extra_files` (name -> text,
    e.g. the processor configs) to write into the same directory before the rename."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)  # type: ignore[operator]
        if extra_config:
            config = json.loads((tmp / "config.json").read_text())
            (tmp / "config.json").write_text(json.dumps(config | extra_config, indent=2, sort_keys=True))
        (tmp / "tokenizer.json").write_text(build_tokenizer_json() if tokenizer_json is None else tokenizer_json)
        tokenizer_config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": max_positions,
            "pad_token": PAD_TOKEN,
            "eos_token": IM_END,
            "bos_token": None,
            "unk_token": PAD_TOKEN,
            "chat_template": CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": False,
        } | dict(tokenizer_config_extra or {})
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
        (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
