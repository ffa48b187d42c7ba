"""read_source: every form of a media cell, and every refusal (relax_hpc/media/sources.py)."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from relax_hpc.media.items import MediaError
from relax_hpc.media.sources import read_source

PAYLOAD = b"\x89PNG not really, but bytes are bytes here"
LIMIT = 1 << 20


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    (tmp_path / "media").mkdir()
    (tmp_path / "media" / "a.png").write_bytes(PAYLOAD)
    return tmp_path


def test_relative_path_is_relative_to_the_data_file(data_dir: Path) -> None:
    assert read_source("media/a.png", base_dir=data_dir, max_bytes=LIMIT) == (PAYLOAD, "media/a.png")


def test_absolute_path_and_path_object(data_dir: Path, tmp_path: Path) -> None:
    absolute = data_dir / "media" / "a.png"
    elsewhere = tmp_path / "other"  # base_dir does not matter for an absolute path
    assert read_source(str(absolute), base_dir=elsewhere, max_bytes=LIMIT)[0] == PAYLOAD
    assert read_source(absolute, base_dir=elsewhere, max_bytes=LIMIT)[0] == PAYLOAD


def test_file_url(data_dir: Path) -> None:
    path = data_dir / "media" / "a.png"
    assert read_source(f"file://{path}", base_dir=Path("/nowhere"), max_bytes=LIMIT)[0] == PAYLOAD
    assert read_source(f"file://localhost{path}", base_dir=Path("/nowhere"), max_bytes=LIMIT)[0] == PAYLOAD
    spaced = data_dir / "media" / "a b.png"
    spaced.write_bytes(PAYLOAD)
    assert read_source(f"file://{data_dir}/media/a%20b.png", base_dir=data_dir, max_bytes=LIMIT)[0] == PAYLOAD
    with pytest.raises(MediaError) as e:
        read_source("file://host/x.png", base_dir=data_dir, max_bytes=LIMIT)
    assert e.value.reason == "malformed file URL"


def test_data_url() -> None:
    url = "data:image/png;base64," + base64.b64encode(PAYLOAD).decode()
    data, name = read_source(url, base_dir=Path("."), max_bytes=LIMIT)
    assert data == PAYLOAD and "image/png" in name
    assert read_source("data:text/plain,a%20b", base_dir=Path("."), max_bytes=LIMIT)[0] == b"a b"


@pytest.mark.parametrize("url", ["data:image/png;base64", "data:image/png;base64,!!!notbase64", "data:;base64,abc"])
def test_malformed_data_url(url: str) -> None:
    with pytest.raises(MediaError) as e:
        read_source(url, base_dir=Path("."), max_bytes=LIMIT)
    assert e.value.reason == "malformed data URL"


def test_bytes_cells() -> None:
    assert read_source(PAYLOAD, base_dir=Path("."), max_bytes=LIMIT)[0] == PAYLOAD
    assert read_source(bytearray(PAYLOAD), base_dir=Path("."), max_bytes=LIMIT)[0] == PAYLOAD
    assert read_source(memoryview(PAYLOAD), base_dir=Path("."), max_bytes=LIMIT)[0] == PAYLOAD


def test_hf_dict_bytes_win_else_path(data_dir: Path) -> None:
    assert read_source({"bytes": PAYLOAD, "path": "gone.png"}, base_dir=data_dir, max_bytes=LIMIT)[0] == PAYLOAD
    assert read_source({"bytes": None, "path": "media/a.png"}, base_dir=data_dir, max_bytes=LIMIT)[0] == PAYLOAD
    with pytest.raises(MediaError) as e:
        read_source({"bytes": None, "path": None}, base_dir=data_dir, max_bytes=LIMIT)
    assert e.value.reason == "empty cell"


@pytest.mark.parametrize(
    "url",
    [
        "http://x.org/a.png",
        "https://x.org/a.png",
        "s3://bucket/a.png",
        "gs://b/a.png",
        "hf://datasets/a/b.png",
        "FTP://h/a",
    ],
)
def test_remote_urls_refused_with_advice(url: str, tmp_path: Path) -> None:
    with pytest.raises(MediaError) as e:
        read_source(url, base_dir=tmp_path, max_bytes=LIMIT)
    assert e.value.reason == "remote URL refused"
    assert "download" in e.value.detail and str(tmp_path) in e.value.detail


def test_missing_file(data_dir: Path) -> None:
    for value in ("media/nope.png", str(data_dir / "nope.png"), "media", ""):
        with pytest.raises(MediaError) as e:
            read_source(value, base_dir=data_dir, max_bytes=LIMIT)
        assert e.value.reason == "missing file", value


def test_too_large_is_refused_before_reading(data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_reading(*args: object, **kwargs: object) -> None:
        raise AssertionError("the file was opened")

    monkeypatch.setattr("builtins.open", no_reading)
    with pytest.raises(MediaError) as e:
        read_source("media/a.png", base_dir=data_dir, max_bytes=len(PAYLOAD) - 1)
    assert e.value.reason == f"larger than max_media_bytes={len(PAYLOAD) - 1}"


def test_too_large_bytes_dict_and_data_url() -> None:
    big = b"x" * 100
    url = "data:audio/wav;base64," + base64.b64encode(big).decode()
    for value in (big, {"bytes": big, "path": None}, url):
        with pytest.raises(MediaError) as e:
            read_source(value, base_dir=Path("."), max_bytes=99)
        assert e.value.reason == "larger than max_media_bytes=99"
    assert read_source(url, base_dir=Path("."), max_bytes=100)[0] == big


@pytest.mark.parametrize("value", [None, 3, 2.5, ["a.png"]])
def test_unsupported_cell_type(value: object) -> None:
    with pytest.raises(MediaError) as e:
        read_source(value, base_dir=Path("."), max_bytes=LIMIT)
    assert e.value.reason == "unsupported cell type"
