"""Prompt datasets from JSON lines or Parquet, with length filtering and a resumable cursor.

A row holds a prompt (a string used as is, or a list of chat messages that goes through the
tokenizer's chat template) and a label the reward function compares against. Keys may be
dotted to reach nested fields ("reward_model.ground_truth"). A `prompt_template` builds the
prompt from several fields; `apply_chat_template` / `system_prompt` turn string prompts into
chat messages. Image / audio / video fields are read, decoded and fitted to the model's patch
grid (relax_hpc.media), placed in the prompt as content parts before the text, and their
placeholders expanded, so `prompt_ids` are exactly what the model reads. Rows whose prompt is
longer than `max_prompt_tokens`, that have none of the declared media fields, or whose media
cannot be used (missing, corrupt, too large, a remote URL) are dropped, and the drops are
counted with reasons and the first row of each. docs/datasets.md and docs/multimodal.md have the
formats.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, Sequence

from relax_hpc.data.records import get_dotted, has_dotted, iter_records
from relax_hpc.media.items import MEDIA_ORDER, MediaError, MediaItem, PromptMedia

MEDIA_KINDS = ("images", "audios", "videos")
_KIND_OF = {"images": "image", "audios": "audio", "videos": "video"}


@dataclass(frozen=True)
class PromptRow:
    index: int  # position in the filtered dataset
    prompt_ids: list[int]
    prompt_text: str
    label: Any
    metadata: dict[str, Any]
    media: PromptMedia | None = None  # a multimodal dataset's media, placeholders expanded in prompt_ids
    # The chat messages prompt_text was templated from (a medium as a {"type": kind} part); None
    # when the prompt is used as plain text. Agents get these, not the templated text.
    messages: list[dict[str, Any]] | None = None


@dataclass
class LoadReport:
    rows_read: int = 0
    kept: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    first: dict[str, str] = field(default_factory=dict)  # reason -> the first row dropped for it

    def drop(self, reason: str, location: str = "") -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        if location:
            self.first.setdefault(reason, location)

    def summary(self) -> str:
        def one(why: str, n: int) -> str:
            return f"{n} {why}" + (f" (first: {self.first[why]})" if why in self.first else "")

        drops = ", ".join(one(why, n) for why, n in sorted(self.dropped.items())) or "none"
        return f"{self.kept} of {self.rows_read} rows kept (dropped: {drops})"


class DataSettings(Protocol):
    """The fields of `[data]` the loader reads (relax_hpc.spec.DataSpec has them)."""

    path: str
    prompt_key: str
    label_key: str
    metadata_keys: list[str]  # empty: every other top-level field
    prompt_template: str | None
    apply_chat_template: bool
    system_prompt: str | None
    image_key: str | None
    audio_key: str | None
    video_key: str | None
    drop_media: bool
    max_media_bytes: int
    video_fps: float
    max_frames: int
    max_media_seconds: float
    max_prompt_tokens: int


def _template_value(value: Any) -> str:
    # Choice lists read best one per line; everything else as its string form.
    if isinstance(value, list):
        return "\n".join(str(v) for v in value)
    return str(value)


def media_keys(data: DataSettings) -> dict[str, str]:
    """The media columns [data] names, by kind ("images", "audios", "videos")."""
    keys = {"images": data.image_key, "audios": data.audio_key, "videos": data.video_key}
    return {kind: key for kind, key in keys.items() if key}


def _fill_template(template: str, record: dict[str, Any]) -> str:
    names = [name for _, name, _, _ in string.Formatter().parse(template) if name]
    missing = [n for n in names if not has_dotted(record, n)]
    if missing:
        raise ValueError(
            f"[data] prompt_template uses {{{missing[0]}}} but the row has no such field "
            f"(fields: {sorted(record)})"
        )
    out = template
    for name in names:
        out = out.replace("{" + name + "}", _template_value(get_dotted(record, name)))
    return out


def _messages(prompt: Any, fmt: DataSettings, media: PromptMedia | None = None) -> list[dict[str, Any]] | None:
    """Chat messages for the prompt, or None when it is used as plain text. With `media`, a
    string prompt always becomes a user message whose content parts are the media, then the text
    (the chat template renders one placeholder per part)."""
    if isinstance(prompt, str):
        if not (fmt.apply_chat_template or fmt.system_prompt or media):
            return None
        content: Any = prompt
        if media:
            content = [*({"type": i.kind} for i in media.items), {"type": "text", "text": prompt}]
        messages: list[dict[str, Any]] = [{"role": "user", "content": content}]
    elif isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
        messages = [dict(m) for m in prompt]
    else:
        raise ValueError("must be a string or a list of chat messages ({role, content} objects)")
    if fmt.system_prompt and messages[0].get("role") != "system":
        messages.insert(0, {"role": "system", "content": fmt.system_prompt})
    return messages


def _prompt_text(prompt: Any, tokenizer: Any, messages: list[dict[str, Any]] | None) -> str:
    if messages is None:
        return str(prompt)
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def _metadata(record: dict[str, Any], fmt: DataSettings) -> dict[str, Any]:
    media = media_keys(fmt)
    if fmt.metadata_keys:
        meta = {k: get_dotted(record, k) for k in fmt.metadata_keys if has_dotted(record, k)}
    else:
        skip = {fmt.prompt_key, fmt.label_key, *media.values()}
        meta = {k: v for k, v in record.items() if k not in skip}
    found = {kind: get_dotted(record, key) for kind, key in media.items() if get_dotted(record, key, None) is not None}
    if found:  # where each medium came from; bytes cells are summarised, not copied
        meta["multimodal"] = {k: [_describe(c) for c in (v if isinstance(v, list) else [v])] for k, v in found.items()}
    return meta


def _describe(cell: Any) -> Any:
    if isinstance(cell, (bytes, bytearray)):
        return f"<{len(cell)} bytes>"
    if isinstance(cell, dict):
        return cell.get("path") or f"<{len(cell.get('bytes') or b'')} bytes>"
    if isinstance(cell, str) and cell.startswith("data:"):
        return f"<data URL, {len(cell)} characters>"
    return cell


class MediaReader(Protocol):
    """What the loader needs of relax_hpc.media.processor.MediaProcessor."""

    def geometry(self) -> Any: ...

    def expand(self, prompt_ids: Sequence[int], media: PromptMedia) -> list[int]: ...


def _load_row_media(record: dict[str, Any], fmt: DataSettings, base_dir: Path,
                    reader: MediaReader) -> PromptMedia:
    """The row's media, decoded and fitted (blanked with drop_media); MediaError names the column."""
    from relax_hpc.media.load import load_media

    geometry = reader.geometry()
    items: list[MediaItem] = []
    for plural, key in sorted(media_keys(fmt).items(), key=lambda kv: MEDIA_ORDER.index(_KIND_OF[kv[0]])):
        cell = get_dotted(record, key, None)
        if cell is None:
            continue
        try:
            loaded = load_media(cell, _KIND_OF[plural], base_dir=base_dir, geometry=geometry, limits=fmt)
        except MediaError as e:
            raise MediaError(f"{e.reason} in '{key}'", e.detail) from e
        items.extend([_blank(i) for i in loaded] if fmt.drop_media else loaded)
    return PromptMedia(tuple(items))


def _blank(item: MediaItem) -> MediaItem:
    """The same shape with no content: black pixels, silence (the drop_media control)."""
    import numpy as np

    return MediaItem(item.kind, np.zeros_like(item.data), item.rate)


def _missing_key_error(location: str, record: Any, key: str) -> ValueError:
    keys = sorted(record) if isinstance(record, dict) else "-"
    return ValueError(
        f"{location}: row has no '{key}' key; set [data] prompt_key to the field that holds the "
        f"prompt (keys here: {keys})"
    )


def load_dataset(data: DataSettings, tokenizer: Any,
                 media_reader: MediaReader | None = None) -> tuple[list[PromptRow], LoadReport]:
    """Read, tokenize and filter the jsonl / Parquet dataset of a `[data]` table. Raises ValueError
    naming the row of a bad row. `media_reader`: the model's media processor, needed when [data]
    names media keys.
    """
    path = Path(data.path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset {path} does not exist; check [data] path")
    prompt_key, label_key, max_prompt_tokens = data.prompt_key, data.label_key, data.max_prompt_tokens
    kinds = media_keys(data)
    if kinds and media_reader is None:
        raise ValueError(f"[data] names media columns ({', '.join(kinds.values())}) but the model reads "
                         "text only; point [model] path at a multimodal model (docs/multimodal.md)")
    rows: list[PromptRow] = []
    report = LoadReport()
    for location, record in iter_records(path):
        report.rows_read += 1
        if not isinstance(record, dict) or not has_dotted(record, prompt_key):
            raise _missing_key_error(location, record, prompt_key)
        prompt = get_dotted(record, prompt_key)
        media: PromptMedia | None = None
        if kinds:
            if all(get_dotted(record, key, None) is None for key in kinds.values()):
                report.drop("no " + " / ".join(f"'{k}'" for k in kinds.values()) + " field", location)
                continue
            try:
                media = _load_row_media(record, data, path.parent, media_reader)  # type: ignore[arg-type]
            except MediaError as e:
                report.drop(e.reason, f"{location}: {e.detail}" if e.detail else location)
                continue
        try:
            if data.prompt_template is not None:
                prompt = _fill_template(data.prompt_template, record)
            messages = _messages(prompt, data, media)
            text = _prompt_text(prompt, tokenizer, messages)
        except ValueError as e:
            where = "" if data.prompt_template is not None and isinstance(prompt, str) else f"'{prompt_key}' "
            raise ValueError(f"{location}: {where}{e}") from e
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if media is not None:
            try:
                ids = media_reader.expand(ids, media)  # type: ignore[union-attr]
            except MediaError as e:
                report.drop(e.reason, f"{location}: {e.detail}" if e.detail else location)
                continue
        if not ids:
            report.drop("empty prompt")
            continue
        if len(ids) > max_prompt_tokens:
            report.drop(f"longer than max_prompt_tokens={max_prompt_tokens}")
            continue
        label = get_dotted(record, label_key, None)
        rows.append(PromptRow(len(rows), list(ids), text, label, _metadata(record, data), media, messages))
    report.kept = len(rows)
    if not rows:
        raise ValueError(f"dataset {path} has no usable rows: {report.summary()}")
    return rows, report


class DataCursor:
    """Walks a dataset in epochs, shuffled deterministically per epoch; its state is checkpointed.

    The state is (epoch, index, seed): the order of epoch e is a permutation drawn from
    Random(seed + e), so a restored cursor continues with exactly the rows it would have given.
    """

    def __init__(self, size: int, seed: int, shuffle: bool = True) -> None:
        if size < 1:
            raise ValueError("a cursor needs a dataset with at least one row")
        self.size, self.seed, self.shuffle = size, seed, shuffle
        self.epoch, self.index = 0, 0
        self._order = self._order_for(0)

    def _order_for(self, epoch: int) -> list[int]:
        order = list(range(self.size))
        if self.shuffle:
            random.Random(self.seed + epoch).shuffle(order)
        return order

    def take(self, count: int) -> list[int]:
        out: list[int] = []
        while len(out) < count:
            if self.index == self.size:
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._order_for(self.epoch)
            out.append(self._order[self.index])
            self.index += 1
        return out

    def state(self) -> dict[str, int | bool]:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "size": self.size}

    def restore(self, state: dict[str, Any]) -> None:
        if state.get("size") != self.size or state.get("seed") != self.seed:
            raise ValueError(
                f"checkpointed data cursor {state} does not match this dataset (size {self.size}, "
                f"seed {self.seed}); the dataset or [job] seed changed since the checkpoint"
            )
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._order = self._order_for(self.epoch)
