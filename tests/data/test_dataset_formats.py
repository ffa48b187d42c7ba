"""Parquet and JSON files, dotted keys, prompt templates, chat options, media fields, and the
row formats of dapo-math-17k, multimodal-open-r1-8k-verified and AVQA-R1-6K (written here)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from relax_hpc.data.dataset import load_dataset
from relax_hpc.data.records import get_dotted
from relax_hpc.media.encode import encode_audio_wav, encode_image_png, encode_video_mkv
from relax_hpc.media.processor import MediaProcessor
from relax_hpc.models.hf import load_tokenizer
from relax_hpc.models.tiny_mm import (
    AUDIO_END,
    AUDIO_PAD,
    AUDIO_START,
    IMAGE_PAD,
    VIDEO_PAD,
    VISION_END,
    VISION_START,
    mm_token_ids,
    write_tiny_multimodal,
)
from relax_hpc.spec.schema import DataSpec


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return load_tokenizer(tiny_model_dir)


def _parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


# dapo-math-17k (BytedTsinghua-SIA/DAPO-Math-17k): prompt is a list of chat messages, the answer
# sits in reward_model.ground_truth, data_source "math_dapo".
DAPO_ROWS = [
    {
        "data_source": "math_dapo",
        "prompt": [{"content": "Solve 1+1. Remember to put your answer on its own line after \"Answer:\".",
                    "role": "user"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": "2", "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": "9a9b6eb4-a1cb-49d1-8c1e-62eaf2f74079"},
    },
    {
        "data_source": "math_dapo",
        "prompt": [{"content": "What is 3*4?", "role": "user"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": "12", "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": "b426d104-244d-4831-a2c4-cd756b61700a"},
    },
]


def test_dapo_math_17k_parquet(tmp_path: Path, tokenizer: Any) -> None:
    path = _parquet(tmp_path / "dapo-math-17k.parquet", DAPO_ROWS)
    rows, report = load_dataset(DataSpec(path=str(path), prompt_key="prompt", label_key="reward_model.ground_truth",
                                         max_prompt_tokens=512), tokenizer)
    assert [r.label for r in rows] == ["2", "12"] and report.kept == 2
    assert rows[1].prompt_text == "<|im_start|>user:What is 3*4?<|im_end|><|im_start|>assistant:"
    assert rows[0].metadata["data_source"] == "math_dapo"  # picks the dapo reward via type_key
    assert rows[0].metadata["reward_model"]["style"] == "rule-lighteval/MATH_v2"
    assert "prompt" not in rows[0].metadata


def test_same_rows_from_jsonl_and_parquet_agree(tmp_path: Path, tokenizer: Any) -> None:
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in DAPO_ROWS))
    parquet = _parquet(tmp_path / "d.parquet", DAPO_ROWS)
    from_jsonl, _ = load_dataset(DataSpec(path=str(jsonl), prompt_key="prompt",
                                          label_key="reward_model.ground_truth", max_prompt_tokens=512), tokenizer)
    from_parquet, _ = load_dataset(DataSpec(path=str(parquet), prompt_key="prompt",
                                            label_key="reward_model.ground_truth", max_prompt_tokens=512), tokenizer)
    assert from_jsonl == from_parquet


# The media datasets load with a real tiny multimodal model: its tokenizer renders the media
# parts, its processor decodes, fits and expands them.
@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_multimodal(tmp_path_factory.mktemp("vl") / "qwen2_5_vl", "qwen2_5_vl", seed=0)


@pytest.fixture(scope="module")
def omni_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_multimodal(tmp_path_factory.mktemp("omni") / "qwen3_omni", "qwen3_omni", seed=0)


def _picture(seed: int, height: int, width: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


# multimodal-open-r1-8k-verified (lmms-lab): image (HF Image feature: {bytes, path}), problem,
# solution ("<answer> ... </answer>"), original_question, original_answer.
def test_multimodal_open_r1_parquet(tmp_path: Path, vl_dir: Path) -> None:
    tokenizer, processor = load_tokenizer(vl_dir), MediaProcessor(vl_dir)
    image_pad = mm_token_ids("qwen2_5_vl")[IMAGE_PAD]
    triangle, square = encode_image_png(_picture(0, 32, 48)), encode_image_png(_picture(1, 16, 16))
    rows: list[dict[str, Any]] = [
        {"image": {"bytes": triangle, "path": "triangle.png"}, "problem": "Find x in the triangle.",
         "solution": "<answer> 5 </answer>", "original_question": "Find x.", "original_answer": "5"},
        {"image": None, "problem": "No picture here.", "solution": "<answer>1</answer>",
         "original_question": "q", "original_answer": "1"},
        {"image": {"bytes": square, "path": None}, "problem": "Area?", "solution": "<answer>4</answer>",
         "original_question": "a", "original_answer": "4"},
    ]
    path = _parquet(tmp_path / "mm-open-r1.parquet", rows)
    fmt = dict(image_key="image", apply_chat_template=True, system_prompt="Think, then answer.")
    loaded, report = load_dataset(DataSpec(path=str(path), prompt_key="problem", label_key="solution",
                                           max_prompt_tokens=512, **fmt), tokenizer, processor)
    assert report.summary() == f"2 of 3 rows kept (dropped: 1 no 'image' field (first: {path}:row 2))"
    row = loaded[0]
    assert row.label == "<answer> 5 </answer>"  # the openr1mm reward reads the <answer> tag
    # Where the image came from, without its bytes; the image column itself is not metadata.
    assert row.metadata["multimodal"] == {"images": ["triangle.png"]}
    assert loaded[1].metadata["multimodal"] == {"images": [f"<{len(square)} bytes>"]}
    assert "image" not in row.metadata and row.metadata["original_answer"] == "5"
    # A chat with the image part before the text; the template renders one placeholder for it.
    assert row.prompt_text == ("<|im_start|>system:Think, then answer.<|im_end|><|im_start|>user:"
                               f"{VISION_START}{IMAGE_PAD}{VISION_END}Find x in the triangle.<|im_end|>"
                               "<|im_start|>assistant:")
    assert row.media is not None and [i.kind for i in row.media.items] == ["image"]
    assert np.array_equal(row.media.items[0].data, _picture(0, 32, 48))  # already on the patch grid
    single = tokenizer(row.prompt_text, add_special_tokens=False)["input_ids"]
    assert row.prompt_ids == processor.expand(single, row.media)
    assert row.prompt_ids.count(image_pad) == 32 * 48 // (8 * 8 * 4)  # merged 8 px patches


# AVQA-R1-6K: question, choices (list), answer (the option text), audio and video paths.
AVQA_ROWS = [
    {"id": 17, "question": "What makes the sound?", "choices": ["A. dog", "B. car", "C. rain", "D. bell"],
     "answer": "B", "audio": "audios/17.wav", "video": "videos/17.mkv"},
]


def test_avqa_r1_jsonl_with_template(tmp_path: Path, omni_dir: Path) -> None:
    tokenizer, processor = load_tokenizer(omni_dir), MediaProcessor(omni_dir)
    ids = mm_token_ids("qwen3_omni")
    (tmp_path / "audios").mkdir()
    (tmp_path / "videos").mkdir()
    wave = 0.5 * np.sin(2 * np.pi * 440 * np.arange(16000) / 16000)
    (tmp_path / "audios" / "17.wav").write_bytes(encode_audio_wav(wave, 16000))
    (tmp_path / "videos" / "17.mkv").write_bytes(encode_video_mkv(np.stack([_picture(s, 16, 32) for s in range(4)]), 2))
    path = tmp_path / "avqa.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in AVQA_ROWS))
    fmt = dict(prompt_template="{question}\n{choices}", audio_key="audio", video_key="video",
               metadata_keys=["id", "choices"])
    rows, _ = load_dataset(DataSpec(path=str(path), prompt_key="question", label_key="answer", max_prompt_tokens=512,
                                    **fmt), tokenizer, processor)
    text = "What makes the sound?\nA. dog\nB. car\nC. rain\nD. bell"
    # With media the template's text becomes a user turn: the video, then the audio, then the text.
    parts = [{"type": "video"}, {"type": "audio"}, {"type": "text", "text": text}]
    assert rows[0].prompt_text == tokenizer.apply_chat_template(
        [{"role": "user", "content": parts}], add_generation_prompt=True, tokenize=False)
    assert rows[0].prompt_text == (f"<|im_start|>user:{VISION_START}{VIDEO_PAD}{VISION_END}"
                                   f"{AUDIO_START}{AUDIO_PAD}{AUDIO_END}{text}<|im_end|><|im_start|>assistant:")
    assert rows[0].label == "B"
    assert rows[0].metadata == {
        "id": 17, "choices": ["A. dog", "B. car", "C. rain", "D. bell"],
        "multimodal": {"audios": ["audios/17.wav"], "videos": ["videos/17.mkv"]},
    }
    media = rows[0].media
    assert media is not None and [(i.kind, i.data.shape) for i in media.items] == [
        ("video", (4, 16, 32, 3)), ("audio", (16000,))]  # 2 fps: every frame of the 2 s clip
    assert rows[0].prompt_ids.count(ids[VIDEO_PAD]) == processor.token_count(media.items[0]) == 4
    assert rows[0].prompt_ids.count(ids[AUDIO_PAD]) == processor.token_count(media.items[1]) > 1


def test_template_naming_a_missing_field(tmp_path: Path, tokenizer: Any) -> None:
    path = tmp_path / "avqa.jsonl"
    path.write_text(json.dumps(AVQA_ROWS[0]) + "\n")
    with pytest.raises(ValueError, match=r"avqa.jsonl:1: \[data\] prompt_template uses \{options\} but the row"):
        load_dataset(DataSpec(path=str(path), prompt_key="question", label_key="answer", max_prompt_tokens=512,
                              prompt_template="{options}"), tokenizer)


def test_string_prompt_through_chat_template(tmp_path: Path, tokenizer: Any) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "1+2=", "label": "3"}) + "\n")
    rows, _ = load_dataset(DataSpec(path=str(path), prompt_key="prompt", label_key="label", max_prompt_tokens=64,
                                    apply_chat_template=True), tokenizer)
    assert rows[0].prompt_text == "<|im_start|>user:1+2=<|im_end|><|im_start|>assistant:"


def test_json_array_file_and_unknown_suffix(tmp_path: Path, tokenizer: Any) -> None:
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"prompt": "1+2=", "label": "3"}, {"prompt": "2+2=", "label": "4"}]))
    rows, _ = load_dataset(DataSpec(path=str(path), prompt_key="prompt", label_key="label", max_prompt_tokens=64),
                                    tokenizer)
    assert [r.label for r in rows] == ["3", "4"]
    bad = tmp_path / "d.csv"
    bad.write_text("prompt,label\n")
    with pytest.raises(ValueError, match=r"unknown file type '\.csv'; \[data\] path must end in"):
        load_dataset(DataSpec(path=str(bad), prompt_key="prompt", label_key="label", max_prompt_tokens=64), tokenizer)


def test_parquet_errors_name_the_row(tmp_path: Path, tokenizer: Any) -> None:
    path = _parquet(tmp_path / "d.parquet", [{"question": "1+2=", "label": "3"}])
    with pytest.raises(ValueError, match=r"d.parquet:row 1: row has no 'prompt' key.*\['label', 'question'\]"):
        load_dataset(DataSpec(path=str(path), prompt_key="prompt", label_key="label", max_prompt_tokens=64), tokenizer)
    not_parquet = tmp_path / "e.parquet"
    not_parquet.write_text("hello")
    with pytest.raises(ValueError, match="is not a readable Parquet file"):
        load_dataset(DataSpec(path=str(not_parquet), prompt_key="prompt", label_key="label", max_prompt_tokens=64),
                              tokenizer)


def test_length_filter_counts_on_parquet(tmp_path: Path, tokenizer: Any) -> None:
    path = _parquet(tmp_path / "d.parquet", [{"prompt": "1+2=", "label": "3"}, {"prompt": "12+34=", "label": "46"}])
    rows, report = load_dataset(DataSpec(path=str(path), prompt_key="prompt", label_key="label",
                                         max_prompt_tokens=4), tokenizer)
    assert [r.prompt_text for r in rows] == ["1+2="]
    assert report.summary() == "1 of 2 rows kept (dropped: 1 longer than max_prompt_tokens=4)"


def test_get_dotted() -> None:
    record = {"a": {"b": [10, {"c": 3}]}, "x.y": 1}
    assert get_dotted(record, "a.b.1.c") == 3 and get_dotted(record, "x.y") == 1
    assert get_dotted(record, "a.z", None) is None
    with pytest.raises(KeyError):
        get_dotted(record, "a.b.5")


def test_load_dataset_from_spec(tmp_path: Path, tokenizer: Any) -> None:
    path = _parquet(tmp_path / "dapo.parquet", DAPO_ROWS)
    spec = DataSpec(path=str(path), label_key="reward_model.ground_truth", metadata_keys=["data_source"],
                    max_prompt_tokens=512)
    rows, report = load_dataset(spec, tokenizer)
    assert report.kept == 2 and rows[0].metadata == {"data_source": "math_dapo"} and rows[0].label == "2"
