"""jsonl prompt loading (string and chat prompts, length filter, errors) and the DataCursor."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from relax_hpc.data.dataset import DataCursor, load_dataset
from relax_hpc.data.tiny_task import tiny_sum_rows, write_tiny_sum_dataset
from relax_hpc.models.hf import load_tokenizer
from relax_hpc.spec.schema import DataSpec


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return load_tokenizer(tiny_model_dir)


def _write(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_string_and_chat_prompts(tmp_path: Path, tokenizer: Any) -> None:
    path = _write(tmp_path / "d.jsonl", [
        {"prompt": "1+2=", "label": "3", "source": "a"},
        "",  # blank lines are skipped, not counted
        {"prompt": [{"role": "user", "content": "4+5="}], "label": "9"},
    ])
    rows, report = load_dataset(DataSpec(path=str(path), prompt_key="prompt", label_key="label",
                                         max_prompt_tokens=64), tokenizer)
    assert [r.index for r in rows] == [0, 1]
    assert rows[0].prompt_text == "1+2="
    assert rows[0].prompt_ids == tokenizer("1+2=", add_special_tokens=False)["input_ids"]
    assert rows[0].label == "3" and rows[0].metadata == {"source": "a"}
    chat = "<|im_start|>user:4+5=<|im_end|><|im_start|>assistant:"
    assert rows[1].prompt_text == chat
    assert rows[1].prompt_ids == tokenizer(chat, add_special_tokens=False)["input_ids"]
    assert rows[1].prompt_ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert rows[1].label == "9" and rows[1].metadata == {}
    assert (report.rows_read, report.kept, report.dropped) == (2, 2, {})
    assert report.summary() == "2 of 2 rows kept (dropped: none)"


def test_custom_keys(tmp_path: Path, tokenizer: Any) -> None:
    path = _write(tmp_path / "d.jsonl", [{"question": "2+2=", "answer": 4}])
    rows, _ = load_dataset(DataSpec(path=str(path), prompt_key="question", label_key="answer", max_prompt_tokens=8),
                                    tokenizer)
    assert rows[0].prompt_text == "2+2=" and rows[0].label == 4


def test_long_rows_dropped_and_counted(tmp_path: Path, tokenizer: Any) -> None:
    path = _write(tmp_path / "d.jsonl", [
        {"prompt": "1+2=", "label": "3"},  # 4 tokens: kept (the limit is inclusive)
        {"prompt": "12+34=", "label": "46"},  # 6 tokens: dropped
        {"prompt": "5+", "label": "?"},  # 2 tokens: kept
        {"prompt": [{"role": "user", "content": "1"}], "label": "1"},  # 19 tokens: dropped
    ])
    rows, report = load_dataset(DataSpec(path=str(path), prompt_key="prompt", label_key="label",
                                         max_prompt_tokens=4), tokenizer)
    assert [r.prompt_text for r in rows] == ["1+2=", "5+"]
    assert [r.index for r in rows] == [0, 1]  # indices of the filtered dataset
    assert report.rows_read == 4 and report.kept == 2
    assert report.summary() == "2 of 4 rows kept (dropped: 2 longer than max_prompt_tokens=4)"


def test_everything_dropped_is_an_error(tmp_path: Path, tokenizer: Any) -> None:
    path = _write(tmp_path / "d.jsonl", [{"prompt": "12+34=", "label": "46"}])
    with pytest.raises(ValueError, match=r"no usable rows: 0 of 1 rows kept \(dropped: 1 longer"):
        load_dataset(DataSpec(path=str(path), prompt_key="prompt", label_key="label", max_prompt_tokens=3), tokenizer)


def test_invalid_json_names_file_and_line(tmp_path: Path, tokenizer: Any) -> None:
    path = _write(tmp_path / "bad.jsonl", [{"prompt": "1+2=", "label": "3"}, "", '{"prompt": "1+'])
    with pytest.raises(ValueError, match=rf"{path}:3: not valid JSON"):
        load_dataset(DataSpec(path=str(path), prompt_key="prompt", label_key="label", max_prompt_tokens=8), tokenizer)


def test_missing_prompt_key_lists_the_keys(tmp_path: Path, tokenizer: Any) -> None:
    path = _write(tmp_path / "d.jsonl", [{"prompt": "1+2="}, {"question": "1+2=", "label": "3"}])
    with pytest.raises(ValueError) as info:
        load_dataset(DataSpec(path=str(path), prompt_key="prompt", label_key="label", max_prompt_tokens=8), tokenizer)
    message = str(info.value)
    assert f"{path}:2:" in message and "no 'prompt' key" in message and "prompt_key" in message
    assert "['label', 'question']" in message


def test_non_object_row_and_bad_prompt_type(tmp_path: Path, tokenizer: Any) -> None:
    path = _write(tmp_path / "d.jsonl", [[1, 2]])
    with pytest.raises(ValueError, match=rf"{path}:1: row has no 'prompt' key"):
        load_dataset(DataSpec(path=str(path), prompt_key="prompt", label_key="label", max_prompt_tokens=8), tokenizer)
    path = _write(tmp_path / "e.jsonl", [{"prompt": 12}])
    with pytest.raises(ValueError, match=rf"{path}:1: 'prompt' must be a string or a list of chat"):
        load_dataset(DataSpec(path=str(path), prompt_key="prompt", label_key="label", max_prompt_tokens=8), tokenizer)


def test_missing_file(tmp_path: Path, tokenizer: Any) -> None:
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl does not exist; check \[data\] path"):
        load_dataset(DataSpec(path=str(tmp_path / "nope.jsonl"), prompt_key="prompt", label_key="label",
                              max_prompt_tokens=8), tokenizer)


def test_tiny_sum_dataset_loads(tmp_path: Path, tokenizer: Any) -> None:
    path = write_tiny_sum_dataset(tmp_path / "sub" / "tiny_sum.jsonl")
    rows, report = load_dataset(DataSpec(path=str(path), prompt_key="prompt", label_key="label",
                                         max_prompt_tokens=8), tokenizer)
    assert len(rows) == report.kept == len(tiny_sum_rows()) > 0
    assert all(int(r.prompt_text[0]) + int(r.prompt_text[2]) == int(r.label) for r in rows)
    assert not list(path.parent.glob("*.tmp"))


# -- DataCursor ---------------------------------------------------------------------------------


def test_cursor_deterministic_per_seed() -> None:
    assert DataCursor(10, seed=3).take(25) == DataCursor(10, seed=3).take(25)
    assert DataCursor(10, seed=3).take(10) != DataCursor(10, seed=4).take(10)


def test_cursor_covers_every_row_once_per_epoch() -> None:
    cursor = DataCursor(7, seed=1)
    epochs = [cursor.take(7) for _ in range(3)]
    for order in epochs:
        assert sorted(order) == list(range(7))
    assert cursor.epoch == 2 and cursor.index == 7
    assert len({tuple(o) for o in epochs}) > 1  # each epoch gets its own shuffle


def test_cursor_epoch_rolls_over_mid_take() -> None:
    cursor = DataCursor(5, seed=0)
    first = cursor.take(3)
    second = cursor.take(4)  # 2 rows left in epoch 0, then 2 rows of epoch 1
    assert sorted(first + second[:2]) == list(range(5))
    assert cursor.state() == {"epoch": 1, "index": 2, "seed": 0, "size": 5}
    assert second[2:] == DataCursor(5, seed=1).take(2)  # epoch e uses Random(seed + e)


def test_cursor_without_shuffle() -> None:
    assert DataCursor(3, seed=9, shuffle=False).take(7) == [0, 1, 2, 0, 1, 2, 0]


@pytest.mark.parametrize("consumed", [0, 4, 11, 12, 13, 30])
def test_cursor_restore_continues_exactly(consumed: int) -> None:
    original = DataCursor(12, seed=5)
    original.take(consumed)
    state = json.loads(json.dumps(original.state()))  # as stored in a checkpoint
    restored = DataCursor(12, seed=5)
    restored.restore(state)
    assert restored.take(30) == original.take(30)


@pytest.mark.parametrize("change", [{"size": 13}, {"seed": 6}, {"size": None}])
def test_cursor_restore_rejects_other_dataset(change: dict[str, Any]) -> None:
    state = DataCursor(12, seed=5).state()
    state.update(change)
    with pytest.raises(ValueError, match="does not match this dataset"):
        DataCursor(12, seed=5).restore(state)


def test_cursor_needs_rows() -> None:
    with pytest.raises(ValueError, match="at least one row"):
        DataCursor(0, seed=0)
